//! The snapshot file format: one `StateSnapshot` message, written in field order so that parts
//! of it come from elsewhere (the jobs' bytes of the previous build, the request ids of the
//! store's files, the history records appended after the hot state), and read in one pass
//! that streams the history out of it.

use super::config::{config_from_pb, config_to_pb};
use super::meta::{coordinators_from_pb, coordinators_to_pb, usage_from_pb, usage_to_pb};
use super::node::{node_status_from_pb, node_status_to_pb};
use super::policy::{policy_history_from_pb, policy_history_to_pb};
use super::request_id::{request_id_entries_to_bytes, request_ids_from_pb, REQUEST_ID_ENTRY_BYTES};
use super::segment::{billed_from_pb, billed_to_pb, segment_from_bytes};
use super::tokens::{join_tokens_from_pb, join_tokens_to_pb, tokens_from_pb, tokens_to_pb};
use super::{check_version, pb, CodecError, SNAPSHOT_FORMAT_VERSION, SNAPSHOT_FORMAT_VERSION_UNSHARED};
use corral_core::State;
use corral_types::{Job, Timestamp};
use prost::Message;
use std::collections::BTreeMap;

/// Field number of `StateSnapshot.request_id_table`.
const SNAPSHOT_REQUEST_ID_TABLE_FIELD: u32 = 16;

/// Field numbers of `StateSnapshot` whose records a snapshot streams after the hot state.
const SNAPSHOT_SEGMENTS_FIELD: u32 = 12;
const SNAPSHOT_ARCHIVED_JOBS_FIELD: u32 = 52;

/// Writes one record of the history after a snapshot begun with [`snapshot_to_bytes`]: the
/// result is still one `StateSnapshot` message.
pub fn write_snapshot_record(out: &mut impl std::io::Write, kind: HistoryRecord, record: &[u8]) -> std::io::Result<()> {
    let field = match kind {
        HistoryRecord::Segment => SNAPSHOT_SEGMENTS_FIELD,
        HistoryRecord::ArchivedJob => SNAPSHOT_ARCHIVED_JOBS_FIELD,
    };
    let mut head = Vec::with_capacity(16);
    prost::encoding::encode_key(field, prost::encoding::WireType::LengthDelimited, &mut head);
    prost::encoding::encode_varint(record.len() as u64, &mut head);
    out.write_all(&head)?;
    out.write_all(record)
}

/// What the history written after a snapshot's hot state depends on: its job ids, the next job
/// id and where its hot ledger starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotBounds {
    /// The hot state's job ids, ascending.
    pub job_ids: Vec<corral_types::JobId>,
    pub next_job_id: corral_types::JobId,
    pub segments_archived_below: u64,
}

impl HotBounds {
    pub fn of(s: &State) -> HotBounds {
        HotBounds {
            job_ids: s.jobs.keys().copied().collect(),
            next_job_id: s.next_job_id,
            segments_archived_below: s.segments_archived_below,
        }
    }

    /// Decoded from a snapshot of the hot state without the rest of it (request ids, jobs'
    /// contents): prost skips the fields these messages do not name.
    pub fn from_snapshot(bytes: &[u8]) -> Result<HotBounds, CodecError> {
        #[derive(Clone, PartialEq, prost::Message)]
        struct JobIdOnly {
            #[prost(uint64, tag = "1")]
            id: u64,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        struct Bounds {
            #[prost(uint32, tag = "1")]
            format_version: u32,
            #[prost(message, repeated, tag = "2")]
            jobs: Vec<JobIdOnly>,
            #[prost(uint64, tag = "5")]
            next_job_id: u64,
            #[prost(uint64, tag = "50")]
            segments_archived_below: u64,
        }
        let b = Bounds::decode(bytes)?;
        check_version(b.format_version)?;
        let mut job_ids: Vec<corral_types::JobId> = b.jobs.into_iter().map(|j| j.id).collect();
        job_ids.sort_unstable();
        Ok(HotBounds { job_ids, next_job_id: b.next_job_id, segments_archived_below: b.segments_archived_below })
    }

    /// Whether job `id` belongs in the history after this hot state: archived before it.
    pub fn archived(&self, id: corral_types::JobId) -> bool {
        id < self.next_job_id && self.job_ids.binary_search(&id).is_err()
    }
}

/// What a snapshot record of the history is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryRecord {
    /// A billing segment (hot or archived), encoded as [`super::segment_to_bytes`] writes it.
    Segment,
    /// A job of the history, encoded as [`super::job_to_bytes`] writes it.
    ArchivedJob,
}

/// A snapshot failed to read: its source failed, or its bytes do not decode.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotReadError {
    #[error("reading the snapshot failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the snapshot does not decode: {0}")]
    Codec(#[from] CodecError),
}

/// Reads a snapshot from `reader` in one pass, without holding its history in memory: every
/// record of the history (every segment, hot ones included, and every archived job) goes to
/// `on_record` as it is read, still encoded; the other top-level fields are the hot state,
/// returned decoded with an empty ledger (the caller keeps the segments it needs).
pub fn read_snapshot<R: std::io::Read, E>(
    mut reader: R,
    mut on_record: impl FnMut(HistoryRecord, Vec<u8>) -> Result<(), E>,
) -> Result<State, E>
where
    E: From<SnapshotReadError>,
{
    use prost::encoding::{encode_key, encode_varint, WireType};
    use std::io::Read;
    let invalid = |value: &str| SnapshotReadError::from(CodecError::Invalid { field: "snapshot", value: value.into() });
    let mut rest = Vec::new();
    while let Some(key) = read_varint(&mut reader)? {
        let field = u32::try_from(key >> 3)
            .ok()
            .filter(|f| (prost::encoding::MIN_TAG..=prost::encoding::MAX_TAG).contains(f))
            .ok_or_else(|| invalid("a bad field key"))?;
        let wire = WireType::try_from(key & 7).map_err(|_| invalid("a bad wire type"))?;
        match wire {
            WireType::Varint => {
                let v = read_varint(&mut reader)?.ok_or_else(|| invalid("a truncated field"))?;
                encode_key(field, wire, &mut rest);
                encode_varint(v, &mut rest);
            }
            WireType::LengthDelimited => {
                let len = read_varint(&mut reader)?.ok_or_else(|| invalid("a truncated field"))?;
                // Read as it arrives, never allocated up front from a length that may be corrupt.
                let mut record = Vec::new();
                (&mut reader).take(len).read_to_end(&mut record).map_err(SnapshotReadError::from)?;
                if record.len() as u64 != len {
                    return Err(invalid("a truncated field").into());
                }
                match field {
                    SNAPSHOT_SEGMENTS_FIELD => on_record(HistoryRecord::Segment, record)?,
                    SNAPSHOT_ARCHIVED_JOBS_FIELD => on_record(HistoryRecord::ArchivedJob, record)?,
                    _ => {
                        encode_key(field, wire, &mut rest);
                        encode_varint(len, &mut rest);
                        rest.extend_from_slice(&record);
                    }
                }
            }
            WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
                let mut fixed = [0u8; 8];
                let n = if wire == WireType::SixtyFourBit { 8 } else { 4 };
                reader.read_exact(&mut fixed[..n]).map_err(|_| invalid("a truncated field"))?;
                encode_key(field, wire, &mut rest);
                rest.extend_from_slice(&fixed[..n]);
            }
            WireType::StartGroup | WireType::EndGroup => return Err(invalid("a group field").into()),
        }
    }
    let snapshot =
        pb::StateSnapshot::decode(rest.as_slice()).map_err(CodecError::from).map_err(SnapshotReadError::from)?;
    Ok(state_from_snapshot_pb(snapshot).map_err(SnapshotReadError::from)?)
}

/// A protobuf varint from `reader`; `None` at the end of the input before its first byte.
fn read_varint(reader: &mut impl std::io::Read) -> Result<Option<u64>, SnapshotReadError> {
    let mut value = 0u64;
    for i in 0..10 {
        let mut byte = [0u8; 1];
        if reader.read(&mut byte)? == 0 {
            if i == 0 {
                return Ok(None);
            }
            return Err(CodecError::Invalid { field: "snapshot", value: "a truncated varint".into() }.into());
        }
        value |= u64::from(byte[0] & 0x7f) << (7 * i);
        if byte[0] & 0x80 == 0 {
            return Ok(Some(value));
        }
    }
    Err(CodecError::Invalid { field: "snapshot", value: "a varint longer than 10 bytes".into() }.into())
}

/// Encodes the hot state for a snapshot (the history is appended by the store).
pub fn snapshot_to_bytes(s: &State) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_snapshot(s, true, &mut JobEncodings::default(), &mut buf).expect("a Vec grows as needed");
    buf
}

/// Encodes the hot state without its request ids, which a store keeps in files of their own
/// (see [`request_id_entries_to_bytes`]), reusing the encodings of jobs that did not change
/// since the last call with `jobs`.
pub fn snapshot_without_request_ids_to_bytes(s: &State, jobs: &mut JobEncodings) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_snapshot(s, false, jobs, &mut buf).expect("a Vec grows as needed");
    buf
}

/// [`snapshot_without_request_ids_to_bytes`] written to `out` as it is encoded, one job at a
/// time: no copy of the whole state is held. Returns the bytes written.
pub fn write_snapshot_without_request_ids(
    s: &State,
    jobs: &mut JobEncodings,
    out: &mut impl std::io::Write,
) -> std::io::Result<u64> {
    let mut counted = Counted { out, bytes: 0 };
    encode_snapshot(s, false, jobs, &mut counted)?;
    Ok(counted.bytes)
}

/// A writer that counts what passes through it.
struct Counted<'a, W> {
    out: &'a mut W,
    bytes: u64,
}

impl<W: std::io::Write> std::io::Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Jobs whose encoding is longer than this are encoded again at every build rather than kept
/// between builds: the cache is for the many small jobs of a large queue, and a job with a
/// script of a megabyte would otherwise be held twice, once as a job and once as its bytes.
const MAX_CACHED_JOB_BYTES: usize = 16 << 10;

/// The encoded jobs of the last snapshot built, with a `Weak` of the job each encodes. While a
/// `Weak` is held, a change to the job moves it into a new `Arc` (`Arc::make_mut`, see
/// `corral_core::Jobs`) and its old allocation is not reused: a job at the same address is
/// unchanged and its bytes are reused. A `Weak` keeps no job's contents alive.
/// Each encoding also says whether it left out the spec the job shares with its array, which
/// depends on the array being there too.
#[derive(Default)]
pub struct JobEncodings(std::collections::HashMap<corral_types::JobId, (std::sync::Weak<Job>, bool, Vec<u8>)>);

impl JobEncodings {
    /// Jobs held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn encode_snapshot(
    s: &State,
    with_request_ids: bool,
    cache: &mut JobEncodings,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    // In field order, which is how prost would write the whole message: the version, the jobs
    // one by one (an unchanged job's bytes come from `cache`), the nodes, the request-id table
    // written straight from the state (up to a day of ids: no message per id is built), then
    // the fields after it.
    // Version 4 only when some task leaves out its array's spec: an older build refuses exactly
    // the snapshots it would misread.
    let shares = s.jobs.shared().any(|(_, job)| spec_shared_with_array(s, job));
    let format_version = if shares { SNAPSHOT_FORMAT_VERSION } else { SNAPSHOT_FORMAT_VERSION_UNSHARED };
    out.write_all(&pb::StateSnapshot { format_version, ..Default::default() }.encode_to_vec())?;
    let mut encoded = std::collections::HashMap::with_capacity(s.jobs.len());
    let mut head = Vec::with_capacity(16);
    for (id, job) in s.jobs.shared() {
        let shared = spec_shared_with_array(s, job);
        let bytes = match cache.0.remove(id) {
            Some((held, was_shared, bytes))
                if std::ptr::eq(held.as_ptr(), std::sync::Arc::as_ptr(job)) && was_shared == shared =>
            {
                bytes
            }
            _ => {
                let mut record = pb::Job::from(&**job);
                if shared {
                    if let Some(spec) = record.spec.as_mut() {
                        spec.command.clear();
                        spec.env.clear();
                        spec.script = None;
                    }
                    record.spec_from_array = true;
                }
                record.encode_to_vec()
            }
        };
        head.clear();
        encode_key(2, WireType::LengthDelimited, &mut head);
        encode_varint(bytes.len() as u64, &mut head);
        out.write_all(&head)?;
        out.write_all(&bytes)?;
        if bytes.len() <= MAX_CACHED_JOB_BYTES {
            encoded.insert(*id, (std::sync::Arc::downgrade(job), shared, bytes));
        }
    }
    cache.0 = encoded;
    out.write_all(
        &pb::StateSnapshot { nodes: s.nodes.values().map(node_status_to_pb).collect(), ..Default::default() }
            .encode_to_vec(),
    )?;
    if with_request_ids {
        let mut buf = Vec::new();
        encode_request_ids(s, &mut buf);
        out.write_all(&buf)?;
    }
    let rest = pb::StateSnapshot {
        next_job_id: s.next_job_id,
        request_ids_expired_before: s.request_ids_expired_before.0,
        next_epoch: s.next_epoch,
        last_ts: s.last_ts.0,
        config: Some(config_to_pb(&s.config)),
        coordinators: coordinators_to_pb(s),
        tso_window_end_ms: s.tso_window_end_ms,
        usage: usage_to_pb(&s.usage),
        segments: s.ledger.values().map(pb::Segment::from).collect(),
        next_segment_id: s.next_segment_id,
        tokens: tokens_to_pb(s),
        next_token_id: s.next_token_id,
        policy_version: s.policy_version,
        policy_history: policy_history_to_pb(s),
        join_tokens: join_tokens_to_pb(s),
        next_join_token_id: s.next_join_token_id,
        revoked_workers: super::revocations::to_pb(&s.revoked_workers),
        segments_archived_below: s.segments_archived_below,
        archived_billed: billed_to_pb(&s.archived_billed),
        ..Default::default()
    };
    out.write_all(&rest.encode_to_vec())
}

/// Whether `job` is an array task holding its array's own command, environment and script (the
/// same allocations, as apply creates tasks), with the array in the state: a snapshot then
/// writes them once, with the array.
fn spec_shared_with_array(s: &State, job: &Job) -> bool {
    let Some(task) = job.array_task else { return false };
    let Some(array) = s.jobs.get(&task.array) else { return false };
    let (mine, theirs) = (&job.spec, &array.spec);
    let same_script = match (&mine.script, &theirs.script) {
        (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
        (None, None) => true,
        _ => false,
    };
    same_script
        && std::sync::Arc::ptr_eq(&mine.command, &theirs.command)
        && std::sync::Arc::ptr_eq(&mine.env, &theirs.env)
}

/// Field `request_id_table` of `StateSnapshot`: one fixed-size entry per request id, in key
/// order, as prost writes a `bytes` field (left out when empty, as proto3 does).
fn encode_request_ids(s: &State, buf: &mut Vec<u8>) {
    if s.request_ids.is_empty() {
        return;
    }
    let len = s.request_ids.len() * REQUEST_ID_ENTRY_BYTES;
    buf.extend_from_slice(&request_id_table_key(len as u64));
    buf.reserve(len);
    request_id_entries_to_bytes(s.request_ids.iter().map(|(k, r)| (*k, *r)), buf);
}

/// The key and length that start a snapshot's `request_id_table` field of `len` bytes: a store
/// that keeps request ids in files of their own writes this, then the files' entries, after a
/// body encoded without them.
pub fn request_id_table_key(len: u64) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, WireType};
    let mut buf = Vec::with_capacity(12);
    encode_key(SNAPSHOT_REQUEST_ID_TABLE_FIELD, WireType::LengthDelimited, &mut buf);
    encode_varint(len, &mut buf);
    buf
}

/// Decodes the hot state of a snapshot, its hot segments in the ledger (see [`read_snapshot`] to
/// read its history too).
pub fn snapshot_from_bytes(bytes: &[u8]) -> Result<State, CodecError> {
    let mut segments = Vec::new();
    let read = read_snapshot(bytes, |kind, record| {
        if kind == HistoryRecord::Segment {
            segments.push(segment_from_bytes(&record)?);
        }
        Ok::<(), SnapshotReadError>(())
    });
    let mut state = read.map_err(|e| match e {
        SnapshotReadError::Codec(e) => e,
        SnapshotReadError::Io(e) => CodecError::Invalid { field: "snapshot", value: e.to_string() },
    })?;
    for segment in segments.into_iter().filter(|g| g.id >= state.segments_archived_below) {
        state.ledger.insert(segment.id, segment);
    }
    Ok(state)
}

/// The state of a snapshot message whose segments and archived jobs were set aside.
fn state_from_snapshot_pb(s: pb::StateSnapshot) -> Result<State, CodecError> {
    check_version(s.format_version)?;
    let mut from_array = Vec::new();
    let mut jobs = BTreeMap::new();
    for record in s.jobs {
        let shares = record.spec_from_array;
        let job = Job::try_from(record)?;
        if shares {
            from_array.push(job.id);
        }
        jobs.insert(job.id, job);
    }
    // Tasks written without their array's spec get the array's, shared as apply shares it.
    for id in from_array {
        let array_id = jobs[&id].array_task.map(|t| t.array);
        let array = array_id.and_then(|a| jobs.get(&a)).map(|a| a.spec.clone()).ok_or_else(|| CodecError::Invalid {
            field: "job.spec_from_array",
            value: format!("task {id} shares the spec of array {array_id:?}, which the snapshot does not hold"),
        })?;
        let spec = &mut jobs.get_mut(&id).expect("decoded above").spec;
        spec.command = array.command;
        spec.env = array.env;
        spec.script = array.script;
    }
    let nodes = s
        .nodes
        .into_iter()
        .map(|n| node_status_from_pb(n).map(|n| (n.spec.name.clone(), n)))
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    let request_ids = request_ids_from_pb(&s.request_id_table, s.request_ids)?;
    let mut state = State::from_parts(
        jobs,
        nodes,
        [],
        s.next_job_id,
        s.next_epoch,
        Timestamp(s.last_ts),
        s.config.map(config_from_pb).unwrap_or_default(),
        coordinators_from_pb(s.coordinators),
        s.tso_window_end_ms,
    );
    state.request_ids_expired_before = Timestamp(s.request_ids_expired_before);
    state.add_request_ids(request_ids);
    state.usage = usage_from_pb(s.usage);
    state.next_segment_id = s.next_segment_id.max(1);
    state.segments_archived_below = s.segments_archived_below;
    state.archived_billed = billed_from_pb(s.archived_billed);
    state.tokens = tokens_from_pb(s.tokens);
    state.next_token_id = s.next_token_id.max(1);
    state.policy_version = s.policy_version;
    state.policy_history = policy_history_from_pb(s.policy_history);
    state.join_tokens = join_tokens_from_pb(s.join_tokens);
    state.next_join_token_id = s.next_join_token_id;
    state.revoked_workers = super::revocations::from_pb(s.revoked_workers);
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{command_from_bytes, command_to_bytes};
    use corral_core::{ClusterConfig, Command, Request, RequestKey};
    use corral_types::{GpuSlice, JobSpec, SchedOptions};

    #[test]
    fn commands_and_snapshots_round_trip() {
        let spec = JobSpec {
            name: "n".into(),
            tenant: "default".into(),
            priority_class: "normal".into(),
            gpus: 0,
            gpu_slice: Some(GpuSlice::Mps { thread_percent: 25, memory_mib: Some(1024) }),
            cpu_millis: 500,
            memory_bytes: 1 << 30,
            time_limit_secs: Some(60),
            image: None,
            command: vec!["sh".into(), "-c".into(), "echo hi".into()].into(),
            env: std::sync::Arc::new([("A".to_string(), "1".to_string())].into()),
            sched: SchedOptions {
                gpus_per_node: None,
                rdma: true,
                no_requeue: true,
                checkpoint_signal: Some(10),
                ..Default::default()
            },
            ..Default::default()
        };
        let req = Request { ts: Timestamp(77), command: Command::SubmitJob { request_id: "r".into(), spec } };
        assert_eq!(command_from_bytes(&command_to_bytes(&req)).unwrap(), req);

        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        state.apply(&req).unwrap();
        let back = snapshot_from_bytes(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(back, state);
        assert_eq!(back.pending_jobs().count(), 1, "derived index rebuilt");
        let bounds = HotBounds::from_snapshot(&snapshot_to_bytes(&state)).unwrap();
        assert_eq!(bounds, HotBounds::of(&state), "the bounds decode without the rest");
        assert!(!bounds.archived(1) && !bounds.archived(2), "a hot job and a job not yet submitted");
        // The request-id table is written straight from the state, byte for byte as prost
        // would write the field.
        let mut table = Vec::new();
        for (key, record) in state.request_ids.iter() {
            table.extend_from_slice(&key.0);
            table.extend_from_slice(&record.job_id.to_le_bytes());
            table.extend_from_slice(&record.at.0.to_le_bytes());
        }
        assert_eq!(table.len(), REQUEST_ID_ENTRY_BYTES);
        assert_eq!(&table[..16], &RequestKey::of("r").0, "keyed by the id's SHA-256");
        let whole = pb::StateSnapshot { request_id_table: table, ..Default::default() };
        let mut part = Vec::new();
        encode_request_ids(&state, &mut part);
        assert_eq!(part, whole.encode_to_vec());
        // A table cut short is refused, not read as fewer ids.
        let mut cut = pb::StateSnapshot::decode(snapshot_to_bytes(&state).as_slice()).unwrap();
        cut.request_id_table.pop();
        assert!(snapshot_from_bytes(&cut.encode_to_vec()).is_err());
    }

    /// A build reuses the bytes of the jobs that did not change since the last one and encodes
    /// the rest again: the result is what a fresh encode writes.
    #[test]
    fn unchanged_jobs_are_not_encoded_again() {
        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        let spec = JobSpec { tenant: "default".into(), command: vec!["true".into()].into(), ..Default::default() };
        let jobs = (0..3).map(|i| (format!("r{i}"), spec.clone())).collect();
        state.apply(&Request { ts: Timestamp(2), command: Command::SubmitJobs { jobs } }).unwrap();
        let mut cache = JobEncodings::default();
        let first = snapshot_without_request_ids_to_bytes(&state, &mut cache);
        assert_eq!(first, snapshot_without_request_ids_to_bytes(&state, &mut JobEncodings::default()));
        assert_eq!(cache.len(), 3);
        let cancel = Command::CancelJob { job_id: 2, reason: "changed".into() };
        state.apply(&Request { ts: Timestamp(3), command: cancel }).unwrap();
        let held = |cache: &JobEncodings, id: u64| cache.0[&id].0.as_ptr();
        let (one, two) = (held(&cache, 1), held(&cache, 2));
        let second = snapshot_without_request_ids_to_bytes(&state, &mut cache);
        assert_eq!(second, snapshot_without_request_ids_to_bytes(&state, &mut JobEncodings::default()));
        assert_ne!(first, second, "the cancelled job is encoded again");
        assert_eq!(one, held(&cache, 1), "an unchanged job keeps its bytes");
        assert_ne!(two, held(&cache, 2), "a changed job moved to a new Arc");
        let back = snapshot_from_bytes(&second).unwrap();
        assert_eq!(back.jobs, state.jobs);
    }

    /// An array's tasks share its command, environment and script (the same allocations): a
    /// snapshot writes them once, with the array, and a decoded snapshot shares them again,
    /// so a 1 MiB script costs 1 MiB whatever the number of tasks.
    #[test]
    fn array_tasks_are_written_without_the_spec_they_share_with_their_array() {
        use corral_types::{ArrayRange, ArraySpec};
        let mut state = State::default();
        state.apply(&Request { ts: Timestamp(1), command: Command::Configure(ClusterConfig::dev_defaults()) }).unwrap();
        let script: String = format!("#!/bin/sh\n#{}\nexit 0\n", "x".repeat((1 << 20) - 32));
        let spec = JobSpec {
            tenant: "default".into(),
            script: Some(script.clone().into()),
            batch_step: true,
            env: std::sync::Arc::new([("BIG".to_string(), "y".repeat(100_000))].into()),
            array: Some(ArraySpec { ranges: vec![ArrayRange { first: 0, last: 15, step: 1 }], max_running: Some(16) }),
            ..Default::default()
        };
        let jobs = vec![("array".to_string(), spec)];
        state.apply(&Request { ts: Timestamp(2), command: Command::SubmitJobs { jobs } }).unwrap();
        let tasks = state.jobs.values().filter(|j| j.array_task.is_some()).count();
        assert_eq!(tasks, 16, "every task is created");
        let bytes = snapshot_to_bytes(&state);
        assert!(bytes.len() < 2 * script.len(), "the script is written once, not per task: {} bytes", bytes.len());
        let version = |bytes: &[u8]| pb::StateSnapshot::decode(bytes).unwrap().format_version;
        assert_eq!(version(&bytes), 4, "a build that reads version 3 refuses it");
        let mut cache = JobEncodings::default();
        let fresh = snapshot_without_request_ids_to_bytes(&state, &mut JobEncodings::default());
        assert_eq!(snapshot_without_request_ids_to_bytes(&state, &mut cache), fresh);
        assert_eq!(snapshot_without_request_ids_to_bytes(&state, &mut cache), fresh, "from the cache, the same bytes");
        let back = snapshot_from_bytes(&bytes).unwrap();
        assert_eq!(back.jobs, state.jobs, "the tasks get their array's spec back");
        let array = &back.jobs[&1].spec;
        for task in back.jobs.values().filter(|j| j.array_task.is_some()) {
            assert!(
                std::sync::Arc::ptr_eq(task.spec.script.as_ref().unwrap(), array.script.as_ref().unwrap()),
                "shared"
            );
            assert!(std::sync::Arc::ptr_eq(&task.spec.env, &array.env));
        }
        // A task that no longer shares (its spec changed on its own) is written whole.
        let mut changed = back.jobs[&2].clone();
        changed.spec.env = std::sync::Arc::new(Default::default());
        let mut other = back.clone();
        other.jobs.insert(2, changed);
        let mut alone = other.clone();
        alone.jobs.insert(1, {
            let mut a = other.jobs[&1].clone();
            a.spec.script = Some("#!/bin/sh\n".into());
            a
        });
        assert_eq!(version(&snapshot_to_bytes(&alone)), 3, "nothing shared: written as version 3");
        let again = snapshot_from_bytes(&snapshot_to_bytes(&other)).unwrap();
        assert!(again.jobs[&2].spec.env.is_empty() && again.jobs[&2].spec.script.is_some());
        // A snapshot naming an array it does not hold is refused, not read with an empty spec.
        let mut torn = pb::StateSnapshot::decode(bytes.as_slice()).unwrap();
        torn.jobs.retain(|j| j.id != 1);
        let err = snapshot_from_bytes(&torn.encode_to_vec()).expect_err("the array is missing");
        assert!(err.to_string().contains("spec_from_array"), "{err}");
    }
}
