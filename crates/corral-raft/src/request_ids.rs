//! Request ids in the store: the files that hold them beside a snapshot, and the log of those
//! applied since.
//!
//! The request ids of the state (up to a day of them) are not re-encoded by every snapshot
//! build. A body this store builds leaves them out, and CURRENT names `.ids` files that hold
//! them: entries of a snapshot's `request_id_table` (`codec::request_id_entries_*`). Each build
//! writes the ids applied since the one before ([`RequestIdLog`], fed by `Touched::request_ids`)
//! into a new file, drops the files whose ids all expired, and merges the newest files into the
//! new one while each is at most twice its size ([`RequestIdCopy::plan`]): each file is then
//! more than twice the next, so a snapshot names about log2(ids) files and an id is written
//! again only as often. Without known files (no build here yet, a received snapshot, a body of
//! an earlier version that holds its ids itself) the next build writes every id into one.
//!
//! Loading ([`load`]) leaves out entries older than `request_ids_expired_before`: a file keeps
//! ids that expired after it was written. A snapshot sent to a follower carries the files'
//! entries as its own `request_id_table` ([`write_table`]).

use crate::codec;
use crate::snapshot_store::{IdFiles, RequestIdFile, SnapshotDir, SyncedWriter};
use corral_core::{RequestKey, RequestRecord, State};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// Most request-id files a snapshot names (they halve in size from the oldest, so only a
/// pathological history needs more): a build that would name more writes every request id into
/// one new file instead.
const MAX_REQUEST_ID_FILES: usize = 64;

/// One request id: its key and record.
type Entry = (RequestKey, RequestRecord);

/// How the request ids of the state stand against the current snapshot's request-id files.
#[derive(Debug, Default)]
pub(crate) struct RequestIdLog {
    /// The current snapshot's files when they and `added` hold every request id of the state;
    /// None when they may not (no snapshot built here yet, or one received): the next build
    /// writes every request id.
    files: Option<Vec<RequestIdFile>>,
    /// Request ids recorded since the state of the current snapshot, in apply order, one slice
    /// per applied batch: a build copies pointers under the lock, not the ids.
    added: Vec<Arc<[Entry]>>,
    /// Changes when the state is replaced (a snapshot installed): a build that copied the log
    /// before leaves it alone.
    generation: u64,
}

impl RequestIdLog {
    /// Records the request ids one applied batch added.
    pub(crate) fn record(&mut self, added: Vec<Entry>) {
        if !added.is_empty() {
            self.added.push(added.into());
        }
    }

    /// The log of a state replaced by a received snapshot.
    pub(crate) fn after(&self) -> RequestIdLog {
        RequestIdLog { files: None, added: Vec::new(), generation: self.generation + 1 }
    }

    /// What a build copies with the state, under the same lock: pointers to the slices, not
    /// the ids.
    pub(crate) fn copy(&self) -> RequestIdCopy {
        RequestIdCopy { files: self.files.clone(), added: self.added.clone(), generation: self.generation }
    }

    /// A build that copied `copy` published a snapshot naming `files`: the ids it wrote leave
    /// the log, which goes on from those files. Nothing changes if the state was replaced since
    /// the copy.
    pub(crate) fn built(&mut self, copy: &RequestIdCopy, files: &[RequestIdFile]) {
        if self.generation == copy.generation {
            self.added.drain(..copy.added.len());
            self.files = Some(files.to_vec());
        }
    }
}

/// What a build copies of the request-id log with the state.
pub(crate) struct RequestIdCopy {
    files: Option<Vec<RequestIdFile>>,
    added: Vec<Arc<[Entry]>>,
    generation: u64,
}

/// What a build writes of its request ids: the files of the current snapshot it keeps, and a
/// new file.
pub(crate) struct IdsToWrite {
    pub keep: Vec<RequestIdFile>,
    pub new: Option<NewIds>,
}

/// A new request-id file a build writes.
pub(crate) struct NewIds {
    pub bytes: Vec<u8>,
    pub entries: u64,
    /// The latest submit time of its entries.
    pub max_at: u64,
}

impl NewIds {
    fn of(entries: &mut dyn Iterator<Item = Entry>) -> Option<NewIds> {
        let mut new = NewIds { bytes: Vec::new(), entries: 0, max_at: 0 };
        codec::request_id_entries_to_bytes(
            entries.inspect(|(_, r)| {
                new.entries += 1;
                new.max_at = new.max_at.max(r.at.0);
            }),
            &mut new.bytes,
        );
        (new.entries > 0).then_some(new)
    }
}

impl RequestIdCopy {
    /// What a build of `state` (copied with this) writes of its request ids, reading the
    /// current files it merges with `read`.
    ///
    /// With the current snapshot's files known, the new file holds the ids added since; files
    /// whose ids all expired are dropped, and the newest kept files are merged into the new one
    /// while each is at most twice its size. Else (or when a file cannot be read back, or the
    /// files would be too many) the new file holds every request id of the state.
    pub(crate) fn plan(
        &self,
        state: &State,
        read: impl Fn(&RequestIdFile) -> anyhow::Result<Vec<Entry>>,
    ) -> IdsToWrite {
        let expired_before = state.request_ids_expired_before.0;
        let live = |(_, r): &Entry| r.at.0 >= expired_before;
        let all =
            || IdsToWrite { keep: Vec::new(), new: NewIds::of(&mut state.request_ids.iter().map(|(k, r)| (*k, *r))) };
        let Some(files) = &self.files else { return all() };
        let mut keep: Vec<RequestIdFile> = files.iter().filter(|f| f.max_at >= expired_before).cloned().collect();
        // Every id of the state is in the files or added since (a check, not a proof: each kept
        // file counts its expired ids too).
        let held = keep.iter().map(|f| f.entries).sum::<u64>() + self.added.iter().map(|a| a.len() as u64).sum::<u64>();
        if held < state.request_ids.len() as u64 {
            tracing::warn!(
                held,
                ids = state.request_ids.len(),
                "the request-id files miss ids: writing them all again"
            );
            return all();
        }
        let mut entries: Vec<Entry> = self.added.iter().flat_map(|a| a.iter().copied()).filter(live).collect();
        while let Some(last) = keep.last().filter(|f| !entries.is_empty() && f.entries <= 2 * entries.len() as u64) {
            match read(last) {
                Ok(older) => {
                    let mut merged: Vec<_> = older.into_iter().filter(live).collect();
                    merged.append(&mut entries);
                    entries = merged;
                    keep.pop();
                }
                Err(e) => {
                    tracing::warn!(file = %last.name, "cannot read a request-id file ({e:#}): writing every request id again");
                    return all();
                }
            }
        }
        if keep.len() >= MAX_REQUEST_ID_FILES {
            return all();
        }
        IdsToWrite { keep, new: NewIds::of(&mut entries.into_iter()) }
    }
}

impl IdsToWrite {
    /// Writes the new file, if any, at `tmp` (synced), and says which files the snapshot names.
    pub(crate) fn write<'a>(&self, tmp: &'a Path) -> std::io::Result<IdFiles<'a>> {
        let new = match &self.new {
            Some(new) => {
                let mut out = SyncedWriter::create(tmp)?;
                out.write_all(&new.bytes)?;
                out.finish()?;
                Some((tmp, new.entries, new.max_at))
            }
            None => None,
        };
        Ok(IdFiles { keep: self.keep.clone(), new })
    }
}

/// The entries of request-id file `file`.
pub(crate) fn read_file(snapshots: &SnapshotDir, file: &RequestIdFile) -> anyhow::Result<Vec<Entry>> {
    let bytes = std::fs::read(snapshots.path(&file.name))?;
    Ok(codec::request_id_entries_from_bytes(&bytes)?)
}

/// Adds to `state`, the hot state of a body this store built, the request ids of the files its
/// snapshot names, leaving out those that expired. Returns the log to go on with: it knows the
/// files only if they hold every id (a body of an earlier version holds its ids itself).
pub(crate) fn load(
    snapshots: &SnapshotDir,
    files: &[RequestIdFile],
    state: &mut State,
) -> anyhow::Result<RequestIdLog> {
    let inline = !state.request_ids.is_empty();
    for file in files {
        state.add_request_ids(read_file(snapshots, file)?);
    }
    Ok(RequestIdLog { files: (!inline).then(|| files.to_vec()), ..Default::default() })
}

/// Opens the request-id files of a snapshot to send, when it is chosen: a newer snapshot may
/// remove them before the body to send is written.
pub(crate) fn open_files(snapshots: &SnapshotDir, files: &[RequestIdFile]) -> std::io::Result<Vec<std::fs::File>> {
    files.iter().map(|f| std::fs::File::open(snapshots.path(&f.name))).collect()
}

/// Writes the entries of the request-id files `files` as a snapshot's `request_id_table` field
/// (nothing when they hold none), after a body encoded without request ids.
pub(crate) fn write_table(files: Vec<std::fs::File>, out: &mut impl Write) -> std::io::Result<()> {
    let lens = files.iter().map(|f| f.metadata().map(|m| m.len())).collect::<std::io::Result<Vec<_>>>()?;
    let total: u64 = lens.iter().sum();
    if total == 0 {
        return Ok(());
    }
    out.write_all(&codec::request_id_table_key(total))?;
    for (mut file, len) in files.into_iter().zip(lens) {
        if std::io::copy(&mut std::io::Read::take(&mut file, len), out)? != len {
            return Err(std::io::Error::other("a request-id file ended early"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_types::Timestamp;

    /// `n` request ids named `{prefix}{i}`, submitted at `at`.
    fn ids(prefix: &str, n: usize, at: u64) -> Vec<Entry> {
        (0..n)
            .map(|i| {
                (RequestKey::of(&format!("{prefix}{i}")), RequestRecord { job_id: i as u64 + 1, at: Timestamp(at) })
            })
            .collect()
    }

    fn file(name: &str, entries: &[Entry]) -> RequestIdFile {
        let max_at = entries.iter().map(|(_, r)| r.at.0).max().unwrap_or(0);
        RequestIdFile { name: name.into(), entries: entries.len() as u64, max_at }
    }

    fn state_with(ids: &[Entry], expired_before: u64) -> State {
        let mut state = State::default();
        state.request_ids_expired_before = Timestamp(expired_before);
        state.add_request_ids(ids.iter().copied());
        state
    }

    fn decoded(new: &Option<NewIds>) -> Vec<Entry> {
        new.as_ref().map_or_else(Vec::new, |n| codec::request_id_entries_from_bytes(&n.bytes).expect("entries"))
    }

    /// A build writes the ids added since the last one into a new file, keeps the older files,
    /// merges the newest into the new one while it is at most twice the new ids, and drops a
    /// file whose ids all expired.
    #[test]
    fn a_build_writes_the_ids_added_since_and_merges_the_small_files() {
        let (a, b, c) = (ids("a", 100, 10), ids("b", 20, 20), ids("c", 10, 30));
        let (fa, fb) = (file("a.ids", &a), file("b.ids", &b));
        let all: Vec<Entry> = a.iter().chain(&b).chain(&c).copied().collect();
        let read = |f: &RequestIdFile| match f.name.as_str() {
            "a.ids" => Ok(a.clone()),
            "b.ids" => Ok(b.clone()),
            other => anyhow::bail!("no file {other}"),
        };
        let mut log = RequestIdLog { files: Some(vec![fa.clone(), fb.clone()]), ..Default::default() };
        log.record(c.clone());
        let plan = log.copy().plan(&state_with(&all, 0), read);
        assert_eq!(plan.keep, vec![fa.clone()], "the file of 100 is more than twice the 30 merged ids");
        let mut expected = b.clone();
        expected.extend(&c);
        assert_eq!(decoded(&plan.new), expected, "the file of 20 is merged with the 10 new ids, oldest first");
        let new = plan.new.as_ref().expect("a new file");
        assert_eq!((new.entries, new.max_at), (30, 30));

        // The ids of the first file expired: it is dropped, and its ids are left out.
        let live: Vec<Entry> = b.iter().chain(&c).copied().collect();
        let plan = log.copy().plan(&state_with(&live, 15), read);
        assert!(plan.keep.is_empty());
        assert_eq!(decoded(&plan.new), expected);

        // Nothing added: no new file, the files are named again.
        let quiet = RequestIdLog { files: Some(vec![fa.clone()]), ..Default::default() };
        let plan = quiet.copy().plan(&state_with(&a, 0), read);
        assert_eq!((plan.keep, plan.new.is_none()), (vec![fa], true));
    }

    /// Every id is written again into one file when the files are not known, do not hold every
    /// id, cannot be read back, or would be too many.
    #[test]
    fn every_id_is_written_again_when_the_files_cannot_be_trusted() {
        let (a, b) = (ids("a", 10, 10), ids("b", 10, 20));
        let all: Vec<Entry> = a.iter().chain(&b).copied().collect();
        let state = state_with(&all, 0);
        let everything = |plan: &IdsToWrite| plan.keep.is_empty() && sorted(&decoded(&plan.new)) == sorted(&all);
        let unknown = RequestIdLog::default();
        assert!(everything(&unknown.copy().plan(&state, |_| anyhow::bail!("not read"))));
        let short = RequestIdLog { files: Some(vec![file("a.ids", &a[..5])]), ..Default::default() };
        assert!(everything(&short.copy().plan(&state, |_| anyhow::bail!("not read"))), "the files miss ids");
        let mut unreadable = RequestIdLog { files: Some(vec![file("a.ids", &a)]), ..Default::default() };
        unreadable.record(b.clone());
        assert!(everything(&unreadable.copy().plan(&state, |_| anyhow::bail!("gone"))), "a file to merge is gone");
        let many: Vec<RequestIdFile> = (0..MAX_REQUEST_ID_FILES).map(|i| file(&format!("{i}.ids"), &a)).collect();
        let mut crowded = RequestIdLog { files: Some(many), ..Default::default() };
        crowded.record(b[..1].to_vec());
        assert!(everything(&crowded.copy().plan(&state, |_| anyhow::bail!("not read"))), "too many files");
    }

    /// A published build takes what it wrote out of the log; ids recorded after its copy stay
    /// for the next build; a build that copied the log before a snapshot was installed changes
    /// nothing.
    #[test]
    fn the_log_keeps_what_a_build_did_not_write() {
        let mut log = RequestIdLog::default();
        log.record(ids("a", 3, 1));
        log.record(Vec::new());
        let copy = log.copy();
        log.record(ids("b", 2, 2));
        let files = vec![file("a.ids", &ids("a", 3, 1))];
        log.built(&copy, &files);
        assert_eq!(log.files, Some(files.clone()));
        assert_eq!(log.added.iter().map(|a| a.len()).collect::<Vec<_>>(), vec![2], "the ids applied after the copy");

        let stale = log.copy();
        let mut installed = log.after();
        assert!(installed.files.is_none() && installed.added.is_empty());
        installed.record(ids("c", 1, 3));
        installed.built(&stale, &files);
        assert!(installed.files.is_none(), "a build of the replaced state is not taken");
        assert_eq!(installed.added.len(), 1);
    }

    /// Loading reads every named file and leaves out expired ids; a snapshot to send carries
    /// the files' entries as its request-id table, so a body without request ids followed by
    /// the table decodes to the state with them.
    #[test]
    fn files_load_into_the_state_and_travel_as_a_snapshot_table() {
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshots = SnapshotDir::open(dir.path()).expect("snapshot dir");
        let (old, new) = (ids("old", 4, 10), ids("new", 3, 20));
        let write = |name: &str, entries: &[Entry]| {
            let mut bytes = Vec::new();
            codec::request_id_entries_to_bytes(entries.iter().copied(), &mut bytes);
            std::fs::write(snapshots.path(name), bytes).expect("write");
            file(name, entries)
        };
        let files = vec![write("1-0.ids", &old), write("2-1.ids", &new)];

        let mut state = state_with(&[], 15);
        let log = load(&snapshots, &files, &mut state).expect("load");
        assert_eq!(state.request_ids.iter().map(|(k, r)| (*k, *r)).collect::<Vec<_>>(), sorted(&new));
        assert_eq!(log.files, Some(files.clone()), "the files hold every id");
        let mut inline = state_with(&old, 0);
        let log = load(&snapshots, &files, &mut inline).expect("load");
        assert!(log.files.is_none(), "a body holding its ids itself: the next build writes them all");

        let mut whole = state_with(&[], 0);
        whole.add_request_ids(old.iter().chain(&new).copied());
        let mut sent = codec::snapshot_without_request_ids_to_bytes(&whole, &mut codec::JobEncodings::default());
        write_table(open_files(&snapshots, &files).expect("open"), &mut sent).expect("table");
        assert_eq!(codec::snapshot_from_bytes(&sent).expect("decodes"), whole);
        let mut empty = Vec::new();
        write_table(Vec::new(), &mut empty).expect("no files");
        assert!(empty.is_empty(), "no table without ids");
    }

    fn sorted(entries: &[Entry]) -> Vec<Entry> {
        let mut entries = entries.to_vec();
        entries.sort_by_key(|(k, _)| *k);
        entries
    }
}
