//! Replicated cluster configuration: tenants and priority classes.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A priority class (Kubernetes PriorityClass / Slurm QOS).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriorityClass {
    pub name: String,
    pub value: i64,
    pub preempts_lower: bool,
    /// Billing multiplier in thousandths (1000 = x1, 400 = x0.4).
    pub billing_multiplier_milli: u32,
    pub is_default: bool,
}

/// Tenants and priority classes known to the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ClusterConfig {
    pub tenants: Vec<String>,
    pub priority_classes: BTreeMap<String, PriorityClass>,
}

impl ClusterConfig {
    /// The defaults `corral dev` starts with: tenants `default`, `team-a`, `team-b`; classes
    /// `preemptible` (0, x0.4), `normal` (1000, default, x1), `gpu-high-priority` (1000000, x2).
    pub fn dev_defaults() -> Self {
        let classes = [
            ("preemptible", 0, false, 400, false),
            ("normal", 1000, false, 1000, true),
            ("gpu-high-priority", 1_000_000, true, 2000, false),
        ];
        ClusterConfig {
            tenants: vec!["default".into(), "team-a".into(), "team-b".into()],
            priority_classes: classes
                .into_iter()
                .map(|(name, value, preempts_lower, billing_multiplier_milli, is_default)| {
                    (
                        name.to_string(),
                        PriorityClass {
                            name: name.to_string(),
                            value,
                            preempts_lower,
                            billing_multiplier_milli,
                            is_default,
                        },
                    )
                })
                .collect(),
        }
    }

    pub fn default_class(&self) -> Option<&PriorityClass> {
        self.priority_classes.values().find(|c| c.is_default)
    }

    /// Value of a class; unknown classes (which apply() rejects) sort lowest.
    pub fn priority_value(&self, class: &str) -> i64 {
        self.priority_classes.get(class).map(|c| c.value).unwrap_or(i64::MIN)
    }
}
