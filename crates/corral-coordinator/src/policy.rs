//! The cluster policy file (`corral admin apply -f cluster.toml`, `cluster init --policy`):
//! tenants, priority classes, prices, scheduler knobs and Slurm's account and QOS names in
//! kebab-case TOML, parsed into the
//! replicated `ClusterConfig` with errors that name the key and line, and rendered back as a
//! file that `apply` accepts (`corral admin show`).
//!
//! The dev pool's policy is a file too (`cluster-configs/dev-policy.toml`, compiled in).

use corral_core::{
    format_multiplier, format_price, ClusterConfig, PriorityClass, SchedulerConfig, SlurmNaming, TenantPolicy,
};
use corral_types::{describe_config_error, ConfigDuration, EndCause};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The policy `corral dev` starts with.
pub const DEV_POLICY: &str = include_str!("../../../cluster-configs/dev-policy.toml");

/// A number as written in the file: `8` or `0.5`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(untagged)]
enum Number {
    Int(i64),
    Float(f64),
}

/// By hand rather than untagged, so that `"four"` reads "expected a number, got \"four\"".
impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Number, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Number;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number, e.g. 8 or 0.5")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Number, E> {
                Ok(Number::Int(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Number, E> {
                i64::try_from(v).map(Number::Int).map_err(|_| E::custom(format!("{v} is too large")))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Number, E> {
                Ok(Number::Float(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Number, E> {
                Err(E::custom(format!("expected a number, got {v:?}")))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Number, E> {
                Err(E::custom(format!("expected a number, got {v}")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

impl Number {
    fn of_fixed(value: u64, unit: u64, text: impl Fn(u64) -> String) -> Number {
        if value.is_multiple_of(unit) {
            Number::Int((value / unit) as i64)
        } else {
            Number::Float(text(value).parse().unwrap_or(value as f64 / unit as f64))
        }
    }

    /// The value in 1/`unit`s, refusing negative, non-finite and too precise values.
    fn to_fixed(self, key: &str, unit: u64) -> Result<u64, String> {
        let value = match self {
            Number::Int(i) if i < 0 => return Err(format!("{key}: must not be negative (got {i})")),
            Number::Int(i) => return (i as u64).checked_mul(unit).ok_or_else(|| format!("{key}: {i} is too large")),
            Number::Float(f) => f,
        };
        if !value.is_finite() || value < 0.0 {
            return Err(format!("{key}: must be a number of at least 0 (got {value})"));
        }
        let scaled = value * unit as f64;
        if scaled > u64::MAX as f64 / 2.0 {
            return Err(format!("{key}: {value} is too large"));
        }
        let rounded = scaled.round();
        if (scaled - rounded).abs() > 1e-6 * scaled.max(1.0) {
            return Err(format!("{key}: {value} has more decimals than the 1/{unit} the cluster counts in"));
        }
        Ok(rounded as u64)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct TenantEntry {
    /// GPU-equivalents; absent: no quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    quota_gpus: Option<Number>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cohort: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    borrow_limit_gpus: Option<Number>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fair_share_weight: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_running_jobs: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_pending_jobs: Option<u32>,
    /// Caps per priority class inside the tenant, in GPU-equivalents.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    class_quota_gpus: BTreeMap<String, Number>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct ClassEntry {
    value: i64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    preempts: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    grace: Option<ConfigDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    billing_multiplier: Option<Number>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    default: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_time: Option<ConfigDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_time: Option<ConfigDuration>,
    /// Idle timeout of an interactive session (`corral alloc`) of the class that gives none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    idle_timeout: Option<ConfigDuration>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct SchedulerEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    usage_half_life: Option<ConfigDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    backfill_reservations: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_preemptors_per_pass: Option<u32>,
    /// No job without a time limit is placed on a leased node this close to its lease end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_guard: Option<ConfigDuration>,
}

/// The file as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    tenants: BTreeMap<String, TenantEntry>,
    #[serde(default)]
    classes: BTreeMap<String, ClassEntry>,
    /// Price per GPU-hour by model; `default` prices models without their own.
    #[serde(default)]
    prices: BTreeMap<String, Number>,
    #[serde(default, skip_serializing_if = "is_default_scheduler")]
    scheduler: SchedulerEntry,
    #[serde(default, skip_serializing_if = "is_default_slurm")]
    slurm: SlurmEntry,
    #[serde(default, skip_serializing_if = "is_default_billing")]
    billing: BillingEntry,
}

/// `[billing]`: `[billing.credits]`, the share of a run's cost credited back per end cause.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct BillingEntry {
    /// End cause (`gpu-fault`, `node-lost`, ...) -> share of the run's cost, 0 to 1.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    credits: BTreeMap<String, Number>,
}

fn is_default_billing(b: &BillingEntry) -> bool {
    *b == BillingEntry::default()
}

/// `[slurm]`: Slurm's account and QOS names of tenants and classes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct SlurmEntry {
    /// `sbatch --account` name -> tenant.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    accounts: BTreeMap<String, String>,
    /// `sbatch --qos` name -> priority class.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    qos: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_account: Option<String>,
}

fn is_default_slurm(s: &SlurmEntry) -> bool {
    *s == SlurmEntry::default()
}

fn is_default_scheduler(s: &SchedulerEntry) -> bool {
    *s == SchedulerEntry::default()
}

/// The key of `[prices]` that prices every model without its own price.
pub const DEFAULT_PRICE_KEY: &str = "default";

/// Parses a policy file; `source` names it in errors. Every error is one line naming the key
/// (and the line, for what the TOML parser finds).
pub fn parse_policy(source: &str, text: &str) -> Result<ClusterConfig, String> {
    let file: PolicyFile = toml::from_str(text)
        .map_err(|e| describe_config_error("policy", Path::new(source), text, e.message(), e.span()))?;
    let config = file.into_config().map_err(|e| format!("policy {source}: {e}"))?;
    config.validate().map_err(|e| format!("policy {source}: {e}"))?;
    Ok(config)
}

/// The policy of `corral dev` (`cluster-configs/dev-policy.toml`).
pub fn dev_policy() -> ClusterConfig {
    parse_policy("dev-policy.toml", DEV_POLICY).expect("the compiled-in dev policy is valid")
}

/// The policy as a file that [`parse_policy`] reads back to the same config.
pub fn render_policy(config: &ClusterConfig, version: u64) -> String {
    let file = PolicyFile::from_config(config);
    let body = toml::to_string(&file).unwrap_or_else(|e| format!("# cannot render the policy: {e}\n"));
    format!(
        "# corral cluster policy, version {version}\n# Change it and apply it with: corral admin apply -f FILE\n\n{body}"
    )
}

impl PolicyFile {
    fn into_config(self) -> Result<ClusterConfig, String> {
        let mut config = ClusterConfig::default();
        for (name, t) in self.tenants {
            check_name("tenants", &name)?;
            let key = |k: &str| format!("tenants.{name}.{k}");
            let mut class_quotas = BTreeMap::new();
            for (class, cap) in t.class_quota_gpus {
                class_quotas.insert(class.clone(), cap.to_fixed(&key(&format!("class-quota-gpus.{class}")), 1000)?);
            }
            if t.fair_share_weight == Some(0) {
                return Err(format!("{}: must be at least 1", key("fair-share-weight")));
            }
            let policy = TenantPolicy {
                quota_milli_gpus: t.quota_gpus.map(|q| q.to_fixed(&key("quota-gpus"), 1000)).transpose()?,
                class_quotas,
                cohort: t.cohort,
                borrowing_limit_milli_gpus: t
                    .borrow_limit_gpus
                    .map(|q| q.to_fixed(&key("borrow-limit-gpus"), 1000))
                    .transpose()?,
                fair_share_weight: t.fair_share_weight.unwrap_or(1),
                max_running_jobs: t.max_running_jobs,
                max_pending_jobs: t.max_pending_jobs,
            };
            if policy.borrowing_limit_milli_gpus.is_some() && policy.cohort.is_none() {
                return Err(format!("{}: a tenant borrows only within a cohort: set cohort", key("borrow-limit-gpus")));
            }
            config.tenants.push(name.clone());
            if policy != TenantPolicy::default() {
                config.tenant_policies.insert(name, policy);
            }
        }
        for (name, c) in self.classes {
            check_name("classes", &name)?;
            let key = |k: &str| format!("classes.{name}.{k}");
            let secs = |d: Option<ConfigDuration>, k: &str| -> Result<Option<u64>, String> {
                match d {
                    Some(d) if d.get().subsec_millis() != 0 => Err(format!("{}: whole seconds only", key(k))),
                    Some(d) => Ok(Some(d.get().as_secs())),
                    None => Ok(None),
                }
            };
            let grace = secs(c.grace, "grace")?;
            let class = PriorityClass {
                name: name.clone(),
                value: c.value,
                preempts_lower: c.preempts,
                billing_multiplier_milli: match c.billing_multiplier {
                    Some(m) => u32::try_from(m.to_fixed(&key("billing-multiplier"), 1000)?)
                        .map_err(|_| format!("{}: too large", key("billing-multiplier")))?,
                    None => 1000,
                },
                is_default: c.default,
                grace_secs: grace.map(|g| u32::try_from(g).unwrap_or(u32::MAX)),
                default_time_secs: secs(c.default_time, "default-time")?,
                max_time_secs: secs(c.max_time, "max-time")?,
                idle_timeout_secs: secs(c.idle_timeout, "idle-timeout")?,
            };
            config.priority_classes.insert(name, class);
        }
        if !config.priority_classes.is_empty() && config.default_class().is_none() {
            let names: Vec<&str> = config.priority_classes.keys().map(String::as_str).collect();
            return Err(format!(
                "classes: no default class: mark one of {} with `default = true` (jobs submitted without --priority get it)",
                names.join(", ")
            ));
        }
        for (model, price) in self.prices {
            if model.trim().is_empty() {
                return Err("prices: a price for no model (an empty name)".into());
            }
            let micros = price.to_fixed(&format!("prices.\"{model}\""), 1_000_000)?;
            if model == DEFAULT_PRICE_KEY {
                config.default_gpu_price = micros;
            } else {
                config.gpu_prices.insert(model, micros);
            }
        }
        let defaults = SchedulerConfig::default();
        config.scheduler = SchedulerConfig {
            usage_half_life_secs: match self.scheduler.usage_half_life {
                Some(d) if d.get().as_secs() == 0 => {
                    return Err("scheduler.usage-half-life: must be at least one second".into())
                }
                Some(d) => d.get().as_secs(),
                None => defaults.usage_half_life_secs,
            },
            backfill_reservations: self.scheduler.backfill_reservations.unwrap_or(defaults.backfill_reservations),
            max_preemptors_per_pass: self.scheduler.max_preemptors_per_pass.unwrap_or(defaults.max_preemptors_per_pass),
            lease_guard_secs: self.scheduler.lease_guard.map_or(defaults.lease_guard_secs, |d| d.get().as_secs()),
        };
        for (name, share) in self.billing.credits {
            let cause = EndCause::parse(&name).map_err(|e| format!("billing.credits: {e}"))?;
            let key = format!("billing.credits.{name}");
            let milli = share.to_fixed(&key, 1000)?;
            if milli > 1000 {
                return Err(format!(
                    "{key}: the share of the run's cost credited, from 0 to 1 (got {})",
                    milli as f64 / 1000.0
                ));
            }
            config.credits.insert(cause, milli as u32);
        }
        for name in self.slurm.accounts.keys() {
            check_name("slurm.accounts", name)?;
        }
        for name in self.slurm.qos.keys() {
            check_name("slurm.qos", name)?;
        }
        config.slurm = SlurmNaming {
            accounts: self.slurm.accounts,
            qos: self.slurm.qos,
            default_account: self.slurm.default_account,
        };
        Ok(config)
    }

    fn from_config(config: &ClusterConfig) -> PolicyFile {
        let gpus = |milli: u64| Number::of_fixed(milli, 1000, corral_core::format_gpus);
        let mut file = PolicyFile::default();
        for name in config.all_tenants() {
            let entry = match config.tenant_policies.get(name) {
                None => TenantEntry::default(),
                Some(p) => TenantEntry {
                    quota_gpus: p.quota_milli_gpus.map(gpus),
                    cohort: p.cohort.clone(),
                    borrow_limit_gpus: p.borrowing_limit_milli_gpus.map(gpus),
                    fair_share_weight: Some(p.fair_share_weight.max(1)).filter(|w| *w != 1),
                    max_running_jobs: p.max_running_jobs,
                    max_pending_jobs: p.max_pending_jobs,
                    class_quota_gpus: p.class_quotas.iter().map(|(c, m)| (c.clone(), gpus(*m))).collect(),
                },
            };
            file.tenants.insert(name.to_string(), entry);
        }
        for (name, c) in &config.priority_classes {
            let entry = ClassEntry {
                value: c.value,
                preempts: c.preempts_lower,
                grace: c.grace_secs.map(|s| ConfigDuration::from_secs(u64::from(s))),
                billing_multiplier: Some(Number::of_fixed(u64::from(c.billing_multiplier_milli), 1000, |m| {
                    format_multiplier(m as u32)
                }))
                .filter(|m| *m != Number::Int(1)),
                default: c.is_default,
                default_time: c.default_time_secs.map(ConfigDuration::from_secs),
                max_time: c.max_time_secs.map(ConfigDuration::from_secs),
                idle_timeout: c.idle_timeout_secs.map(ConfigDuration::from_secs),
            };
            file.classes.insert(name.clone(), entry);
        }
        let price = |micros: u64| Number::of_fixed(micros, 1_000_000, format_price);
        for (model, micros) in &config.gpu_prices {
            file.prices.insert(model.clone(), price(*micros));
        }
        if config.default_gpu_price != 0 || !config.gpu_prices.is_empty() {
            file.prices.insert(DEFAULT_PRICE_KEY.into(), price(config.default_gpu_price));
        }
        let defaults = SchedulerConfig::default();
        let s = &config.scheduler;
        file.scheduler = SchedulerEntry {
            usage_half_life: Some(ConfigDuration::from_secs(s.usage_half_life_secs))
                .filter(|_| s.usage_half_life_secs != defaults.usage_half_life_secs),
            backfill_reservations: Some(s.backfill_reservations)
                .filter(|_| s.backfill_reservations != defaults.backfill_reservations),
            max_preemptors_per_pass: Some(s.max_preemptors_per_pass)
                .filter(|_| s.max_preemptors_per_pass != defaults.max_preemptors_per_pass),
            lease_guard: Some(ConfigDuration::from_secs(s.lease_guard_secs))
                .filter(|_| s.lease_guard_secs != defaults.lease_guard_secs),
        };
        file.slurm = SlurmEntry {
            accounts: config.slurm.accounts.clone(),
            qos: config.slurm.qos.clone(),
            default_account: config.slurm.default_account.clone(),
        };
        file.billing = BillingEntry {
            credits: config
                .credits
                .iter()
                .map(|(cause, milli)| {
                    (
                        cause.as_str().to_string(),
                        Number::of_fixed(u64::from(*milli), 1000, |m| format_multiplier(m as u32)),
                    )
                })
                .collect(),
        };
        file
    }
}

/// Tenant and class names: what a job spec and the CLI can carry.
fn check_name(table: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!("{table}.\"{name}\": names are 1 to 63 letters, digits, '-', '_' or '.'"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dev_policy_file_is_the_dev_defaults() {
        assert_eq!(dev_policy(), ClusterConfig::dev_defaults());
    }

    #[test]
    fn the_cluster_example_parses_and_every_policy_renders_back_to_itself() {
        let example = include_str!("../../../cluster-configs/cluster.toml");
        let config = parse_policy("cluster.toml", example).unwrap();
        assert_eq!(config.tenant_policies["team-a"].quota_milli_gpus, Some(8000));
        assert!(config.tenants.iter().any(|t| t == "default"), "a plain submit must keep working");
        assert_eq!(config.priority_classes["gpu-high-priority"].value, 1_000_000);
        assert!(config.priority_classes["gpu-high-priority"].preempts_lower);
        assert_eq!(config.gpu_prices["H100"], 2_490_000);
        assert_eq!(config.slurm.tenant_of("proj_y"), Ok("team-b"));
        assert_eq!(config.slurm.class_of("scavenger"), Ok("preemptible"));
        assert_eq!(config.slurm.default_account.as_deref(), Some("proj_x"));
        assert_eq!(config.credits[&EndCause::NodeLost], 1000);
        assert_eq!(config.credits[&EndCause::Drained], 500);
        assert!(!config.credits.contains_key(&EndCause::Exited), "a renter's own failure is not credited");
        for config in [config, dev_policy()] {
            let text = render_policy(&config, 3);
            assert_eq!(parse_policy("shown", &text).unwrap(), config, "{text}");
        }
    }

    #[test]
    fn the_lease_guard_is_a_scheduler_key_with_a_default_of_an_hour() {
        let dev = include_str!("../../../cluster-configs/dev-policy.toml");
        assert_eq!(dev_policy().scheduler.lease_guard_secs, 3600);
        let config = parse_policy("p", &format!("{dev}\n[scheduler]\nlease-guard = \"30m\"\n")).unwrap();
        assert_eq!(config.scheduler.lease_guard_secs, 1800);
        let text = render_policy(&config, 2);
        assert!(text.contains("lease-guard"), "{text}");
        assert_eq!(parse_policy("shown", &text).unwrap(), config, "{text}");
    }

    #[test]
    fn the_issue_s_example_reads_as_written() {
        let text = r#"
[tenants.team-a]
quota-gpus = 8
cohort = "research"
borrow-limit-gpus = 4
fair-share-weight = 2
max-running-jobs = 100
max-pending-jobs = 10000
[tenants.team-b]
quota-gpus = 0.5
cohort = "research"
[classes.gpu-high-priority]
value = 1000000
preempts = true
grace = "30s"
billing-multiplier = 2.0
max-time = "7d"
[classes.normal]
value = 1000
default = true
[prices]
"RTX 5090" = 0.89
"H200" = 3.50
"#;
        let c = parse_policy("p.toml", text).unwrap();
        let a = &c.tenant_policies["team-a"];
        assert_eq!(
            (a.quota_milli_gpus, a.borrowing_limit_milli_gpus, a.fair_share_weight),
            (Some(8000), Some(4000), 2)
        );
        assert_eq!((a.max_running_jobs, a.max_pending_jobs), (Some(100), Some(10_000)));
        assert_eq!(c.tenant_policies["team-b"].quota_milli_gpus, Some(500));
        let high = &c.priority_classes["gpu-high-priority"];
        assert_eq!(
            (high.grace_secs, high.billing_multiplier_milli, high.max_time_secs),
            (Some(30), 2000, Some(604_800))
        );
        assert_eq!(c.gpu_prices["RTX 5090"], 890_000);
        assert_eq!(c.gpu_prices["H200"], 3_500_000);
        assert_eq!(c.default_gpu_price, 0);
    }

    #[test]
    fn bad_policies_get_one_line_naming_the_key() {
        let cases = [
            ("[tenants.a]\nquota-gpu = 8\n", "quota-gpu"),
            ("[tenants.a]\nquota-gpus = -1\n", "tenants.a.quota-gpus: must not be negative"),
            ("[classes.x]\nvalue = 1\n", "no default class"),
            (
                "[classes.x]\nvalue = 1\ndefault = true\n[classes.y]\nvalue = 2\ndefault = true\n",
                "more than one default",
            ),
            ("[prices]\n\"\" = 1.0\n", "a price for no model"),
            ("[prices]\n\"H100\" = \"cheap\"\n", "line 2"),
            ("[classes.x]\nvalue = 1\ndefault = true\ngrace = 30\n", "no unit"),
            ("[tenants.a]\nborrow-limit-gpus = 2\n", "within a cohort"),
            ("[tenants.a]\nquota-gpus = 0.0001\n", "more decimals"),
            ("[tenants.a]\ncohort = \"c\"\n", "without a quota"),
            ("[tenants.a]\nquota-gpus = \"four\"\n", "tenants.a.quota-gpus: expected a number, got \"four\""),
            ("[billing.credits]\ngpu-falut = 1\n", "unknown end cause 'gpu-falut': the causes are exited,"),
            (
                "[billing.credits]\nnode-lost = 1.5\n",
                "billing.credits.node-lost: the share of the run's cost credited, from 0 to 1",
            ),
            ("[billing.credits]\nnode-lost = -1\n", "billing.credits.node-lost: must not be negative"),
            ("[billing]\ncredit = 1\n", "credit"),
        ];
        for (text, wanted) in cases {
            let err = parse_policy("bad.toml", text).unwrap_err();
            assert!(err.contains(wanted), "{text:?}: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }
}
