//! Tests that measure the cluster's timing under faults and load (leases that lapse, runs billed
//! as long as they were seen), so they must not share the machine's cores with the rest of the
//! suite: cargo runs test binaries one after another, so this one never beside `it`, and within
//! it each such test holds [`alone`] while it runs.

mod chaos;
mod cluster_control;

/// Held by a timing-sensitive test for as long as it runs: one at a time.
pub fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
