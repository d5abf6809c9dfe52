//! The worker's `WorkerAgent` gRPC service: streams a job's log files, and the output files of
//! its steps' tasks (`srun` on another node relays them), to the coordinator; its image calls
//! (`corral image`, relayed by the coordinator) are `agent_images.rs`'s, `corral attach`'s
//! processes `agent_attach.rs`'s.
//!
//! Invariant: log paths are built from numbers only (`<data>/jobs/<id>/<epoch>/`, a task's
//! `step-<step>.<task>.out` there); nothing else from the request becomes a path.
//!
//! Bounds: whatever the size of a log, a call reads at most `16 * CHUNK` bytes of a file at a
//! time and keeps at most 16 chunks of `CHUNK` ready (a bounded channel: a slow reader holds
//! the reading back); with `tail_bytes` it starts that far before each file's end.

use crate::agent_images::{AgentImages, PullStream};
use crate::executor::{STDERR_LOG, STDOUT_LOG};
use crate::jobs::JobTable;
use corral_proto::v1::worker_agent_server::{WorkerAgent, WorkerAgentServer};
use corral_proto::v1::{self as pb, LogStream};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

const CHUNK: usize = 64 * 1024;
const POLL: Duration = Duration::from_millis(100);
/// How often a followed task output file is read: `srun` relays it as it comes.
const STEP_POLL: Duration = Duration::from_millis(20);
/// How long a follower waits for a just-placed job's log directory to appear.
const START_WAIT: Duration = Duration::from_secs(30);

/// The service reading logs under `jobs_dir`, following them while `jobs` runs the job.
pub(crate) fn server(jobs_dir: PathBuf, jobs: Arc<JobTable>, images: AgentImages) -> WorkerAgentServer<Agent> {
    WorkerAgentServer::new(Agent { jobs_dir, jobs, images })
        .max_decoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
        .max_encoding_message_size(corral_proto::MAX_SMALL_MESSAGE_BYTES)
}

/// Over TLS only coordinators may read logs (they check the tenant before proxying).
pub(crate) fn guard(tls: bool, audit: Arc<corral_security::AuditLog>) -> corral_security::RoleGuard {
    corral_security::RoleGuard::new("worker agent", &[corral_security::Role::Coordinator], tls, audit)
        .with_hint("only coordinators may read job logs from a worker")
}

pub(crate) struct Agent {
    jobs_dir: PathBuf,
    jobs: Arc<JobTable>,
    images: AgentImages,
}

/// The directory of the latest attempt of `job_id`, if any.
pub(crate) fn latest_attempt_dir(jobs_dir: &Path, job_id: u64) -> Option<PathBuf> {
    let dir = jobs_dir.join(job_id.to_string());
    let epoch = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .max()?;
    Some(dir.join(epoch.to_string()))
}

/// Reads what was appended to `path` since `offset`, without following symlinks.
fn read_new(path: &Path, offset: &mut u64) -> std::io::Result<Vec<u8>> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    let mut file = match options.open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    file.seek(SeekFrom::Start(*offset))?;
    let mut buf = Vec::new();
    file.take(16 * CHUNK as u64).read_to_end(&mut buf)?;
    *offset += buf.len() as u64;
    Ok(buf)
}

/// Where reading `path` starts: its start, or `tail` bytes before its end.
fn start_offset(path: &Path, tail: Option<u64>) -> u64 {
    let Some(tail) = tail else { return 0 };
    let len = std::fs::symlink_metadata(path).map(|m| m.len()).unwrap_or(0);
    len.saturating_sub(tail)
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl WorkerAgent for Agent {
    type ReadLogsStream = ChunkStream;

    async fn read_logs(&self, request: Request<pb::ReadLogsRequest>) -> Result<Response<ChunkStream>, Status> {
        let req = request.into_inner();
        let (jobs_dir, jobs) = (self.jobs_dir.clone(), self.jobs.clone());
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let started = Instant::now();
            let dir = loop {
                match latest_attempt_dir(&jobs_dir, req.job_id) {
                    Some(dir) => break dir,
                    None if req.follow && started.elapsed() < START_WAIT => {
                        tokio::time::sleep(POLL).await;
                    }
                    None => return,
                }
            };
            let files = [(dir.join(STDOUT_LOG), LogStream::Stdout), (dir.join(STDERR_LOG), LogStream::Stderr)];
            let mut offsets = files.each_ref().map(|(path, _)| start_offset(path, req.tail_bytes));
            loop {
                // Decide before reading, so output written just before the exit is not lost.
                let last_round = !req.follow || !jobs.is_running(req.job_id);
                let mut progressed = false;
                for (i, (path, stream)) in files.iter().enumerate() {
                    let data = match read_new(path, &mut offsets[i]) {
                        Ok(d) => d,
                        Err(e) => {
                            let _ = tx.send(Err(Status::internal(format!("cannot read log: {e}")))).await;
                            return;
                        }
                    };
                    progressed |= !data.is_empty();
                    for piece in data.chunks(CHUNK) {
                        let chunk = pb::LogChunk { stream: *stream as i32, data: piece.to_vec() };
                        if tx.send(Ok(chunk)).await.is_err() {
                            return; // the reader went away
                        }
                    }
                }
                if last_round && !progressed {
                    return;
                }
                if !progressed {
                    tokio::time::sleep(POLL).await;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    type ReadStepOutputStream = ChunkStream;
    type PullImageStream = PullStream;

    async fn list_images(
        &self,
        _request: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        self.images.list()
    }

    async fn pull_image(&self, request: Request<pb::PullImageRequest>) -> Result<Response<PullStream>, Status> {
        self.images.pull(request)
    }

    async fn remove_image(
        &self,
        request: Request<pb::RemoveImageRequest>,
    ) -> Result<Response<pb::RemoveImageResponse>, Status> {
        self.images.remove(request)
    }

    async fn load_image(
        &self,
        request: Request<tonic::Streaming<pb::LoadImageChunk>>,
    ) -> Result<Response<pb::LoadImageResponse>, Status> {
        self.images.load(request).await
    }

    type AttachStream = crate::agent_attach::AttachStream;

    async fn attach(
        &self,
        request: Request<tonic::Streaming<pb::AttachInput>>,
    ) -> Result<Response<crate::agent_attach::AttachStream>, Status> {
        crate::agent_attach::attach(self.jobs.clone(), request.into_inner()).await.map(Response::new)
    }

    /// One task's output file of a step, followed until this node's tasks of the step are gone
    /// (the runtime marks it: `step_done_marker`) or the job no longer runs here.
    async fn read_step_output(
        &self,
        request: Request<pb::ReadStepOutputRequest>,
    ) -> Result<Response<ChunkStream>, Status> {
        let req = request.into_inner();
        let dir = self.jobs_dir.join(req.job_id.to_string()).join(req.epoch.to_string());
        let jobs = self.jobs.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let path = crate::executor::task_output(&dir, req.step, req.task);
            let done = crate::executor::step_done_marker(&dir, req.step);
            // The part may still be starting here when the step's srun starts elsewhere.
            let started = Instant::now();
            while !jobs.runs(req.job_id, req.epoch) && !done.exists() && started.elapsed() < START_WAIT {
                tokio::time::sleep(STEP_POLL).await;
            }
            let mut offset = 0;
            loop {
                // Decide before reading, so output written just before the end is not lost.
                let last_round = done.exists() || !jobs.runs(req.job_id, req.epoch);
                let data = match read_new(&path, &mut offset) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(format!("cannot read task output: {e}")))).await;
                        return;
                    }
                };
                for piece in data.chunks(CHUNK) {
                    let chunk = pb::LogChunk { stream: LogStream::Stdout as i32, data: piece.to_vec() };
                    if tx.send(Ok(chunk)).await.is_err() {
                        return; // the reader went away
                    }
                }
                if last_round && data.is_empty() {
                    return;
                }
                if data.is_empty() {
                    tokio::time::sleep(STEP_POLL).await;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a tail, reading starts that far before the end, however long the log is: what the
    /// web view's job page asks for.
    #[test]
    fn a_tail_reads_only_the_end_of_a_long_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(STDOUT_LOG);
        let log: Vec<u8> = (0..64 * CHUNK).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(&path, &log).expect("write");
        let mut offset = start_offset(&path, Some(1000));
        assert_eq!(offset, log.len() as u64 - 1000);
        assert_eq!(read_new(&path, &mut offset).expect("read"), log[log.len() - 1000..]);
        assert_eq!(start_offset(&path, Some(u64::MAX)), 0, "a tail longer than the log reads all of it");
        assert_eq!(start_offset(&path, None), 0);
        assert_eq!(start_offset(&dir.path().join("absent"), Some(10)), 0);
        // A read takes at most 16 chunks, whatever is left.
        let mut offset = 0;
        assert_eq!(read_new(&path, &mut offset).expect("read").len(), 16 * CHUNK);
    }
}
