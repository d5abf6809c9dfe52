//! `WatchJobs`: the matching jobs, then each change of one, as events at revisions (applied log
//! indexes), resumable from a revision through the state machine's change log.
//!
//! Invariant: an event's `resume_revision` is set only when every matching change up to it was
//! sent on the stream, so a client that resumes from it misses nothing. Events of one batch go
//! out in increasing revision order; a job changed several times since the last batch is sent
//! once, as it is now (with the revision of its latest change).

use crate::filter::JobFilter;
use crate::reply::job_reply;
use crate::scheduler::PendingJobs;
use crate::snapshot::Snapshot;
use crate::{CoordError, Coordinator};
use corral_proto::v1 as pb;
use tonic::Status;

/// One batch of events, every change up to `upto` included.
struct Batch {
    /// (revision, job), in increasing revision order.
    jobs: Vec<(u64, pb::Job)>,
    upto: u64,
}

impl Batch {
    /// The events, each ending a revision marked as a resume point.
    fn events(self) -> Vec<pb::JobEvent> {
        let upto = self.upto;
        let revisions: Vec<u64> = self.jobs.iter().map(|(r, _)| *r).collect();
        self.jobs
            .into_iter()
            .enumerate()
            .map(|(i, (revision, job))| {
                let resume_revision = match revisions.get(i + 1) {
                    None => Some(upto),
                    Some(next) if *next > revision => Some(revision),
                    Some(_) => None,
                };
                pb::JobEvent { revision, job: Some(job), resume_revision }
            })
            .collect()
    }
}

/// A quiet watch gets a progress event at most this often (on an applied change).
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

fn compacted(e: corral_raft::Compacted) -> CoordError {
    CoordError::OutOfRange(format!(
        "revision {} is too old to resume the watch from: this coordinator remembers changes from revision {} on; list the jobs again (watch without a revision) or resume from revision {} or later",
        e.asked, e.oldest, e.oldest
    ))
}

/// The first batch of a watch: every matching job now (`from` absent) or every matching job
/// changed after `from`.
///
/// The state's read lock is held only to copy the jobs' persistent map (constant time): the
/// walk over every job and the replies are made after it, so apply never waits for them.
fn first_batch(snapshot: &Snapshot, filter: &JobFilter, from: Option<u64>) -> Result<Batch, CoordError> {
    let (all, upto, changed) = {
        let data = snapshot.read();
        let changes = snapshot.store().changes();
        let upto = data.applied_index();
        let changed = match from {
            None => None,
            Some(from) if from > upto => {
                return Err(CoordError::InvalidArgument(format!(
                "revision {from} is ahead of this cluster (at revision {upto}): resume only from a revision a watch sent"
            )))
            }
            Some(from) => Some(changes.changed_since(from).map_err(compacted)?),
        };
        (data.state.jobs.clone(), upto, changed)
    };
    let jobs = match changed {
        None => all.values().filter(|j| filter.matches(j)).map(|j| (upto, snapshot.job_reply(j))).collect(),
        Some(changed) => changed_jobs(&all, changed, filter, snapshot.pending()),
    };
    Ok(Batch { jobs, upto })
}

/// The matching jobs changed after `after`, up to the applied revision.
fn next_batch(snapshot: &Snapshot, filter: &JobFilter, after: u64) -> Result<Batch, CoordError> {
    let (jobs, upto, changed) = {
        let data = snapshot.read();
        let changes = snapshot.store().changes();
        let changed = changes.changed_since(after).map_err(compacted)?;
        (data.state.jobs.clone(), data.applied_index(), changed)
    };
    Ok(Batch { jobs: changed_jobs(&jobs, changed, filter, snapshot.pending()), upto })
}

/// Starts a watch for the leader of `term`: the first batch is computed now from `snapshot`
/// (so a refused revision is the call's error), the rest as entries are applied, each batch
/// from a fresh snapshot.
pub(crate) fn watch_jobs(
    coord: &Coordinator,
    snapshot: &Snapshot,
    filter: JobFilter,
    from: Option<u64>,
    term: u64,
) -> Result<tokio::sync::mpsc::Receiver<Result<pb::JobEvent, Status>>, CoordError> {
    let mut applied = snapshot.store().subscribe_applied();
    let first = first_batch(snapshot, &filter, from)?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let coord = coord.clone();
    tokio::spawn(async move {
        let mut upto = first.upto;
        for event in first.events() {
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
        }
        let progress = |upto| pb::JobEvent { revision: upto, job: None, resume_revision: Some(upto) };
        if tx.send(Ok(progress(upto))).await.is_err() {
            return;
        }
        // A watch whose jobs rarely change still moves its resume point now and then, so
        // that its revision is not forgotten (compacted) while it waits.
        let mut last_sent = std::time::Instant::now();
        loop {
            tokio::select! {
                changed = applied.changed() => if changed.is_err() { return },
                _ = tx.closed() => return,
            }
            if coord.leading_term() != Some(term) {
                // Deposed: the client resumes at the new leader from its last resume point.
                return;
            }
            let batch = match next_batch(&coord.snapshot(), &filter, upto) {
                Ok(batch) => batch,
                Err(e) => {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            };
            upto = upto.max(batch.upto);
            if batch.jobs.is_empty() {
                if last_sent.elapsed() >= PROGRESS_EVERY {
                    last_sent = std::time::Instant::now();
                    if tx.send(Ok(progress(upto))).await.is_err() {
                        return;
                    }
                }
                continue;
            }
            last_sent = std::time::Instant::now();
            for event in batch.events() {
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(rx)
}

/// The jobs of `changed` (job id -> revision of its latest change) that still exist and match,
/// in revision order.
fn changed_jobs(
    jobs: &corral_core::Jobs,
    changed: std::collections::BTreeMap<u64, u64>,
    filter: &JobFilter,
    pending: &PendingJobs,
) -> Vec<(u64, pb::Job)> {
    let mut out: Vec<(u64, pb::Job)> = changed
        .into_iter()
        // A job gone from the state (moved to the history) is not sent.
        .filter_map(|(id, revision)| {
            jobs.get(&id).filter(|j| filter.matches(j)).map(|j| (revision, job_reply(j, pending)))
        })
        .collect();
    out.sort_by_key(|(revision, job)| (*revision, job.id));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: u64) -> pb::Job {
        pb::Job { id, ..Default::default() }
    }

    /// A resume point is set after the last event of each revision, and on the batch's last
    /// event at the batch's revision.
    #[test]
    fn resume_points_close_each_revision() {
        let batch = Batch { jobs: vec![(3, job(1)), (5, job(2)), (5, job(3)), (7, job(4))], upto: 9 };
        let events: Vec<(u64, u64, Option<u64>)> =
            batch.events().into_iter().map(|e| (e.revision, e.job.map_or(0, |j| j.id), e.resume_revision)).collect();
        assert_eq!(events, vec![(3, 1, Some(3)), (5, 2, None), (5, 3, Some(5)), (7, 4, Some(9))]);
    }
}
