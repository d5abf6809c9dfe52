//! Fuzz target: bytes decoded as every persisted encoding (Raft log commands, snapshots, the
//! state machine's per-key records) must never panic; decoded snapshots round-trip.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    corral_raft::fuzz::decode(data);
});
