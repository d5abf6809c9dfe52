//! The leader's compaction loop: every `compact-every`, one `Command::Compact` moves jobs that
//! finished more than `archive-after` ago (and segments that ended then) out of the hot state into
//! the on-disk history, expires request ids older than `request-id-window`, and deletes history
//! past its retention. The cutoffs travel in the command, so every replica does the same.

use crate::{CoordError, Coordinator};
use corral_core::{Command, CompactCutoffs, Compacted, Outcome};
use corral_types::Timestamp;
use std::time::Duration;

/// What stays in memory and for how long history is kept (the `[history]` config section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryConfig {
    /// Finished jobs stay in the hot state this long (dependencies, `corral wait`, the queue
    /// views read them there); then only the history has them.
    pub archive_after: Duration,
    /// A retried submit with the same request id within this window returns the first job.
    pub request_id_window: Duration,
    /// Finished jobs submitted longer ago are deleted from the history (`None`: kept).
    pub job_retention: Option<Duration>,
    /// Billing segments that ended longer ago are deleted (`None`: kept, the default).
    pub segment_retention: Option<Duration>,
    /// How often the leader compacts.
    pub compact_every: Duration,
    /// Finished jobs in the hot state past about this many bytes leave before `archive_after`,
    /// the oldest first (`None`: no bound but the delay).
    pub max_finished_bytes: Option<u64>,
}

/// Default of `history.max-finished-bytes`.
pub const DEFAULT_MAX_FINISHED_BYTES: u64 = 128 << 20;

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig {
            archive_after: Duration::from_secs(600),
            request_id_window: Duration::from_secs(24 * 3600),
            job_retention: Some(Duration::from_secs(90 * 24 * 3600)),
            segment_retention: None,
            compact_every: Duration::from_secs(30),
            max_finished_bytes: Some(DEFAULT_MAX_FINISHED_BYTES),
        }
    }
}

impl HistoryConfig {
    /// The cutoffs of a compaction at `now`.
    pub fn cutoffs(&self, now: Timestamp) -> CompactCutoffs {
        let before = |d: Duration| {
            let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
            Timestamp::compose(now.physical_ms().saturating_sub(ms), 0)
        };
        CompactCutoffs {
            archive_before: before(self.archive_after),
            request_ids_before: before(self.request_id_window),
            jobs_before: self.job_retention.map(before),
            segments_before: self.segment_retention.map(before),
            max_finished_bytes: self.max_finished_bytes,
        }
    }
}

/// Runs forever; compacts only while this node is the leader.
pub(crate) async fn run(coord: Coordinator) {
    let every = coord.config().history.compact_every;
    loop {
        tokio::time::sleep(every).await;
        if coord.leading_term().is_none() {
            continue;
        }
        match compact_once(&coord).await {
            Ok(done) if done.archived_jobs + done.archived_segments + done.expired_request_ids > 0 => {
                tracing::info!(
                    archived_jobs = done.archived_jobs,
                    archived_segments = done.archived_segments,
                    expired_request_ids = done.expired_request_ids,
                    "compacted the hot state"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "no compaction"),
        }
    }
}

/// Proposes one compaction with the cutoffs of now.
pub(crate) async fn compact_once(coord: &Coordinator) -> Result<Compacted, CoordError> {
    let now = coord.timestamps(1).await?;
    let cutoffs = coord.config().history.cutoffs(now);
    match coord.propose_at(now, Command::Compact(cutoffs)).await? {
        Outcome::Compacted(done) => Ok(done),
        other => Err(CoordError::Unavailable(format!("unexpected outcome of a compaction: {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cutoffs_count_back_from_now_and_keep_forever_as_none() {
        let config = HistoryConfig { job_retention: None, ..HistoryConfig::default() };
        let now = Timestamp::compose(100_000_000, 7);
        let c = config.cutoffs(now);
        assert_eq!(c.archive_before, Timestamp::compose(100_000_000 - 600_000, 0));
        assert_eq!(c.request_ids_before, Timestamp::compose(100_000_000 - 86_400_000, 0));
        assert_eq!((c.jobs_before, c.segments_before), (None, None));
        let early = config.cutoffs(Timestamp::compose(5, 0));
        assert_eq!(early.archive_before, Timestamp::compose(0, 0), "no cutoff before the epoch");
    }
}
