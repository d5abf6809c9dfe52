//! Coordinator errors and their one mapping to gRPC status codes.

use corral_core::ApplyError;
use corral_proto::{LEADER_ADDR_METADATA, RETRY_AFTER_METADATA};
use std::time::Duration;

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
    /// The leader's queue of submits is full: the client retries after `retry_after`.
    #[error("the leader's submit queue is full ({queued} jobs waiting, at most {capacity}): retry after {}ms", .retry_after.as_millis())]
    Overloaded { queued: usize, capacity: usize, retry_after: Duration },
    /// As many client requests as `limits.max-client-requests` are being served: the client
    /// retries after `retry_after`.
    #[error("the coordinator is serving as many client requests as it admits at once ({capacity}): retry after {}ms", .retry_after.as_millis())]
    Busy { capacity: usize, retry_after: Duration },
    /// A watch resumed from a revision this coordinator no longer remembers.
    #[error("{0}")]
    OutOfRange(String),
    /// A limit of the configuration was reached (its message names the limit); nothing was
    /// done.
    #[error("{0}")]
    Exhausted(String),
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
            CoordError::Overloaded { retry_after, .. } | CoordError::Busy { retry_after, .. } => {
                let mut status = Status::resource_exhausted(message);
                let ms = retry_after.as_millis().max(1).to_string();
                if let Ok(value) = ms.parse() {
                    status.metadata_mut().insert(RETRY_AFTER_METADATA, value);
                }
                status
            }
            CoordError::OutOfRange(_) => Status::out_of_range(message),
            CoordError::Exhausted(_) => Status::resource_exhausted(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_submit_queue_is_resource_exhausted_with_a_retry_after() {
        let e = CoordError::Overloaded { queued: 10, capacity: 10, retry_after: Duration::from_millis(250) };
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(status.metadata().get(RETRY_AFTER_METADATA).and_then(|v| v.to_str().ok()), Some("250"));
        assert!(status.message().contains("retry after 250ms"), "{}", status.message());
        // A quota refusal is RESOURCE_EXHAUSTED too, but nothing to retry soon: no retry-after.
        let quota =
            CoordError::Rejected(ApplyError::TooManyPendingJobs { tenant: "a".into(), pending: 1, adding: 1, max: 1 });
        assert!(tonic::Status::from(quota).metadata().get(RETRY_AFTER_METADATA).is_none());
    }
}
