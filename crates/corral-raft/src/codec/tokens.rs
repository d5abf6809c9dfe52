//! Access tokens and single-use worker join tokens (their SHA-256 only, never a secret).

use super::pb;
use corral_core::{JoinTokenRecord, JoinTokenUse, State, TokenRecord};
use corral_types::Timestamp;
use std::collections::BTreeMap;

pub(super) fn join_tokens_to_pb(s: &State) -> Vec<pb::JoinTokenRecord> {
    s.join_tokens
        .values()
        .map(|t| pb::JoinTokenRecord {
            id: t.id,
            sha256: t.sha256.clone(),
            created: t.created.0,
            expires_at_ms: t.expires_at_ms,
            used: t.used.as_ref().map(|u| pb::JoinTokenUse {
                node: u.node.clone(),
                public_key_sha256: u.public_key_sha256.clone(),
                at: u.at.0,
            }),
        })
        .collect()
}

pub(super) fn join_tokens_from_pb(records: Vec<pb::JoinTokenRecord>) -> BTreeMap<u64, JoinTokenRecord> {
    records
        .into_iter()
        .map(|t| {
            let used = t.used.map(|u| JoinTokenUse {
                node: u.node,
                public_key_sha256: u.public_key_sha256,
                at: Timestamp(u.at),
            });
            let record = JoinTokenRecord {
                id: t.id,
                sha256: t.sha256,
                created: Timestamp(t.created),
                expires_at_ms: t.expires_at_ms,
                used,
            };
            (t.id, record)
        })
        .collect()
}

pub(super) fn tokens_to_pb(s: &State) -> Vec<pb::TokenRecord> {
    s.tokens
        .values()
        .map(|t| pb::TokenRecord {
            id: t.id,
            tenant: t.tenant.clone(),
            admin: t.admin,
            sha256: t.sha256.clone(),
            created: t.created.0,
            expires_at_ms: t.expires_at_ms,
            revoked: t.revoked,
        })
        .collect()
}

pub(super) fn tokens_from_pb(records: Vec<pb::TokenRecord>) -> BTreeMap<u64, TokenRecord> {
    records
        .into_iter()
        .map(|t| {
            let record = TokenRecord {
                id: t.id,
                tenant: t.tenant,
                admin: t.admin,
                sha256: t.sha256,
                created: Timestamp(t.created),
                expires_at_ms: t.expires_at_ms,
                revoked: t.revoked,
            };
            (t.id, record)
        })
        .collect()
}
