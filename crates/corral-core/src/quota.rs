//! Quota rules on plain numbers, shared by apply() (re-validation) and the scheduling pass.
//!
//! A tenant with a quota may use up to it; in a cohort it may borrow above it what the cohort's
//! members leave unused (up to its borrowing limit), as long as the cohort as a whole stays within
//! the sum of its members' quotas. A lender that needs its quota back gets it by preempting the
//! borrowers (reclaim). Per-class caps are hard and never borrowed.
//!
//! Invariant: after any accepted placement, every tenant is within quota + borrowing limit, every
//! cohort within the sum of its quotas, every class cap respected.

use crate::config::ClusterConfig;
use std::fmt;
use std::sync::Arc;

/// The numbers one quota decision needs, in milli GPU-equivalents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct QuotaNumbers {
    pub tenant_used: u64,
    /// `None`: no quota, nothing else is checked but the class cap.
    pub tenant_quota: Option<u64>,
    pub borrowing_limit: Option<u64>,
    /// (used, sum of quotas) of the tenant's cohort.
    pub cohort: Option<(u64, u64)>,
    /// (used, cap) of the tenant's class scope, if it has one for the job's class.
    pub class: Option<(u64, u64)>,
}

/// Why a job does not fit its quotas (names are shared, so a pass that leaves many jobs of one
/// tenant pending does not copy them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaBlock {
    /// The tenant (not in a cohort) would exceed its quota.
    Tenant { tenant: Arc<str>, used: u64, quota: u64, need: u64 },
    /// The tenant would borrow more than its borrowing limit.
    BorrowLimit { tenant: Arc<str>, used: u64, quota: u64, limit: u64, need: u64 },
    /// The cohort has no unused quota left. `within_quota`: the tenant itself is within its own
    /// quota, so borrowers may be preempted to give it back (reclaim).
    Cohort { cohort: Arc<str>, used: u64, quota: u64, need: u64, within_quota: bool },
    /// The tenant's cap for this priority class is reached.
    Class { tenant: Arc<str>, class: Arc<str>, used: u64, cap: u64, need: u64 },
}

/// Formats milli GPU-equivalents as GPUs: `4`, `2.5`, `0.14`.
pub fn format_gpus(milli: u64) -> String {
    if milli.is_multiple_of(1000) {
        format!("{}", milli / 1000)
    } else {
        let s = format!("{:.2}", milli as f64 / 1000.0);
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

impl fmt::Display for QuotaBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = |m: &u64| format_gpus(*m);
        match self {
            QuotaBlock::Tenant { tenant, used, quota, need } => write!(
                f,
                "quota: tenant {tenant} uses {} of its {} gpus and the job needs {}",
                g(used),
                g(quota),
                g(need)
            ),
            QuotaBlock::BorrowLimit { tenant, used, quota, limit, need } => write!(
                f,
                "quota: tenant {tenant} uses {} gpus (quota {}) and may borrow at most {} more; the job needs {}",
                g(used),
                g(quota),
                g(limit),
                g(need)
            ),
            QuotaBlock::Cohort { cohort, used, quota, need, within_quota } => {
                write!(
                    f,
                    "quota: cohort {cohort} uses {} of its {} gpus and the job needs {}",
                    g(used),
                    g(quota),
                    g(need)
                )?;
                if *within_quota {
                    write!(f, " (borrowed quota is being reclaimed)")?;
                }
                Ok(())
            }
            QuotaBlock::Class { tenant, class, used, cap, need } => write!(
                f,
                "quota: tenant {tenant} may use {} gpus of class {class}, uses {} and the job needs {}",
                g(cap),
                g(used),
                g(need)
            ),
        }
    }
}

/// Which limit blocked, without names (the caller adds them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Limit {
    Tenant,
    Borrowing,
    Cohort { within_quota: bool },
    Class,
}

/// Whether `need` more fits the numbers.
pub(crate) fn check(n: &QuotaNumbers, need: u64) -> Result<(), Limit> {
    if let Some((used, cap)) = n.class {
        if used + need > cap {
            return Err(Limit::Class);
        }
    }
    let Some(quota) = n.tenant_quota else { return Ok(()) };
    let within_quota = n.tenant_used + need <= quota;
    match n.cohort {
        None if within_quota => Ok(()),
        None => Err(Limit::Tenant),
        Some((cohort_used, cohort_quota)) => {
            if !within_quota {
                if let Some(limit) = n.borrowing_limit {
                    if n.tenant_used + need > quota + limit {
                        return Err(Limit::Borrowing);
                    }
                }
            }
            if cohort_used + need > cohort_quota {
                return Err(Limit::Cohort { within_quota });
            }
            Ok(())
        }
    }
}

/// Names the limit `check` reported.
pub(crate) fn describe(
    config: &ClusterConfig,
    tenant: &str,
    class: &str,
    n: &QuotaNumbers,
    need: u64,
    limit: Limit,
) -> QuotaBlock {
    let cohort = || config.tenant_policy(tenant).and_then(|p| p.cohort.as_deref()).unwrap_or_default().into();
    describe_named(n, need, limit, || tenant.into(), || class.into(), cohort)
}

/// `describe` with the names supplied (lazily) by the caller.
pub(crate) fn describe_named(
    n: &QuotaNumbers,
    need: u64,
    limit: Limit,
    tenant: impl FnOnce() -> Arc<str>,
    class: impl FnOnce() -> Arc<str>,
    cohort: impl FnOnce() -> Arc<str>,
) -> QuotaBlock {
    let quota = n.tenant_quota.unwrap_or(0);
    match limit {
        Limit::Tenant => QuotaBlock::Tenant { tenant: tenant(), used: n.tenant_used, quota, need },
        Limit::Borrowing => QuotaBlock::BorrowLimit {
            tenant: tenant(),
            used: n.tenant_used,
            quota,
            limit: n.borrowing_limit.unwrap_or(0),
            need,
        },
        Limit::Cohort { within_quota } => {
            let (used, quota) = n.cohort.unwrap_or_default();
            QuotaBlock::Cohort { cohort: cohort(), used, quota, need, within_quota }
        }
        Limit::Class => {
            let (used, cap) = n.class.unwrap_or_default();
            QuotaBlock::Class { tenant: tenant(), class: class(), used, cap, need }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(used: u64, quota: Option<u64>, cohort: Option<(u64, u64)>) -> QuotaNumbers {
        QuotaNumbers { tenant_used: used, tenant_quota: quota, cohort, ..Default::default() }
    }

    #[test]
    fn rules() {
        assert_eq!(check(&n(5000, None, None), 9000), Ok(()), "no quota: unlimited");
        assert_eq!(check(&n(3000, Some(4000), None), 1000), Ok(()));
        assert_eq!(check(&n(3000, Some(4000), None), 2000), Err(Limit::Tenant));
        // Borrowing: the cohort has room.
        assert_eq!(check(&n(4000, Some(4000), Some((4000, 8000))), 2000), Ok(()));
        let mut limited = n(4000, Some(4000), Some((4000, 8000)));
        limited.borrowing_limit = Some(1000);
        assert_eq!(check(&limited, 2000), Err(Limit::Borrowing));
        // The cohort is full: a borrower waits, an owner within its quota reclaims.
        assert_eq!(check(&n(4000, Some(4000), Some((8000, 8000))), 1000), Err(Limit::Cohort { within_quota: false }));
        assert_eq!(check(&n(0, Some(4000), Some((8000, 8000))), 1000), Err(Limit::Cohort { within_quota: true }));
        let mut class = n(0, None, None);
        class.class = Some((2000, 2000));
        assert_eq!(check(&class, 1), Err(Limit::Class));
    }

    #[test]
    fn gpus_format_compactly() {
        assert_eq!(format_gpus(4000), "4");
        assert_eq!(format_gpus(2500), "2.5");
        assert_eq!(format_gpus(142), "0.14");
    }
}
