//! Harnesses for hostile bytes over the persisted encoding (`codec`), shared by the cargo-fuzz
//! targets in `fuzz/` and the stable random-input tests (`tests/it/fuzz.rs`): decoding must
//! never panic, and whatever decodes must apply without panicking and leave a consistent state.

use crate::codec::{self, command_from_bytes, command_to_bytes, snapshot_from_bytes, snapshot_to_bytes};
use corral_core::{ClusterConfig, Command, Request, State};
use corral_types::{GpuDevice, NodeSpec, Timestamp};

/// Decodes `bytes` as every persisted encoding; a decoded snapshot must encode back to a
/// snapshot that decodes to the same state.
pub fn decode(bytes: &[u8]) {
    let _ = command_from_bytes(bytes);
    let _ = codec::meta_from_bytes(bytes);
    let _ = codec::job_from_bytes(bytes);
    let _ = codec::node_from_bytes(bytes);
    let _ = codec::segment_from_bytes(bytes);
    if let Ok(state) = snapshot_from_bytes(bytes) {
        let again = snapshot_from_bytes(&snapshot_to_bytes(&state)).expect("a re-encoded snapshot decodes");
        assert_eq!(again, state, "snapshot round trip changed the state");
    }
}

/// A small cluster to apply fuzzed commands to: the dev config and two nodes.
pub fn seed_state() -> State {
    let mut state = State::default();
    let node = |name: &str, gpus: u32| NodeSpec {
        name: name.into(),
        address: format!("{name}:7171"),
        gpus: (0..gpus)
            .map(|index| GpuDevice {
                index,
                uuid: format!("GPU-{name}-{index}"),
                model: "RTX 5090".into(),
                memory_mib: 32768,
                ..Default::default()
            })
            .collect(),
        cpu_millis: 16_000,
        memory_bytes: 64 << 30,
        labels: vec![],
        rendezvous_ports: None,
        lease_end: None,
    };
    let commands = [
        Command::Configure(ClusterConfig::dev_defaults()),
        Command::RegisterNode { spec: node("n1", 4) },
        Command::RegisterNode { spec: node("n2", 2) },
    ];
    for (i, command) in commands.into_iter().enumerate() {
        state.apply(&Request { ts: Timestamp::compose(1 + i as u64, 0), command }).expect("seed command applies");
    }
    state
}

/// Splits `bytes` into length-prefixed (one byte) command encodings, applies every one that
/// decodes to a seeded state, and checks the state's invariants after each.
pub fn apply(bytes: &[u8]) {
    let mut state = seed_state();
    let mut rest = bytes;
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::from(len).min(tail.len());
        let (chunk, tail) = tail.split_at(len);
        rest = tail;
        let Ok(request) = command_from_bytes(chunk) else { continue };
        apply_checked(&mut state, &request);
    }
}

/// Applies one request and checks what must hold after any request.
pub fn apply_checked(state: &mut State, request: &Request) {
    let before_ts = state.last_ts;
    let _ = state.apply(request);
    assert!(state.last_ts >= before_ts, "the state's clock went back");
    let mut rebuilt = state.clone();
    rebuilt.rebuild_indexes();
    assert_eq!(&rebuilt, state, "derived indexes differ from a rebuild after {:?}", request.command);
    let round_trip = snapshot_from_bytes(&snapshot_to_bytes(state)).expect("snapshot of an applied state decodes");
    assert_eq!(&round_trip, state, "snapshot round trip changed the state after {:?}", request.command);
    // A command that applied re-encodes to bytes that decode to itself.
    assert_eq!(command_from_bytes(&command_to_bytes(request)).ok().as_ref(), Some(request));
}
