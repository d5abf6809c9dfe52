//! Replicated cluster configuration: tenants (quotas, cohorts, fair-share weights), priority classes
//! and scheduler knobs.

use corral_types::EndCause;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Grace period of a preempted job when its class does not set one.
pub const DEFAULT_GRACE_SECS: u32 = 30;

/// A priority class (Kubernetes PriorityClass / Slurm QOS).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriorityClass {
    pub name: String,
    pub value: i64,
    /// Preemption policy: jobs of this class may preempt running jobs of lower classes
    /// (`false` = never preempt).
    pub preempts_lower: bool,
    /// Billing multiplier in thousandths (1000 = x1, 400 = x0.4). Fair-share usage is charged
    /// with it too.
    pub billing_multiplier_milli: u32,
    pub is_default: bool,
    /// Seconds a job of this class gets between SIGTERM and SIGKILL when it is preempted
    /// (`None`: [`DEFAULT_GRACE_SECS`]).
    #[serde(default)]
    pub grace_secs: Option<u32>,
    /// Time limit of a job of this class submitted without one.
    #[serde(default)]
    pub default_time_secs: Option<u64>,
    /// Longest time limit a job of this class may ask for (a job without one gets this).
    #[serde(default)]
    pub max_time_secs: Option<u64>,
    /// Idle timeout of an interactive session (`corral alloc`) of this class that gives none
    /// (`None`: `DEFAULT_IDLE_TIMEOUT_SECS`; 0: never).
    #[serde(default)]
    pub idle_timeout_secs: Option<u64>,
}

impl PriorityClass {
    pub fn grace_secs(&self) -> u32 {
        self.grace_secs.unwrap_or(DEFAULT_GRACE_SECS)
    }
}

/// Scheduling policy of one tenant. Quantities are milli GPU-equivalents: a whole GPU is 1000,
/// a MIG or MPS slice its fraction (`GpuSlice::milli_gpus`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantPolicy {
    /// Hard quota (nominal share). `None`: unlimited, and the tenant neither lends nor borrows.
    #[serde(default)]
    pub quota_milli_gpus: Option<u64>,
    /// Caps on what jobs of one priority class may use inside this tenant (never borrowed).
    #[serde(default)]
    pub class_quotas: BTreeMap<String, u64>,
    /// Tenants of one cohort lend each other their unused quota; a lender gets it back by
    /// preemption of the borrowers when it needs it.
    #[serde(default)]
    pub cohort: Option<String>,
    /// Most this tenant may borrow above its quota (`None`: whatever its cohort has unused).
    #[serde(default)]
    pub borrowing_limit_milli_gpus: Option<u64>,
    /// Relative fair-share weight among tenants (Slurm's shares); 0 counts as 1.
    #[serde(default = "default_weight")]
    pub fair_share_weight: u32,
    /// Most jobs of this tenant running at once (`None`: no limit).
    #[serde(default)]
    pub max_running_jobs: Option<u32>,
    /// Most jobs of this tenant pending at once; a submit above it is refused.
    #[serde(default)]
    pub max_pending_jobs: Option<u32>,
}

fn default_weight() -> u32 {
    1
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy {
            quota_milli_gpus: None,
            class_quotas: BTreeMap::new(),
            cohort: None,
            borrowing_limit_milli_gpus: None,
            fair_share_weight: 1,
            max_running_jobs: None,
            max_pending_jobs: None,
        }
    }
}

/// Knobs of the scheduling pass.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Half-life of past usage in fair share (Slurm's PriorityDecayHalfLife), in seconds.
    #[serde(default = "default_half_life")]
    pub usage_half_life_secs: u64,
    /// How many blocked jobs (highest in the queue first) get a backfill reservation per pass.
    /// 0 disables reservations: every job that fits starts (big jobs may starve).
    #[serde(default = "default_reservations")]
    pub backfill_reservations: u32,
    /// How many pending jobs may look for preemption victims in one pass.
    #[serde(default = "default_preemptors")]
    pub max_preemptors_per_pass: u32,
    /// A job without a time limit is not placed on a leased node within this many seconds of
    /// the lease end (policy `lease-guard`).
    #[serde(default = "default_lease_guard")]
    pub lease_guard_secs: u64,
}

fn default_lease_guard() -> u64 {
    3600
}

fn default_half_life() -> u64 {
    7 * 24 * 3600
}

fn default_reservations() -> u32 {
    4
}

fn default_preemptors() -> u32 {
    16
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            usage_half_life_secs: default_half_life(),
            backfill_reservations: default_reservations(),
            max_preemptors_per_pass: default_preemptors(),
            lease_guard_secs: default_lease_guard(),
        }
    }
}

/// Tenants, priority classes and scheduling policy known to the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClusterConfig {
    pub tenants: Vec<String>,
    pub priority_classes: BTreeMap<String, PriorityClass>,
    /// Quota, cohort and weight per tenant; tenants without an entry are unlimited, weight 1.
    #[serde(default)]
    pub tenant_policies: BTreeMap<String, TenantPolicy>,
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Price of one GPU-hour by GPU model, in micro-units of the currency.
    #[serde(default)]
    pub gpu_prices: BTreeMap<String, u64>,
    /// Price of one GPU-hour of a model without its own price.
    #[serde(default)]
    pub default_gpu_price: u64,
    /// Slurm's names for tenants and classes (`[slurm]` of the policy file).
    #[serde(default)]
    pub slurm: SlurmNaming,
    /// The share of a run's cost credited back when it ends for a cause, in thousandths (1000:
    /// all of it); `[billing.credits]` of the policy file. A cause without an entry: no credit.
    #[serde(default)]
    pub credits: BTreeMap<EndCause, u32>,
}

/// Slurm's accounts and QOS as the policy file maps them: `sbatch --account A` is the tenant
/// `accounts[A]`, `--qos Q` the priority class `qos[Q]`. Without entries an account names a
/// tenant and a QOS a class directly.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SlurmNaming {
    /// Account name -> tenant.
    #[serde(default)]
    pub accounts: BTreeMap<String, String>,
    /// QOS name -> priority class.
    #[serde(default)]
    pub qos: BTreeMap<String, String>,
    /// The account of a job that names neither an account nor a tenant (Slurm's default account).
    #[serde(default)]
    pub default_account: Option<String>,
}

impl SlurmNaming {
    /// The tenant of `account`; an unknown account is one line listing the known ones.
    pub fn tenant_of<'a>(&'a self, account: &'a str) -> Result<&'a str, String> {
        if self.accounts.is_empty() {
            return Ok(account);
        }
        self.accounts.get(account).map(String::as_str).ok_or_else(|| {
            let known: Vec<&str> = self.accounts.keys().map(String::as_str).collect();
            format!("unknown account '{account}': the accounts are {}", known.join(", "))
        })
    }

    /// The priority class of `qos`; an unknown QOS is one line listing the known ones.
    pub fn class_of<'a>(&'a self, qos: &'a str) -> Result<&'a str, String> {
        if self.qos.is_empty() {
            return Ok(qos);
        }
        self.qos.get(qos).map(String::as_str).ok_or_else(|| {
            let known: Vec<&str> = self.qos.keys().map(String::as_str).collect();
            format!("unknown QOS '{qos}': the QOS are {}", known.join(", "))
        })
    }
}

impl ClusterConfig {
    /// Hourly price of one GPU of `model`, in micro-units.
    pub fn gpu_price(&self, model: &str) -> u64 {
        self.gpu_prices.get(model).copied().unwrap_or(self.default_gpu_price)
    }

    /// The defaults `corral dev` starts with: tenants `default` (unlimited), `team-a` and `team-b`
    /// (4 GPUs of quota each, lending each other in cohort `dev`); classes `preemptible`
    /// (0, x0.4), `normal` (1000, default, x1), `gpu-high-priority` (1000000, preempts lower, x2).
    pub fn dev_defaults() -> Self {
        let classes = [
            ("preemptible", 0, false, 400, false, 30),
            ("normal", 1000, false, 1000, true, 60),
            ("gpu-high-priority", 1_000_000, true, 2000, false, 120),
        ];
        let team = TenantPolicy { quota_milli_gpus: Some(4000), cohort: Some("dev".into()), ..TenantPolicy::default() };
        ClusterConfig {
            tenants: vec!["default".into(), "team-a".into(), "team-b".into()],
            priority_classes: classes
                .into_iter()
                .map(|(name, value, preempts_lower, billing_multiplier_milli, is_default, grace)| {
                    (
                        name.to_string(),
                        PriorityClass {
                            name: name.to_string(),
                            value,
                            preempts_lower,
                            billing_multiplier_milli,
                            is_default,
                            grace_secs: Some(grace),
                            default_time_secs: None,
                            max_time_secs: None,
                            idle_timeout_secs: None,
                        },
                    )
                })
                .collect(),
            tenant_policies: [("team-a".to_string(), team.clone()), ("team-b".to_string(), team)].into(),
            scheduler: SchedulerConfig::default(),
            // An RTX 5090 GPU-hour costs 0.89 and an H200 3.50; other models 1.00.
            gpu_prices: [("RTX 5090".to_string(), 890_000), ("H200".to_string(), 3_500_000)].into(),
            default_gpu_price: 1_000_000,
            slurm: SlurmNaming::default(),
            credits: BTreeMap::new(),
        }
    }

    pub fn default_class(&self) -> Option<&PriorityClass> {
        self.priority_classes.values().find(|c| c.is_default)
    }

    /// Value of a class; unknown classes (which apply() rejects) sort lowest.
    pub fn priority_value(&self, class: &str) -> i64 {
        self.priority_classes.get(class).map(|c| c.value).unwrap_or(i64::MIN)
    }

    /// The policy of a tenant (the default one for tenants without an entry).
    pub fn tenant_policy(&self, tenant: &str) -> Option<&TenantPolicy> {
        self.tenant_policies.get(tenant)
    }

    /// Sum of the quotas of a cohort's members.
    pub fn cohort_quota(&self, cohort: &str) -> u64 {
        self.tenant_policies
            .values()
            .filter(|p| p.cohort.as_deref() == Some(cohort))
            .filter_map(|p| p.quota_milli_gpus)
            .sum()
    }

    /// Checks the config for contradictions; the message says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        if let Some((cause, milli)) = self.credits.iter().find(|(_, m)| **m > 1000) {
            return Err(format!(
                "the credit for '{cause}' is {milli}/1000 of the run's cost: at most all of it (1000)"
            ));
        }
        let defaults: Vec<&str> =
            self.priority_classes.values().filter(|c| c.is_default).map(|c| c.name.as_str()).collect();
        if defaults.len() > 1 {
            return Err(format!("more than one default priority class ({})", defaults.join(", ")));
        }
        for (key, class) in &self.priority_classes {
            if key != &class.name {
                return Err(format!("priority class '{}' is stored under the name '{key}'", class.name));
            }
            if let (Some(default), Some(max)) = (class.default_time_secs, class.max_time_secs) {
                if default > max {
                    return Err(format!("priority class '{key}' has a default time above its max time"));
                }
            }
            if class.default_time_secs == Some(0) || class.max_time_secs == Some(0) {
                return Err(format!("priority class '{key}' has a zero time limit"));
            }
        }
        let known: BTreeSet<&str> = self.tenants.iter().map(String::as_str).collect();
        for (tenant, policy) in &self.tenant_policies {
            if !self.tenants.is_empty() && !known.contains(tenant.as_str()) {
                return Err(format!("policy for unknown tenant '{tenant}': add it to the tenants first"));
            }
            for class in policy.class_quotas.keys() {
                if !self.priority_classes.contains_key(class) {
                    return Err(format!("tenant '{tenant}' has a quota for unknown priority class '{class}'"));
                }
            }
            if policy.cohort.as_deref() == Some("") {
                return Err(format!("tenant '{tenant}' has an empty cohort name"));
            }
            if policy.cohort.is_some() && policy.quota_milli_gpus.is_none() {
                return Err(format!(
                    "tenant '{tenant}' is in cohort '{}' without a quota: give it a quota or no cohort",
                    policy.cohort.as_deref().unwrap_or_default()
                ));
            }
        }
        for (account, tenant) in &self.slurm.accounts {
            if account.is_empty() {
                return Err("slurm.accounts: an empty account name".into());
            }
            if !self.tenants.is_empty() && !known.contains(tenant.as_str()) {
                return Err(format!("slurm.accounts: account '{account}' maps to unknown tenant '{tenant}'"));
            }
        }
        for (qos, class) in &self.slurm.qos {
            if qos.is_empty() {
                return Err("slurm.qos: an empty QOS name".into());
            }
            if !self.priority_classes.contains_key(class) {
                return Err(format!("slurm.qos: QOS '{qos}' maps to unknown priority class '{class}'"));
            }
        }
        if let Some(account) = &self.slurm.default_account {
            self.slurm.tenant_of(account).map_err(|e| format!("slurm.default-account: {e}"))?;
            if self.slurm.accounts.is_empty() && !self.tenants.is_empty() && !known.contains(account.as_str()) {
                return Err(format!("slurm.default-account: '{account}' is not a tenant (and no accounts are mapped)"));
            }
        }
        if self.scheduler.usage_half_life_secs == 0 {
            return Err("usage half-life must be at least one second".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_defaults_are_valid_and_lend_within_one_cohort() {
        let c = ClusterConfig::dev_defaults();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.cohort_quota("dev"), 8000);
        assert!(c.tenant_policy("default").is_none(), "the default tenant is unlimited");
        assert_eq!(c.priority_classes["preemptible"].grace_secs(), 30);
    }

    #[test]
    fn contradictions_are_refused() {
        let mut c = ClusterConfig::dev_defaults();
        c.tenant_policies.insert("ghost".into(), TenantPolicy::default());
        assert_eq!(c.validate().unwrap_err(), "policy for unknown tenant 'ghost': add it to the tenants first");
        let mut c = ClusterConfig::dev_defaults();
        c.tenant_policies.get_mut("team-a").unwrap().class_quotas.insert("urgent".into(), 1000);
        assert!(c.validate().unwrap_err().contains("unknown priority class 'urgent'"));
        let mut c = ClusterConfig::dev_defaults();
        c.tenant_policies.get_mut("team-a").unwrap().quota_milli_gpus = None;
        assert!(c.validate().unwrap_err().contains("without a quota"));
        for (naming, want) in [
            (
                SlurmNaming { accounts: [("p".into(), "ghost".into())].into(), ..Default::default() },
                "unknown tenant 'ghost'",
            ),
            (
                SlurmNaming { qos: [("short".into(), "urgent".into())].into(), ..Default::default() },
                "unknown priority class 'urgent'",
            ),
            (SlurmNaming { default_account: Some("nobody".into()), ..Default::default() }, "'nobody' is not a tenant"),
            (
                SlurmNaming {
                    accounts: [("p".into(), "team-a".into())].into(),
                    default_account: Some("q".into()),
                    ..Default::default()
                },
                "slurm.default-account: unknown account 'q': the accounts are p",
            ),
        ] {
            let mut c = ClusterConfig::dev_defaults();
            c.slurm = naming;
            let err = c.validate().unwrap_err();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn accounts_and_qos_map_to_tenants_and_classes() {
        let direct = SlurmNaming::default();
        assert_eq!((direct.tenant_of("team-a"), direct.class_of("normal")), (Ok("team-a"), Ok("normal")));
        let naming = SlurmNaming {
            accounts: [("proj_x".into(), "team-a".into()), ("proj_y".into(), "team-a".into())].into(),
            qos: [("short".into(), "normal".into())].into(),
            default_account: Some("proj_x".into()),
        };
        assert_eq!(naming.tenant_of("proj_y"), Ok("team-a"));
        assert_eq!(naming.class_of("short"), Ok("normal"));
        assert_eq!(
            naming.tenant_of("team-a").unwrap_err(),
            "unknown account 'team-a': the accounts are proj_x, proj_y"
        );
        assert_eq!(naming.class_of("long").unwrap_err(), "unknown QOS 'long': the QOS are short");
        let mut c = ClusterConfig::dev_defaults();
        c.slurm = naming;
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn old_encodings_get_defaults() {
        let json = r#"{"tenants":["a"],"priority_classes":{}}"#;
        let c: ClusterConfig = serde_json::from_str(json).unwrap();
        assert_eq!(c.scheduler, SchedulerConfig::default());
        let p: TenantPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(p.fair_share_weight, 1);
    }
}
