//! The image calls of the worker agent, for `corral image` (the coordinator relays them): the
//! node's images, a pull with its progress, a removal that spares what jobs need, an archive
//! loaded from chunks the coordinator relays.
//!
//! Bounds: at most `MAX_PULLS` operator pulls at once on a node (each also under the store's
//! download limit) and one load at a time; a load writes at most the store's `max-size` bytes
//! (the archive's announced size is checked first, every chunk after) into the store's `tmp/`,
//! removed once it is loaded or the call ends.

use corral_image::{ImageEntry, ImageRecord, ImageRef, Images, PullProgress};
use corral_proto::v1::{self as pb};
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

/// Operator pulls a node runs at once.
const MAX_PULLS: usize = 4;
/// How often a pull's progress is sent.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

pub(crate) type PullStream = Pin<Box<dyn Stream<Item = Result<pb::ImagePullEvent, Status>> + Send>>;

/// The node's store, if it has one, and the limits of operator calls on it.
#[derive(Clone)]
pub(crate) struct AgentImages {
    node: String,
    images: Option<Images>,
    pulls: Arc<Semaphore>,
    loads: Arc<Semaphore>,
}

impl AgentImages {
    pub(crate) fn new(node: String, images: Option<Images>) -> AgentImages {
        AgentImages { node, images, pulls: Arc::new(Semaphore::new(MAX_PULLS)), loads: Arc::new(Semaphore::new(1)) }
    }

    fn images(&self) -> Result<&Images, Status> {
        self.images.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!("node {} has no image store: it runs no registry images", self.node))
        })
    }

    fn info(&self, record: &ImageRecord, in_use: bool) -> pb::ImageInfo {
        pb::ImageInfo {
            node: self.node.clone(),
            names: record.names.iter().cloned().collect(),
            digest: record.id.to_string(),
            size_bytes: record.size(),
            last_used_ms: record.last_used_ms,
            in_use,
        }
    }

    fn entry_info(&self, entry: &ImageEntry) -> pb::ImageInfo {
        self.info(&entry.record, entry.pins > 0)
    }

    /// `WorkerAgent.ListImages`: every image of the store (a store holds what fits its
    /// `max-size`, so the reply is as bounded as the store).
    pub(crate) fn list(&self) -> Result<Response<pb::ListImagesResponse>, Status> {
        let mut images: Vec<pb::ImageInfo> =
            self.images()?.store().images().iter().map(|e| self.entry_info(e)).collect();
        images.sort_by_key(|i| std::cmp::Reverse(i.last_used_ms));
        Ok(Response::new(pb::ListImagesResponse { images, unreachable: Vec::new() }))
    }

    /// `WorkerAgent.PullImage`: progress every `PROGRESS_EVERY`, then the final event.
    pub(crate) fn pull(&self, request: Request<pb::PullImageRequest>) -> Result<Response<PullStream>, Status> {
        let images = self.images()?.clone();
        let reference = ImageRef::parse(&request.get_ref().reference)
            .map_err(|e| Status::invalid_argument(format!("node {}: {e}", self.node)))?;
        let permit = Arc::clone(&self.pulls).try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!("node {}: {MAX_PULLS} image pulls are under way already", self.node))
        })?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let progress = PullProgress::new();
            let pull = images.pull(&reference, &progress);
            tokio::pin!(pull);
            let mut ticks = tokio::time::interval(PROGRESS_EVERY);
            let outcome = loop {
                tokio::select! {
                    outcome = &mut pull => break outcome,
                    _ = ticks.tick() => {
                        let seen = progress.snapshot();
                        let event = pb::ImagePullEvent {
                            node: this.node.clone(),
                            bytes_done: seen.bytes_done,
                            bytes_total: seen.bytes_total,
                            layers_done: seen.layers_done as u32,
                            layers_total: seen.layers_total as u32,
                            ..Default::default()
                        };
                        if tx.send(Ok(event)).await.is_err() {
                            return; // the caller left: the pull stops (shared layer downloads go on)
                        }
                    }
                }
            };
            let seen = progress.snapshot();
            let mut last = pb::ImagePullEvent {
                node: this.node.clone(),
                bytes_done: seen.bytes_done,
                bytes_total: seen.bytes_total,
                layers_done: seen.layers_done as u32,
                layers_total: seen.layers_total as u32,
                done: true,
                ..Default::default()
            };
            match outcome {
                Ok(record) => last.image = Some(this.info(&record, false)),
                Err(e) => last.error = e.to_string(),
            }
            let _ = tx.send(Ok(last)).await;
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    /// `WorkerAgent.RemoveImage`: refused while a job placed or running here needs the image
    /// (the coordinator names them in `needed`; pins of jobs the worker holds refuse it too).
    pub(crate) fn remove(
        &self,
        request: Request<pb::RemoveImageRequest>,
    ) -> Result<Response<pb::RemoveImageResponse>, Status> {
        let images = self.images()?;
        let req = request.into_inner();
        let reference = ImageRef::parse(&req.reference)
            .map_err(|e| Status::invalid_argument(format!("node {}: {e}", self.node)))?;
        let Some(record) = images.store().find(&reference) else {
            let skipped = vec![format!("{}: {reference} is not in its store", self.node)];
            return Ok(Response::new(pb::RemoveImageResponse { removed: Vec::new(), skipped, refused: Vec::new() }));
        };
        for (i, digest) in req.needed.iter().enumerate() {
            let Ok(digest) = corral_image::Digest::parse(digest) else { continue };
            if record.is_named_by(&digest) {
                let job = req.needed_by.get(i).map_or_else(|| "a job".to_string(), |j| format!("job {j}"));
                return Err(Status::failed_precondition(format!(
                    "image {reference} ({}) is needed by {job} on node {}",
                    record.id, self.node
                )));
            }
        }
        let removed = images
            .store()
            .remove(&reference.pinned(record.id.clone()))
            .map_err(|e| Status::failed_precondition(format!("node {}: {e}", self.node)))?;
        Ok(Response::new(pb::RemoveImageResponse {
            removed: vec![self.info(&removed, false)],
            skipped: Vec::new(),
            refused: Vec::new(),
        }))
    }

    /// `WorkerAgent.LoadImage`: the chunks written to a file in the store's `tmp/` (at most
    /// `max-size` bytes), then loaded.
    pub(crate) async fn load(
        &self,
        request: Request<Streaming<pb::LoadImageChunk>>,
    ) -> Result<Response<pb::LoadImageResponse>, Status> {
        let images = self.images()?.clone();
        let _permit = Arc::clone(&self.loads).try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!("node {}: an image load is under way already", self.node))
        })?;
        let max = images.store().max_size();
        let too_big = |bytes: u64| {
            Status::invalid_argument(format!(
                "node {}: the archive ({bytes} bytes) is larger than the store's max-size ({max} bytes)",
                self.node
            ))
        };
        let upload = images.upload_dir().map_err(|e| Status::unavailable(format!("node {}: {e}", self.node)))?;
        let path = upload.path().join("archive");
        let mut file = std::fs::File::create(&path)
            .map_err(|e| Status::unavailable(format!("node {}: cannot write the archive: {e}", self.node)))?;
        let mut stream = request.into_inner();
        let (mut received, mut announced) = (0u64, None);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            if announced.is_none() {
                if chunk.total_bytes > max {
                    return Err(too_big(chunk.total_bytes));
                }
                announced = Some(chunk.total_bytes);
            }
            received += chunk.data.len() as u64;
            if received > max {
                return Err(too_big(received));
            }
            // A blocking write of one chunk (at most a message's size).
            file.write_all(&chunk.data)
                .map_err(|e| Status::unavailable(format!("node {}: cannot write the archive: {e}", self.node)))?;
        }
        if announced.is_some_and(|a| a != received) {
            return Err(Status::invalid_argument(format!(
                "node {}: the archive ended after {received} of {} bytes",
                self.node,
                announced.unwrap_or(0)
            )));
        }
        drop(file);
        let records =
            images.load(&path).await.map_err(|e| Status::invalid_argument(format!("node {}: {e}", self.node)))?;
        drop(upload);
        let images = records.iter().map(|r| self.info(r, false)).collect();
        Ok(Response::new(pb::LoadImageResponse { images, failed: Vec::new() }))
    }
}
