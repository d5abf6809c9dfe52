//! Coordinator errors and their one mapping to gRPC status codes.

use corral_core::ApplyError;
use corral_proto::LEADER_ADDR_METADATA;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CoordError {
    #[error("{0}")]
    Rejected(#[from] ApplyError),
    #[error("this coordinator is not the leader{}", leader_hint(.leader_id, .leader_addr))]
    NotLeader { leader_id: Option<u64>, leader_addr: Option<String> },
    #[error("raft error: {0}")]
    Raft(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
    /// A watch resumed from a revision this coordinator no longer remembers.
    #[error("{0}")]
    OutOfRange(String),
}

fn leader_hint(id: &Option<u64>, addr: &Option<String>) -> String {
    match (id, addr) {
        (Some(id), Some(addr)) => format!("; the leader is node {id} at {addr}"),
        (Some(id), None) => format!("; the leader is node {id}"),
        _ => "; no leader is known yet, retry shortly".to_string(),
    }
}

impl From<corral_raft::RaftError> for CoordError {
    fn from(e: corral_raft::RaftError) -> Self {
        match e {
            corral_raft::RaftError::NotLeader { leader_id, leader_addr } => {
                CoordError::NotLeader { leader_id, leader_addr }
            }
            corral_raft::RaftError::Refused(reason) => CoordError::InvalidArgument(reason),
            corral_raft::RaftError::Failed(reason) => CoordError::Raft(reason),
        }
    }
}

impl From<CoordError> for tonic::Status {
    fn from(e: CoordError) -> Self {
        use tonic::Status;
        let message = e.to_string();
        match e {
            CoordError::Rejected(ApplyError::NoSuchJob(_) | ApplyError::NoSuchNode(_) | ApplyError::NoSuchToken(_))
            | CoordError::NotFound(_) => Status::not_found(message),
            CoordError::Rejected(
                ApplyError::TooManyGpus { .. }
                | ApplyError::TooMuchMemory { .. }
                | ApplyError::TooManyCpus { .. }
                | ApplyError::PolicyStrandsJobs(_)
                | ApplyError::JobControl(_),
            ) => Status::failed_precondition(message),
            CoordError::Rejected(ApplyError::TooManyPendingJobs { .. }) => Status::resource_exhausted(message),
            CoordError::Rejected(_) | CoordError::InvalidArgument(_) => Status::invalid_argument(message),
            CoordError::NotLeader { leader_addr, .. } => {
                let mut status = Status::unavailable(message);
                if let Some(addr) = leader_addr.and_then(|a| a.parse().ok()) {
                    status.metadata_mut().insert(LEADER_ADDR_METADATA, addr);
                }
                status
            }
            CoordError::Raft(_) | CoordError::Unavailable(_) => Status::unavailable(message),
            CoordError::OutOfRange(_) => Status::out_of_range(message),
        }
    }
}
