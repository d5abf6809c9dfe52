//! A stand-in for a distributed training launcher in the gang tests: each part reads the
//! rendezvous environment corral gave it, rank 0 listens on MASTER_ADDR:MASTER_PORT and every
//! other part connects (retrying until a deadline), and they exchange their RANKs over TCP.
//! Prints what it saw and whom it met; exits 0 once every peer was met, 2 otherwise.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

/// Sends our rank and reads the peer's, one line each way.
fn exchange(stream: TcpStream, rank: &str) -> Result<String, String> {
    stream.set_read_timeout(Some(Duration::from_secs(20))).map_err(|e| e.to_string())?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    writer.write_all(format!("{rank}\n").as_bytes()).map_err(|e| format!("send: {e}"))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).map_err(|e| format!("receive: {e}"))?;
    Ok(line.trim().to_string())
}

fn run() -> Result<(), String> {
    let (addr, port) = (var("MASTER_ADDR")?, var("MASTER_PORT")?);
    let (rank, node_rank, nnodes) = (var("RANK")?, var("NODE_RANK")?, var("NNODES")?);
    let (world, local) = (var("WORLD_SIZE")?, var("LOCAL_WORLD_SIZE")?);
    println!("rank {rank} node_rank {node_rank} of {nnodes} world {world} local {local} meets at {addr}:{port}");
    let hostfile = std::fs::read_to_string(var("CORRAL_HOSTFILE")?).map_err(|e| format!("hostfile: {e}"))?;
    for line in hostfile.lines() {
        println!("hostfile: {line}");
    }
    let nnodes: usize = nnodes.parse().map_err(|_| "NNODES is not a number".to_string())?;
    let deadline = Instant::now() + DEADLINE;
    if node_rank == "0" {
        let listener = TcpListener::bind(format!("{addr}:{port}")).map_err(|e| format!("listen: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut met = 0;
        while met < nnodes - 1 {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
                    let peer = exchange(stream, &rank)?;
                    println!("rank {rank} met rank {peer}");
                    met += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(format!("accept: {e}")),
            }
        }
        return Ok(());
    }
    loop {
        match TcpStream::connect(format!("{addr}:{port}")) {
            Ok(stream) => {
                let peer = exchange(stream, &rank)?;
                println!("rank {rank} met rank {peer}");
                return Ok(());
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("connect: {e}")),
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("rendezvous-probe: {e}");
        std::process::exit(2);
    }
}
