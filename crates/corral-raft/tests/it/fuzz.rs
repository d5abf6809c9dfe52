//! Hostile input on stable Rust: the same harnesses as the cargo-fuzz targets in `fuzz/`, fed
//! by proptest with random bytes and with valid encodings that have bytes flipped.

use corral_core::{Command, Placement, Request};
use corral_raft::codec::command_to_bytes;
use corral_raft::fuzz;
use corral_types::{JobExitReport, JobSpec, Timestamp};
use proptest::prelude::*;

/// A plausible command about small ids, so that mutations land near real state.
fn command(kind: u8, id: u64, n: u32) -> Command {
    match kind % 11 {
        0 => Command::SubmitJob {
            request_id: format!("r{id}"),
            spec: JobSpec {
                name: "j".into(),
                tenant: ["default", "team-a", "team-b"][id as usize % 3].into(),
                gpus: n % 5,
                command: vec!["true".into()].into(),
                ..Default::default()
            },
        },
        1 => Command::PlaceJob { job_id: id, node: "n1".into(), gpus: (0..n % 5).collect() },
        2 => Command::JobStarted { job_id: id, epoch: u64::from(n) },
        3 => Command::JobFinished {
            job_id: id,
            epoch: u64::from(n),
            node: format!("n{}", n % 3),
            report: JobExitReport::default(),
        },
        4 => Command::CancelJob { job_id: id, reason: "x".into() },
        5 => Command::Schedule {
            placements: vec![Placement {
                job_id: id,
                node: "n2".into(),
                gpus: vec![n % 3],
                more_nodes: vec![],
                slice: None,
            }],
            preemptions: vec![],
        },
        6 => Command::CreateToken {
            tenant: "team-a".into(),
            admin: false,
            sha256: format!("{:064x}", u128::from(n) * 7919 + u128::from(id)),
            expires_at_ms: Some(u64::from(n)),
        },
        7 => Command::RevokeToken { token_id: id },
        8 => Command::CreateJoinToken { sha256: format!("{:064x}", u128::from(n) * 31 + 1), ttl_ms: u64::from(n) },
        9 => Command::ConsumeJoinToken {
            sha256: format!("{:064x}", u128::from(n) * 31 + 1),
            node: format!("n{}", n % 3),
            public_key_sha256: format!("{:064x}", id),
        },
        _ => Command::PreemptJob { job_id: id, by: id + 1, grace_secs: n % 10 },
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzz::decode(&bytes);
    }

    #[test]
    fn random_bytes_never_panic_apply(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        fuzz::apply(&bytes);
    }

    #[test]
    fn mutated_commands_apply_consistently(
        commands in proptest::collection::vec((any::<u8>(), 1u64..6, any::<u32>()), 1..24),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
    ) {
        let mut state = fuzz::seed_state();
        let mut all = Vec::new();
        for (i, (kind, id, n)) in commands.into_iter().enumerate() {
            let request = Request { ts: Timestamp::compose(10 + i as u64, 0), command: command(kind, id, n) };
            fuzz::apply_checked(&mut state, &request);
            let bytes = command_to_bytes(&request);
            all.push(u8::try_from(bytes.len()).unwrap_or(u8::MAX));
            all.extend_from_slice(&bytes[..bytes.len().min(255)]);
        }
        for (at, xor) in flips {
            if !all.is_empty() {
                let at = at % all.len();
                all[at] ^= xor;
            }
        }
        fuzz::apply(&all);
        fuzz::decode(&all);
    }
}
