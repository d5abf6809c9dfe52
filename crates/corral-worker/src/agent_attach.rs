//! `WorkerAgent.Attach`: a process started inside a running job's cgroup on this node (what
//! `corral attach` asks for, relayed by the coordinator once it checked the caller owns the
//! job), as a step's task is: the run's user, working directory, environment and limits. Its
//! stdin comes from the call's messages and its output goes back as messages: on a terminal
//! this worker opens for it (the caller's stdin is a TTY: a pseudo-terminal, its controlling
//! terminal, resized as the caller's is), else through pipes (stdout and stderr apart).
//!
//! Its life is bounded by the run's: the process is in the job's cgroup, so the job's end kills
//! it. The caller going away (the call's input ends without an end of stdin, or the reply
//! stream is dropped) hangs it up: SIGHUP to its process group, SIGKILL `HANGUP_GRACE` later.
//! Bounds: a stdin message is at most the agent's message size; output is read `CHUNK` at a
//! time into a channel of `QUEUE` messages (a slow caller holds the process's writes back).

use crate::executor::AttachSpec;
use crate::jobs::JobTable;
use corral_proto::v1::{self as pb};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

/// Bytes read from the process at a time.
const CHUNK: usize = 32 * 1024;
/// Output messages waiting for the caller.
const QUEUE: usize = 16;
/// Between SIGHUP and SIGKILL when the caller went away.
const HANGUP_GRACE: Duration = Duration::from_secs(5);
/// Longest command an attach may run (arguments, bytes).
const MAX_COMMAND_BYTES: usize = 64 * 1024;

pub(crate) type AttachStream = Pin<Box<dyn Stream<Item = Result<pb::AttachOutput, Status>> + Send>>;

/// Starts the process the first message asks for and relays it until it exits.
pub(crate) async fn attach(jobs: Arc<JobTable>, mut input: Streaming<pb::AttachInput>) -> Result<AttachStream, Status> {
    let first = input.message().await?.ok_or_else(|| Status::invalid_argument("attach: no start message"))?;
    let Some(pb::attach_input::Input::Start(start)) = first.input else {
        return Err(Status::invalid_argument("attach: the first message must say what to start"));
    };
    let (Some(handle), Some(info)) = (jobs.handle(start.job_id, start.epoch), jobs.info(start.job_id, start.epoch))
    else {
        return Err(Status::failed_precondition(format!(
            "job {} does not run on this node (run {}): it may have just ended",
            start.job_id, start.epoch
        )));
    };
    if start.command.iter().map(String::len).sum::<usize>() > MAX_COMMAND_BYTES {
        return Err(Status::invalid_argument(format!("the command is longer than {MAX_COMMAND_BYTES} bytes")));
    }
    let argv = if start.command.is_empty() {
        vec![info.env.get("SHELL").cloned().unwrap_or_else(|| "/bin/sh".into())]
    } else {
        start.command.clone()
    };
    let mut env = info.env.clone();
    if start.tty {
        env.insert("TERM".into(), if start.term.is_empty() { "xterm".into() } else { start.term.clone() });
    }
    let spec =
        AttachSpec { argv, env, cwd: info.cwd.clone(), uid: info.uid, gid: info.gid, open_files: info.open_files };
    let (job_id, tty, size) = (start.job_id, start.tty, (start.rows, start.cols));
    let started = tokio::task::spawn_blocking(move || {
        let ends = if tty { Ends::terminal(size)? } else { Ends::pipes()? };
        let process = handle
            .spawn_attached(&spec, &ends.child_stdin, &ends.child_stdout, &ends.child_stderr, tty)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok::<_, std::io::Error>((process, ends.ours))
    })
    .await
    .map_err(|e| Status::internal(e.to_string()))?;
    let (mut process, ours) = started.map_err(|e| Status::failed_precondition(format!("attach: {e}")))?;
    let pid = process.pid();
    tracing::info!(job_id, pid, tty, "attached a process to the job");
    let (tx, rx) = mpsc::channel::<Result<pb::AttachOutput, Status>>(QUEUE);
    // Output: one reader thread per stream (blocking reads of a pipe or the terminal).
    let mut readers = Vec::new();
    for (file, is_err) in ours.outputs {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || read_output(file, is_err, tx)));
    }
    // Input: the call's messages to the process's stdin (or the terminal), and resizes.
    let stdin = ours.stdin;
    let resize_fd = ours.terminal;
    tokio::spawn(async move {
        let mut stdin = stdin.map(|f| Some(std::fs::File::from(f)));
        while let Ok(Some(message)) = input.message().await {
            match message.input {
                Some(pb::attach_input::Input::Stdin(data)) => {
                    if let Some(Some(file)) = stdin.as_mut() {
                        let mut file = file.try_clone().ok();
                        let wrote = tokio::task::spawn_blocking(move || {
                            file.as_mut().map(|f| f.write_all(&data).is_ok()).unwrap_or(false)
                        })
                        .await
                        .unwrap_or(false);
                        if !wrote {
                            stdin = Some(None);
                        }
                    }
                }
                Some(pb::attach_input::Input::StdinEof(_)) => {
                    match &resize_fd {
                        // A terminal's end of input is its EOF character (^D).
                        Some(_) => {
                            if let Some(Some(file)) = stdin.as_mut() {
                                let _ = file.write_all(&[4]);
                            }
                        }
                        None => stdin = Some(None),
                    }
                }
                Some(pb::attach_input::Input::Resize(size)) => {
                    if let Some(fd) = &resize_fd {
                        set_size(fd, (size.rows, size.cols));
                    }
                }
                _ => {}
            }
        }
    });
    let group = i32::try_from(pid).unwrap_or(0);
    tokio::spawn(async move {
        let status = process.wait().await;
        for reader in readers {
            let _ = tokio::task::spawn_blocking(move || reader.join()).await;
        }
        let (exit_code, signal) = status.unwrap_or((None, None));
        let exit = pb::AttachExit { exit_code, signal };
        let _ = tx.send(Ok(pb::AttachOutput { output: Some(pb::attach_output::Output::Exit(exit)) })).await;
    });
    let hangup = Hangup { group };
    Ok(Box::pin(output_stream(rx, hangup)))
}

/// The process's output as the reply stream; dropping the stream before the exit (the caller
/// went away) hangs the process up.
fn output_stream(
    rx: mpsc::Receiver<Result<pb::AttachOutput, Status>>,
    mut hangup: Hangup,
) -> impl Stream<Item = Result<pb::AttachOutput, Status>> + Send {
    tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), move |item| {
        if matches!(&item, Ok(pb::AttachOutput { output: Some(pb::attach_output::Output::Exit(_)) })) {
            // It exited: nothing to hang up.
            hangup.disarm();
        }
        item
    })
}

/// Hangs up the attached process group when dropped before the process exited.
struct Hangup {
    group: i32,
}

impl Hangup {
    fn disarm(&mut self) {
        self.group = 0;
    }
}

impl Drop for Hangup {
    fn drop(&mut self) {
        let group = self.group;
        if group <= 0 {
            return;
        }
        // SAFETY: kill(2) on the process group of the process this attach started (it leads
        // its own session); a group that is gone is ESRCH.
        unsafe { libc::kill(-group, libc::SIGHUP) };
        std::thread::spawn(move || {
            std::thread::sleep(HANGUP_GRACE);
            // SAFETY: as above.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        });
    }
}

fn read_output(mut file: std::fs::File, is_err: bool, tx: mpsc::Sender<Result<pb::AttachOutput, Status>>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // A terminal whose last writer closed reads EIO.
            Err(_) => return,
        };
        let data = buf[..n].to_vec();
        let output =
            if is_err { pb::attach_output::Output::Stderr(data) } else { pb::attach_output::Output::Stdout(data) };
        if tx.blocking_send(Ok(pb::AttachOutput { output: Some(output) })).is_err() {
            return;
        }
    }
}

/// The process's ends and ours.
struct Ends {
    child_stdin: std::fs::File,
    child_stdout: std::fs::File,
    child_stderr: std::fs::File,
    ours: Ours,
}

struct Ours {
    stdin: Option<OwnedFd>,
    /// (reader, is stderr)
    outputs: Vec<(std::fs::File, bool)>,
    /// The terminal's master side, for resizes.
    terminal: Option<OwnedFd>,
}

impl Ends {
    fn pipes() -> std::io::Result<Ends> {
        let (in_r, in_w) = std::io::pipe()?;
        let (out_r, out_w) = std::io::pipe()?;
        let (err_r, err_w) = std::io::pipe()?;
        Ok(Ends {
            child_stdin: std::fs::File::from(OwnedFd::from(in_r)),
            child_stdout: std::fs::File::from(OwnedFd::from(out_w)),
            child_stderr: std::fs::File::from(OwnedFd::from(err_w)),
            ours: Ours {
                stdin: Some(OwnedFd::from(in_w)),
                outputs: vec![
                    (std::fs::File::from(OwnedFd::from(out_r)), false),
                    (std::fs::File::from(OwnedFd::from(err_r)), true),
                ],
                terminal: None,
            },
        })
    }

    fn terminal(size: (u32, u32)) -> std::io::Result<Ends> {
        let (mut master, mut slave) = (-1, -1);
        // SAFETY: openpty writes two new fds; no name buffer, default termios.
        let rc =
            unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        use std::os::fd::FromRawFd;
        // SAFETY: fresh fds from openpty, owned by nobody else.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        for fd in [&master, &slave] {
            // SAFETY: fcntl on an fd we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        set_size(&master, size);
        let slave = std::fs::File::from(slave);
        Ok(Ends {
            child_stdin: slave.try_clone()?,
            child_stdout: slave.try_clone()?,
            child_stderr: slave,
            ours: Ours {
                stdin: Some(master.try_clone()?),
                outputs: vec![(std::fs::File::from(master.try_clone()?), false)],
                terminal: Some(master),
            },
        })
    }
}

fn set_size(fd: &OwnedFd, (rows, cols): (u32, u32)) {
    if rows == 0 || cols == 0 {
        return;
    }
    let size = libc::winsize {
        ws_row: u16::try_from(rows).unwrap_or(u16::MAX),
        ws_col: u16::try_from(cols).unwrap_or(u16::MAX),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ with a valid winsize on a terminal fd we own.
    unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &size) };
}
