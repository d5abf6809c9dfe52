//! Starting a job's main process without copying the worker's address space: a vfork-style
//! `clone(CLONE_VM | CLONE_VFORK)` child confines itself (session, cgroup, limits, privileges)
//! and execs; [`JobProcess`] then awaits its exit through a pidfd.
//!
//! A plain `fork` copies the page tables of the whole worker (and of the coordinator in
//! `corral dev`), and the exec that follows tears the copy down again: that was half of the CPU
//! of a drain of short jobs. The vfork-style child borrows the parent's memory instead, so it
//! follows the rules glibc's `posix_spawn` follows: everything it touches is prepared by the
//! parent, it never allocates or takes a lock, credentials change through raw system calls
//! (glibc's wrappers would broadcast the change to the parent's threads), every signal is
//! blocked across the clone, and handlers are reset before signals are let in again.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

use tokio::io::unix::AsyncFd;

/// Size of the child's stack (it runs a few dozen system calls); one guard page below it.
const STACK_SIZE: usize = 128 * 1024;

/// What the child does before exec, all of it prepared by the parent.
pub(crate) struct Confinement<'a> {
    /// `cgroup.procs` of every hierarchy of the job cgroup, opened for writing.
    pub(crate) cgroup_procs: &'a [File],
    /// `RLIMIT_NOFILE` (soft = hard).
    pub(crate) open_files: Option<u64>,
    pub(crate) uid: Option<u32>,
    pub(crate) gid: Option<u32>,
    /// The child does not exec at or after this moment (the worker's lease end): the spawn then
    /// fails with `io::ErrorKind::TimedOut`.
    pub(crate) not_after: Option<std::time::Instant>,
}

/// The steps of the child, named in the error when one fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
enum Step {
    None = 0,
    Session,
    Cgroup,
    Stdio,
    WorkDir,
    OpenFiles,
    NoNewPrivs,
    Capabilities,
    Groups,
    Gid,
    Uid,
    Exec,
    Lease,
}

impl Step {
    fn from_raw(raw: i32) -> Step {
        [
            Step::None,
            Step::Session,
            Step::Cgroup,
            Step::Stdio,
            Step::WorkDir,
            Step::OpenFiles,
            Step::NoNewPrivs,
            Step::Capabilities,
            Step::Groups,
            Step::Gid,
            Step::Uid,
            Step::Exec,
            Step::Lease,
        ]
        .get(usize::try_from(raw).unwrap_or(0))
        .copied()
        .unwrap_or(Step::None)
    }

    fn describe(self) -> &'static str {
        match self {
            Step::None => "start the process",
            Step::Session => "start a new session",
            Step::Cgroup => "join the job cgroup",
            Step::Stdio => "set up stdin, stdout and stderr",
            Step::WorkDir => "enter the work dir",
            Step::OpenFiles => "set the open-files limit",
            Step::NoNewPrivs => "set no_new_privs",
            Step::Capabilities => "drop capabilities",
            Step::Groups => "set the supplementary groups",
            Step::Gid => "switch to the job's gid",
            Step::Uid => "switch to the job's uid",
            Step::Exec => "exec the program",
            Step::Lease => "start the job before this worker's lease ran out",
        }
    }
}

/// Everything the child reads, and the two words it writes back when a step fails. Lives on
/// the parent's stack for the duration of the clone; the child shares that memory.
#[repr(C)]
struct ChildArgs {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    work_dir: *const libc::c_char,
    /// stdin, stdout, stderr: all at fd 3 or above.
    stdio: [RawFd; 3],
    procs_fds: *const RawFd,
    procs_len: usize,
    open_files: libc::rlim_t,
    has_open_files: bool,
    uid: libc::uid_t,
    has_uid: bool,
    gid: libc::gid_t,
    has_gid: bool,
    /// CLOCK_MONOTONIC time at which the child must not exec any more.
    deadline: libc::timespec,
    has_deadline: bool,
    /// stdin is a terminal that becomes the new session's controlling terminal.
    ctty: bool,
    failed_step: i32,
    errno: i32,
}

/// Starts `program` with `argv` (argv[0] included) and exactly `env`, in `work_dir`, stdin from
/// /dev/null and stdout/stderr to the given files, confined as `confinement` says. Returns once
/// the child has exec'd or failed; a failure names the step and reaps the child.
pub(crate) fn spawn(
    program: &Path,
    argv: &[String],
    env: impl IntoIterator<Item = (impl AsRef<str>, impl AsRef<str>)>,
    work_dir: &Path,
    stdout: &File,
    stderr: &File,
    confinement: &Confinement<'_>,
) -> io::Result<JobProcess> {
    let stdin = File::open("/dev/null")?;
    spawn_with_stdin(program, argv, env, work_dir, [&stdin, stdout, stderr], false, confinement)
}

/// [`spawn`] with the given stdin too; with `ctty` stdin is a terminal that becomes the
/// controlling terminal of the process's new session (`corral attach` on a terminal).
pub(crate) fn spawn_with_stdin(
    program: &Path,
    argv: &[String],
    env: impl IntoIterator<Item = (impl AsRef<str>, impl AsRef<str>)>,
    work_dir: &Path,
    [stdin, stdout, stderr]: [&File; 3],
    ctty: bool,
    confinement: &Confinement<'_>,
) -> io::Result<JobProcess> {
    let program_c = c_string(program.as_os_str())?;
    let argv_c: Vec<CString> = argv.iter().map(|a| c_string(OsStr::new(a))).collect::<io::Result<_>>()?;
    let envp_c: Vec<CString> = env
        .into_iter()
        .map(|(k, v)| c_string(OsStr::new(&format!("{}={}", k.as_ref(), v.as_ref()))))
        .collect::<io::Result<_>>()?;
    let work_dir_c = c_string(work_dir.as_os_str())?;
    let argv_ptrs: Vec<*const libc::c_char> =
        argv_c.iter().map(|a| a.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
    let envp_ptrs: Vec<*const libc::c_char> =
        envp_c.iter().map(|e| e.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
    // The child moves these onto fds 0-2; sources at 3 or above cannot be overwritten on the way.
    let stdio = [high_fd(stdin)?, high_fd(stdout)?, high_fd(stderr)?];
    let procs_fds: Vec<RawFd> = confinement.cgroup_procs.iter().map(AsRawFd::as_raw_fd).collect();
    let mut args = ChildArgs {
        program: program_c.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: envp_ptrs.as_ptr(),
        work_dir: work_dir_c.as_ptr(),
        stdio: [stdio[0].as_raw_fd(), stdio[1].as_raw_fd(), stdio[2].as_raw_fd()],
        procs_fds: procs_fds.as_ptr(),
        procs_len: procs_fds.len(),
        open_files: confinement.open_files.unwrap_or(0) as libc::rlim_t,
        has_open_files: confinement.open_files.is_some(),
        uid: confinement.uid.unwrap_or(0),
        has_uid: confinement.uid.is_some(),
        gid: confinement.gid.unwrap_or(0),
        has_gid: confinement.gid.is_some(),
        deadline: confinement.not_after.map(monotonic_at).unwrap_or(libc::timespec { tv_sec: 0, tv_nsec: 0 }),
        has_deadline: confinement.not_after.is_some(),
        ctty,
        failed_step: Step::None as i32,
        errno: 0,
    };
    let stack = Stack::new()?;

    // SAFETY: every signal is blocked in this thread across the clone, so no handler of the
    // parent runs on the child's borrowed memory; the child resets all handlers before it
    // unblocks them. `args` and everything it points to outlive the clone: CLONE_VFORK suspends
    // this thread until the child has exec'd or exited, and nothing here is touched meanwhile.
    let (pid, clone_error) = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child_main,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&raw mut args).cast(),
        );
        let clone_error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        (pid, clone_error)
    };
    drop(stack);
    if pid == -1 {
        return Err(clone_error);
    }
    // SAFETY: the child wrote these before it exited (or never did); it has exec'd or exited by
    // now, so nothing writes them any more.
    let (failed_step, errno) =
        unsafe { (std::ptr::read_volatile(&args.failed_step), std::ptr::read_volatile(&args.errno)) };
    if failed_step != Step::None as i32 {
        reap_blocking(pid);
        let step = Step::from_raw(failed_step);
        let source = io::Error::from_raw_os_error(errno);
        let kind = if step == Step::Lease { io::ErrorKind::TimedOut } else { source.kind() };
        return Err(io::Error::new(kind, format!("cannot {}: {source}", step.describe())));
    }
    Ok(JobProcess::new(pid))
}

/// `at` on the CLOCK_MONOTONIC clock (the one `Instant` reads on Linux, which runs on while a
/// process is stopped), for the child to compare without touching `Instant`.
fn monotonic_at(at: std::time::Instant) -> libc::timespec {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    let left = at.saturating_duration_since(std::time::Instant::now());
    let nanos = now.tv_nsec as u64 + u64::from(left.subsec_nanos());
    libc::timespec {
        tv_sec: now.tv_sec + left.as_secs() as libc::time_t + (nanos / 1_000_000_000) as libc::time_t,
        tv_nsec: (nanos % 1_000_000_000) as libc::c_long,
    }
}

fn c_string(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "contains a NUL byte"))
}

/// A close-on-exec duplicate of `file` at fd 3 or above.
fn high_fd(file: &File) -> io::Result<OwnedFd> {
    // SAFETY: fcntl on a valid fd; the result is a new fd that we own.
    let fd = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if fd == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The child's stack: anonymous memory with a guard page below, unmapped on drop.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

impl Stack {
    fn new() -> io::Result<Stack> {
        let page = page_size();
        let len = STACK_SIZE + page;
        // SAFETY: a fresh private anonymous mapping; checked for failure.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the lowest page of the mapping made above.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The stack grows down from the end of the mapping (16-byte aligned: mmap is page aligned).
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, which is what clone expects.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; the child no longer runs on it.
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(4096)
}

/// The child: runs on its own stack in the parent's memory until exec. Async-signal-safe
/// system calls only, no allocation, no locks; credentials through raw system calls.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `ChildArgs`, alive and untouched until we exec or exit.
    let args = unsafe { &mut *arg.cast::<ChildArgs>() };
    /// Records the failed step and errno for the parent, then exits.
    fn fail(args: &mut ChildArgs, step: Step) -> libc::c_int {
        // SAFETY: reading errno and exiting without running any handler.
        unsafe {
            args.errno = *libc::__errno_location();
            args.failed_step = step as i32;
            libc::_exit(127)
        }
    }
    // SAFETY: system calls on values the parent prepared.
    unsafe {
        // Handlers of the parent must not run here; the job starts with every signal at its
        // default (an ignored SIGPIPE would otherwise be inherited through exec).
        // The kernel's `struct sigaction` (handler, flags, restorer, mask) all zero is SIG_DFL.
        // A raw call, because glibc refuses to touch its two internal signals.
        let default = [0u64; 4];
        for signal in 1..=64 {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::syscall(libc::SYS_rt_sigaction, signal, default.as_ptr(), std::ptr::null::<u64>(), 8usize);
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());

        if libc::setsid() == -1 {
            return fail(args, Step::Session);
        }
        // "0" means "the writing process" in cgroup.procs on v1 and v2: joining before exec
        // means nothing the job forks can start outside the cgroup.
        for i in 0..args.procs_len {
            if libc::write(*args.procs_fds.add(i), b"0".as_ptr().cast(), 1) != 1 {
                return fail(args, Step::Cgroup);
            }
        }
        for (target, &source) in args.stdio.iter().enumerate() {
            if libc::dup2(source, target as RawFd) == -1 {
                return fail(args, Step::Stdio);
            }
        }
        if args.ctty && libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
            return fail(args, Step::Stdio);
        }
        if libc::chdir(args.work_dir) == -1 {
            return fail(args, Step::WorkDir);
        }
        if args.has_open_files {
            let limit = libc::rlimit { rlim_cur: args.open_files, rlim_max: args.open_files };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return fail(args, Step::OpenFiles);
            }
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) != 0 {
            return fail(args, Step::NoNewPrivs);
        }
        if !drop_capabilities() {
            return fail(args, Step::Capabilities);
        }
        if args.has_gid {
            let groups = [args.gid];
            if libc::syscall(libc::SYS_setgroups, 1 as libc::c_long, groups.as_ptr()) != 0 {
                return fail(args, Step::Groups);
            }
            if libc::syscall(libc::SYS_setgid, args.gid as libc::c_long) != 0 {
                return fail(args, Step::Gid);
            }
        }
        if args.has_uid {
            // Drop root's supplementary groups unless a gid already replaced them.
            if !args.has_gid
                && libc::syscall(libc::SYS_setgroups, 0 as libc::c_long, std::ptr::null::<libc::gid_t>()) != 0
            {
                return fail(args, Step::Groups);
            }
            if libc::syscall(libc::SYS_setuid, args.uid as libc::c_long) != 0 {
                return fail(args, Step::Uid);
            }
        }
        // Last, right before exec: a worker stopped since it decided to launch (SIGSTOP, a stall)
        // may have lost its lease, and its job been given to another node meanwhile.
        if args.has_deadline {
            let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
            if (now.tv_sec, now.tv_nsec) >= (args.deadline.tv_sec, args.deadline.tv_nsec) {
                *libc::__errno_location() = libc::ETIME;
                return fail(args, Step::Lease);
            }
        }
        libc::execve(args.program, args.argv, args.envp);
        fail(args, Step::Exec)
    }
}

/// Empties the capability bounding set and the ambient set, so the job never holds a capability:
/// a job that stays root (no user mapping) execs with none, and one that switches to its
/// tenant's uid cannot regain any. Needs CAP_SETPCAP: a worker without it has none to give away.
/// Runs in the child; leaves errno set when it returns false.
fn drop_capabilities() -> bool {
    // SAFETY: prctl with integer arguments.
    unsafe {
        if libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) != 0
            && *libc::__errno_location() != libc::EINVAL
        {
            return false;
        }
        for cap in 0..64 as libc::c_ulong {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                match *libc::__errno_location() {
                    // Past the last capability this kernel knows.
                    libc::EINVAL => break,
                    // Not privileged: nothing to drop.
                    libc::EPERM => return true,
                    _ => return false,
                }
            }
        }
    }
    true
}

/// Waits for `pid` (our child) in this thread.
fn reap_blocking(pid: libc::pid_t) -> Option<ExitStatus> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child with a valid status pointer.
        match unsafe { libc::waitpid(pid, &mut status, 0) } {
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
            -1 => return None,
            _ => return Some(ExitStatus::from_raw(status)),
        }
    }
}

/// A child started by [`spawn`]: waited for through a pidfd (a blocking thread on kernels
/// without one), reaped in the background when dropped unwaited.
#[derive(Debug)]
pub(crate) struct JobProcess {
    pid: libc::pid_t,
    pidfd: Option<AsyncFd<OwnedFd>>,
    status: Option<ExitStatus>,
}

impl JobProcess {
    fn new(pid: libc::pid_t) -> JobProcess {
        // SAFETY: pidfd_open of our own unreaped child: the pid cannot have been reused.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        // SAFETY: a new fd that nobody else owns.
        let owned = (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw as RawFd) });
        let pidfd = owned.filter(|_| tokio::runtime::Handle::try_current().is_ok()).and_then(|fd| {
            // SAFETY: an OwnedFd stays open and returns the same fd until the AsyncFd drops it.
            unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.ok()
        });
        JobProcess { pid, pidfd, status: None }
    }

    /// Takes over the waiting for `child`, started with `std::process::Command` (which neither
    /// waits for nor kills a child it drops).
    pub(crate) fn adopt(child: std::process::Child) -> JobProcess {
        JobProcess::new(child.id() as libc::pid_t)
    }

    pub(crate) fn id(&self) -> u32 {
        self.pid.unsigned_abs()
    }

    /// Reaps the child if it has exited.
    fn try_reap(&mut self) -> io::Result<Option<ExitStatus>> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        let mut raw = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        match unsafe { libc::waitpid(self.pid, &mut raw, libc::WNOHANG) } {
            -1 => Err(io::Error::last_os_error()),
            0 => Ok(None),
            _ => {
                let status = ExitStatus::from_raw(raw);
                self.status = Some(status);
                Ok(Some(status))
            }
        }
    }

    /// Waits for the child to exit and reaps it. Cancel-safe.
    pub(crate) async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.try_reap()? {
                return Ok(status);
            }
            match &self.pidfd {
                Some(pidfd) => {
                    let mut ready = pidfd.readable().await?;
                    ready.clear_ready();
                }
                None => {
                    let pid = self.pid;
                    let status = tokio::task::spawn_blocking(move || reap_blocking(pid))
                        .await
                        .map_err(io::Error::other)?
                        .ok_or_else(|| io::Error::other("the job's main process could not be waited for"))?;
                    self.status = Some(status);
                }
            }
        }
    }
}

impl Drop for JobProcess {
    fn drop(&mut self) {
        if matches!(self.try_reap(), Ok(Some(_)) | Err(_)) {
            return;
        }
        let mut orphan = JobProcess { pid: self.pid, pidfd: self.pidfd.take(), status: None };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if orphan.pidfd.is_some() => {
                runtime.spawn(async move {
                    let _ = orphan.wait().await;
                });
            }
            _ => {
                orphan.status = Some(ExitStatus::from_raw(0));
                let pid = orphan.pid;
                std::thread::spawn(move || reap_blocking(pid));
            }
        }
    }
}
