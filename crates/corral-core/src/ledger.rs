//! The billing ledger: one segment per run of a job on GPUs, priced exactly in integer
//! micro-units from the replicated config, written once by apply().
//!
//! Invariant: a segment is created only by the state transition that ends a run (exit report of
//! the current allocation epoch, or a requeue of a running job), so duplicate or stale worker
//! reports, retries and leader changes can never charge twice.

use crate::resources::job_milli_gpus;
use crate::State;
use corral_types::{JobId, Timestamp};
use serde::{Deserialize, Serialize};

/// One priced stretch of GPU use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub id: u64,
    pub job_id: JobId,
    /// Allocation epoch of the run.
    pub epoch: u64,
    pub tenant: String,
    pub node: String,
    pub gpu_model: String,
    /// Whole GPUs, or 1 for a slice.
    pub gpus: u32,
    /// GPU-equivalents in thousandths (whole GPU = 1000, a slice its fraction).
    pub gpu_milli: u32,
    pub priority_class: String,
    pub multiplier_milli: u32,
    /// Price of one whole GPU-hour of this model, in micro-units.
    pub price_micros_per_gpu_hour: u64,
    pub start: Timestamp,
    pub end: Timestamp,
    /// How the run ended: succeeded, failed, cancelled, requeued, preempted.
    pub end_state: String,
    pub cost_micros: u64,
}

impl Segment {
    pub fn duration_ms(&self) -> u64 {
        self.end.millis_since(self.start)
    }
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
    /// Records the segment of the current run of `job_id`, ending at `end` (before the job's
    /// allocation is cleared). A run that never started, or held no GPU, records nothing.
    pub(crate) fn close_segment(&mut self, job_id: JobId, end: Timestamp, end_state: &str) -> Option<u64> {
        let job = self.jobs.get(&job_id)?;
        let allocation = job.allocation.as_ref()?;
        let start = job.started_at?;
        let gpu_model = self
            .nodes
            .get(&allocation.node)
            .and_then(|n| {
                let first = allocation.gpus.first()?;
                n.spec.gpus.iter().find(|g| g.index == *first).map(|g| g.model.clone())
            })
            .unwrap_or_default();
        let gpus: u32 = allocation.parts().map(|(_, g)| g.len() as u32).sum();
        if gpus == 0 {
            // GPU time is what is billed: a CPU-only run leaves no segment.
            return None;
        }
        let milli = u32::try_from(job_milli_gpus(&job.spec)).unwrap_or(u32::MAX);
        let price = self.config.gpu_price(&gpu_model);
        let multiplier =
            self.config.priority_classes.get(&job.spec.priority_class).map_or(1000, |c| c.billing_multiplier_milli);
        let end = end.max(start);
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        let segment = Segment {
            id,
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
            end_state: end_state.to_string(),
            cost_micros: cost_micros(end.millis_since(start), milli, price, multiplier),
        };
        self.ledger.insert(id, segment);
        Some(id)
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
}
