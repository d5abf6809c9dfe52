//! Request ids as the snapshot's `request_id_table` packs them: fixed-size entries of the
//! request key, the job id and the submit time; and the strings of version 2 snapshots. The
//! store's request-id files hold the same entries (`crate::request_ids`).

use super::{pb, CodecError};
use corral_core::{RequestKey, RequestRecord};
use corral_types::Timestamp;

/// Bytes of one entry of a snapshot's `request_id_table`: key, job id (LE), submit time (LE).
pub const REQUEST_ID_ENTRY_BYTES: usize = 32;

/// Appends request ids as entries of a `request_id_table` ([`REQUEST_ID_ENTRY_BYTES`] each).
pub fn request_id_entries_to_bytes(entries: impl IntoIterator<Item = (RequestKey, RequestRecord)>, out: &mut Vec<u8>) {
    for (key, record) in entries {
        out.extend_from_slice(&key.0);
        out.extend_from_slice(&record.job_id.to_le_bytes());
        out.extend_from_slice(&record.at.0.to_le_bytes());
    }
}

/// Decodes entries [`request_id_entries_to_bytes`] wrote.
pub fn request_id_entries_from_bytes(bytes: &[u8]) -> Result<Vec<(RequestKey, RequestRecord)>, CodecError> {
    if !bytes.len().is_multiple_of(REQUEST_ID_ENTRY_BYTES) {
        return Err(CodecError::Invalid {
            field: "request_id_table",
            value: format!("{} bytes, not a multiple of {REQUEST_ID_ENTRY_BYTES}", bytes.len()),
        });
    }
    let u64_at = |entry: &[u8], at: usize| u64::from_le_bytes(entry[at..at + 8].try_into().expect("8 bytes"));
    Ok(bytes
        .chunks_exact(REQUEST_ID_ENTRY_BYTES)
        .map(|entry| {
            let key = RequestKey(entry[..16].try_into().expect("16 bytes"));
            (key, RequestRecord { job_id: u64_at(entry, 16), at: Timestamp(u64_at(entry, 24)) })
        })
        .collect())
}

/// The request ids of a snapshot: its table, and the string entries of version 2 snapshots.
pub(super) fn request_ids_from_pb(
    table: &[u8],
    entries: Vec<pb::RequestIdEntry>,
) -> Result<Vec<(RequestKey, RequestRecord)>, CodecError> {
    let mut ids = request_id_entries_from_bytes(table)?;
    ids.extend(
        entries
            .into_iter()
            .map(|e| (RequestKey::of(&e.request_id), RequestRecord { job_id: e.job_id, at: Timestamp(e.at) })),
    );
    Ok(ids)
}
