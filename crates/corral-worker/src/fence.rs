//! The fence guard: a small process beside the worker that kills every job of the worker when
//! the worker's lease runs out, even if the worker itself is frozen (SIGSTOP, a stuck host) or
//! dead (SIGKILL, a crash).
//!
//! The worker renews the guard's deadline each time a leader answers it; the deadline lies
//! between the worker's own fence time (when it stops its jobs itself) and the node TTL (when
//! the leader gives the node up and may run its jobs elsewhere). So a job is dead on this node
//! before it can start on another: the guard is the part of fencing that does not depend on
//! the worker being alive.
//!
//! Protocol: the worker writes 8-byte big-endian deadlines (CLOCK_MONOTONIC nanoseconds, one
//! clock for every process of the host) to the guard's stdin. The guard kills every job cgroup
//! under the worker's cgroup root whenever its deadline has passed (it starts expired: the
//! worker renews before its first launch), and once more and exits at end of file (the worker
//! exited or died) or SIGTERM. It reads every pending renewal before it acts on an expiry, so a
//! renewal written before a launch always wins.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often an expired guard looks for (new) job processes to kill.
const EXPIRED_POLL: Duration = Duration::from_millis(100);

/// Nanoseconds of CLOCK_MONOTONIC: the same clock in every process of the host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// How the worker starts its guard: a program (usually the `corral` binary itself) and its
/// arguments; the guard's side is [`run_guard`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// The worker's handle on its guard process.
pub(crate) struct FenceGuard {
    command: GuardCommand,
    child: Child,
    stdin: ChildStdin,
    /// The last deadline sent (monotonic ns), re-sent to a restarted guard.
    deadline_ns: u64,
}

impl FenceGuard {
    /// Starts the guard. Its deadline starts expired.
    pub(crate) fn start(command: GuardCommand) -> std::io::Result<Self> {
        let (child, stdin) = spawn(&command)?;
        Ok(FenceGuard { command, child, stdin, deadline_ns: 0 })
    }

    /// Moves the deadline to `deadline` (the guard kills every job after it). Restarts a guard
    /// that died; never blocks.
    pub(crate) fn renew(&mut self, deadline: Instant) {
        let now = Instant::now();
        let ns = monotonic_ns().saturating_add(deadline.saturating_duration_since(now).as_nanos() as u64);
        self.deadline_ns = ns;
        if let Ok(Some(status)) = self.child.try_wait() {
            tracing::error!(%status, "the fence guard exited: starting it again");
            match spawn(&self.command) {
                Ok((child, stdin)) => (self.child, self.stdin) = (child, stdin),
                Err(e) => {
                    tracing::error!(error = %e, "cannot restart the fence guard: jobs are not fenced if this worker freezes");
                    return;
                }
            }
        }
        match self.stdin.write(&ns.to_be_bytes()) {
            Ok(8) => {}
            Ok(_) | Err(_) => tracing::warn!("the fence guard is not reading its renewals"),
        }
    }

    /// Stops the guard after the worker stopped every job itself: closing its stdin makes it
    /// kill what might be left and exit.
    pub(crate) fn stop(self) {
        let FenceGuard { mut child, stdin, .. } = self;
        drop(stdin);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn spawn(command: &GuardCommand) -> std::io::Result<(Child, ChildStdin)> {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new(&command.program)
        .args(&command.args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        // Its own process group: a terminal's Ctrl-C for the worker must not kill the guard
        // before the worker has stopped its jobs.
        .process_group(0)
        .spawn()?;
    let stdin = child.stdin.take().ok_or_else(|| std::io::Error::other("no stdin pipe to the fence guard"))?;
    // A stuck guard must never block the worker.
    // SAFETY: fcntl on a file descriptor we own.
    unsafe {
        let fd = stdin.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    Ok((child, stdin))
}

static TERMINATED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigterm(_: libc::c_int) {
    TERMINATED.store(true, Ordering::SeqCst);
}

/// The guard's main loop (the `corral worker-guard` process): reads deadlines from stdin and
/// kills the job cgroups under `cgroup_root` whenever the deadline passed, at end of file and at
/// SIGTERM. Blocking; returns when the worker is gone.
pub fn run_guard(cgroup_root: &str) -> std::io::Result<()> {
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe {
        let handler: extern "C" fn(libc::c_int) = on_sigterm;
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    // Unbuffered: a buffered reader could hold renewals that poll() no longer reports.
    // SAFETY: fd 0 stays open for the life of the process; ManuallyDrop never closes it.
    let mut stdin = std::mem::ManuallyDrop::new(unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(0) });
    let fd = stdin.as_raw_fd();
    let mut deadline_ns = 0u64;
    let mut pending = Vec::with_capacity(64);
    loop {
        if TERMINATED.load(Ordering::SeqCst) {
            kill(cgroup_root, "the guard was terminated");
            return Ok(());
        }
        let now = monotonic_ns();
        let wait = if deadline_ns > now { Duration::from_nanos(deadline_ns - now) } else { EXPIRED_POLL };
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let timeout_ms = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if ready > 0 {
            let mut buf = [0u8; 512];
            match stdin.read(&mut buf) {
                Ok(0) => {
                    kill(cgroup_root, "the worker exited");
                    return Ok(());
                }
                Ok(n) => {
                    pending.extend_from_slice(&buf[..n]);
                    while pending.len() >= 8 {
                        let bytes: [u8; 8] = pending[..8].try_into().expect("8 bytes");
                        deadline_ns = u64::from_be_bytes(bytes);
                        pending.drain(..8);
                    }
                    // Read everything that is there before judging the deadline.
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        if monotonic_ns() > deadline_ns {
            kill(cgroup_root, "the worker's lease expired");
        }
    }
}

fn kill(cgroup_root: &str, why: &str) {
    match crate::executor::kill_job_cgroups(cgroup_root) {
        Ok(killed) if killed.is_empty() => {}
        Ok(killed) => eprintln!("corral fence guard: {why}: killed every process of {}", killed.join(", ")),
        Err(e) => eprintln!("corral fence guard: {why}, but killing the jobs failed: {e}"),
    }
}
