//! Fuzz target: bytes split into length-prefixed command encodings, each applied to a seeded
//! state; apply() must never panic and the state's indexes and snapshot must stay consistent.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    corral_raft::fuzz::apply(data);
});
