//! `Jobs`, the hot jobs by id: a persistent map whose clone shares the whole map with the
//! original, so a snapshot copies the state under its read lock in constant time however many
//! jobs there are; a job (and the path of the tree above it) is copied only when it changes
//! while a clone still shares it.

use corral_types::{Job, JobId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::ops::RangeBounds;
use std::sync::Arc;

/// The hot jobs by id, with the read API of a `BTreeMap<JobId, Job>`. The jobs are `Arc`s, so a
/// tree node copied after a clone copies pointers, not jobs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Jobs(imbl::OrdMap<JobId, Arc<Job>>);

impl Jobs {
    pub fn new() -> Jobs {
        Jobs::default()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains_key(&self, id: &JobId) -> bool {
        self.0.contains_key(id)
    }

    pub fn get(&self, id: &JobId) -> Option<&Job> {
        self.0.get(id).map(|j| &**j)
    }

    /// The job, copied first if a clone of the map still shares it.
    pub fn get_mut(&mut self, id: &JobId) -> Option<&mut Job> {
        self.0.get_mut(id).map(Arc::make_mut)
    }

    pub fn insert(&mut self, id: JobId, job: Job) -> Option<Job> {
        self.0.insert(id, Arc::new(job)).map(Arc::unwrap_or_clone)
    }

    pub fn remove(&mut self, id: &JobId) -> Option<Job> {
        self.0.remove(id).map(Arc::unwrap_or_clone)
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &JobId> + ExactSizeIterator + '_ {
        self.0.keys()
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &Job> + ExactSizeIterator + '_ {
        self.0.values().map(|j| &**j)
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&JobId, &Job)> + ExactSizeIterator + '_ {
        self.0.iter().map(|(id, j)| (id, &**j))
    }

    /// The jobs as the map holds them: a job that changes is a new `Arc` whenever another
    /// holder shares the old one.
    pub fn shared(&self) -> impl DoubleEndedIterator<Item = (&JobId, &Arc<Job>)> + ExactSizeIterator + '_ {
        self.0.iter()
    }

    pub fn range<R: RangeBounds<JobId>>(&self, range: R) -> impl DoubleEndedIterator<Item = (&JobId, &Job)> + '_ {
        self.0.range(range).map(|(id, j)| (id, &**j))
    }
}

impl std::ops::Index<&JobId> for Jobs {
    type Output = Job;

    fn index(&self, id: &JobId) -> &Job {
        self.get(id).expect("no job with this id")
    }
}

impl FromIterator<(JobId, Job)> for Jobs {
    fn from_iter<I: IntoIterator<Item = (JobId, Job)>>(iter: I) -> Jobs {
        Jobs(iter.into_iter().map(|(id, j)| (id, Arc::new(j))).collect())
    }
}

impl From<BTreeMap<JobId, Job>> for Jobs {
    fn from(jobs: BTreeMap<JobId, Job>) -> Jobs {
        jobs.into_iter().collect()
    }
}

impl Serialize for Jobs {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Jobs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Jobs, D::Error> {
        BTreeMap::<JobId, Job>::deserialize(deserializer).map(Jobs::from)
    }
}

#[cfg(test)]
mod tests {
    use crate::{ClusterConfig, Command, Request, State};
    use corral_types::{JobSpec, Timestamp};

    /// A clone shares the jobs; changing one through either map leaves the other's as it was.
    #[test]
    fn a_clone_shares_jobs_until_one_changes() {
        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        let spec = JobSpec { tenant: "default".into(), command: vec!["true".into()].into(), ..Default::default() };
        let batch = (0..3).map(|i| (format!("r{i}"), spec.clone())).collect();
        state.apply(&Request { ts: Timestamp(2), command: Command::SubmitJobs { jobs: batch } }).unwrap();
        let mut jobs = state.jobs.clone();
        let snapshot = jobs.clone();
        assert!(std::ptr::eq(jobs.get(&2).unwrap(), snapshot.get(&2).unwrap()), "shared, not copied");
        jobs.get_mut(&2).unwrap().spec.name = "changed".into();
        assert_eq!(jobs[&2].spec.name, "changed");
        assert_eq!(snapshot[&2].spec.name, "", "the clone keeps the job as it was");
        assert!(std::ptr::eq(jobs.get(&1).unwrap(), snapshot.get(&1).unwrap()), "untouched jobs stay shared");
        assert_eq!(jobs.remove(&3).map(|j| j.id), Some(3));
        assert_eq!(snapshot.len(), 3);
        assert_eq!(jobs.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
    }
}
