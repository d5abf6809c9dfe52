//! Which jobs a request selects: the one filter behind `ListJobs`, `WatchJobs` and
//! `CancelJobs`, decoded once from each request. Job states on the wire are decoded by
//! corral-proto's conversion only.

use crate::CoordError;
use corral_proto::v1 as pb;
use corral_types::{Job, JobId, JobState, Timestamp};
use std::collections::BTreeSet;

/// Every job state.
pub(crate) const ALL_STATES: [JobState; 6] = [
    JobState::Pending,
    JobState::Running,
    JobState::Succeeded,
    JobState::Failed,
    JobState::Cancelled,
    JobState::Preempted,
];

/// Most job ids one filter names (a watch's, a billing listing's).
pub(crate) const MAX_FILTER_JOB_IDS: usize = 10_000;

/// The states of a job that has not ended.
pub(crate) const LIVE_STATES: [JobState; 2] = [JobState::Pending, JobState::Running];

/// Which jobs a listing, a watch or a bulk cancel selects. Each field left at its default
/// selects every job, so `JobFilter::default()` matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct JobFilter {
    /// Only these jobs; empty: any job.
    pub job_ids: BTreeSet<JobId>,
    /// Only jobs in these states; empty: any state.
    pub states: BTreeSet<JobState>,
    pub tenant: Option<String>,
    pub name: NameMatch,
    /// Submitted at or after this.
    pub submitted_since: Option<Timestamp>,
    /// Submitted before this.
    pub submitted_until: Option<Timestamp>,
    /// Submitted by this user (the login name recorded at submit).
    pub user: Option<String>,
}

/// How a job's name is matched.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum NameMatch {
    #[default]
    Any,
    Exact(String),
    Prefix(String),
}

/// The states a request names (`corral.v1.JobState` values).
fn wire_states(states: &[i32]) -> Result<BTreeSet<JobState>, CoordError> {
    states
        .iter()
        .map(|state| {
            corral_proto::job_state_from_i32(*state).map_err(|_| {
                CoordError::InvalidArgument(format!(
                    "unknown job state {state} in the filter (pending, running, succeeded, failed, cancelled or preempted)"
                ))
            })
        })
        .collect()
}

impl JobFilter {
    /// The filter of a `ListJobs` request: its states (none: the live ones, or every state
    /// with `all`), name or name prefix and submit window, for `tenant`.
    pub(crate) fn of_list(request: &pb::ListJobsRequest, tenant: Option<String>) -> Result<JobFilter, CoordError> {
        let mut states = wire_states(&request.states)?;
        if states.is_empty() {
            states = if request.all { ALL_STATES.into() } else { LIVE_STATES.into() };
        }
        let name = match (&request.name, &request.name_prefix) {
            (Some(_), Some(_)) => {
                return Err(CoordError::InvalidArgument("give a name or a name prefix, not both".into()));
            }
            (Some(name), None) => NameMatch::Exact(name.clone()),
            (None, Some(prefix)) => NameMatch::Prefix(prefix.clone()),
            (None, None) => NameMatch::Any,
        };
        Ok(JobFilter {
            job_ids: BTreeSet::new(),
            states,
            tenant,
            name,
            submitted_since: request.submitted_since.map(Timestamp),
            submitted_until: request.submitted_until.map(Timestamp),
            user: request.user.clone(),
        })
    }

    /// The filter of a `WatchJobs` request: its job ids (at most `MAX_FILTER_JOB_IDS`) and
    /// states (none: every state), for `tenant`.
    pub(crate) fn of_watch(request: &pb::WatchJobsRequest, tenant: Option<String>) -> Result<JobFilter, CoordError> {
        if request.job_ids.len() > MAX_FILTER_JOB_IDS {
            return Err(CoordError::InvalidArgument(format!(
                "the watch names {} jobs, at most {MAX_FILTER_JOB_IDS}: watch by tenant or state instead",
                request.job_ids.len()
            )));
        }
        Ok(JobFilter {
            job_ids: request.job_ids.iter().copied().collect(),
            states: wire_states(&request.states)?,
            tenant,
            ..JobFilter::default()
        })
    }

    /// The filter of a `CancelJobs` request: the live states it names by name (none: both) and
    /// its exact name, for `tenant`. A finished state is refused: nothing to cancel there.
    pub(crate) fn of_cancel(request: &pb::CancelJobsRequest, tenant: Option<String>) -> Result<JobFilter, CoordError> {
        let mut states = BTreeSet::new();
        for name in &request.states {
            match JobState::parse(name).filter(|s| LIVE_STATES.contains(s)) {
                Some(state) => states.insert(state),
                None => {
                    return Err(CoordError::InvalidArgument(format!(
                        "cannot cancel jobs in state '{name}': pending or running"
                    )))
                }
            };
        }
        if states.is_empty() {
            states = LIVE_STATES.into();
        }
        let name = request.name.clone().map_or(NameMatch::Any, NameMatch::Exact);
        Ok(JobFilter { states, tenant, name, ..JobFilter::default() })
    }

    /// Whether a finished job can match (only then is the history read).
    pub(crate) fn wants_finished(&self) -> bool {
        self.states.is_empty() || self.states.iter().any(|s| s.is_terminal())
    }

    pub(crate) fn matches(&self, job: &Job) -> bool {
        let name_ok = match &self.name {
            NameMatch::Any => true,
            NameMatch::Exact(name) => job.spec.name == *name,
            NameMatch::Prefix(prefix) => job.spec.name.starts_with(prefix.as_str()),
        };
        name_ok
            && (self.job_ids.is_empty() || self.job_ids.contains(&job.id))
            && (self.states.is_empty() || self.states.contains(&job.state))
            && self.tenant.as_ref().is_none_or(|t| *t == job.spec.tenant)
            && self.submitted_since.is_none_or(|s| job.submitted_at >= s)
            && self.submitted_until.is_none_or(|u| job.submitted_at < u)
            && self.user.as_ref().is_none_or(|u| job.spec.slurm.user.as_ref() == Some(u))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: JobId, tenant: &str, name: &str, state: JobState) -> Job {
        let spec = corral_types::JobSpec { tenant: tenant.into(), name: name.into(), ..Default::default() };
        let mut job = Job::pending(id, spec, String::new(), Timestamp(1));
        job.state = state;
        job
    }

    #[test]
    fn the_filter_matches_ids_tenant_states_and_names() {
        let mut j = job(4, "a", "train-1", JobState::Pending);
        assert!(JobFilter::default().matches(&j), "the default selects everything");
        let by_id = JobFilter { job_ids: [5].into(), ..Default::default() };
        assert!(!by_id.matches(&j));
        let by_tenant = JobFilter { tenant: Some("b".into()), ..Default::default() };
        assert!(!by_tenant.matches(&j));
        let running = JobFilter { states: [JobState::Running].into(), ..Default::default() };
        assert!(!running.matches(&j));
        j.state = JobState::Running;
        assert!(running.matches(&j));
        let prefix = JobFilter { name: NameMatch::Prefix("train-".into()), ..Default::default() };
        let exact = JobFilter { name: NameMatch::Exact("train".into()), ..Default::default() };
        assert!(prefix.matches(&j) && !exact.matches(&j));
        let ana = JobFilter { user: Some("ana".into()), ..Default::default() };
        assert!(!ana.matches(&j), "a job with no user recorded is nobody's");
        j.spec.slurm.user = Some("bo".into());
        assert!(!ana.matches(&j));
        j.spec.slurm.user = Some("ana".into());
        assert!(ana.matches(&j));
    }

    /// Each request decodes its own default: a listing shows the live jobs (every job with
    /// `all`), a watch every state, a bulk cancel the live states it may name.
    #[test]
    fn requests_decode_their_defaults_and_refuse_unknown_states() {
        let list = |req: pb::ListJobsRequest| JobFilter::of_list(&req, None);
        let live = JobFilter { states: LIVE_STATES.into(), ..Default::default() };
        assert_eq!(list(Default::default()).expect("list"), live);
        assert!(!live.wants_finished(), "a listing of live jobs never reads the history");
        let all = list(pb::ListJobsRequest { all: true, ..Default::default() }).expect("all");
        assert!(all.states == ALL_STATES.into() && all.wants_finished());
        let failed = list(pb::ListJobsRequest { states: vec![pb::JobState::Failed as i32], ..Default::default() });
        assert_eq!(failed.expect("failed").states, [JobState::Failed].into());
        for bad in [42, pb::JobState::Unspecified as i32] {
            let err = list(pb::ListJobsRequest { states: vec![bad], ..Default::default() }).expect_err("bad state");
            assert!(err.to_string().contains(&format!("unknown job state {bad}")), "{err}");
            let watch = pb::WatchJobsRequest { states: vec![bad], ..Default::default() };
            assert!(JobFilter::of_watch(&watch, None).is_err());
        }
        let both = pb::ListJobsRequest { name: Some("a".into()), name_prefix: Some("a".into()), ..Default::default() };
        assert!(list(both).is_err(), "a name and a prefix");

        let watch = JobFilter::of_watch(&pb::WatchJobsRequest { job_ids: vec![3], ..Default::default() }, None);
        assert_eq!(watch.expect("watch"), JobFilter { job_ids: [3].into(), ..Default::default() });
        let most: Vec<u64> = (1..=MAX_FILTER_JOB_IDS as u64).collect();
        let watch = pb::WatchJobsRequest { job_ids: most.clone(), ..Default::default() };
        assert_eq!(JobFilter::of_watch(&watch, None).expect("the most ids").job_ids.len(), MAX_FILTER_JOB_IDS);
        let watch = pb::WatchJobsRequest { job_ids: [most, vec![0]].concat(), ..Default::default() };
        let err = JobFilter::of_watch(&watch, None).expect_err("one id too many");
        assert!(err.to_string().contains(&format!("at most {MAX_FILTER_JOB_IDS}")), "{err}");

        let cancel = |states: &[&str]| {
            let req =
                pb::CancelJobsRequest { states: states.iter().map(|s| s.to_string()).collect(), ..Default::default() };
            JobFilter::of_cancel(&req, Some("a".into()))
        };
        assert_eq!(cancel(&[]).expect("both").states, LIVE_STATES.into());
        assert_eq!(cancel(&["running"]).expect("running").states, [JobState::Running].into());
        for bad in ["succeeded", "nope"] {
            let err = cancel(&[bad]).expect_err(bad);
            assert!(err.to_string().contains(&format!("cannot cancel jobs in state '{bad}'")), "{err}");
        }
    }
}
