//! The billing ledger: one segment per run of a job on GPUs, priced exactly in integer
//! micro-units from the replicated config, written once by apply().
//!
//! Invariant: a segment is created only by the state transition that ends a run (exit report of
//! the current allocation epoch, or a requeue of a running job), so duplicate or stale worker
//! reports, retries and leader changes can never charge twice.
//!
//! Invariant: a run is billed for how long it ran, not for a difference of one leader's wall
//! clock: the worker's monotonic run time, clipped to the TSO interval since the placement (a
//! worker cannot bill more than the cluster saw); the TSO interval alone only when the worker
//! never reported (its node was lost).

use crate::resources::job_milli_gpus;
use crate::State;
use corral_types::{Job, JobId, Segment, Timestamp};

/// How the length of a run that ends is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunLength {
    /// The worker measured it on its monotonic clock.
    Reported { worker_ms: u64 },
    /// The worker never reported (its node was lost or restarted).
    Lost,
    /// The worker never reported, and the node's next worker process stopped the run at this
    /// time (it said how long before registering): billed until then at the latest.
    LostStoppedBy(Timestamp),
}

/// Exact integer price: duration x GPU-equivalents x hourly price x class multiplier, rounded
/// down to a micro-unit.
pub fn cost_micros(duration_ms: u64, gpu_milli: u32, price_micros_per_gpu_hour: u64, multiplier_milli: u32) -> u64 {
    let numerator = u128::from(duration_ms)
        * u128::from(gpu_milli)
        * u128::from(price_micros_per_gpu_hour)
        * u128::from(multiplier_milli);
    (numerator / (3_600_000u128 * 1_000 * 1_000)) as u64
}

impl State {
    /// GPU model of the run of `job` (the model of its first GPU), if it holds a GPU.
    pub(crate) fn run_gpu_model(&self, job: &Job) -> Option<String> {
        let allocation = job.allocation.as_ref()?;
        let first = allocation.gpus.first()?;
        let node = self.nodes.get(&allocation.node)?;
        Some(node.spec.gpus.iter().find(|g| g.index == *first).map(|g| g.model.clone()).unwrap_or_default())
    }

    /// Records the segments of the current run of `job_id`, ending at `end` (before the job's
    /// allocation is cleared): one per piece between price breaks, the last one priced by the
    /// current policy. A run that never started, or held no GPU, records nothing. Returns the
    /// id of the last segment.
    pub(crate) fn close_segment(
        &mut self,
        job_id: JobId,
        end: Timestamp,
        end_state: &str,
        length: RunLength,
    ) -> Option<u64> {
        let end = match length {
            RunLength::LostStoppedBy(stopped) => end.min(stopped),
            _ => end,
        };
        let job = self.jobs.get(&job_id)?;
        let allocation = job.allocation.as_ref()?;
        let placed = job.admitted_at.or(job.started_at)?;
        let start = job.started_at.unwrap_or(placed);
        let gpu_model =
            if allocation.gpus.is_empty() { String::new() } else { self.run_gpu_model(job).unwrap_or_default() };
        let gpus: u32 = allocation.parts().map(|(_, g)| g.len() as u32).sum();
        if gpus == 0 {
            // GPU time is what is billed: a CPU-only run leaves no segment.
            return None;
        }
        let duration_ms = billed_ms(placed, start, end, length);
        let milli = u32::try_from(job_milli_gpus(&job.spec)).unwrap_or(u32::MAX);
        let price = self.config.gpu_price(&gpu_model);
        let multiplier =
            self.config.priority_classes.get(&job.spec.priority_class).map_or(1000, |c| c.billing_multiplier_milli);
        let end = end.max(start);
        // The pieces: each break ends one at its time with the pricing it recorded; the last
        // piece runs to the end with today's pricing. Breaks before the start cut nothing.
        let mut pieces: Vec<(Timestamp, u64, u32, u64)> = allocation
            .price_breaks
            .iter()
            .filter(|b| b.at > start && b.at < end)
            .map(|b| (b.at, b.price_micros_per_gpu_hour, b.multiplier_milli, b.policy_version))
            .collect();
        pieces.push((end, price, multiplier, self.policy_version));
        let template = Segment {
            id: 0,
            job_id,
            epoch: allocation.epoch,
            tenant: job.spec.tenant.clone(),
            node: allocation.node.clone(),
            gpu_model,
            gpus,
            gpu_milli: milli,
            priority_class: job.spec.priority_class.clone(),
            multiplier_milli: multiplier,
            price_micros_per_gpu_hour: price,
            start,
            end,
            duration_ms,
            lost: matches!(length, RunLength::Lost | RunLength::LostStoppedBy(_)),
            end_state: end_state.to_string(),
            cost_micros: 0,
            policy_version: self.policy_version,
        };
        // The billed length is shared out in order: each earlier piece gets its TSO interval
        // (never more than is left), the last piece the rest, so the pieces add up to the run.
        let mut from = start;
        let mut left = duration_ms;
        let last = pieces.len() - 1;
        let mut id = 0;
        for (i, (to, price, multiplier, version)) in pieces.into_iter().enumerate() {
            let ms = if i == last { left } else { to.millis_since(from).min(left) };
            left -= ms;
            id = self.next_segment_id;
            self.next_segment_id += 1;
            let segment = Segment {
                id,
                start: from,
                end: to,
                duration_ms: ms,
                multiplier_milli: multiplier,
                price_micros_per_gpu_hour: price,
                policy_version: version,
                cost_micros: cost_micros(ms, milli, price, multiplier),
                ..template.clone()
            };
            self.ledger.insert(id, segment);
            from = to;
        }
        Some(id)
    }
}

/// How much longer than its TSO interval a reported run may be billed. The stamps of a leader
/// elected after a failover start above its predecessor's window, up to one TSO window (3 s)
/// ahead of the clocks, so a TSO interval can be shorter than the time that really passed.
pub const TSO_LEAD_ALLOWANCE_MS: u64 = 5_000;

/// The billed length of a run placed at `placed` (TSO), started at `start` and ended at `end`:
/// the worker's run time clipped to the TSO interval since the placement (plus the allowance for
/// stamps running ahead of the clock), or the TSO interval since the start when the worker never
/// reported (until the node's next worker process stopped it, if it said when).
pub(crate) fn billed_ms(placed: Timestamp, start: Timestamp, end: Timestamp, length: RunLength) -> u64 {
    match length {
        RunLength::Reported { worker_ms } => worker_ms.min(end.millis_since(placed) + TSO_LEAD_ALLOWANCE_MS),
        RunLength::Lost => end.millis_since(start),
        RunLength::LostStoppedBy(stopped) => end.min(stopped).millis_since(start),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_is_exact_integer_arithmetic() {
        // One hour on one GPU at 0.89/h (890_000 micro) at x1: exactly 890_000.
        assert_eq!(cost_micros(3_600_000, 1000, 890_000, 1000), 890_000);
        // 90 minutes, 2 GPUs, x2: 3 * 2 * 890_000 = 5_340_000.
        assert_eq!(cost_micros(5_400_000, 2000, 890_000, 2000), 5_340_000);
        // A quarter GPU (MPS 25%) for 1 hour at x0.4: 0.25 * 0.4 * 890_000 = 89_000.
        assert_eq!(cost_micros(3_600_000, 250, 890_000, 400), 89_000);
        // Rounds down, never up.
        assert_eq!(cost_micros(1, 1000, 890_000, 1000), 0);
        // No overflow for a year on 1024 GPUs at a high price and multiplier.
        assert!(cost_micros(365 * 86_400_000, 1_024_000, 100_000_000, 10_000) > 0);
    }

    #[test]
    fn runs_are_billed_by_the_worker_clock_clipped_to_the_tso_interval() {
        let ts = |ms| Timestamp::compose(ms, 0);
        let reported = |ms| RunLength::Reported { worker_ms: ms };
        // The usual case: the worker's run time, shorter than the interval since placement.
        assert_eq!(billed_ms(ts(1_000), ts(1_050), ts(61_100), reported(60_000)), 60_000);
        // An end stamped by a leader whose clock is an hour ahead changes nothing.
        assert_eq!(billed_ms(ts(1_000), ts(1_050), ts(3_661_100), reported(60_000)), 60_000);
        // A worker claiming more than the cluster saw is clipped to the interval (plus the
        // allowance for stamps ahead of the clock).
        assert_eq!(billed_ms(ts(1_000), ts(1_050), ts(11_000), reported(60_000)), 10_000 + TSO_LEAD_ALLOWANCE_MS);
        // Stamps that ran ahead after a failover make the interval short: the worker's time stands.
        assert_eq!(billed_ms(ts(1_000), ts(1_050), ts(1_300), reported(1_400)), 1_400);
        // A lost node: the TSO interval from the start (or the placement when no start came).
        assert_eq!(billed_ms(ts(1_000), ts(2_000), ts(12_000), RunLength::Lost), 10_000);
        assert_eq!(billed_ms(ts(1_000), ts(1_000), ts(12_000), RunLength::Lost), 11_000);
        // A lost node whose next worker process stopped the run: until then at the latest.
        assert_eq!(billed_ms(ts(1_000), ts(2_000), ts(90_000), RunLength::LostStoppedBy(ts(5_000))), 3_000);
        assert_eq!(billed_ms(ts(1_000), ts(2_000), ts(4_000), RunLength::LostStoppedBy(ts(5_000))), 2_000);
        // Stopped before it started (its stamps ran ahead): nothing.
        assert_eq!(billed_ms(ts(1_000), ts(2_000), ts(90_000), RunLength::LostStoppedBy(ts(1_500))), 0);
    }
}
