//! Paged listings of jobs and billing segments: the one place that walks the state for
//! `ListJobs` and `ListSegments`, from a page token, with the filters the API offers.
//!
//! Jobs come in ascending job id order — the hot state's merged by id with the on-disk
//! history's, which is read only when the filter asks for a finished state — and segments in
//! ascending segment id order, from the store; a page token names the last id a page looked
//! at (`v1:job:<id>`, `v1:segment:<id>`), so the next page starts right after it. Invariant: a page walks the map from its token and stops as soon as it is full
//! (its count, or about `PAGE_BYTES` of jobs: big specs make shorter pages, far below the
//! gRPC message limit), or after `SCAN_BUDGET` entries (then it may be short, even empty, and
//! still name a next page): a page of 50 among 100k jobs neither clones nor encodes the
//! others, and the state lock is held for a bounded walk.

use crate::filter::JobFilter;
use crate::CoordError;
use corral_core::Jobs;
use corral_types::{Job, JobId, Segment, Timestamp};
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::ops::Bound;

/// Page size when the request gives no limit.
pub(crate) const DEFAULT_PAGE: usize = 1000;
/// Largest page served, whatever the request asks (a page of big jobs stays far below the
/// gRPC message limit).
pub(crate) const MAX_PAGE: usize = 10_000;
/// Most entries one page looks at before it ends short.
pub(crate) const SCAN_BUDGET: usize = 100_000;
/// A page ends once its entries take about this much room (a job's spec may be up to a few
/// megabytes: command, environment, script).
pub(crate) const PAGE_BYTES: usize = 8 << 20;

/// About how many bytes `segment` takes on the wire.
fn segment_bytes(segment: &Segment) -> usize {
    128 + segment.tenant.len() + segment.node.len() + segment.gpu_model.len() + segment.priority_class.len()
}

/// The page size served for a requested `limit` (0: the default).
pub(crate) fn page_size(limit: u32) -> usize {
    match limit as usize {
        0 => DEFAULT_PAGE,
        n => n.min(MAX_PAGE),
    }
}

/// Which segments a listing returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SegmentFilter {
    pub tenant: Option<String>,
    /// Only segments of these jobs; empty: any job.
    pub job_ids: BTreeSet<JobId>,
    /// Segments that end at or after this.
    pub since: Option<Timestamp>,
    /// Segments that start before this.
    pub until: Option<Timestamp>,
}

impl SegmentFilter {
    pub(crate) fn matches(&self, segment: &Segment) -> bool {
        self.tenant.as_ref().is_none_or(|t| *t == segment.tenant)
            && (self.job_ids.is_empty() || self.job_ids.contains(&segment.job_id))
            && self.since.is_none_or(|s| segment.end >= s)
            && self.until.is_none_or(|u| segment.start < u)
    }
}

const JOB_TOKEN: &str = "v1:job:";
const SEGMENT_TOKEN: &str = "v1:segment:";

fn parse_token(token: &str, prefix: &str, what: &str) -> Result<Option<u64>, CoordError> {
    if token.is_empty() {
        return Ok(None);
    }
    token.strip_prefix(prefix).and_then(|id| id.parse::<u64>().ok()).map(Some).ok_or_else(|| {
        CoordError::InvalidArgument(format!(
            "invalid page token '{token}': pass the next_page_token of the previous {what} reply unchanged"
        ))
    })
}

/// The last job id a job page token names (`None`: from the start); refuses a malformed one.
pub(crate) fn job_token(token: &str) -> Result<Option<JobId>, CoordError> {
    parse_token(token, JOB_TOKEN, "job listing")
}

/// The last segment id a segment page token names; refuses a malformed one.
pub(crate) fn segment_token(token: &str) -> Result<Option<u64>, CoordError> {
    parse_token(token, SEGMENT_TOKEN, "billing")
}

/// Walks `entries` (ascending ids after the token), keeping what `keep` accepts, until `limit`
/// are kept, they weigh `PAGE_BYTES` (by `bytes`), or `SCAN_BUDGET` were looked at. Returns the
/// kept entries and the last id looked at when more entries follow it.
fn page<E>(
    entries: impl Iterator<Item = (u64, E)>,
    limit: usize,
    keep: impl Fn(&E) -> bool,
    bytes: impl Fn(&E) -> usize,
) -> (Vec<E>, Option<u64>) {
    let mut entries = entries.peekable();
    let mut kept = Vec::new();
    let (mut scanned, mut weight) = (0, 0);
    while let Some((id, entry)) = entries.next() {
        scanned += 1;
        if keep(&entry) {
            weight += bytes(&entry);
            kept.push(entry);
        }
        if kept.len() >= limit || weight >= PAGE_BYTES || scanned >= SCAN_BUDGET {
            return (kept, entries.peek().is_some().then_some(id));
        }
    }
    (kept, None)
}

/// Two ascending job sources merged by id; a job in both (moving to the history while it is
/// read) comes once, from the hot state.
fn merge_by_id<'a>(
    hot: impl Iterator<Item = &'a Job>,
    archived: impl Iterator<Item = Job>,
) -> impl Iterator<Item = (u64, Cow<'a, Job>)> {
    let (mut hot, mut archived) = (hot.peekable(), archived.peekable());
    std::iter::from_fn(move || {
        let next = match (hot.peek(), archived.peek()) {
            (Some(h), Some(a)) if a.id < h.id => archived.next().map(Cow::Owned),
            (Some(h), Some(a)) if a.id == h.id => {
                archived.next();
                hot.next().map(Cow::Borrowed)
            }
            (Some(_), _) => hot.next().map(Cow::Borrowed),
            (None, _) => archived.next().map(Cow::Owned),
        };
        next.map(|job| (job.id, job))
    })
}

/// One page of the jobs `filter` selects among the hot `jobs` (a copy of the state's map: no
/// lock is held while it is walked) and the history's, in ascending job id order, after job
/// `after`; at most `limit` (already capped, see [`page_size`]). `archived(from)` reads the
/// history's jobs from id `from` on, in id order; it is called only when the filter can match
/// a finished job. Returns the jobs and the token of the next page, if any.
pub(crate) fn list_jobs<I: Iterator<Item = Job>>(
    jobs: &Jobs,
    archived: impl FnOnce(JobId) -> I,
    filter: &JobFilter,
    after: Option<JobId>,
    limit: usize,
) -> (Vec<Job>, String) {
    let start = after.map_or(Bound::Unbounded, Bound::Excluded);
    let hot = jobs.range((start, Bound::Unbounded)).map(|(_, j)| j);
    let history = filter.wants_finished().then(|| archived(after.map_or(0, |a| a.saturating_add(1))));
    let merged = merge_by_id(hot, history.into_iter().flatten());
    let (jobs, last) = page(merged, limit.max(1), |j| filter.matches(j), |j| j.approx_bytes());
    (jobs.into_iter().map(Cow::into_owned).collect(), last.map(|id| format!("{JOB_TOKEN}{id}")).unwrap_or_default())
}

/// One page of the segments `filter` selects from `segments` (the store's, in ascending id
/// order, from just after `after`); at most `limit`. Returns the segments and the token of
/// the next page, if any.
pub(crate) fn list_segments(
    segments: impl Iterator<Item = Segment>,
    filter: &SegmentFilter,
    after: Option<u64>,
    limit: usize,
) -> (Vec<Segment>, String) {
    let entries = segments.filter(|g| after.is_none_or(|a| g.id > a)).map(|g| (g.id, g));
    let (segments, last) = page(entries, limit.max(1), |g| filter.matches(g), segment_bytes);
    (segments, last.map(|id| format!("{SEGMENT_TOKEN}{id}")).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::{NameMatch, ALL_STATES, LIVE_STATES};
    use corral_core::{ClusterConfig, State};
    use corral_types::JobState;
    use std::collections::BTreeMap;

    fn job(id: JobId, tenant: &str, name: &str, state: JobState) -> Job {
        let spec = corral_types::JobSpec { name: name.into(), tenant: tenant.into(), ..Default::default() };
        let mut job = Job::pending(id, spec, format!("r{id}"), Timestamp(id * 10));
        job.state = state;
        job
    }

    fn state_of(jobs: Vec<Job>) -> State {
        let jobs: BTreeMap<JobId, Job> = jobs.into_iter().map(|j| (j.id, j)).collect();
        let next = jobs.keys().max().copied().unwrap_or(0) + 1;
        State::from_parts(
            jobs,
            BTreeMap::new(),
            BTreeMap::new(),
            next,
            1,
            Timestamp(0),
            ClusterConfig::default(),
            BTreeMap::new(),
            0,
        )
    }

    /// The live jobs: what a listing that names no state selects.
    fn live() -> JobFilter {
        JobFilter { states: LIVE_STATES.into(), ..Default::default() }
    }

    /// A history that must not be read.
    fn no_history(_: JobId) -> std::iter::Empty<Job> {
        std::iter::empty()
    }

    /// Follows every page; returns the ids and the number of pages.
    fn all_pages(state: &State, filter: &JobFilter, limit: usize) -> (Vec<JobId>, usize) {
        all_pages_with(state, &[], filter, limit)
    }

    /// Follows every page of the hot state and `history`.
    fn all_pages_with(state: &State, history: &[Job], filter: &JobFilter, limit: usize) -> (Vec<JobId>, usize) {
        let (mut ids, mut pages, mut token) = (Vec::new(), 0, String::new());
        loop {
            let archived = |from: JobId| history.iter().filter(move |j| j.id >= from).cloned();
            let (jobs, next) = list_jobs(&state.jobs, archived, filter, job_token(&token).expect("token"), limit);
            pages += 1;
            ids.extend(jobs.iter().map(|j| j.id));
            if next.is_empty() {
                return (ids, pages);
            }
            token = next;
        }
    }

    #[test]
    fn pages_cover_every_job_once_in_id_order() {
        let state = state_of((1..=25).map(|id| job(id, "a", "x", JobState::Pending)).collect());
        let (ids, pages) = all_pages(&state, &live(), 10);
        assert_eq!(ids, (1..=25).collect::<Vec<_>>());
        assert_eq!(pages, 3);
        // A page that ends exactly at the last job names no next page.
        let (ids, pages) = all_pages(&state, &live(), 25);
        assert_eq!((ids.len(), pages), (25, 1));
    }

    #[test]
    fn a_page_starts_after_its_token_and_stops_when_full() {
        let state = state_of((1..=100).map(|id| job(id, "a", "x", JobState::Pending)).collect());
        let (jobs, next) = list_jobs(&state.jobs, no_history, &live(), Some(40), 5);
        assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![41, 42, 43, 44, 45]);
        assert_eq!(next, "v1:job:45");
    }

    #[test]
    fn filters_select_state_tenant_name_and_submit_time() {
        let state = state_of(vec![
            job(1, "a", "train-1", JobState::Pending),
            job(2, "b", "train-2", JobState::Running),
            job(3, "a", "eval", JobState::Succeeded),
            job(4, "a", "train", JobState::Failed),
            job(5, "a", "train-3", JobState::Running),
        ]);
        let ids = |filter: JobFilter| all_pages(&state, &filter, 2).0;
        assert_eq!(ids(live()), vec![1, 2, 5], "live jobs by default");
        assert_eq!(ids(JobFilter { states: ALL_STATES.into(), ..Default::default() }), vec![1, 2, 3, 4, 5]);
        let finished = [JobState::Succeeded, JobState::Failed].into_iter().collect();
        assert_eq!(ids(JobFilter { states: finished, ..Default::default() }), vec![3, 4]);
        assert_eq!(ids(JobFilter { tenant: Some("b".into()), ..live() }), vec![2]);
        let all: BTreeSet<JobState> = ALL_STATES.into();
        assert_eq!(
            ids(JobFilter { states: all.clone(), name: NameMatch::Exact("train".into()), ..Default::default() }),
            vec![4]
        );
        assert_eq!(
            ids(JobFilter { states: all.clone(), name: NameMatch::Prefix("train-".into()), ..Default::default() }),
            vec![1, 2, 5]
        );
        // Submitted at id * 10: since is inclusive, until exclusive.
        let window = JobFilter {
            states: all,
            submitted_since: Some(Timestamp(20)),
            submitted_until: Some(Timestamp(40)),
            ..Default::default()
        };
        assert_eq!(ids(window), vec![2, 3]);
    }

    #[test]
    fn finished_jobs_of_the_history_merge_in_by_id_and_only_when_asked_for() {
        // Hot: live 2, 4, 5 and finished 6 (moving to the history: it is in both).
        let state = state_of(vec![
            job(2, "a", "x", JobState::Pending),
            job(4, "a", "x", JobState::Running),
            job(5, "a", "x", JobState::Pending),
            job(6, "a", "x", JobState::Failed),
        ]);
        let history = vec![
            job(1, "a", "x", JobState::Succeeded),
            job(3, "a", "x", JobState::Cancelled),
            job(6, "a", "x", JobState::Failed),
            job(7, "b", "x", JobState::Succeeded),
        ];
        let all = JobFilter { states: ALL_STATES.into(), ..Default::default() };
        for limit in [1, 2, 3, 100] {
            assert_eq!(all_pages_with(&state, &history, &all, limit).0, vec![1, 2, 3, 4, 5, 6, 7], "limit {limit}");
        }
        let finished = JobFilter { states: [JobState::Succeeded].into_iter().collect(), ..Default::default() };
        assert_eq!(all_pages_with(&state, &history, &finished, 1).0, vec![1, 7]);
        let tenant_b = JobFilter { tenant: Some("b".into()), ..all.clone() };
        assert_eq!(all_pages_with(&state, &history, &tenant_b, 10).0, vec![7]);
        // Live jobs never read the history.
        let must_not_read = |_: JobId| -> std::iter::Empty<Job> { panic!("the history was read for live jobs") };
        let (jobs, next) = list_jobs(&state.jobs, must_not_read, &live(), None, 10);
        assert_eq!((jobs.iter().map(|j| j.id).collect::<Vec<_>>(), next), (vec![2, 4, 5], String::new()));
    }

    #[test]
    fn a_sparse_filter_ends_a_page_short_after_the_scan_budget() {
        let mut jobs: Vec<Job> =
            (1..=(SCAN_BUDGET as u64 + 10)).map(|id| job(id, "a", "x", JobState::Pending)).collect();
        jobs.last_mut().expect("a job").spec.tenant = "b".into();
        let state = state_of(jobs);
        let filter = JobFilter { tenant: Some("b".into()), ..live() };
        let (first, next) = list_jobs(&state.jobs, no_history, &filter, None, 10);
        assert!(first.is_empty(), "the budget ends the page before the match");
        assert_eq!(next, format!("v1:job:{SCAN_BUDGET}"));
        let (second, next) = list_jobs(&state.jobs, no_history, &filter, job_token(&next).expect("token"), 10);
        assert_eq!(second.iter().map(|j| j.id).collect::<Vec<_>>(), vec![SCAN_BUDGET as u64 + 10]);
        assert!(next.is_empty());
    }

    #[test]
    fn big_jobs_make_short_pages() {
        let big = |id| {
            let mut j = job(id, "a", "x", JobState::Pending);
            j.spec.script = Some("#".repeat(1 << 20).into());
            j
        };
        let state = state_of((1..=20).map(big).collect());
        let (jobs, next) = list_jobs(&state.jobs, no_history, &live(), None, MAX_PAGE);
        assert_eq!(jobs.len(), 8, "8 MiB of 1 MiB scripts");
        assert_eq!(next, "v1:job:8");
        assert_eq!(all_pages(&state, &live(), MAX_PAGE).0, (1..=20).collect::<Vec<_>>());
    }

    #[test]
    fn page_sizes_default_and_cap() {
        assert_eq!(page_size(0), DEFAULT_PAGE);
        assert_eq!(page_size(50), 50);
        assert_eq!(page_size(u32::MAX), MAX_PAGE);
    }

    #[test]
    fn malformed_tokens_are_refused() {
        assert_eq!(job_token("").expect("empty"), None);
        assert_eq!(job_token("v1:job:17").expect("valid"), Some(17));
        assert_eq!(segment_token("v1:segment:3").expect("valid"), Some(3));
        for bad in ["17", "v1:job:", "v1:job:-1", "v1:job:x", "v2:job:1", "v1:segment:1"] {
            let err = job_token(bad).expect_err(bad);
            assert!(matches!(&err, CoordError::InvalidArgument(m) if m.contains("invalid page token")), "{err}");
            assert_eq!(tonic::Status::from(err).code(), tonic::Code::InvalidArgument);
        }
        assert!(segment_token("v1:job:1").is_err(), "a job token does not page segments");
    }

    #[test]
    fn segments_page_in_id_order_with_filters() {
        let mut state = state_of(Vec::new());
        for id in 1..=7u64 {
            let segment = Segment {
                id,
                job_id: id % 3,
                epoch: 1,
                tenant: if id % 2 == 0 { "a".into() } else { "b".into() },
                node: "n".into(),
                gpu_model: "m".into(),
                gpus: 1,
                gpu_milli: 1000,
                priority_class: "normal".into(),
                multiplier_milli: 1000,
                price_micros_per_gpu_hour: 1,
                start: Timestamp(id * 100),
                end: Timestamp(id * 100 + 50),
                duration_ms: 50,
                lost: false,
                end_state: "succeeded".into(),
                cost_micros: 1,
                policy_version: 1,
                cause: None,
                credit_for: None,
            };
            state.ledger.insert(id, segment);
        }
        let collect = |filter: &SegmentFilter| {
            let (mut ids, mut token) = (Vec::new(), String::new());
            loop {
                let after = segment_token(&token).expect("token");
                let (page, next) = list_segments(state.ledger.values().cloned(), filter, after, 2);
                ids.extend(page.iter().map(|g| g.id));
                if next.is_empty() {
                    return ids;
                }
                token = next;
            }
        };
        assert_eq!(collect(&SegmentFilter::default()), (1..=7).collect::<Vec<_>>());
        assert_eq!(collect(&SegmentFilter { tenant: Some("a".into()), ..Default::default() }), vec![2, 4, 6]);
        assert_eq!(
            collect(&SegmentFilter { job_ids: [1, 2].into_iter().collect(), ..Default::default() }),
            vec![1, 2, 4, 5, 7]
        );
        let window = SegmentFilter { since: Some(Timestamp(300)), until: Some(Timestamp(500)), ..Default::default() };
        assert_eq!(collect(&window), vec![3, 4]);
    }
}
