//! `corral attach JOB [--node N] [-- CMD]` (like `srun --jobid=JOB --overlap --pty bash`): a
//! shell, or CMD, inside a running job's cgroup on one of its nodes, as the job's user in its
//! working directory with its environment. The coordinator relays the call to the node's agent
//! (`Corral.Attach`). When this process's stdin and stdout are a terminal, the node gives the
//! command a terminal of its own and ours goes raw (every key goes through; ours is restored
//! on the way out), resized with ours (SIGWINCH); otherwise stdin, stdout and stderr are plain
//! pipes, so scripts and tests can drive it. Exits with the command's status (128+N when
//! signal N killed it).

use crate::args::{AttachArgs, GlobalArgs};
use crate::connect::client;
use corral_proto::v1::{self as pb};
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use tokio::sync::mpsc;

/// Bytes of stdin sent at a time.
const CHUNK: usize = 32 * 1024;

pub async fn attach(global: &GlobalArgs, args: AttachArgs) -> anyhow::Result<ExitCode> {
    let tty = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let (rows, cols) = if tty { window_size() } else { (0, 0) };
    let start = pb::AttachStart {
        job_id: args.job,
        node: args.node.unwrap_or_default(),
        command: args.command,
        tty,
        rows,
        cols,
        term: std::env::var("TERM").unwrap_or_default(),
        epoch: 0,
    };
    let (tx, rx) = mpsc::channel::<pb::AttachInput>(16);
    tx.send(pb::AttachInput { input: Some(pb::attach_input::Input::Start(start)) }).await?;
    // stdin, read on a thread of its own (a blocking read), until its end.
    let stdin_tx = tx.clone();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; CHUNK];
        loop {
            let input = match stdin.read(&mut buf) {
                Ok(0) | Err(_) => pb::attach_input::Input::StdinEof(true),
                Ok(n) => pb::attach_input::Input::Stdin(buf[..n].to_vec()),
            };
            let end = matches!(input, pb::attach_input::Input::StdinEof(_));
            if stdin_tx.blocking_send(pb::AttachInput { input: Some(input) }).is_err() || end {
                return;
            }
        }
    });
    if tty {
        let resize_tx = tx.clone();
        let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
        tokio::spawn(async move {
            while winch.recv().await.is_some() {
                let (rows, cols) = window_size();
                let resize = pb::attach_input::Input::Resize(pb::WindowSize { rows, cols });
                if resize_tx.send(pb::AttachInput { input: Some(resize) }).await.is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut output = client(global)?.attach(tokio_stream::wrappers::ReceiverStream::new(rx)).await?;
    let raw = if tty { RawMode::enter() } else { None };
    let mut code = None;
    loop {
        let message = match output.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(e) => {
                drop(raw);
                anyhow::bail!("attach: {}", e.message());
            }
        };
        match message.output {
            Some(pb::attach_output::Output::Stdout(data)) => {
                let mut out = std::io::stdout().lock();
                out.write_all(&data)?;
                out.flush()?;
            }
            Some(pb::attach_output::Output::Stderr(data)) => {
                let mut err = std::io::stderr().lock();
                err.write_all(&data)?;
                err.flush()?;
            }
            Some(pb::attach_output::Output::Exit(exit)) => {
                code = Some(match (exit.exit_code, exit.signal) {
                    (Some(c), _) => c,
                    (None, Some(s)) => 128 + s,
                    _ => 1,
                });
            }
            None => {}
        }
    }
    drop(raw);
    match code {
        Some(c) => Ok(ExitCode::from(u8::try_from(c.clamp(0, 255)).unwrap_or(1))),
        None => anyhow::bail!("attach: the node's worker went away before the command ended (the job may have ended)"),
    }
}

/// Our terminal's size (rows, columns); (0, 0) when unknown.
fn window_size() -> (u32, u32) {
    let mut size = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ writes the winsize it is given.
    if unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } != 0 {
        return (0, 0);
    }
    (u32::from(size.ws_row), u32::from(size.ws_col))
}

/// Our terminal in raw mode while this lives; restored when dropped.
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enter() -> Option<RawMode> {
        // SAFETY: tcgetattr/tcsetattr on stdin with termios structs we own.
        unsafe {
            let mut saved: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(libc::STDIN_FILENO, &mut saved) != 0 {
                return None;
            }
            let mut raw = saved;
            libc::cfmakeraw(&mut raw);
            if libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw) != 0 {
                return None;
            }
            Some(RawMode { saved })
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the attributes read in `enter`.
        unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &self.saved) };
    }
}
