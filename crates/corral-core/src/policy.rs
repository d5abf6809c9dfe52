//! Versioned cluster policy: what changes between two configs (what `corral admin diff` shows and
//! the history keeps), which jobs a change would strand, and the `ApplyPolicy` transition that
//! bumps the version, re-prices running runs from the change on and records the change.
//!
//! Invariant: a policy change never rewrites a billed segment. A run whose price or billing
//! multiplier changes while it holds its GPUs gets a `PriceBreak` at the change; the ledger bills
//! it in one segment per piece, each with the policy version whose prices it used.

use crate::quota::format_gpus;
use crate::{ApplyError, ClusterConfig, Outcome, PriorityClass, Response, SchedulerConfig, State, TenantPolicy};
use corral_types::{JobId, JobState, PriceBreak, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt::Display;

/// Most policy changes the history keeps (the oldest are dropped).
pub const MAX_POLICY_HISTORY: usize = 1000;

/// One applied policy change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRecord {
    pub version: u64,
    pub ts: Timestamp,
    /// Who applied it (the principal as the audit log names it).
    pub by: String,
    /// What changed, one line per key (`ClusterConfig::changes_to`).
    pub changes: Vec<String>,
    /// Jobs cancelled because the change removed their tenant or class (`--force`).
    pub cancelled: Vec<JobId>,
}

/// What applying a policy would do.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyPlan {
    pub changes: Vec<String>,
    /// Unfinished jobs whose tenant or priority class the policy removes, with why.
    pub stranded: Vec<(JobId, JobState, String)>,
}

impl PolicyPlan {
    /// One line: how many jobs are stranded and by what.
    pub fn describe_stranded(&self) -> String {
        let pending = self.stranded.iter().filter(|(_, s, _)| *s == JobState::Pending).count();
        let running = self.stranded.len() - pending;
        let mut reasons: Vec<&str> = self.stranded.iter().map(|(_, _, why)| why.as_str()).collect();
        reasons.dedup();
        let reasons: BTreeSet<&str> = reasons.into_iter().collect();
        format!(
            "{pending} pending and {running} running job(s) of a removed tenant or class ({})",
            reasons.into_iter().collect::<Vec<_>>().join("; ")
        )
    }
}

/// A price in micro-units as the policy file writes it (`0.89`).
pub fn format_price(micros: u64) -> String {
    format_fixed(micros, 1_000_000)
}

/// A billing multiplier in thousandths as the policy file writes it (`0.4`).
pub fn format_multiplier(milli: u32) -> String {
    format_fixed(u64::from(milli), 1000)
}

fn format_fixed(value: u64, unit: u64) -> String {
    let whole = value / unit;
    let frac = value % unit;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = unit.ilog10() as usize;
    let frac = format!("{frac:0digits$}");
    format!("{whole}.{}", frac.trim_end_matches('0'))
}

/// Seconds as the policy file writes a duration: `7d`, `1d12h`, `90s`.
pub fn format_secs(secs: u64) -> String {
    if secs == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    let mut rest = secs;
    for (unit, len) in [("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)] {
        if rest >= len {
            out.push_str(&format!("{}{unit}", rest / len));
            rest %= len;
        }
    }
    out
}

fn secs(s: u64) -> String {
    format_secs(s)
}

/// Appends "`prefix`: `key` A -> B" (or set / unset) when the values differ.
fn field<T: PartialEq + Display>(out: &mut Vec<String>, prefix: &str, key: &str, old: Option<T>, new: Option<T>) {
    match (old, new) {
        (Some(a), Some(b)) if a != b => out.push(format!("{prefix}: {key} {a} -> {b}")),
        (None, Some(b)) => out.push(format!("{prefix}: {key} set to {b}")),
        (Some(a), None) => out.push(format!("{prefix}: {key} unset (was {a})")),
        _ => {}
    }
}

fn tenant_fields(out: &mut Vec<String>, name: &str, old: &TenantPolicy, new: &TenantPolicy) {
    let p = format!("tenant {name}");
    field(out, &p, "quota-gpus", old.quota_milli_gpus.map(format_gpus), new.quota_milli_gpus.map(format_gpus));
    field(out, &p, "cohort", old.cohort.as_deref(), new.cohort.as_deref());
    field(
        out,
        &p,
        "borrow-limit-gpus",
        old.borrowing_limit_milli_gpus.map(format_gpus),
        new.borrowing_limit_milli_gpus.map(format_gpus),
    );
    field(out, &p, "fair-share-weight", Some(old.fair_share_weight.max(1)), Some(new.fair_share_weight.max(1)));
    field(out, &p, "max-running-jobs", old.max_running_jobs, new.max_running_jobs);
    field(out, &p, "max-pending-jobs", old.max_pending_jobs, new.max_pending_jobs);
    let classes: BTreeSet<&String> = old.class_quotas.keys().chain(new.class_quotas.keys()).collect();
    for class in classes {
        field(
            out,
            &p,
            &format!("class-quota-gpus.{class}"),
            old.class_quotas.get(class).map(|m| format_gpus(*m)),
            new.class_quotas.get(class).map(|m| format_gpus(*m)),
        );
    }
}

fn class_fields(out: &mut Vec<String>, old: &PriorityClass, new: &PriorityClass) {
    let p = format!("class {}", new.name);
    field(out, &p, "value", Some(old.value), Some(new.value));
    field(out, &p, "preempts", Some(old.preempts_lower), Some(new.preempts_lower));
    field(out, &p, "grace", Some(secs(u64::from(old.grace_secs()))), Some(secs(u64::from(new.grace_secs()))));
    field(
        out,
        &p,
        "billing-multiplier",
        Some(format_multiplier(old.billing_multiplier_milli)),
        Some(format_multiplier(new.billing_multiplier_milli)),
    );
    field(out, &p, "default", Some(old.is_default), Some(new.is_default));
    field(out, &p, "default-time", old.default_time_secs.map(secs), new.default_time_secs.map(secs));
    field(out, &p, "max-time", old.max_time_secs.map(secs), new.max_time_secs.map(secs));
    field(out, &p, "idle-timeout", old.idle_timeout_secs.map(secs), new.idle_timeout_secs.map(secs));
}

fn scheduler_fields(out: &mut Vec<String>, old: &SchedulerConfig, new: &SchedulerConfig) {
    let p = "scheduler";
    field(out, p, "usage-half-life", Some(secs(old.usage_half_life_secs)), Some(secs(new.usage_half_life_secs)));
    field(out, p, "backfill-reservations", Some(old.backfill_reservations), Some(new.backfill_reservations));
    field(out, p, "max-preemptors-per-pass", Some(old.max_preemptors_per_pass), Some(new.max_preemptors_per_pass));
    field(out, p, "lease-guard", Some(secs(old.lease_guard_secs)), Some(secs(new.lease_guard_secs)));
}

impl ClusterConfig {
    /// Every tenant: the listed ones, then those with only a policy.
    pub fn all_tenants(&self) -> BTreeSet<&str> {
        self.tenants.iter().chain(self.tenant_policies.keys()).map(String::as_str).collect()
    }

    /// What changes from `self` to `new`, one line per key, in the policy file's key names.
    pub fn changes_to(&self, new: &ClusterConfig) -> Vec<String> {
        let mut out = Vec::new();
        let (old_tenants, new_tenants) = (self.all_tenants(), new.all_tenants());
        let default_policy = TenantPolicy::default();
        for name in old_tenants.union(&new_tenants) {
            match (old_tenants.contains(name), new_tenants.contains(name)) {
                (true, false) => out.push(format!("tenant {name} removed")),
                (false, true) => {
                    out.push(format!("tenant {name} added"));
                    let policy = new.tenant_policies.get(*name).unwrap_or(&default_policy);
                    tenant_fields(&mut out, name, &default_policy, policy);
                }
                _ => {
                    let old = self.tenant_policies.get(*name).unwrap_or(&default_policy);
                    let policy = new.tenant_policies.get(*name).unwrap_or(&default_policy);
                    tenant_fields(&mut out, name, old, policy);
                }
            }
        }
        let names: BTreeSet<&String> = self.priority_classes.keys().chain(new.priority_classes.keys()).collect();
        for name in names {
            match (self.priority_classes.get(name), new.priority_classes.get(name)) {
                (Some(_), None) => out.push(format!("class {name} removed")),
                (None, Some(class)) => {
                    out.push(format!(
                        "class {name} added (value {}, billing-multiplier {}{})",
                        class.value,
                        format_multiplier(class.billing_multiplier_milli),
                        if class.preempts_lower { ", preempts" } else { "" }
                    ));
                }
                (Some(old), Some(class)) => class_fields(&mut out, old, class),
                (None, None) => {}
            }
        }
        let models: BTreeSet<&String> = self.gpu_prices.keys().chain(new.gpu_prices.keys()).collect();
        for model in models {
            field(
                &mut out,
                "prices",
                &format!("\"{model}\""),
                self.gpu_prices.get(model).map(|p| format_price(*p)),
                new.gpu_prices.get(model).map(|p| format_price(*p)),
            );
        }
        field(
            &mut out,
            "prices",
            "default",
            Some(format_price(self.default_gpu_price)),
            Some(format_price(new.default_gpu_price)),
        );
        scheduler_fields(&mut out, &self.scheduler, &new.scheduler);
        let (old, slurm) = (&self.slurm, &new.slurm);
        for account in old.accounts.keys().chain(slurm.accounts.keys()).collect::<BTreeSet<_>>() {
            let (a, b) = (old.accounts.get(account), slurm.accounts.get(account));
            field(&mut out, "slurm.accounts", &format!("\"{account}\""), a, b);
        }
        for qos in old.qos.keys().chain(slurm.qos.keys()).collect::<BTreeSet<_>>() {
            field(&mut out, "slurm.qos", &format!("\"{qos}\""), old.qos.get(qos), slurm.qos.get(qos));
        }
        field(&mut out, "slurm", "default-account", old.default_account.as_ref(), slurm.default_account.as_ref());
        for cause in self.credits.keys().chain(new.credits.keys()).collect::<BTreeSet<_>>() {
            let (a, b) = (self.credits.get(cause), new.credits.get(cause));
            let fraction = |m: &u32| format_multiplier(*m);
            field(&mut out, "billing.credits", cause.as_str(), a.map(fraction), b.map(fraction));
        }
        out
    }
}

impl State {
    /// What applying `config` would change and which jobs it would strand; refuses an invalid
    /// config.
    pub fn plan_policy(&self, config: &ClusterConfig) -> Result<PolicyPlan, ApplyError> {
        config.validate().map_err(ApplyError::InvalidConfig)?;
        let tenants = config.all_tenants();
        let mut stranded = Vec::new();
        for job in self.live_jobs() {
            let why = if !tenants.is_empty() && !tenants.contains(job.spec.tenant.as_str()) {
                format!("tenant '{}' removed", job.spec.tenant)
            } else if !config.priority_classes.is_empty()
                && !config.priority_classes.contains_key(&job.spec.priority_class)
            {
                format!("class '{}' removed", job.spec.priority_class)
            } else {
                continue;
            };
            stranded.push((job.id, job.state, why));
        }
        Ok(PolicyPlan { changes: self.config.changes_to(config), stranded })
    }

    /// Hourly price and billing multiplier of `job_id`'s current run under `config`.
    fn run_pricing(&self, config: &ClusterConfig, job_id: JobId) -> Option<(u64, u32)> {
        let job = self.jobs.get(&job_id)?;
        let model = self.run_gpu_model(job)?;
        let multiplier =
            config.priority_classes.get(&job.spec.priority_class).map_or(1000, |c| c.billing_multiplier_milli);
        Some((config.gpu_price(&model), multiplier))
    }

    /// Applies a new policy version: refuses one that strands jobs unless `force` (which cancels
    /// them), gives every running run whose pricing changes a price break, and records the change.
    pub(crate) fn apply_policy(&mut self, ts: Timestamp, config: &ClusterConfig, by: &str, force: bool) -> Response {
        let plan = self.plan_policy(config)?;
        if plan.changes.is_empty() {
            return Ok(Outcome::PolicyApplied {
                version: self.policy_version,
                changes: Vec::new(),
                cancelled: Vec::new(),
            });
        }
        if !plan.stranded.is_empty() && !force {
            return Err(ApplyError::PolicyStrandsJobs(format!(
                "the policy would strand {}: apply it with --force to cancel them, or keep the tenant or class until they end",
                plan.describe_stranded()
            )));
        }
        let old_version = self.policy_version;
        let version = old_version + 1;
        let running: Vec<JobId> = self.index.running.iter().copied().collect();
        for id in running {
            let (Some(old), Some(new)) = (self.run_pricing(&self.config, id), self.run_pricing(config, id)) else {
                continue;
            };
            if old == new {
                continue;
            }
            if let Some(alloc) = self.jobs.get_mut(&id).and_then(|j| j.allocation.as_mut()) {
                alloc.price_breaks.push(PriceBreak {
                    at: ts,
                    price_micros_per_gpu_hour: old.0,
                    multiplier_milli: old.1,
                    policy_version: old_version,
                });
            }
        }
        let mut cancelled = Vec::new();
        for (id, _, why) in &plan.stranded {
            let _ = self.cancel(ts, *id, &format!("cancelled: {why} by policy version {version}"));
            cancelled.push(*id);
        }
        self.config = config.clone();
        self.policy_version = version;
        self.policy_history.push(PolicyRecord {
            version,
            ts,
            by: by.to_string(),
            changes: plan.changes.clone(),
            cancelled: cancelled.clone(),
        });
        if self.policy_history.len() > MAX_POLICY_HISTORY {
            let excess = self.policy_history.len() - MAX_POLICY_HISTORY;
            self.policy_history.drain(..excess);
        }
        Ok(Outcome::PolicyApplied { version, changes: plan.changes, cancelled })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::tests::{cluster, spec, submit};
    use crate::{Command, Request};
    use corral_types::{JobExitReport, Segment};

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    fn apply_policy(s: &mut State, ms: u64, config: &ClusterConfig, force: bool) -> Response {
        s.apply(&at(ms, Command::ApplyPolicy { config: config.clone(), by: "admin".into(), force }))
    }

    fn run(s: &mut State, ms: u64, id: JobId) {
        let epoch = s.next_epoch;
        s.apply(&at(ms, Command::PlaceJob { job_id: id, node: "n1".into(), gpus: vec![0] })).unwrap();
        s.apply(&at(ms, Command::JobStarted { job_id: id, epoch })).unwrap();
    }

    fn finish(s: &mut State, ms: u64, id: JobId, run_time_ms: u64) {
        let epoch = s.jobs[&id].allocation.as_ref().unwrap().epoch;
        let report = JobExitReport { exit_code: Some(0), run_time_ms, ..Default::default() };
        s.apply(&at(ms, Command::JobFinished { job_id: id, epoch, node: "n1".into(), report })).unwrap();
    }

    #[test]
    fn a_price_change_in_a_run_bills_it_in_two_pieces_and_rewrites_nothing() {
        let mut s = cluster();
        let Ok(Outcome::JobSubmitted { job_id: before, .. }) = submit(&mut s, 10, "a", spec(1)) else { panic!() };
        run(&mut s, 1_000, before);
        finish(&mut s, 2_000, before, 1_000);
        let Ok(Outcome::JobSubmitted { job_id: id, .. }) = submit(&mut s, 10, "b", spec(1)) else { panic!() };
        run(&mut s, 3_000, id);
        let billed_before: Vec<Segment> = s.ledger.values().cloned().collect();
        let mut dearer = s.config.clone();
        dearer.gpu_prices.insert("RTX 5090".into(), 1_780_000);
        let Ok(Outcome::PolicyApplied { version: 1, .. }) = apply_policy(&mut s, 3_000 + 3_600_000, &dearer, false)
        else {
            panic!()
        };
        assert_eq!(s.ledger.values().cloned().collect::<Vec<_>>(), billed_before, "billed segments stay as they were");
        // Two hours in all: one at the old price, one at the new.
        finish(&mut s, 3_000 + 7_200_000, id, 7_200_000);
        let pieces: Vec<&Segment> = s.ledger.values().filter(|g| g.job_id == id).collect();
        assert_eq!(pieces.len(), 2);
        assert_eq!((pieces[0].policy_version, pieces[0].duration_ms, pieces[0].cost_micros), (0, 3_600_000, 890_000));
        assert_eq!((pieces[1].policy_version, pieces[1].duration_ms, pieces[1].cost_micros), (1, 3_600_000, 1_780_000));
        assert_eq!(pieces[0].end, pieces[1].start);
        assert_eq!(pieces[1].end_state, "succeeded");
        // A change that does not touch this run's pricing cuts nothing.
        let Ok(Outcome::JobSubmitted { job_id: third, .. }) = submit(&mut s, 10, "c", spec(1)) else { panic!() };
        run(&mut s, 8_000_000, third);
        let mut other = s.config.clone();
        other.gpu_prices.insert("H100".into(), 2_000_000);
        apply_policy(&mut s, 8_100_000, &other, false).unwrap();
        finish(&mut s, 8_200_000, third, 200_000);
        assert_eq!(s.ledger.values().filter(|g| g.job_id == third).count(), 1);
    }

    #[test]
    fn credit_changes_are_named_in_the_diff_and_a_share_above_all_is_refused() {
        let old = ClusterConfig::dev_defaults();
        let mut new = old.clone();
        new.credits = [(corral_types::EndCause::NodeLost, 1000), (corral_types::EndCause::Drained, 500)].into();
        assert_eq!(
            old.changes_to(&new),
            ["billing.credits: drained set to 0.5", "billing.credits: node-lost set to 1"]
        );
        assert_eq!(
            new.changes_to(&old),
            ["billing.credits: drained unset (was 0.5)", "billing.credits: node-lost unset (was 1)"]
        );
        new.credits.insert(corral_types::EndCause::GpuFault, 1001);
        assert!(new.validate().unwrap_err().contains("at most all of it"));
    }

    #[test]
    fn removing_a_tenant_with_jobs_needs_force_which_cancels_them() {
        let mut s = cluster();
        let mut team_b = spec(1);
        team_b.tenant = "team-b".into();
        let Ok(Outcome::JobSubmitted { job_id: pending, .. }) = submit(&mut s, 10, "a", team_b.clone()) else {
            panic!()
        };
        let mut without = s.config.clone();
        without.tenants.retain(|t| t != "team-b");
        without.tenant_policies.remove("team-b");
        let before = s.clone();
        let err = apply_policy(&mut s, 100, &without, false).unwrap_err();
        assert!(err.to_string().contains("1 pending and 0 running job(s)"), "{err}");
        assert!(err.to_string().contains("tenant 'team-b' removed"), "{err}");
        assert_eq!(s.config, before.config, "a refused policy changes nothing");
        assert_eq!(s.policy_version, 0);
        let Ok(Outcome::PolicyApplied { version, cancelled, changes }) = apply_policy(&mut s, 200, &without, true)
        else {
            panic!()
        };
        assert_eq!((version, cancelled), (1, vec![pending]));
        assert_eq!(changes, vec!["tenant team-b removed"]);
        assert_eq!(s.jobs[&pending].state, JobState::Cancelled);
        assert!(s.jobs[&pending].reason.as_deref().unwrap().contains("by policy version 1"));
        assert_eq!(s.policy_history.last().unwrap().cancelled, vec![pending]);
        // The same policy again is no new version.
        let Ok(Outcome::PolicyApplied { version: 1, changes, .. }) = apply_policy(&mut s, 300, &without, false) else {
            panic!()
        };
        assert!(changes.is_empty());
        assert_eq!(s.policy_history.len(), 1);
        // An invalid one is refused whole.
        let mut bad = without.clone();
        bad.priority_classes.get_mut("preemptible").unwrap().is_default = true;
        assert!(matches!(apply_policy(&mut s, 400, &bad, true), Err(ApplyError::InvalidConfig(_))));
    }

    #[test]
    fn tenant_job_limits_and_class_time_limits_hold_at_submit_and_placement() {
        let mut s = cluster();
        let mut config = s.config.clone();
        let team = config.tenant_policies.get_mut("team-a").unwrap();
        team.max_pending_jobs = Some(2);
        team.max_running_jobs = Some(1);
        let normal = config.priority_classes.get_mut("normal").unwrap();
        normal.default_time_secs = Some(3600);
        normal.max_time_secs = Some(86_400);
        apply_policy(&mut s, 5, &config, false).unwrap();
        let mut a = spec(1);
        a.tenant = "team-a".into();
        let Ok(Outcome::JobSubmitted { job_id: first, .. }) = submit(&mut s, 10, "1", a.clone()) else { panic!() };
        assert_eq!(s.jobs[&first].spec.time_limit_secs, Some(3600), "the class's default time");
        submit(&mut s, 11, "2", a.clone()).unwrap();
        let err = submit(&mut s, 12, "3", a.clone()).unwrap_err();
        assert!(matches!(err, ApplyError::TooManyPendingJobs { pending: 2, .. }), "{err}");
        let mut long = a.clone();
        long.time_limit_secs = Some(2 * 86_400);
        let err = submit(&mut s, 13, "4", long).unwrap_err().to_string();
        assert_eq!(err, "job asks for a time limit of 2d but class 'normal' allows at most 1d (max-time)");
        // One runs; the scheduler holds the second back with the reason, and apply refuses it.
        let pass = crate::schedule(&s, Timestamp::compose(20, 0), &BTreeSet::new());
        assert_eq!(pass.placements.len(), 1);
        assert!(pass.pending.iter().any(|p| p.reason.to_string().contains("max-running-jobs")));
        let first_placed = pass.placements[0].job_id;
        run(&mut s, 30, first_placed);
        let second = if first_placed == first { first + 1 } else { first };
        let err = s.apply(&at(40, Command::PlaceJob { job_id: second, node: "n1".into(), gpus: vec![1] })).unwrap_err();
        assert!(err.to_string().contains("max-running-jobs"), "{err}");
    }

    #[test]
    fn fixed_point_values_print_as_the_file_writes_them() {
        assert_eq!(format_price(890_000), "0.89");
        assert_eq!(format_price(3_500_000), "3.5");
        assert_eq!(format_price(2_000_000), "2");
        assert_eq!(format_price(1), "0.000001");
        assert_eq!(format_multiplier(400), "0.4");
        assert_eq!(format_multiplier(2000), "2");
        assert_eq!(format_secs(7 * 86_400), "7d");
        assert_eq!(format_secs(86_400 + 43_200 + 5), "1d12h5s");
        assert_eq!(format_secs(90), "1m30s");
    }

    #[test]
    fn changes_name_each_key_in_the_file_s_words() {
        let old = ClusterConfig::dev_defaults();
        let mut new = old.clone();
        new.tenant_policies.get_mut("team-a").unwrap().quota_milli_gpus = Some(8000);
        new.tenant_policies.get_mut("team-a").unwrap().max_running_jobs = Some(100);
        new.tenants.retain(|t| t != "team-b");
        new.tenant_policies.remove("team-b");
        new.gpu_prices.insert("RTX 5090".into(), 950_000);
        new.gpu_prices.insert("H100".into(), 2_500_000);
        new.priority_classes.get_mut("normal").unwrap().max_time_secs = Some(7 * 86_400);
        new.slurm.accounts.insert("proj_x".into(), "team-a".into());
        new.slurm.qos.insert("short".into(), "normal".into());
        new.slurm.default_account = Some("proj_x".into());
        assert_eq!(
            old.changes_to(&new),
            vec![
                "tenant team-a: quota-gpus 4 -> 8",
                "tenant team-a: max-running-jobs set to 100",
                "tenant team-b removed",
                "class normal: max-time set to 7d",
                "prices: \"H100\" set to 2.5",
                "prices: \"RTX 5090\" 0.89 -> 0.95",
                "slurm.accounts: \"proj_x\" set to team-a",
                "slurm.qos: \"short\" set to normal",
                "slurm: default-account set to proj_x",
            ]
        );
        assert!(old.changes_to(&old).is_empty());
    }
}
