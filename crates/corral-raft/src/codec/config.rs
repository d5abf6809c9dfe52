//! The cluster policy: tenants, priority classes, tenant policies, scheduler settings and GPU
//! prices, Slurm's account and QOS names.

use super::pb;
use corral_core::{ClusterConfig, PriorityClass, SchedulerConfig, SlurmNaming, TenantPolicy};

pub(super) fn config_to_pb(c: &ClusterConfig) -> pb::ClusterConfig {
    pb::ClusterConfig {
        tenants: c.tenants.iter().map(|t| pb::Tenant { name: t.clone() }).collect(),
        priority_classes: c
            .priority_classes
            .values()
            .map(|p| pb::PriorityClass {
                name: p.name.clone(),
                value: p.value,
                preempts_lower: p.preempts_lower,
                billing_multiplier_milli: p.billing_multiplier_milli,
                is_default: p.is_default,
                grace_secs: p.grace_secs,
                default_time_secs: p.default_time_secs,
                max_time_secs: p.max_time_secs,
                idle_timeout_secs: p.idle_timeout_secs,
            })
            .collect(),
        tenant_policies: c
            .tenant_policies
            .iter()
            .map(|(tenant, p)| pb::TenantPolicy {
                tenant: tenant.clone(),
                quota_milli_gpus: p.quota_milli_gpus,
                class_quotas: p.class_quotas.clone(),
                cohort: p.cohort.clone(),
                borrowing_limit_milli_gpus: p.borrowing_limit_milli_gpus,
                fair_share_weight: p.fair_share_weight,
                max_running_jobs: p.max_running_jobs,
                max_pending_jobs: p.max_pending_jobs,
            })
            .collect(),
        scheduler: Some(pb::SchedulerConfig {
            usage_half_life_secs: c.scheduler.usage_half_life_secs,
            backfill_reservations: c.scheduler.backfill_reservations,
            max_preemptors_per_pass: c.scheduler.max_preemptors_per_pass,
            // Written only when set, so configs written before it encode to the same bytes.
            lease_guard_secs: Some(c.scheduler.lease_guard_secs)
                .filter(|s| *s != SchedulerConfig::default().lease_guard_secs),
        }),
        gpu_prices: c
            .gpu_prices
            .iter()
            .map(|(model, price)| pb::GpuPrice { model: model.clone(), micros_per_gpu_hour: *price })
            .collect(),
        default_gpu_price: c.default_gpu_price,
        slurm: Some(pb::SlurmNaming {
            accounts: c.slurm.accounts.clone(),
            qos: c.slurm.qos.clone(),
            default_account: c.slurm.default_account.clone(),
        })
        .filter(|s| !s.accounts.is_empty() || !s.qos.is_empty() || s.default_account.is_some()),
        credit_milli: c.credits.iter().map(|(cause, milli)| (cause.as_str().to_string(), *milli)).collect(),
    }
}

pub(super) fn config_from_pb(c: pb::ClusterConfig) -> ClusterConfig {
    ClusterConfig {
        tenants: c.tenants.into_iter().map(|t| t.name).collect(),
        priority_classes: c
            .priority_classes
            .into_iter()
            .map(|p| {
                let class = PriorityClass {
                    name: p.name.clone(),
                    value: p.value,
                    preempts_lower: p.preempts_lower,
                    billing_multiplier_milli: p.billing_multiplier_milli,
                    is_default: p.is_default,
                    grace_secs: p.grace_secs,
                    default_time_secs: p.default_time_secs,
                    max_time_secs: p.max_time_secs,
                    idle_timeout_secs: p.idle_timeout_secs,
                };
                (p.name, class)
            })
            .collect(),
        tenant_policies: c
            .tenant_policies
            .into_iter()
            .map(|p| {
                let policy = TenantPolicy {
                    quota_milli_gpus: p.quota_milli_gpus,
                    class_quotas: p.class_quotas,
                    cohort: p.cohort,
                    borrowing_limit_milli_gpus: p.borrowing_limit_milli_gpus,
                    fair_share_weight: p.fair_share_weight.max(1),
                    max_running_jobs: p.max_running_jobs,
                    max_pending_jobs: p.max_pending_jobs,
                };
                (p.tenant, policy)
            })
            .collect(),
        scheduler: c
            .scheduler
            .map(|s| SchedulerConfig {
                usage_half_life_secs: s.usage_half_life_secs,
                backfill_reservations: s.backfill_reservations,
                max_preemptors_per_pass: s.max_preemptors_per_pass,
                lease_guard_secs: s.lease_guard_secs.unwrap_or(SchedulerConfig::default().lease_guard_secs),
            })
            .unwrap_or_default(),
        gpu_prices: c.gpu_prices.into_iter().map(|p| (p.model, p.micros_per_gpu_hour)).collect(),
        default_gpu_price: c.default_gpu_price,
        slurm: c
            .slurm
            .map(|s| SlurmNaming { accounts: s.accounts, qos: s.qos, default_account: s.default_account })
            .unwrap_or_default(),
        // A cause this version does not know (set by a newer one) credits nothing here.
        credits: c
            .credit_milli
            .into_iter()
            .filter_map(|(cause, milli)| corral_types::EndCause::parse(&cause).ok().map(|c| (c, milli)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_names_round_trip_and_none_is_not_encoded() {
        let mut config = ClusterConfig::dev_defaults();
        assert!(config_to_pb(&config).slurm.is_none(), "older encodings stay byte for byte");
        config.slurm = SlurmNaming {
            accounts: [("proj_x".into(), "team-a".into())].into(),
            qos: [("short".into(), "normal".into())].into(),
            default_account: Some("proj_x".into()),
        };
        assert_eq!(config_from_pb(config_to_pb(&config)), config);
    }
}
