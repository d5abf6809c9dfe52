//! Fixtures of the coordinator's unit tests: replicated states built through `State::apply`,
//! as the state machine builds them.

use corral_core::{ClusterConfig, Command, Request, State};
use corral_types::{GpuDevice, NodeSpec, Timestamp};

/// Applies `command` stamped at `ms`; panics if apply refuses it.
pub(crate) fn apply(state: &mut State, ms: u64, command: Command) {
    state.apply(&Request { ts: Timestamp::compose(ms, 0), command }).expect("applied");
}

/// A state with the dev policy (tenants `default`, `team-a`, `team-b`) and node `n1`
/// registered at 1 s: two 32 GiB RTX 5090s, 8 CPUs, 16 GiB of memory.
pub(crate) fn dev_state_with_node() -> State {
    let mut state = State::default();
    apply(&mut state, 1_000, Command::Configure(ClusterConfig::dev_defaults()));
    let gpu = |index| GpuDevice {
        index,
        uuid: format!("GPU-{index}"),
        model: "RTX 5090".into(),
        memory_mib: 32768,
        ..Default::default()
    };
    let node = NodeSpec {
        name: "n1".into(),
        address: "127.0.0.1:1".into(),
        gpus: vec![gpu(0), gpu(1)],
        cpu_millis: 8000,
        memory_bytes: 1 << 34,
        labels: Vec::new(),
        rendezvous_ports: None,
        lease_end: None,
    };
    apply(&mut state, 1_000, Command::RegisterNode { spec: node });
    state
}
