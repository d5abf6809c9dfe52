//! Durable openraft log store (vote, log entries, committed log id) on the `raft-log` WAL.
//!
//! [`LogStore`] implements openraft's [`RaftLogStorage`] (storage-v2) on top of
//! [`raft_log::RaftLog`], the chunked, checksummed, fsynced write-ahead log that the openraft
//! author wrote for databend-meta.
//!
//! Durability rules (see DESIGN.md, "Pitfalls"):
//! - `save_vote` returns only after the vote record is fsynced.
//! - `append` hands the entries to the WAL and returns at once; openraft's [`LogFlushed`]
//!   callback fires from the WAL flush thread only after the fsync that covers the entries.
//! - Vote and log writes go through one WAL, in call order, so they are never reordered: an
//!   fsync covers every record written before it.
//! - `truncate` and `save_committed` are written without waiting for an fsync; the next sync
//!   flush (the following `append` or `save_vote`) covers them. `purge` requests a sync flush
//!   (which also lets raft-log delete fully purged chunk files) but does not wait for it.
//!
//! On-disk mapping of openraft types (raft-log [`raft_log::Types`] = [`RaftLogTypes`]):
//! - log id: [`StoredLogId`] = `((term, leader_node_id), index)`; tuple order equals openraft's
//!   `LogId` order.
//! - payload: [`StoredPayload`], a versioned tag + bytes: application data as bytes from
//!   [`PayloadCodec`] (protobuf, owned by the caller, shared with the payload: the log neither
//!   copies nor re-encodes them, and hands the same bytes to every reader), membership as JSON.
//! - vote: [`StoredVote`] `{term, node_id, committed}`; field order equals openraft's `Vote` order.

use std::fmt;
use std::io;
use std::marker::PhantomData;
use std::ops::Bound;
use std::ops::RangeBounds;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::MutexGuard;

use openraft::storage::LogFlushed;
use openraft::storage::LogState;
use openraft::storage::RaftLogStorage;
use openraft::BasicNode;
use openraft::CommittedLeaderId;
use openraft::Entry;
use openraft::EntryPayload;
use openraft::LeaderId;
use openraft::LogId;
use openraft::Membership;
use openraft::OptionalSend;
use openraft::RaftLogReader;
use openraft::RaftTypeConfig;
use openraft::StorageError;
use openraft::StorageIOError;
use openraft::Vote;
use prost::bytes::Bytes;
use raft_log::api::raft_log_writer::RaftLogWriter;
use raft_log::codeq::Decode;
use raft_log::codeq::Encode;
use raft_log::RaftLog;
use tokio::sync::oneshot;

/// How an application payload (`C::D`) is stored in the log: protobuf bytes, owned by the caller.
pub trait PayloadCodec: Sized {
    /// The bytes stored in the log for the payload: a payload that holds its encoding hands
    /// it over (a `Bytes` clone shares it).
    fn encode_payload(&self) -> Bytes;

    /// The payload of bytes previously produced by [`PayloadCodec::encode_payload`].
    fn decode_payload(bytes: Bytes) -> Result<Self, io::Error>;
}

/// Log id as stored in raft-log: `((term, leader_node_id), index)`.
///
/// Lexicographic tuple order is the order of openraft's `LogId` (leader id, then index).
pub type StoredLogId = ((u64, u64), u64);

/// Vote as stored in raft-log.
///
/// The derived order (term, node id, committed) is openraft's `Vote` order, which raft-log
/// relies on to reject a vote that goes backwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StoredVote {
    /// Election term.
    pub term: u64,
    /// Candidate (or leader) node id voted for.
    pub node_id: u64,
    /// Whether a quorum granted this vote.
    pub committed: bool,
}

impl Encode for StoredVote {
    fn encode<W: io::Write>(&self, mut w: W) -> Result<usize, io::Error> {
        let mut n = 0;
        n += self.term.encode(&mut w)?;
        n += self.node_id.encode(&mut w)?;
        n += self.committed.encode(&mut w)?;
        Ok(n)
    }
}

impl Decode for StoredVote {
    fn decode<R: io::Read>(mut r: R) -> Result<Self, io::Error> {
        Ok(Self { term: u64::decode(&mut r)?, node_id: u64::decode(&mut r)?, committed: bool::decode(&mut r)? })
    }
}

/// Entry payload as stored in raft-log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredPayload {
    /// openraft blank entry (leader's first entry of a term).
    Blank,
    /// Application data, encoded by [`PayloadCodec`] (shared, not copied, by the log's cache and
    /// its readers).
    Normal(Bytes),
    /// Membership config, as JSON.
    Membership(Vec<u8>),
}

impl StoredPayload {
    /// Encoding format version, written before every payload.
    const VERSION: u8 = 1;

    const TAG_BLANK: u8 = 0;
    const TAG_NORMAL: u8 = 1;
    const TAG_MEMBERSHIP: u8 = 2;

    fn size(&self) -> u64 {
        match self {
            StoredPayload::Blank => 0,
            StoredPayload::Normal(b) => b.len() as u64,
            StoredPayload::Membership(b) => b.len() as u64,
        }
    }
}

impl Encode for StoredPayload {
    fn encode<W: io::Write>(&self, mut w: W) -> Result<usize, io::Error> {
        let mut n = Self::VERSION.encode(&mut w)?;
        match self {
            StoredPayload::Blank => {
                n += Self::TAG_BLANK.encode(&mut w)?;
            }
            StoredPayload::Normal(bytes) => {
                n += Self::TAG_NORMAL.encode(&mut w)?;
                // As a Vec<u8> is written: a big-endian u32 length, then the bytes.
                w.write_all(&(bytes.len() as u32).to_be_bytes())?;
                w.write_all(bytes)?;
                n += 4 + bytes.len();
            }
            StoredPayload::Membership(bytes) => {
                n += Self::TAG_MEMBERSHIP.encode(&mut w)?;
                n += bytes.encode(&mut w)?;
            }
        }
        Ok(n)
    }
}

impl Decode for StoredPayload {
    fn decode<R: io::Read>(mut r: R) -> Result<Self, io::Error> {
        let version = u8::decode(&mut r)?;
        if version != Self::VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unsupported log payload format version {version}"),
            ));
        }
        let tag = u8::decode(&mut r)?;
        match tag {
            Self::TAG_BLANK => Ok(StoredPayload::Blank),
            Self::TAG_NORMAL => Ok(StoredPayload::Normal(Vec::<u8>::decode(&mut r)?.into())),
            Self::TAG_MEMBERSHIP => Ok(StoredPayload::Membership(Vec::<u8>::decode(&mut r)?)),
            _ => Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown log payload tag {tag}"))),
        }
    }
}

/// Completion callback of a raft-log flush, called from the WAL flush thread.
pub enum FlushCallback<C>
where
    C: RaftTypeConfig,
{
    /// Wake an async waiter (used by `save_vote` and [`LogStore::append_and_wait`]).
    Notify(oneshot::Sender<io::Result<()>>),
    /// Tell openraft that appended entries are on disk.
    LogFlushed(LogFlushed<C>),
}

impl<C> raft_log::Callback for FlushCallback<C>
where
    C: RaftTypeConfig,
{
    fn send(self, res: Result<(), io::Error>) {
        match self {
            FlushCallback::Notify(tx) => {
                // The waiter may have gone (e.g. its task was cancelled); nothing to do then.
                let _ = tx.send(res);
            }
            FlushCallback::LogFlushed(cb) => cb.log_io_completed(res),
        }
    }
}

/// The raft-log [`raft_log::Types`] of a [`LogStore`] for the openraft type config `C`.
pub struct RaftLogTypes<C>(PhantomData<fn() -> C>);

impl<C> fmt::Debug for RaftLogTypes<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RaftLogTypes")
    }
}

impl<C> Default for RaftLogTypes<C> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<C> Clone for RaftLogTypes<C> {
    fn clone(&self) -> Self {
        Self(PhantomData)
    }
}

impl<C> PartialEq for RaftLogTypes<C> {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl<C> Eq for RaftLogTypes<C> {}

impl<C> raft_log::Types for RaftLogTypes<C>
where
    C: RaftTypeConfig<NodeId = u64>,
{
    type LogId = StoredLogId;
    type LogPayload = StoredPayload;
    type Vote = StoredVote;
    type Callback = FlushCallback<C>;
    type UserData = ();

    fn log_index(log_id: &Self::LogId) -> u64 {
        log_id.1
    }

    fn payload_size(payload: &Self::LogPayload) -> u64 {
        payload.size()
    }
}

fn to_stored_log_id(log_id: &LogId<u64>) -> StoredLogId {
    ((log_id.leader_id.term, log_id.leader_id.node_id), log_id.index)
}

fn from_stored_log_id(log_id: &StoredLogId) -> LogId<u64> {
    let ((term, node_id), index) = *log_id;
    LogId::new(CommittedLeaderId::new(term, node_id), index)
}

fn to_stored_vote(vote: &Vote<u64>) -> StoredVote {
    StoredVote { term: vote.leader_id.term, node_id: vote.leader_id.node_id, committed: vote.committed }
}

fn from_stored_vote(vote: &StoredVote) -> Vote<u64> {
    Vote { leader_id: LeaderId::new(vote.term, vote.node_id), committed: vote.committed }
}

fn write_logs_err(e: io::Error) -> StorageError<u64> {
    StorageIOError::write_logs(&e).into()
}

fn read_logs_err(e: io::Error) -> StorageError<u64> {
    StorageIOError::read_logs(&e).into()
}

fn write_vote_err(e: io::Error) -> StorageError<u64> {
    StorageIOError::write_vote(&e).into()
}

fn read_vote_err(e: io::Error) -> StorageError<u64> {
    StorageIOError::read_vote(&e).into()
}

/// Convert a `RangeBounds<u64>` into a half-open `[from, to)` pair.
fn to_half_open<RB: RangeBounds<u64>>(range: &RB) -> (u64, u64) {
    let from = match range.start_bound() {
        Bound::Included(&x) => x,
        Bound::Excluded(&x) => x.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let to = match range.end_bound() {
        Bound::Included(&x) => x.saturating_add(1),
        Bound::Excluded(&x) => x,
        Bound::Unbounded => u64::MAX,
    };
    (from, to)
}

struct Inner<C>
where
    C: RaftTypeConfig<NodeId = u64>,
{
    dir: PathBuf,
    log: Mutex<RaftLog<RaftLogTypes<C>>>,
}

/// Durable openraft log store on `raft-log`. Cheap to clone: clones share one WAL.
///
/// The WAL directory is locked while any clone is alive; dropping the last clone flushes,
/// fsyncs and stops the WAL flush thread, then releases the lock.
pub struct LogStore<C>
where
    C: RaftTypeConfig<NodeId = u64>,
{
    inner: Arc<Inner<C>>,
}

impl<C> Clone for LogStore<C>
where
    C: RaftTypeConfig<NodeId = u64>,
{
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<C> fmt::Debug for LogStore<C>
where
    C: RaftTypeConfig<NodeId = u64>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogStore").field("dir", &self.inner.dir).finish()
    }
}

impl<C> LogStore<C>
where
    C: RaftTypeConfig<NodeId = u64, Node = BasicNode, Entry = Entry<C>>,
    C::D: PayloadCodec,
{
    /// Open (or create) the log store in `dir` with raft-log's default settings.
    pub fn open(dir: &Path) -> Result<Self, io::Error> {
        let dir_str = dir.to_str().ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("raft log dir is not valid UTF-8: {}", dir.display()))
        })?;
        Self::open_with_config(raft_log::Config::new(dir_str))
    }

    /// Open (or create) the log store with explicit raft-log settings (chunk size, cache size,
    /// flush batching). `config.wal.dir` is the directory.
    pub fn open_with_config(config: raft_log::Config) -> Result<Self, io::Error> {
        let dir = PathBuf::from(&config.wal.dir);
        std::fs::create_dir_all(&dir)?;

        let log = RaftLog::<RaftLogTypes<C>>::open(Arc::new(config))?;
        {
            let st = log.log_state();
            tracing::info!(
                dir = %dir.display(),
                vote = ?st.vote(),
                purged = ?st.purged(),
                committed = ?st.committed(),
                last = ?st.last(),
                "opened raft log"
            );
        }

        Ok(Self { inner: Arc::new(Inner { dir, log: Mutex::new(log) }) })
    }

    /// The WAL directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Append entries and wait until they are fsynced.
    ///
    /// openraft itself uses [`RaftLogStorage::append`], which does not wait; this is for tools
    /// and tests that write a log outside of a running Raft node.
    pub async fn append_and_wait<I>(&self, entries: I) -> Result<(), StorageError<u64>>
    where
        I: IntoIterator<Item = Entry<C>>,
    {
        let (tx, rx) = oneshot::channel();
        self.append_with_callback(entries, FlushCallback::Notify(tx)).map_err(write_logs_err)?;
        Self::wait_flushed(rx).await.map_err(write_logs_err)
    }

    fn lock(&self) -> Result<MutexGuard<'_, RaftLog<RaftLogTypes<C>>>, io::Error> {
        self.inner.log.lock().map_err(|_poisoned| io::Error::other("raft log mutex poisoned"))
    }

    async fn wait_flushed(rx: oneshot::Receiver<io::Result<()>>) -> Result<(), io::Error> {
        rx.await.map_err(|_closed| io::Error::other("raft log flush worker dropped the callback"))?
    }

    fn encode_entry(entry: Entry<C>) -> Result<(StoredLogId, StoredPayload), io::Error> {
        let payload = match entry.payload {
            EntryPayload::Blank => StoredPayload::Blank,
            EntryPayload::Normal(data) => StoredPayload::Normal(data.encode_payload()),
            EntryPayload::Membership(membership) => {
                StoredPayload::Membership(serde_json::to_vec(&membership).map_err(io::Error::other)?)
            }
        };
        Ok((to_stored_log_id(&entry.log_id), payload))
    }

    fn decode_entry(log_id: &StoredLogId, payload: StoredPayload) -> Result<Entry<C>, io::Error> {
        let payload = match payload {
            StoredPayload::Blank => EntryPayload::Blank,
            StoredPayload::Normal(bytes) => EntryPayload::Normal(C::D::decode_payload(bytes)?),
            StoredPayload::Membership(bytes) => {
                let membership: Membership<u64, BasicNode> =
                    serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                EntryPayload::Membership(membership)
            }
        };
        Ok(Entry { log_id: from_stored_log_id(log_id), payload })
    }

    /// Write entries to the WAL and request a sync flush that fires `callback` after fsync.
    fn append_with_callback<I>(&self, entries: I, callback: FlushCallback<C>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry<C>>,
    {
        // Encode before taking the lock.
        let mut records = entries.into_iter().map(Self::encode_entry).collect::<Result<Vec<_>, _>>()?;

        let mut log = self.lock()?;

        // Entries at or below the purge point are already covered by the state machine
        // (openraft purges only applied logs), and raft-log would reject them as going
        // backwards. openraft does not send such entries to a live store, but its conformance
        // suite does (after `get_initial_state` purged up to `last_applied`); drop them.
        if let Some(purged_index) = log.log_state().purged().map(|id| id.1) {
            let before = records.len();
            records.retain(|(id, _)| id.1 > purged_index);
            if records.len() != before {
                tracing::debug!(
                    skipped = before - records.len(),
                    purged_index,
                    "raft log append: skipped entries at or below the purged index"
                );
            }
        }

        let first = records.first().map(|(id, _)| *id);
        let last = records.last().map(|(id, _)| *id);
        tracing::debug!(n = records.len(), ?first, ?last, "raft log append");

        log.append(records)?;
        // Not waiting here: the callback runs on the flush thread after the fsync.
        log.flush(true, Some(callback))?;
        Ok(())
    }

    fn read_entries(&self, from: u64, to: u64) -> Result<Vec<Entry<C>>, io::Error> {
        if from >= to {
            return Ok(Vec::new());
        }
        let raw = {
            let log = self.lock()?;
            log.read(from, to).collect::<Result<Vec<_>, _>>()?
        };
        raw.into_iter().map(|(log_id, payload)| Self::decode_entry(&log_id, payload)).collect::<Result<Vec<_>, _>>()
    }

    /// Entries from `from` until `to`, ending once they hold `budget` bytes of payload (always
    /// at least one entry of a range that is not empty): the entries after it are not read.
    fn read_entries_within(&self, from: u64, to: u64, budget: u64) -> Result<Vec<Entry<C>>, io::Error> {
        if from >= to {
            return Ok(Vec::new());
        }
        let raw = {
            let log = self.lock()?;
            let mut taken = Vec::new();
            let mut bytes = 0u64;
            for item in log.read(from, to) {
                let (log_id, payload) = item?;
                bytes += payload.size();
                taken.push((log_id, payload));
                if bytes >= budget {
                    break;
                }
            }
            taken
        };
        raw.into_iter().map(|(log_id, payload)| Self::decode_entry(&log_id, payload)).collect::<Result<Vec<_>, _>>()
    }
}

/// Most bytes of entries replication reads for one AppendEntries request (plus one entry): openraft
/// asks for up to `max_payload_entries` entries whatever their size, which for entries of a
/// megabyte (the largest scripts) was hundreds of megabytes per follower and request.
pub(crate) const APPEND_BUDGET: usize = 4 << 20;

impl<C> RaftLogReader<C> for LogStore<C>
where
    C: RaftTypeConfig<NodeId = u64, Node = BasicNode, Entry = Entry<C>>,
    C::D: PayloadCodec,
{
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<C::Entry>, StorageError<u64>> {
        let (from, to) = to_half_open(&range);
        self.read_entries(from, to).map_err(read_logs_err)
    }

    /// What replication sends next: at most about [`APPEND_BUDGET`] bytes of entries.
    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<C::Entry>, StorageError<u64>> {
        self.read_entries_within(start, end, APPEND_BUDGET as u64).map_err(read_logs_err)
    }
}

impl<C> RaftLogStorage<C> for LogStore<C>
where
    C: RaftTypeConfig<NodeId = u64, Node = BasicNode, Entry = Entry<C>>,
    C::D: PayloadCodec,
{
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, StorageError<u64>> {
        let log = self.lock().map_err(read_logs_err)?;
        let st = log.log_state();
        let last_purged_log_id = st.purged().map(from_stored_log_id);
        let last_log_id = st.last().map(from_stored_log_id).or(last_purged_log_id);
        Ok(LogState { last_purged_log_id, last_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), StorageError<u64>> {
        tracing::debug!(%vote, "raft log save_vote");
        let rx = {
            let mut log = self.lock().map_err(write_vote_err)?;
            log.save_vote(to_stored_vote(vote)).map_err(write_vote_err)?;
            let (tx, rx) = oneshot::channel();
            log.flush(true, Some(FlushCallback::Notify(tx))).map_err(write_vote_err)?;
            rx
        };
        // Durable before returning: wait for the fsync without blocking the runtime.
        Self::wait_flushed(rx).await.map_err(write_vote_err)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, StorageError<u64>> {
        let log = self.lock().map_err(read_vote_err)?;
        Ok(log.log_state().vote().map(from_stored_vote))
    }

    async fn save_committed(&mut self, committed: Option<LogId<u64>>) -> Result<(), StorageError<u64>> {
        let Some(committed) = committed else {
            return Ok(());
        };
        let stored = to_stored_log_id(&committed);

        let mut log = self.lock().map_err(write_logs_err)?;
        let st = log.log_state();
        if Some(&stored) <= st.committed() {
            return Ok(());
        }
        if Some(&stored) > st.last() {
            // raft-log refuses a committed id beyond its last log id. Persisting `committed` is
            // an optimization (openraft recovers it from the state machine), so skip, loudly.
            tracing::warn!(
                %committed,
                last = ?st.last(),
                "raft log save_committed: committed is beyond the last log id, not saved"
            );
            return Ok(());
        }
        tracing::debug!(%committed, "raft log save_committed");
        log.commit(stored).map_err(write_logs_err)?;
        // No fsync needed: the next sync flush covers it.
        log.flush(false, None).map_err(write_logs_err)?;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<u64>>, StorageError<u64>> {
        let log = self.lock().map_err(read_logs_err)?;
        Ok(log.log_state().committed().map(from_stored_log_id))
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<C>) -> Result<(), StorageError<u64>>
    where
        I: IntoIterator<Item = C::Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        self.append_with_callback(entries, FlushCallback::LogFlushed(callback)).map_err(write_logs_err)
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), StorageError<u64>> {
        // openraft: remove `log_id.index` and everything after it.
        // raft-log: `truncate(index)` removes entries at and after `index`.
        let mut log = self.lock().map_err(write_logs_err)?;
        let last_index = log.log_state().last().map(|id| id.1);
        match last_index {
            Some(last) if log_id.index <= last => {
                tracing::debug!(%log_id, "raft log truncate");
                log.truncate(log_id.index).map_err(write_logs_err)?;
                // No need to wait: the fsync of the next append covers this record, and
                // nothing is acknowledged before that.
                log.flush(false, None).map_err(write_logs_err)?;
            }
            _ => {
                tracing::debug!(%log_id, ?last_index, "raft log truncate: nothing at or after index");
            }
        }
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), StorageError<u64>> {
        // openraft and raft-log agree: remove everything up to and including `log_id`. If it is
        // beyond the last log, raft-log moves the last log id up to it.
        tracing::debug!(%log_id, "raft log purge");
        let mut log = self.lock().map_err(write_logs_err)?;
        log.purge(to_stored_log_id(&log_id)).map_err(write_logs_err)?;
        // A sync flush lets raft-log delete chunk files whose entries are all purged, once the
        // purge record is on disk. Not waited for: losing it on a crash only keeps more log.
        log.flush(true, None).map_err(write_logs_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Application data is written as a `Vec<u8>` was before payloads shared their bytes: a
    /// log written by an earlier build reads the same, and the other way round.
    #[test]
    fn a_payload_keeps_its_bytes_on_disk() {
        let data = b"a command".to_vec();
        let mut written = Vec::new();
        StoredPayload::Normal(Bytes::from(data.clone())).encode(&mut written).expect("encode");
        let mut earlier = vec![StoredPayload::VERSION, StoredPayload::TAG_NORMAL];
        data.encode(&mut earlier).expect("encode");
        assert_eq!(written, earlier);
        assert_eq!(StoredPayload::decode(written.as_slice()).expect("decode"), StoredPayload::Normal(data.into()));
        let mut blank = Vec::new();
        StoredPayload::Blank.encode(&mut blank).expect("encode");
        assert_eq!(StoredPayload::decode(blank.as_slice()).expect("decode"), StoredPayload::Blank);
    }
}
