//! The `pulling` stage of a run whose image is a registry reference: pin the image the job was
//! pinned to at submit (its digest, never the tag's current meaning), pull what the store
//! lacks, mount the run's overlay root and read the image config. It runs as a task of its
//! own and tells the runtime with `Event::Pulled`; the runtime aborts it when the run is
//! abandoned (a stop, a lost lease, the run gone from the desired state), and launches from
//! what it prepared only while the run is still pulling.

use super::state::{Event, Outcome};
use crate::launch::Prepared;
use corral_image::{Digest, ImageError, ImageRef, Images, JobRoot, PullProgress};
use corral_types::Job;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The reference the job runs: its image pinned to the digest the coordinator resolved.
pub(crate) fn pinned_reference(job: &Job) -> Result<Option<ImageRef>, ImageError> {
    let (Some(image), Some(digest)) = (&job.spec.image, &job.spec.image_digest) else { return Ok(None) };
    Ok(Some(ImageRef::parse(image)?.pinned(Digest::parse(digest)?)))
}

/// Pulls and mounts the image of allocation `epoch` of `job`, then reports the outcome.
pub(crate) async fn run(
    images: Images,
    job: Arc<Job>,
    epoch: u64,
    progress: PullProgress,
    events: mpsc::UnboundedSender<Event>,
) {
    let outcome = prepare(&images, &job, epoch, &progress).await;
    let _ = events.send(Event::Pulled { job_id: job.id, epoch, outcome: Box::new(outcome) });
}

async fn prepare(images: &Images, job: &Job, epoch: u64, progress: &PullProgress) -> Outcome {
    let reference = pinned_reference(job)?
        .ok_or_else(|| ImageError::invalid_reference(format!("job {} has no pinned image", job.id)))?;
    // Pinned first: a collection that runs meanwhile keeps what this run needs.
    let pin = images.pin(&reference)?;
    let record = images.pull(&reference, progress).await?;
    let config = record.config().map_err(|e| e.context(&reference))?;
    let images = images.clone();
    let key = format!("job-{}-{epoch}", job.id);
    let root = tokio::task::spawn_blocking(move || images.mount(&pin, &key))
        .await
        .map_err(|e| ImageError::new(corral_image::ErrorKind::Io, format!("mount task failed: {e}")))??;
    Ok(Prepared { root, config })
}

/// Removes a run's root (unmount, delete its writable layer) off the runtime's thread.
pub(crate) fn remove_root(root: JobRoot) {
    tokio::task::spawn_blocking(move || {
        let path = root.path().display().to_string();
        if let Err(e) = root.remove() {
            tracing::warn!(root = %path, error = %e, "cannot remove a job root");
        }
    });
}
