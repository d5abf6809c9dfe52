//! A job's output copied into its own output files (`--stdout`/`--stderr`) as well as its log:
//! a pipe the job writes into and a thread that tees it ([`tee`]), joined once the job's
//! processes are gone ([`join_copiers`]). Shared by the process executor, which starts the
//! copies, and the running job, which drains them after the exit.

use std::fs::File;
use std::io;
use std::time::Duration;

use tracing::warn;

use super::ExecError;

/// How long a finished job's output copies may take to drain.
const COPY_DRAIN: Duration = Duration::from_secs(5);

/// A pipe whose reading end is copied by a thread into `log` and `extra`: the job writes into
/// the returned end, and both files get everything it writes.
pub(crate) fn tee(job_id: u64, log: File, extra: File) -> Result<(File, std::thread::JoinHandle<()>), ExecError> {
    let spawn_error = |source: io::Error| ExecError::Spawn { program: "the output copier".to_owned(), source };
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fresh descriptors we then own.
    let (read_end, write_end) = unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(spawn_error(io::Error::last_os_error()));
        }
        use std::os::fd::FromRawFd;
        (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
    };
    let copier = std::thread::Builder::new()
        .name(format!("job-{job_id}-output"))
        .spawn(move || copy_output(job_id, read_end, log, extra))
        .map_err(spawn_error)?;
    Ok((write_end, copier))
}

fn copy_output(job_id: u64, mut from: File, mut log: File, mut extra: File) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 * 1024];
    let mut extra_ok = true;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!(job_id, error = %e, "cannot read the job's output");
                return;
            }
        };
        if let Err(e) = log.write_all(&buf[..n]) {
            warn!(job_id, error = %e, "cannot write the job's log");
        }
        if extra_ok {
            if let Err(e) = extra.write_all(&buf[..n]) {
                warn!(job_id, error = %e, "cannot write the job's output file: it gets no more output");
                extra_ok = false;
            }
        }
    }
}

/// Waits (bounded) for the output copiers of a job whose processes are all gone.
pub(crate) async fn join_copiers(job_id: u64, copiers: Vec<std::thread::JoinHandle<()>>) {
    if copiers.is_empty() {
        return;
    }
    let join = tokio::task::spawn_blocking(move || {
        for copier in copiers {
            let _ = copier.join();
        }
    });
    if tokio::time::timeout(COPY_DRAIN, join).await.is_err() {
        warn!(job_id, "the job's output is still held open by a process outside it: its output files may be cut short");
    }
}
