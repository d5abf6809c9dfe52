//! A step's task: one more process started inside a running job's cgroup (what `srun` inside a
//! job launches), confined as the job's main process is (same cgroup, user, limits), with its
//! output in a file of its own. In an image job it runs in the job's container (through the
//! container runtime: `runc exec`). It cannot outlive the job: the job's end kills its cgroup.

use super::job::{ContainerExec, ExecStarted, JobHandle};
use super::process::resolve_program;
use super::spawn;
use super::{ExecError, DEFAULT_PATH};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

/// The output file of task `task` (its rank in the step) of step `step` in the run's directory
/// `work_dir`.
pub fn task_output(work_dir: &Path, step: u32, task: u32) -> PathBuf {
    work_dir.join(format!("step-{step}.{task}.out"))
}

/// Made in the run's directory once this node's tasks of step `step` are all gone (or could not
/// start), before their end is reported: a reader of their output files has read everything
/// once it has read past this file's appearance.
pub fn step_done_marker(work_dir: &Path, step: u32) -> PathBuf {
    work_dir.join(format!("step-{step}.done"))
}

/// What to run as one task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskSpec {
    /// Program and arguments; `argv[0]` is looked up in the environment's `PATH`.
    pub argv: Vec<String>,
    /// Its whole environment.
    pub env: BTreeMap<String, String>,
    /// Its working directory (absolute).
    pub cwd: PathBuf,
    /// Receives its stdout and stderr (created, or truncated; owned by the job's user).
    pub output: PathBuf,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub open_files: Option<u64>,
}

/// What `corral attach` runs in a job's cgroup: a task whose stdio the caller gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachSpec {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub open_files: Option<u64>,
}

/// A started task.
#[derive(Debug)]
pub struct TaskProcess {
    /// The task itself, or in a container the runtime's process that runs it.
    process: spawn::JobProcess,
    /// In a container: the file holding the task's own pid (host pid namespace).
    container_pid_file: Option<PathBuf>,
}

impl TaskProcess {
    fn bare(process: spawn::JobProcess) -> TaskProcess {
        TaskProcess { process, container_pid_file: None }
    }

    fn in_container(started: ExecStarted) -> TaskProcess {
        TaskProcess { process: started.runtime_process, container_pid_file: Some(started.pid_file) }
    }

    /// Its pid (also its process group's): in a container, the runtime process's.
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// Sends `signal` to its process group: the task and what it started, or in a container the
    /// runtime, which passes it on. SIGKILL, which the runtime cannot pass on, goes to the task
    /// in the container too. Only while it is not reaped, so the pids are still its own.
    pub fn signal(&self, signal: Signal) {
        if signal == Signal::SIGKILL {
            let pid = self.container_pid_file.as_ref().and_then(|f| std::fs::read_to_string(f).ok());
            if let Some(pid) = pid.and_then(|p| p.trim().parse::<i32>().ok()).filter(|p| *p > 1) {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        let _ = killpg(Pid::from_raw(self.pid() as i32), signal);
    }

    /// Waits for it to exit and reaps it: (exit code, signal). Cancel-safe.
    pub async fn wait(&mut self) -> std::io::Result<(Option<i32>, Option<i32>)> {
        let status = self.process.wait().await?;
        let (code, signal) = (status.code(), status.signal());
        Ok(if self.container_pid_file.is_some() { super::runc::container_status(code, signal) } else { (code, signal) })
    }
}

impl JobHandle {
    /// Starts a task inside the job's cgroup (it joins it before exec). Blocking (a little
    /// filesystem work); call inside a tokio runtime.
    pub fn spawn_task(&self, spec: &TaskSpec) -> Result<TaskProcess, ExecError> {
        let argv0 = spec.argv.first().ok_or_else(|| ExecError::InvalidSpec("a task needs a command".into()))?;
        let open = || {
            let mut options = OpenOptions::new();
            options.write(true).create(true).truncate(true).mode(0o640).custom_flags(libc::O_NOFOLLOW);
            let file = options.open(&spec.output)?;
            if spec.uid.is_some() || spec.gid.is_some() {
                std::os::unix::fs::fchown(&file, spec.uid, spec.gid)?;
            }
            Ok::<_, std::io::Error>(file)
        };
        let output = open().map_err(|source| ExecError::OutputFile { path: spec.output.clone(), source })?;
        if let Some(container) = self.container() {
            // The container's PATH and files: runc looks the program up in there.
            let exec = ContainerExec {
                argv: &spec.argv,
                env: &spec.env,
                cwd: &spec.cwd,
                uid: spec.uid,
                gid: spec.gid,
                tty: false,
                name: exec_name(&spec.output),
            };
            let null = std::fs::File::open("/dev/null")
                .map_err(|source| ExecError::Spawn { program: "/dev/null".into(), source })?;
            return container.exec(&exec, [&null, &output, &output]).map(TaskProcess::in_container);
        }
        let path_var = spec.env.get("PATH").map_or(DEFAULT_PATH, String::as_str);
        let program = resolve_program(argv0, path_var, &spec.cwd)?;
        let cgroup_procs = self.cgroup_procs()?;
        let confinement = spawn::Confinement {
            cgroup_procs: &cgroup_procs,
            open_files: spec.open_files,
            uid: spec.uid,
            gid: spec.gid,
            // A step's tasks join a run that is already running (and fenced with it).
            not_after: None,
        };
        let process = spawn::spawn(&program, &spec.argv, &spec.env, &spec.cwd, &output, &output, &confinement)
            .map_err(|source| ExecError::Spawn { program: program.display().to_string(), source })?;
        Ok(TaskProcess::bare(process))
    }

    /// Starts `corral attach`'s process inside the job's cgroup, confined as a task, with the
    /// given stdio (with `tty`, `stdin` is a terminal that becomes its controlling terminal).
    /// Blocking; call inside a tokio runtime.
    pub fn spawn_attached(
        &self,
        spec: &AttachSpec,
        stdin: &std::fs::File,
        stdout: &std::fs::File,
        stderr: &std::fs::File,
        tty: bool,
    ) -> Result<TaskProcess, ExecError> {
        let argv0 = spec.argv.first().ok_or_else(|| ExecError::InvalidSpec("attach needs a command".into()))?;
        if let Some(container) = self.container() {
            let exec = ContainerExec {
                argv: &spec.argv,
                env: &spec.env,
                cwd: &spec.cwd,
                uid: spec.uid,
                gid: spec.gid,
                tty,
                name: format!("attach-{}", next_attach()),
            };
            return container.exec(&exec, [stdin, stdout, stderr]).map(TaskProcess::in_container);
        }
        let path_var = spec.env.get("PATH").map_or(DEFAULT_PATH, String::as_str);
        let program = resolve_program(argv0, path_var, &spec.cwd)?;
        let cgroup_procs = self.cgroup_procs()?;
        let confinement = spawn::Confinement {
            cgroup_procs: &cgroup_procs,
            open_files: spec.open_files,
            uid: spec.uid,
            gid: spec.gid,
            not_after: None,
        };
        let process = spawn::spawn_with_stdin(
            &program,
            &spec.argv,
            &spec.env,
            &spec.cwd,
            [stdin, stdout, stderr],
            tty,
            &confinement,
        )
        .map_err(|source| ExecError::Spawn { program: program.display().to_string(), source })?;
        Ok(TaskProcess::bare(process))
    }
}

/// The name of a task's exec in its container: its output file's (`step-S.R`).
fn exec_name(output: &Path) -> String {
    output.file_stem().map_or_else(|| "task".to_owned(), |s| s.to_string_lossy().into_owned())
}

/// A number for each attach of this worker process (names its exec in the container).
fn next_attach() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
