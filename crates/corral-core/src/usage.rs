//! Fair-share usage history (Slurm's decayed usage), kept in integers so that every replica holds
//! bit-identical state: apply() charges each finished run into time buckets stamped with TSO time;
//! the decay is computed only when the leader reads it (`decayed`), so floats never enter the
//! replicated state.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Buckets older than this many half-lives weigh less than 1/1024 and are dropped.
const RETAINED_HALF_LIVES: u64 = 10;
/// Buckets per half-life (the decay resolution).
const BUCKETS_PER_HALF_LIFE: u64 = 16;
/// Shortest bucket, so short half-lives (tests, dev) do not make many tiny buckets.
const MIN_BUCKET_MS: u64 = 1_000;

/// Charged usage per tenant: bucket start (TSO physical ms) -> milli-GPU-seconds, already
/// weighted by the priority class's billing multiplier.
///
/// Replicated (persisted with the scalar state). Invariant: no empty maps or zero buckets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageLedger {
    pub tenants: BTreeMap<String, BTreeMap<u64, u64>>,
}

fn bucket_ms(half_life_secs: u64) -> u64 {
    (half_life_secs * 1000 / BUCKETS_PER_HALF_LIFE).max(MIN_BUCKET_MS)
}

impl UsageLedger {
    /// Charges `milli_gpus` (weighted) held from `from_ms` to `to_ms`, spread over the buckets
    /// the run overlaps, and drops the tenant's buckets that have decayed away.
    pub(crate) fn charge(&mut self, tenant: &str, from_ms: u64, to_ms: u64, milli_gpus: u64, half_life_secs: u64) {
        let width = bucket_ms(half_life_secs);
        let horizon = to_ms.saturating_sub(RETAINED_HALF_LIVES * half_life_secs * 1000);
        let from_ms = from_ms.max(horizon);
        if milli_gpus == 0 || to_ms <= from_ms {
            return;
        }
        let buckets = self.tenants.entry(tenant.to_string()).or_default();
        let mut start = from_ms - from_ms % width;
        while start < to_ms {
            let overlap = to_ms.min(start + width) - from_ms.max(start);
            let amount = milli_gpus * overlap / 1000;
            if amount > 0 {
                *buckets.entry(start).or_default() += amount;
            }
            start += width;
        }
        let keep_from = horizon.saturating_sub(width);
        buckets.retain(|start, _| *start >= keep_from);
        if buckets.is_empty() {
            self.tenants.remove(tenant);
        }
    }

    /// Decayed usage of `tenant` at `now_ms` in milli-GPU-seconds (read on the leader only).
    pub fn decayed(&self, tenant: &str, now_ms: u64, half_life_secs: u64) -> f64 {
        let Some(buckets) = self.tenants.get(tenant) else { return 0.0 };
        let width = bucket_ms(half_life_secs);
        let half_life_ms = (half_life_secs * 1000) as f64;
        buckets
            .iter()
            .map(|(start, amount)| {
                let age = now_ms.saturating_sub(start + width / 2) as f64;
                *amount as f64 * (-age / half_life_ms).exp2()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3600;

    #[test]
    fn usage_decays_by_half_each_half_life() {
        let mut ledger = UsageLedger::default();
        // One GPU for one hour, half-life one hour.
        ledger.charge("a", 0, HOUR * 1000, 1000, HOUR);
        let total: u64 = ledger.tenants["a"].values().sum();
        assert_eq!(total, 3600 * 1000);
        let right_after = ledger.decayed("a", HOUR * 1000, HOUR);
        let later = ledger.decayed("a", 2 * HOUR * 1000, HOUR);
        assert!((later / right_after - 0.5).abs() < 1e-9, "{later} vs {right_after}");
        assert_eq!(ledger.decayed("b", 0, HOUR), 0.0);
    }

    #[test]
    fn old_buckets_are_dropped_and_charges_are_bounded() {
        let mut ledger = UsageLedger::default();
        ledger.charge("a", 0, 1000, 1000, 1);
        ledger.charge("a", 100_000, 101_000, 1000, 1);
        assert_eq!(ledger.tenants["a"].keys().copied().collect::<Vec<_>>(), vec![100_000]);
        // A run far longer than the retention only charges the retained tail.
        ledger.charge("b", 0, 1_000_000_000, 1000, 1);
        assert!(ledger.tenants["b"].len() as u64 <= RETAINED_HALF_LIVES + 2);
        ledger.charge("c", 5, 5, 1000, 1);
        assert!(!ledger.tenants.contains_key("c"), "nothing charged, nothing stored");
    }
}
