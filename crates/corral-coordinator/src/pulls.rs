//! Leader-memory view of the image pulls workers report in their heartbeats: what a run that
//! was placed but has not started yet is waiting for. Never replicated; a reply shows it as the
//! reason of a running job whose process has not started (`pulling image REF: 2/5 layers,
//! 12.3/200.0 MB`). A new heartbeat of a node replaces everything the node said before; an
//! entry whose epoch is no longer the job's allocation is ignored.

use corral_proto::v1 as pb;
use corral_types::{Job, JobId, JobState};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Pulls a heartbeat may report; more are dropped (a node runs few jobs at once).
pub(crate) const MAX_PULLS_PER_HEARTBEAT: usize = 64;
/// Longest image reference kept for a reason line.
const MAX_IMAGE_CHARS: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    epoch: u64,
    image: String,
    layers_done: u32,
    layers_total: u32,
    bytes_done: u64,
    bytes_total: u64,
}

#[derive(Debug, Default)]
struct Board {
    /// By job, then node: a gang's parts pull on several nodes.
    jobs: BTreeMap<(JobId, String), Seen>,
    /// The jobs each node reported last.
    by_node: BTreeMap<String, Vec<JobId>>,
}

/// The pulls workers reported last.
#[derive(Debug, Default)]
pub(crate) struct PullBoard {
    board: Mutex<Board>,
}

impl PullBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces what `node` reported before with `pulls` (at most [`MAX_PULLS_PER_HEARTBEAT`]).
    pub(crate) fn report(&self, node: &str, pulls: Vec<pb::PullProgress>) {
        let mut board = self.lock();
        for job in board.by_node.remove(node).unwrap_or_default() {
            board.jobs.remove(&(job, node.to_string()));
        }
        if pulls.is_empty() {
            return;
        }
        let mut jobs = Vec::with_capacity(pulls.len().min(MAX_PULLS_PER_HEARTBEAT));
        for p in pulls.into_iter().take(MAX_PULLS_PER_HEARTBEAT) {
            let image: String = p.image.chars().take(MAX_IMAGE_CHARS).collect();
            let seen = Seen {
                epoch: p.epoch,
                image,
                layers_done: p.layers_done,
                layers_total: p.layers_total,
                bytes_done: p.bytes_done,
                bytes_total: p.bytes_total,
            };
            board.jobs.insert((p.job_id, node.to_string()), seen);
            jobs.push(p.job_id);
        }
        board.by_node.insert(node.to_string(), jobs);
    }

    /// Drops a removed node's reports.
    pub(crate) fn forget(&self, node: &str) {
        self.report(node, Vec::new());
    }

    /// What `job` waits for while its image is pulled: its running allocation, not started,
    /// with a pull reported for that allocation on one of its nodes (a gang's summed).
    pub(crate) fn detail(&self, job: &Job) -> Option<String> {
        let epoch = job.allocation.as_ref()?.epoch;
        if job.state != JobState::Running || job.started_at.is_some() {
            return None;
        }
        let board = self.lock();
        let mut sum: Option<Seen> = None;
        for ((_, _), seen) in board.jobs.range((job.id, String::new())..).take_while(|((id, _), _)| *id == job.id) {
            if seen.epoch != epoch {
                continue;
            }
            let total = sum.get_or_insert_with(|| Seen {
                layers_done: 0,
                layers_total: 0,
                bytes_done: 0,
                bytes_total: 0,
                ..seen.clone()
            });
            total.layers_done += seen.layers_done;
            total.layers_total += seen.layers_total;
            total.bytes_done += seen.bytes_done;
            total.bytes_total += seen.bytes_total;
        }
        let s = sum?;
        if s.layers_total == 0 {
            return Some(format!("pulling image {}", s.image));
        }
        let mb = |b: u64| b as f64 / 1e6;
        Some(format!(
            "pulling image {}: {}/{} layers, {:.1}/{:.1} MB",
            s.image,
            s.layers_done,
            s.layers_total,
            mb(s.bytes_done),
            mb(s.bytes_total)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::{Allocation, JobSpec, Timestamp};

    fn pull(job_id: JobId, epoch: u64, done: u64) -> pb::PullProgress {
        pb::PullProgress {
            job_id,
            epoch,
            image: "reg:5000/train:v1".into(),
            layers_done: u32::from(done == 200_000_000),
            layers_total: 2,
            bytes_done: done,
            bytes_total: 200_000_000,
        }
    }

    #[test]
    fn a_placed_job_shows_its_pull_until_it_starts_and_the_latest_report_wins() {
        let board = PullBoard::default();
        let mut job =
            Job::pending(7, JobSpec { tenant: "a".into(), ..Default::default() }, String::new(), Timestamp(1));
        job.state = JobState::Running;
        job.allocation = Some(Allocation { node: "n1".into(), epoch: 3, ..Default::default() });
        assert_eq!(board.detail(&job), None, "nothing reported");
        board.report("n1", vec![pull(7, 3, 12_300_000)]);
        assert_eq!(board.detail(&job).as_deref(), Some("pulling image reg:5000/train:v1: 0/2 layers, 12.3/200.0 MB"));
        board.report("n1", vec![pull(7, 2, 50_000_000)]);
        assert_eq!(board.detail(&job), None, "another allocation's pull");
        board.report("n1", vec![pull(7, 3, 200_000_000)]);
        assert!(board.detail(&job).is_some_and(|d| d.ends_with("1/2 layers, 200.0/200.0 MB")));
        job.started_at = Some(Timestamp(5));
        assert_eq!(board.detail(&job), None, "started: no longer pulling");
        job.started_at = None;
        board.report("n1", Vec::new());
        assert_eq!(board.detail(&job), None, "the node's next heartbeat has no pull");
        board.report("n1", (0..100).map(|j| pull(j, 1, 0)).collect());
        assert_eq!(board.lock().jobs.len(), MAX_PULLS_PER_HEARTBEAT);
        board.forget("n1");
        assert!(board.lock().jobs.is_empty() && board.lock().by_node.is_empty());
    }
}
