//! The user API's replies built from the state: a job as the API shows it (with why it waits)
//! and a token's record. One place, so that `GetJob`, `ListJobs`, `WatchJob`, `WatchJobs` and
//! job control answer with the same job.

use crate::scheduler::PendingJobs;
use corral_proto::v1 as pb;
use corral_types::{Job, JobState};

/// A job as the API returns it: a pending job without a reason of its own shows why the
/// leader's last scheduling pass left it waiting.
pub(crate) fn job_reply(job: &Job, pending: &PendingJobs) -> pb::Job {
    let mut reply = pb::Job::from(job);
    if job.state == JobState::Pending && reply.reason.is_none() {
        reply.reason = pending.reason(job.id).map(String::from);
    }
    reply
}

/// A token's record (never its secret, which is not kept).
pub(crate) fn token_info(t: &corral_core::TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: t.id,
        tenant: t.tenant.clone(),
        admin: t.admin,
        created: t.created.0,
        expires_at_ms: t.expires_at_ms,
        revoked: t.revoked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pass's reason shows on a pending job that has none of its own, and nowhere else.
    #[test]
    fn a_pending_job_shows_why_the_last_pass_left_it() {
        let spec = corral_types::JobSpec { tenant: "a".into(), ..Default::default() };
        let mut job = Job::pending(4, spec, String::new(), corral_types::Timestamp(1));
        let pending = PendingJobs::of_pass([(4, "resources: no node is up".to_string())]);
        assert_eq!(job_reply(&job, &pending).reason.as_deref(), Some("resources: no node is up"));
        assert_eq!(job_reply(&job, &PendingJobs::default()).reason, None);
        job.reason = Some("held by the user".into());
        assert_eq!(job_reply(&job, &pending).reason.as_deref(), Some("held by the user"), "its own reason first");
        job.reason = None;
        job.state = JobState::Running;
        assert_eq!(job_reply(&job, &pending).reason, None, "only a pending job waits");
    }
}
