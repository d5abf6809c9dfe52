//! A job's output on our stdout and stderr: one rank's copied as it comes (`corral logs`,
//! `corral run`), or with `--all-ranks` every part of a gang, each line prefixed with
//! `[rank N] ` (stdout and stderr kept apart). Without `-f` the ranks are printed one after the
//! other; with `-f` their lines interleave as they come.

use anyhow::Context;
use corral_client::Client;
use corral_proto::v1::{LogChunk, LogStream};
use corral_types::Job;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use tokio_stream::{StreamExt, StreamMap};
use tonic::Streaming;

/// Copies one log stream to stdout and stderr until it ends; stdout is flushed after each chunk,
/// so that output piped on shows as it comes.
pub async fn copy(mut stream: Streaming<LogChunk>) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    while let Some(chunk) = stream.message().await.context("log stream broke off")? {
        if chunk.stream == LogStream::Stderr as i32 {
            stderr.write_all(&chunk.data)?;
        } else {
            stdout.write_all(&chunk.data)?;
            stdout.flush()?;
        }
    }
    Ok(())
}

/// Splits each rank's output into lines and writes them with the rank's prefix.
#[derive(Default)]
struct Prefixer {
    /// Unfinished line per (rank, is stderr).
    partial: BTreeMap<(u32, bool), Vec<u8>>,
}

impl Prefixer {
    fn write(
        &mut self,
        rank: u32,
        chunk: &LogChunk,
        out: &mut impl Write,
        err: &mut impl Write,
    ) -> std::io::Result<()> {
        let is_err = chunk.stream == LogStream::Stderr as i32;
        let buf = self.partial.entry((rank, is_err)).or_default();
        buf.extend_from_slice(&chunk.data);
        let Some(end) = buf.iter().rposition(|b| *b == b'\n') else { return Ok(()) };
        let rest = buf.split_off(end + 1);
        let sink: &mut dyn Write = if is_err { err } else { out };
        for line in buf.split_inclusive(|b| *b == b'\n') {
            sink.write_all(format!("[rank {rank}] ").as_bytes())?;
            sink.write_all(line)?;
        }
        *buf = rest;
        sink.flush()
    }

    /// Writes what is left of unfinished lines (of `rank`, or of every rank), ended by a newline.
    fn finish(&mut self, rank: Option<u32>, out: &mut impl Write, err: &mut impl Write) -> std::io::Result<()> {
        for ((r, is_err), buf) in self.partial.iter_mut().filter(|((r, _), _)| rank.is_none_or(|k| k == *r)) {
            if buf.is_empty() {
                continue;
            }
            let sink: &mut dyn Write = if *is_err { err } else { out };
            sink.write_all(format!("[rank {r}] ").as_bytes())?;
            sink.write_all(buf)?;
            sink.write_all(b"\n")?;
            buf.clear();
        }
        Ok(())
    }
}

pub async fn all_ranks(client: &Client, job: &Job, follow: bool) -> anyhow::Result<ExitCode> {
    let ranks = job.spec.parts();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr();
    let mut lines = Prefixer::default();
    if !follow {
        for rank in 0..ranks {
            let mut stream = client.read_rank_logs(job.id, rank, false).await?;
            while let Some(chunk) =
                stream.message().await.with_context(|| format!("log stream of rank {rank} broke off"))?
            {
                lines.write(rank, &chunk, &mut out, &mut err)?;
            }
            lines.finish(Some(rank), &mut out, &mut err)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut streams = StreamMap::new();
    for rank in 0..ranks {
        streams.insert(rank, client.read_rank_logs(job.id, rank, true).await?);
    }
    while let Some((rank, chunk)) = streams.next().await {
        let chunk = chunk.with_context(|| format!("log stream of rank {rank} broke off"))?;
        lines.write(rank, &chunk, &mut out, &mut err)?;
    }
    lines.finish(None, &mut out, &mut err)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(stream: LogStream, data: &str) -> LogChunk {
        LogChunk { stream: stream as i32, data: data.as_bytes().to_vec() }
    }

    #[test]
    fn every_line_carries_its_rank_even_when_chunks_split_lines() {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut p = Prefixer::default();
        p.write(0, &chunk(LogStream::Stdout, "hello fr"), &mut out, &mut err).expect("write");
        p.write(1, &chunk(LogStream::Stdout, "rank one\nsecond"), &mut out, &mut err).expect("write");
        p.write(0, &chunk(LogStream::Stdout, "om zero\n"), &mut out, &mut err).expect("write");
        p.write(1, &chunk(LogStream::Stderr, "oops\n"), &mut out, &mut err).expect("write");
        p.finish(None, &mut out, &mut err).expect("finish");
        assert_eq!(
            String::from_utf8(out).expect("utf-8"),
            "[rank 1] rank one\n[rank 0] hello from zero\n[rank 1] second\n"
        );
        assert_eq!(String::from_utf8(err).expect("utf-8"), "[rank 1] oops\n");
    }
}
