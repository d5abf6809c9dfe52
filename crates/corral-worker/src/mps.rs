//! CUDA MPS for fractional jobs on GPUs without MIG: one MPS control daemon per GPU, started
//! on first use (or found running from an earlier worker process) with its own pipe and log
//! directories under `<data-dir>/mps/<gpu>`. Jobs get `CUDA_MPS_PIPE_DIRECTORY` and
//! `CUDA_MPS_LOG_DIRECTORY` pointing at them (the caller sets the thread percentage and memory
//! limit). On a host without `nvidia-cuda-mps-control` MPS is simulated: jobs only get the
//! limit variables, and the worker says so once.
//!
//! Known limit: an MPS server serves one uid at a time; jobs of another tenant wait for it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The control daemon's binary name.
pub const MPS_CONTROL: &str = "nvidia-cuda-mps-control";

/// How long a freshly started daemon may take to create its pipe.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// MPS settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsConfig {
    /// Start MPS daemons for fractional jobs when the control binary exists.
    pub enabled: bool,
    /// The control binary; a bare name is looked up in PATH.
    pub control: PathBuf,
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig { enabled: true, control: PathBuf::from(MPS_CONTROL) }
    }
}

/// What a job needs to reach its GPU's MPS daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsAttachment {
    pub env: Vec<(String, String)>,
    /// Directories a container must see (the pipe and log directories).
    pub binds: Vec<PathBuf>,
}

/// The MPS daemons of this worker.
#[derive(Debug)]
pub struct Mps {
    control: Option<PathBuf>,
    base_dir: PathBuf,
    /// GPUs whose daemon this process started or attached to.
    daemons: Mutex<BTreeMap<u32, PathBuf>>,
}

impl Mps {
    /// Finds the control binary; without it (or when disabled) MPS is simulated.
    pub fn new(config: &MpsConfig, base_dir: PathBuf) -> Self {
        let control = if config.enabled { crate::executor::find_program(&config.control, &[]) } else { None };
        match &control {
            Some(path) => tracing::info!(control = %path.display(), "MPS available for fractional jobs"),
            None if config.enabled => tracing::info!(
                "MPS is simulated: {} not found, so fractional jobs get only their CUDA_MPS_* limits",
                config.control.display()
            ),
            None => tracing::info!("MPS disabled by config: fractional jobs get only their CUDA_MPS_* limits"),
        }
        Mps { control, base_dir, daemons: Mutex::new(BTreeMap::new()) }
    }

    /// True when real MPS daemons are used.
    pub fn is_real(&self) -> bool {
        self.control.is_some()
    }

    fn dirs(&self, gpu: u32) -> (PathBuf, PathBuf) {
        let dir = self.base_dir.join(gpu.to_string());
        (dir.join("pipe"), dir.join("log"))
    }

    /// Makes sure a daemon serves `gpu` (device `uuid`) and says how to reach it; `None` when
    /// MPS is simulated. Blocking (may start the daemon).
    pub fn attach(&self, gpu: u32, uuid: &str) -> Result<Option<MpsAttachment>, String> {
        let Some(control) = &self.control else { return Ok(None) };
        let (pipe, log) = self.dirs(gpu);
        let mut daemons = self.daemons.lock().unwrap_or_else(|p| p.into_inner());
        if !daemon_alive(&pipe) {
            for dir in [&pipe, &log] {
                std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                // Clients of any tenant uid must reach the pipe.
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
            }
            let status = Command::new(control)
                .arg("-d")
                .env("CUDA_VISIBLE_DEVICES", uuid)
                .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
                .env("CUDA_MPS_LOG_DIRECTORY", &log)
                .stdin(Stdio::null())
                .status()
                .map_err(|e| format!("cannot start {}: {e}", control.display()))?;
            if !status.success() {
                return Err(format!("{} -d failed ({status}); see {}", control.display(), log.display()));
            }
            let deadline = Instant::now() + START_TIMEOUT;
            while !daemon_alive(&pipe) {
                if Instant::now() > deadline {
                    return Err(format!("the MPS daemon for gpu {gpu} did not start; see {}", log.display()));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            tracing::info!(gpu, pipe = %pipe.display(), "started the MPS control daemon");
        }
        daemons.insert(gpu, pipe.clone());
        Ok(Some(MpsAttachment {
            env: vec![
                ("CUDA_MPS_PIPE_DIRECTORY".into(), pipe.display().to_string()),
                ("CUDA_MPS_LOG_DIRECTORY".into(), log.display().to_string()),
            ],
            binds: vec![pipe, log],
        }))
    }

    /// Asks every daemon this worker used to quit (at worker shutdown). Blocking.
    pub fn shutdown(&self) {
        let Some(control) = &self.control else { return };
        let daemons = std::mem::take(&mut *self.daemons.lock().unwrap_or_else(|p| p.into_inner()));
        for (gpu, pipe) in daemons {
            let quit = Command::new(control)
                .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .and_then(|mut child| {
                    use std::io::Write;
                    if let Some(mut stdin) = child.stdin.take() {
                        stdin.write_all(b"quit\n")?;
                    }
                    child.wait()
                });
            match quit {
                Ok(_) => tracing::info!(gpu, "stopped the MPS control daemon"),
                Err(e) => tracing::warn!(gpu, error = %e, "cannot stop the MPS control daemon"),
            }
        }
    }
}

/// The daemon writes its pid next to its control pipe.
fn daemon_alive(pipe: &Path) -> bool {
    let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).ok();
    let Some(pid) = pid.and_then(|p| p.trim().parse::<u32>().ok()) else { return false };
    // A zombie nobody reaped yet is not a daemon.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            !matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('Z' | 'X'))
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_control_binary_mps_is_simulated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = MpsConfig { enabled: true, control: PathBuf::from("no-such-mps-control-corral") };
        let mps = Mps::new(&config, dir.path().join("mps"));
        assert!(!mps.is_real());
        assert_eq!(mps.attach(0, "GPU-x"), Ok(None));
        mps.shutdown();
    }

    #[test]
    fn a_fake_control_daemon_is_started_once_and_attached() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Stands in for nvidia-cuda-mps-control -d: writes its pid file and stays alive.
        let fake = dir.path().join("fake-mps-control");
        std::fs::write(
            &fake,
            "#!/bin/sh\ncase \"$1\" in -d) sleep 30 & echo $! > \"$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid\"; echo \"$CUDA_VISIBLE_DEVICES\" > \"$CUDA_MPS_LOG_DIRECTORY/started\";; *) cat >/dev/null; kill $(cat \"$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid\");; esac\n",
        )
        .expect("write fake");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let mps = Mps::new(&MpsConfig { enabled: true, control: fake }, dir.path().join("mps"));
        assert!(mps.is_real());
        let first = mps.attach(2, "GPU-abc").expect("attach").expect("real mps");
        let pipe = dir.path().join("mps/2/pipe");
        assert!(first.env.contains(&("CUDA_MPS_PIPE_DIRECTORY".into(), pipe.display().to_string())));
        let started = std::fs::read_to_string(dir.path().join("mps/2/log/started")).expect("started");
        assert_eq!(started.trim(), "GPU-abc");
        let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).expect("pid");
        assert_eq!(mps.attach(2, "GPU-abc").expect("attach again"), Some(first));
        assert_eq!(std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).expect("pid"), pid, "reused");
        mps.shutdown();
        let deadline = Instant::now() + Duration::from_secs(10);
        while daemon_alive(&pipe) {
            assert!(Instant::now() < deadline, "the daemon did not quit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
