//! The on-disk history of the state machine: finished jobs a `Compact` took out of the hot state,
//! and every billed segment, in one redb file (`history.redb`).
//!
//! Three tables: `jobs` (job id to the job's bytes), `tasks` ((array, index) to the job id of an
//! archived array task) and `segments` (segment id to the segment's bytes). Retention deletes
//! from the front of `jobs` and `segments` by a pure predicate on each record (ids grow with
//! submit and end time), so every replica deletes the same records.
//!
//! redb, not sled: redb's page cache bounds the memory the history takes (64 MiB, however long
//! the history), where sled's page table and cache grew with the data whatever its cache
//! setting. Applied batches commit without an fsync; [`History::sync`] (before
//! a snapshot names the history) and every [`SYNC_EVERY_RECORDS`] records commit durably, with
//! redb's quick repair, so a restart after a crash reopens at once, at the last durable commit,
//! and the log entries after the snapshot are applied again. Applying an entry again writes the
//! same records, so a history that ran ahead of the snapshot converges to the same bytes.
//!
//! A store of an earlier version kept the history in sled (`sm/`): it is copied here on open,
//! then removed.

use crate::codec::{self, HistoryRecord};
use anyhow::Context;
use corral_core::{CompactCutoffs, State, Touched};
use corral_types::{Job, Timestamp};
use redb::{Durability, ReadableDatabase, ReadableTable, TableDefinition};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
const TASKS: TableDefinition<(u64, u32), u64> = TableDefinition::new("tasks");
const SEGMENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("segments");

/// redb's page cache: the history is read page by page, so this bounds what it holds in memory.
const CACHE_BYTES: usize = 64 << 20;
/// Records written without an fsync after which a commit is made durable anyway: a backstop
/// for a long stretch without snapshots, during which redb can neither reuse the pages freed
/// since the last durable commit nor forget the ones allocated.
const SYNC_EVERY_RECORDS: u64 = 1_000_000;
/// Records written per transaction when a snapshot is installed or an earlier store migrated.
const INSTALL_BATCH_RECORDS: usize = 10_000;
/// Record bytes a snapshot install holds before it writes them: a history of large jobs (a
/// megabyte script each) was held whole, and decoded besides, while the install read it.
const INSTALL_BATCH_BYTES: usize = 8 << 20;

/// The history store of one state machine.
pub(crate) struct History {
    db: redb::Database,
    /// The database file, for [`Self::sync`] to write its pages back before it takes redb's
    /// write lock.
    file: std::fs::File,
    /// Records written since the last durable commit.
    unsynced: AtomicU64,
}

fn err(e: impl Into<redb::Error>) -> std::io::Error {
    std::io::Error::other(format!("history store: {}", e.into()))
}

fn decode_err(e: codec::CodecError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

/// The tables of one write transaction.
pub(crate) struct Writer<'t> {
    jobs: redb::Table<'t, u64, &'static [u8]>,
    tasks: redb::Table<'t, (u64, u32), u64>,
    segments: redb::Table<'t, u64, &'static [u8]>,
    /// Records written or removed.
    changed: u64,
}

impl Writer<'_> {
    /// Writes `job` (encoded as `bytes`) into the history, with its task key if it is an array task.
    fn put_job(&mut self, job: &Job, bytes: &[u8]) -> std::io::Result<()> {
        self.jobs.insert(job.id, bytes).map_err(err)?;
        self.changed += 1;
        if let Some(task) = job.array_task {
            self.tasks.insert((task.array, task.index), job.id).map_err(err)?;
            self.changed += 1;
        }
        Ok(())
    }

    fn put_segment(&mut self, id: u64, bytes: &[u8]) -> std::io::Result<()> {
        self.segments.insert(id, bytes).map_err(err)?;
        self.changed += 1;
        Ok(())
    }

    /// Removes job `id` of the history and its task key.
    fn remove_job(&mut self, id: u64) -> std::io::Result<()> {
        let task = match self.jobs.remove(id).map_err(err)? {
            Some(bytes) => codec::job_from_bytes(bytes.value()).map_err(decode_err)?.array_task,
            None => return Ok(()),
        };
        self.changed += 1;
        if let Some(task) = task {
            self.tasks.remove((task.array, task.index)).map_err(err)?;
            self.changed += 1;
        }
        Ok(())
    }

    fn remove_segment(&mut self, id: u64) -> std::io::Result<()> {
        if self.segments.remove(id).map_err(err)?.is_some() {
            self.changed += 1;
        }
        Ok(())
    }

    /// Deletes the records past the retention of `cutoffs`: archived jobs submitted before
    /// `jobs_before` (and their task keys), segments that ended before `segments_before`.
    fn expire(&mut self, cutoffs: &CompactCutoffs) -> std::io::Result<()> {
        if let Some(before) = cutoffs.jobs_before {
            for id in expired_front(&self.jobs, job_expired(before), usize::MAX)? {
                self.remove_job(id)?;
            }
        }
        if let Some(before) = cutoffs.segments_before {
            for id in expired_front(&self.segments, segment_expired(before), usize::MAX)? {
                self.remove_segment(id)?;
            }
        }
        Ok(())
    }
}

/// Whether an archived job (its bytes) was submitted before `before`.
fn job_expired(before: Timestamp) -> impl Fn(&[u8]) -> std::io::Result<bool> {
    move |bytes| Ok(codec::job_from_bytes(bytes).map_err(decode_err)?.submitted_at < before)
}

/// Whether a segment (its bytes) ended before `before`.
fn segment_expired(before: Timestamp) -> impl Fn(&[u8]) -> std::io::Result<bool> {
    move |bytes| Ok(codec::segment_from_bytes(bytes).map_err(decode_err)?.end < before)
}

/// The ids, at most `limit`, at the front of `table` whose record `expired` says is past
/// retention: ids grow with time, so the first record kept ends the scan.
fn expired_front<T: ReadableTable<u64, &'static [u8]>>(
    table: &T,
    expired: impl Fn(&[u8]) -> std::io::Result<bool>,
    limit: usize,
) -> std::io::Result<Vec<u64>> {
    let mut ids = Vec::new();
    for kv in table.iter().map_err(err)?.take(limit) {
        let (id, bytes) = kv.map_err(err)?;
        if !expired(bytes.value())? {
            break;
        }
        ids.push(id.value());
    }
    Ok(ids)
}

impl History {
    /// Opens (or creates) the history under `dir`, moving in the history an earlier version
    /// kept in sled.
    pub(crate) fn open(dir: &Path) -> anyhow::Result<History> {
        let path = dir.join("history.redb");
        let db = redb::Builder::new()
            .set_cache_size(CACHE_BYTES)
            .create(&path)
            .with_context(|| format!("cannot open the history store {}", path.display()))?;
        let history = History { db, file: std::fs::File::open(&path)?, unsynced: AtomicU64::new(0) };
        // Creates the tables, so that a read never finds one missing.
        history.write(|_| Ok(()))?;
        history.sync()?;
        migrate_from_sled(dir, &history)?;
        Ok(history)
    }

    /// Runs `f` in one write transaction and commits it: durable at the next [`Self::sync`], or
    /// at once when enough records went unsynced.
    fn write<T>(&self, f: impl FnOnce(&mut Writer<'_>) -> std::io::Result<T>) -> std::io::Result<T> {
        let tx = self.db.begin_write().map_err(err)?;
        let (out, changed) = {
            let mut w = Writer {
                jobs: tx.open_table(JOBS).map_err(err)?,
                tasks: tx.open_table(TASKS).map_err(err)?,
                segments: tx.open_table(SEGMENTS).map_err(err)?,
                changed: 0,
            };
            (f(&mut w)?, w.changed)
        };
        let unsynced = self.unsynced.fetch_add(changed, Ordering::Relaxed) + changed;
        self.commit(tx, unsynced >= SYNC_EVERY_RECORDS)?;
        Ok(out)
    }

    fn commit(&self, mut tx: redb::WriteTransaction, durable: bool) -> std::io::Result<()> {
        if durable {
            tx.set_quick_repair(true);
            self.unsynced.store(0, Ordering::Relaxed);
        } else {
            tx.set_durability(Durability::None).map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        tx.commit().map_err(err)
    }

    /// Makes every commit so far durable. The pages written since the last sync go to disk
    /// first, without redb's write lock, so that apply waits only for what is written meanwhile.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        self.file.sync_data()?;
        let tx = self.db.begin_write().map_err(err)?;
        self.commit(tx, true)
    }

    /// The bytes of archived job `id`, if kept.
    pub(crate) fn job(&self, id: u64) -> std::io::Result<Option<Vec<u8>>> {
        let tx = self.db.begin_read().map_err(err)?;
        let jobs = tx.open_table(JOBS).map_err(err)?;
        Ok(jobs.get(id).map_err(err)?.map(|v| v.value().to_vec()))
    }

    /// The job id of task `index` of job array `array`, if archived and kept.
    pub(crate) fn task(&self, array: u64, index: u32) -> std::io::Result<Option<u64>> {
        let tx = self.db.begin_read().map_err(err)?;
        let tasks = tx.open_table(TASKS).map_err(err)?;
        Ok(tasks.get((array, index)).map_err(err)?.map(|v| v.value()))
    }

    /// Archived jobs with an id of at least `from`, in id order, read lazily from one read
    /// transaction; a read that fails is logged and ends the iteration.
    pub(crate) fn jobs_from(&self, from: u64) -> impl Iterator<Item = Vec<u8>> + use<> {
        self.range(JOBS, from)
    }

    /// Segments with an id of at least `from`, in id order (as [`Self::jobs_from`]).
    pub(crate) fn segments_from(&self, from: u64) -> impl Iterator<Item = Vec<u8>> + use<> {
        self.range(SEGMENTS, from)
    }

    fn range(&self, table: TableDefinition<u64, &[u8]>, from: u64) -> impl Iterator<Item = Vec<u8>> + use<> {
        let range = (|| {
            let tx = self.db.begin_read().map_err(err)?;
            let range = tx.open_table(table).map_err(err)?.range(from..).map_err(err)?;
            std::io::Result::Ok(range)
        })();
        let failed = |e: &dyn std::fmt::Display| tracing::warn!(error = %e, "history read failed");
        let range = range.inspect_err(|e| failed(e)).ok();
        range.into_iter().flatten().map_while(move |kv| match kv {
            Ok((_, v)) => Some(v.value().to_vec()),
            Err(e) => {
                failed(&e);
                None
            }
        })
    }

    /// True if the history holds no record (tests).
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        use redb::ReadableTableMetadata;
        let tx = self.db.begin_read().expect("read");
        tx.open_table(JOBS).expect("jobs").is_empty().expect("len")
            && tx.open_table(TASKS).expect("tasks").is_empty().expect("len")
            && tx.open_table(SEGMENTS).expect("segments").is_empty().expect("len")
    }

    /// Deletes every record and syncs (tests: a crash that lost the history).
    #[cfg(test)]
    pub(crate) fn clear(&self) {
        self.write(|w| {
            w.jobs.retain(|_, _| false).map_err(err)?;
            w.tasks.retain(|_, _| false).map_err(err)?;
            w.segments.retain(|_, _| false).map_err(err)
        })
        .expect("clear");
        self.sync().expect("sync");
    }

    /// Writes what the applied batch `touched` added to or deleted from the history, in one
    /// transaction: archived jobs, new segments, then retention (so that applying a batch again
    /// deletes the same records). The hot state is not written.
    pub(crate) fn persist(&self, state: &State, touched: &Touched) -> std::io::Result<()> {
        let expire = match &touched.history_cutoffs {
            Some(cutoffs) if self.expiry_due(cutoffs)? => Some(cutoffs),
            _ => None,
        };
        if touched.archived.is_empty() && touched.segments.is_empty() && expire.is_none() {
            return Ok(());
        }
        self.write(|w| {
            for job in &touched.archived {
                w.put_job(job, &codec::job_to_bytes(job))?;
            }
            for id in &touched.segments {
                if let Some(segment) = state.ledger.get(id) {
                    w.put_segment(*id, &codec::segment_to_bytes(segment))?;
                }
            }
            // A segment written and archived in one batch (a run reported long after it ended,
            // then a compaction) is no longer in the hot ledger: write it from what the
            // compaction took.
            for segment in touched.archived_segments.iter().filter(|g| touched.segments.contains(&g.id)) {
                w.put_segment(segment.id, &codec::segment_to_bytes(segment))?;
            }
            if let Some(cutoffs) = &touched.history_cutoffs {
                // Also when `expire` is None: a job written above may be past retention.
                w.expire(cutoffs)?;
            }
            Ok(())
        })
    }

    /// True if the oldest archived job or segment is past the retention of `cutoffs`, read
    /// without a write transaction: the leader's periodic `Compact` usually deletes nothing,
    /// and apply then never waits for redb's write lock (held by a build's sync).
    fn expiry_due(&self, cutoffs: &CompactCutoffs) -> std::io::Result<bool> {
        let tx = self.db.begin_read().map_err(err)?;
        if let Some(before) = cutoffs.jobs_before {
            if !expired_front(&tx.open_table(JOBS).map_err(err)?, job_expired(before), 1)?.is_empty() {
                return Ok(true);
            }
        }
        if let Some(before) = cutoffs.segments_before {
            if !expired_front(&tx.open_table(SEGMENTS).map_err(err)?, segment_expired(before), 1)?.is_empty() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Makes the history that of a snapshot body (with its history) read from `body` and
    /// returns the body's hot state, with the hot ledger loaded from the store. Only records that
    /// differ are written and only those the body lacks are removed, in bounded transactions: a
    /// follower that was briefly away rewrites little.
    pub(crate) fn install(&self, body: std::fs::File) -> anyhow::Result<State> {
        let started = std::time::Instant::now();
        let (mut jobs, mut segments, mut records, mut changed) = (Vec::new(), Vec::new(), 0u64, 0u64);
        // Each record with its id, and the job it holds (None: a segment).
        type Batch = Vec<(u64, Option<Job>, Vec<u8>)>;
        let mut batch: Batch = Vec::new();
        let mut batch_bytes = 0usize;
        let mut write_batch = |batch: &mut Batch| -> std::io::Result<()> {
            changed += self.write(|w| {
                for (id, job, record) in batch.drain(..) {
                    let table = if job.is_some() { &w.jobs } else { &w.segments };
                    if table.get(id).map_err(err)?.is_some_and(|old| old.value() == record.as_slice()) {
                        continue;
                    }
                    match job {
                        Some(job) => w.put_job(&job, &record)?,
                        None => w.put_segment(id, &record)?,
                    }
                }
                Ok(w.changed)
            })?;
            Ok(())
        };
        let reader = std::io::BufReader::with_capacity(1 << 20, body);
        let mut state = codec::read_snapshot(reader, |kind, record| -> anyhow::Result<()> {
            records += 1;
            batch_bytes += record.len();
            match kind {
                HistoryRecord::Segment => {
                    let id = codec::segment_from_bytes(&record)?.id;
                    segments.push(id);
                    batch.push((id, None, record));
                }
                HistoryRecord::ArchivedJob => {
                    let job = codec::job_from_bytes(&record)?;
                    jobs.push(job.id);
                    batch.push((job.id, Some(job), record));
                }
            }
            if batch.len() == INSTALL_BATCH_RECORDS || batch_bytes >= INSTALL_BATCH_BYTES {
                write_batch(&mut batch)?;
                batch_bytes = 0;
            }
            Ok(())
        })?;
        write_batch(&mut batch)?;
        // The body lists the history in id order, the hot segments before the archived ones.
        jobs.sort_unstable();
        segments.sort_unstable();
        let (stale_jobs, stale_segments) = {
            let tx = self.db.begin_read().map_err(err)?;
            let stale = |table: TableDefinition<u64, &[u8]>, keep: &[u64]| -> anyhow::Result<Vec<u64>> {
                let mut stale = Vec::new();
                for kv in tx.open_table(table)?.iter()? {
                    let id = kv?.0.value();
                    if keep.binary_search(&id).is_err() {
                        stale.push(id);
                    }
                }
                Ok(stale)
            };
            (stale(JOBS, &jobs)?, stale(SEGMENTS, &segments)?)
        };
        for ids in stale_jobs.chunks(INSTALL_BATCH_RECORDS) {
            changed += self.write(|w| {
                for id in ids {
                    w.remove_job(*id)?;
                }
                Ok(w.changed)
            })?;
        }
        for ids in stale_segments.chunks(INSTALL_BATCH_RECORDS) {
            changed += self.write(|w| {
                for id in ids {
                    w.remove_segment(*id)?;
                }
                Ok(w.changed)
            })?;
        }
        self.sync()?;
        for bytes in self.segments_from(state.segments_archived_below) {
            let segment = codec::segment_from_bytes(&bytes)?;
            state.ledger.insert(segment.id, segment);
        }
        let ms = started.elapsed().as_millis() as u64;
        tracing::info!(records, changed, ms, "snapshot history written to the store");
        Ok(state)
    }

    /// Writes the history as of `hot` after its snapshot body, from one read transaction: the
    /// archived jobs that are not in the hot state and were submitted before it, and the
    /// segments below its hot ledger. Jobs archived since are in `hot`; records retention deleted
    /// since are deleted again by the entries after the snapshot.
    pub(crate) fn write_to(&self, hot: &codec::HotBounds, out: &mut impl Write) -> std::io::Result<()> {
        let tx = self.db.begin_read().map_err(err)?;
        for kv in tx.open_table(JOBS).map_err(err)?.iter().map_err(err)? {
            let (id, bytes) = kv.map_err(err)?;
            if hot.archived(id.value()) {
                codec::write_snapshot_record(out, HistoryRecord::ArchivedJob, bytes.value())?;
            }
        }
        for kv in tx.open_table(SEGMENTS).map_err(err)?.range(..hot.segments_archived_below).map_err(err)? {
            codec::write_snapshot_record(out, HistoryRecord::Segment, kv.map_err(err)?.1.value())?;
        }
        Ok(())
    }
}

/// `bytes` as an array of `N` bytes, or an error naming a sled record of the wrong length.
fn fixed<const N: usize>(bytes: &[u8]) -> std::io::Result<[u8; N]> {
    bytes.try_into().map_err(|_| {
        let why = format!("a sled history record of {} bytes where {N} were expected", bytes.len());
        std::io::Error::new(std::io::ErrorKind::InvalidData, why)
    })
}

/// Copies the history a store of an earlier version kept in sled under `dir/sm` (`h/<job id>`,
/// `t/<array><index>`, `l/<segment id>`; the hot records it may still hold are left out), makes
/// it durable, then removes the sled store. A crash before the removal copies it again.
fn migrate_from_sled(dir: &Path, history: &History) -> anyhow::Result<()> {
    let (sled_dir, done) = (dir.join("sm"), dir.join("sm.migrated"));
    if done.exists() {
        std::fs::remove_dir_all(&done)?;
    }
    if !sled_dir.exists() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    let (mut jobs, mut segments) = (0u64, 0u64);
    {
        let db = sled::Config::new().path(&sled_dir).open()?;
        let tree = db.open_tree("state")?;
        let mut batch = Vec::new();
        let mut batch_bytes = 0usize;
        let flush = |batch: &mut Vec<(u8, Vec<u8>, Vec<u8>)>| -> anyhow::Result<()> {
            history.write(|w| {
                for (kind, k, v) in batch.drain(..) {
                    match kind {
                        b'h' => w.put_job(&codec::job_from_bytes(&v).map_err(decode_err)?, &v)?,
                        b'l' => w.put_segment(u64::from_be_bytes(fixed(&k)?), &v)?,
                        _ => {
                            // `t/` keys: the array id, then the task index, big-endian.
                            let (array, index) = k.split_at(8.min(k.len()));
                            let (array, index) = (u64::from_be_bytes(fixed(array)?), u32::from_be_bytes(fixed(index)?));
                            w.tasks.insert((array, index), u64::from_be_bytes(fixed(&v)?)).map_err(err)?;
                        }
                    }
                }
                Ok(())
            })?;
            Ok(())
        };
        for prefix in [b"h/", b"t/", b"l/"] {
            for kv in tree.scan_prefix(prefix) {
                let (k, v) = kv?;
                match prefix[0] {
                    b'h' => jobs += 1,
                    b'l' => segments += 1,
                    _ => {}
                }
                batch_bytes += v.len();
                batch.push((prefix[0], k[prefix.len()..].to_vec(), v.to_vec()));
                if batch.len() == INSTALL_BATCH_RECORDS || batch_bytes >= INSTALL_BATCH_BYTES {
                    flush(&mut batch)?;
                    batch_bytes = 0;
                }
            }
        }
        flush(&mut batch)?;
        history.sync()?;
    }
    std::fs::rename(&sled_dir, &done)?;
    std::fs::remove_dir_all(&done)?;
    tracing::info!(
        jobs,
        segments,
        ms = started.elapsed().as_millis() as u64,
        "moved the history an earlier version kept in sled into history.redb"
    );
    Ok(())
}
