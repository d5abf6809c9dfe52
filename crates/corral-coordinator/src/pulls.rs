//! Leader-memory view of the image pulls workers report in their heartbeats: what a run that
//! was placed but has not started yet is waiting for. Never replicated; a reply shows it as the
//! reason of a running job whose process has not started (`pulling image REF: 2/5 layers,
//! 12.3/200.0 MB`). A new heartbeat of a node replaces everything the node said before; an
//! entry whose epoch is no longer the job's allocation is ignored.
//!
//! [`HeldImages`]: the images each worker's store holds, as its heartbeats last said (every few
//! of them carry the list), kept as the scheduler's `ImageHints` (rebuilt when a node's list
//! changes, handed to each pass as one `Arc`), so placement prefers the nodes that hold most of
//! a job's image. Never replicated either.

use corral_proto::v1 as pb;
use corral_types::{Job, JobId, JobState};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

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

/// Images, and layers of each, kept per node report.
const MAX_HELD_IMAGES: usize = 64;
const MAX_HELD_LAYERS: usize = 256;

/// The images the workers' stores hold, as the scheduler's hints.
#[derive(Debug, Default)]
pub(crate) struct HeldImages {
    state: Mutex<Held>,
}

/// One image a node holds: the digests that name it, and its layers (digest, bytes).
type HeldImage = (Vec<String>, Arc<Vec<(String, u64)>>);

#[derive(Debug, Default)]
struct Held {
    /// Each node's last report.
    by_node: BTreeMap<String, Vec<HeldImage>>,
    hints: Arc<corral_core::ImageHints>,
}

impl HeldImages {
    /// Replaces what `node` said it holds (at most `MAX_HELD_IMAGES` images of
    /// `MAX_HELD_LAYERS` layers); the hints are rebuilt only when that changed.
    pub(crate) fn report(&self, node: &str, images: Vec<pb::HeldImage>) {
        let report: Vec<HeldImage> = images
            .into_iter()
            .take(MAX_HELD_IMAGES)
            .map(|i| {
                let names = [i.digest, i.index].into_iter().filter(|d| !d.is_empty()).collect();
                let layers = i.layers.into_iter().take(MAX_HELD_LAYERS).map(|l| (l.digest, l.size)).collect();
                (names, Arc::new(layers))
            })
            .collect();
        let mut held = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if held.by_node.get(node) == Some(&report) {
            return;
        }
        held.by_node.insert(node.to_string(), report);
        let mut hints = corral_core::ImageHints::default();
        for (node, images) in &held.by_node {
            let layers = hints.nodes.entry(node.clone()).or_default();
            for (names, image_layers) in images {
                layers.extend(image_layers.iter().map(|(d, _)| d.clone()));
                for name in names {
                    hints.images.entry(name.clone()).or_insert_with(|| Arc::clone(image_layers));
                }
            }
        }
        held.hints = Arc::new(hints);
    }

    /// What the scheduler's next pass prefers by.
    pub(crate) fn hints(&self) -> Arc<corral_core::ImageHints> {
        Arc::clone(&self.state.lock().unwrap_or_else(|p| p.into_inner()).hints)
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

    #[test]
    fn held_images_become_the_schedulers_hints() {
        let held = HeldImages::default();
        let layer = |d: &str, size| pb::HeldLayer { digest: d.into(), size };
        let image = pb::HeldImage {
            digest: "sha256:m".into(),
            index: "sha256:i".into(),
            layers: vec![layer("a", 900), layer("b", 100)],
        };
        held.report("n1", vec![image.clone()]);
        let other = vec![pb::HeldImage { layers: vec![layer("a", 900)], digest: "sha256:o".into(), ..image }];
        held.report("n2", other.clone());
        let hints = held.hints();
        assert_eq!(hints.missing("sha256:m", "n1"), Some(0));
        assert_eq!(hints.missing("sha256:i", "n2"), Some(100), "by its index digest too");
        assert_eq!(hints.missing("sha256:m", "n3"), Some(1000));
        assert_eq!(hints.missing("sha256:x", "n1"), None);
        let same = held.hints();
        held.report("n2", other);
        assert!(Arc::ptr_eq(&same, &held.hints()), "an unchanged report rebuilds nothing");
        held.report("n1", Vec::new());
        assert_eq!(held.hints().missing("sha256:m", "n1"), None, "no node holds it any more");
    }
}
