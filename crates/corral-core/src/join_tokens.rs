//! Single-use join tokens for worker nodes, replicated. Like access tokens, only the SHA-256 of
//! each secret is stored. Consuming a token is a replicated command whose apply refuses an
//! unknown, expired or already used token, so a token admits one worker across every
//! coordinator and every failover.
//!
//! Invariant: expiry is judged against the request's TSO timestamp only (`Request.ts`), never a
//! clock: every coordinator reaches the same verdict. A consume repeated with the same public
//! key (a worker retrying after a lost reply) is answered again without admitting anyone new.

use crate::{ApplyError, Outcome, State};
use corral_types::{NodeState, Timestamp};
use serde::{Deserialize, Serialize};

/// Most join tokens (used and expired ones included) the state keeps.
pub const MAX_JOIN_TOKENS: usize = 1_000;
/// Used or expired join tokens are forgotten this long after they expired (until then a second
/// use is refused as a reuse, not as an unknown token).
pub const JOIN_TOKEN_RETENTION_MS: u64 = 7 * 24 * 3600 * 1000;
/// The longest a join token may live.
pub const MAX_JOIN_TOKEN_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// Who used a join token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinTokenUse {
    /// The node name the worker joined as (its certificate's name).
    pub node: String,
    /// Lower-case hex SHA-256 of the public key that was certified.
    pub public_key_sha256: String,
    pub at: Timestamp,
}

/// One issued join token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinTokenRecord {
    pub id: u64,
    /// Lower-case hex SHA-256 of the secret.
    pub sha256: String,
    pub created: Timestamp,
    /// Physical TSO milliseconds from which the token is refused.
    pub expires_at_ms: u64,
    pub used: Option<JoinTokenUse>,
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A node name as certificates and configs carry it: 1 to 63 letters, digits, '-', '_', '.'.
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 63 && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

impl State {
    /// The join token whose secret hashes to `sha256`.
    pub fn join_token_by_hash(&self, sha256: &str) -> Option<&JoinTokenRecord> {
        self.join_tokens.values().find(|t| t.sha256 == sha256)
    }

    pub(crate) fn create_join_token(
        &mut self,
        ts: Timestamp,
        sha256: &str,
        ttl_ms: u64,
    ) -> Result<Outcome, ApplyError> {
        if !is_sha256_hex(sha256) {
            return Err(ApplyError::JoinTokenRefused("the token hash must be 64 lower-case hex digits".into()));
        }
        if ttl_ms == 0 || ttl_ms > MAX_JOIN_TOKEN_TTL_MS {
            return Err(ApplyError::JoinTokenRefused(format!(
                "the lifetime must be between 1ms and {}h",
                MAX_JOIN_TOKEN_TTL_MS / 3_600_000
            )));
        }
        // Forget tokens long past their expiry (deterministic: judged at this request's time).
        let now = ts.physical_ms();
        self.join_tokens.retain(|_, t| t.expires_at_ms.saturating_add(JOIN_TOKEN_RETENTION_MS) > now);
        if self.join_token_by_hash(sha256).is_some() {
            return Err(ApplyError::JoinTokenRefused("a join token with this secret exists already".into()));
        }
        if self.join_tokens.len() >= MAX_JOIN_TOKENS {
            return Err(ApplyError::JoinTokenRefused(format!(
                "at most {MAX_JOIN_TOKENS} join tokens are kept: wait until old ones expire"
            )));
        }
        let id = self.next_join_token_id.max(1);
        self.next_join_token_id = id + 1;
        let record = JoinTokenRecord {
            id,
            sha256: sha256.to_string(),
            created: ts,
            expires_at_ms: now.saturating_add(ttl_ms),
            used: None,
        };
        self.join_tokens.insert(id, record);
        Ok(Outcome::JoinTokenCreated { token_id: id })
    }

    /// Uses the join token whose secret hashes to `sha256` for `node` with the public key
    /// hashing to `public_key_sha256`; refuses an unknown, expired or used token.
    pub(crate) fn consume_join_token(
        &mut self,
        ts: Timestamp,
        sha256: &str,
        node: &str,
        public_key_sha256: &str,
    ) -> Result<Outcome, ApplyError> {
        if !valid_node_name(node) {
            return Err(ApplyError::JoinTokenRefused(format!(
                "'{node}' is not a usable node name (1 to 63 letters, digits, '-', '_' or '.')"
            )));
        }
        if !is_sha256_hex(public_key_sha256) {
            return Err(ApplyError::JoinTokenRefused("the public key hash must be 64 lower-case hex digits".into()));
        }
        let up = self.nodes.get(node).is_some_and(|n| n.state == NodeState::Up);
        let issued_at_s = self.worker_certificate_issue_s(node);
        let Some(token) = self.join_tokens.values_mut().find(|t| t.sha256 == sha256) else {
            return Err(ApplyError::JoinTokenRefused("unknown join token: not issued by this cluster".into()));
        };
        if let Some(used) = &token.used {
            if used.node == node && used.public_key_sha256 == public_key_sha256 {
                // The same worker asking again (its first reply was lost): nothing new is admitted.
                return Ok(Outcome::JoinTokenConsumed { token_id: token.id, duplicate: true, issued_at_s });
            }
            return Err(ApplyError::JoinTokenRefused(format!(
                "join token {} was already used by node '{}': issue a new one with `corral node join-token`",
                token.id, used.node
            )));
        }
        if ts.physical_ms() >= token.expires_at_ms {
            return Err(ApplyError::JoinTokenRefused(format!(
                "join token {} expired: issue a new one with `corral node join-token`",
                token.id
            )));
        }
        if up {
            return Err(ApplyError::JoinTokenRefused(format!(
                "node '{node}' is registered and up: give the new worker another node-name"
            )));
        }
        token.used =
            Some(JoinTokenUse { node: node.to_string(), public_key_sha256: public_key_sha256.to_string(), at: ts });
        Ok(Outcome::JoinTokenConsumed { token_id: token.id, duplicate: false, issued_at_s })
    }
}

#[cfg(test)]
mod tests {
    use crate::{ApplyError, Command, Outcome, Request, State};
    use corral_types::Timestamp;

    const HOUR_MS: u64 = 3_600_000;

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    fn hash(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn create(c: char, ttl_ms: u64) -> Command {
        Command::CreateJoinToken { sha256: hash(c), ttl_ms }
    }

    fn consume(c: char, node: &str, key: char) -> Command {
        Command::ConsumeJoinToken { sha256: hash(c), node: node.into(), public_key_sha256: hash(key) }
    }

    fn refusal(response: crate::Response) -> String {
        match response {
            Err(ApplyError::JoinTokenRefused(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_join_token_admits_one_worker() {
        let mut s = State::default();
        assert_eq!(s.apply(&at(1_000, create('a', HOUR_MS))), Ok(Outcome::JoinTokenCreated { token_id: 1 }));
        let first = s.apply(&at(2_000, consume('a', "gpu-1", 'c')));
        assert_eq!(first, Ok(Outcome::JoinTokenConsumed { token_id: 1, duplicate: false, issued_at_s: 2 }));
        // The same worker with the same key retrying: answered again, nobody new admitted.
        let retry = s.apply(&at(3_000, consume('a', "gpu-1", 'c')));
        assert_eq!(retry, Ok(Outcome::JoinTokenConsumed { token_id: 1, duplicate: true, issued_at_s: 3 }));
        // Anyone else (another key, another name) is refused as a reuse.
        let other_key = refusal(s.apply(&at(4_000, consume('a', "gpu-1", 'd'))));
        assert!(other_key.contains("join token 1 was already used by node 'gpu-1'"), "{other_key}");
        let other_node = refusal(s.apply(&at(5_000, consume('a', "gpu-2", 'c'))));
        assert!(other_node.contains("already used"), "{other_node}");
        let used = s.join_token_by_hash(&hash('a')).and_then(|t| t.used.clone()).expect("used");
        assert_eq!((used.node.as_str(), used.at), ("gpu-1", Timestamp::compose(2_000, 0)));
    }

    #[test]
    fn expiry_is_judged_at_the_request_timestamp() {
        let mut s = State::default();
        s.apply(&at(10_000, create('a', 1_000))).expect("create");
        // Expired from created + ttl on, whatever any clock says: only Request.ts counts.
        let expired = refusal(s.apply(&at(11_000, consume('a', "gpu-1", 'c'))));
        assert!(expired.contains("join token 1 expired"), "{expired}");
        s.apply(&at(10_000, create('b', 1_000))).expect("create");
        assert!(s.apply(&at(10_999, consume('b', "gpu-1", 'c'))).is_ok());
        // An expired token stays known (refused as expired, not unknown) until the retention ends.
        let later = refusal(s.apply(&at(12_000, consume('a', "gpu-2", 'c'))));
        assert!(later.contains("expired"), "{later}");
    }

    #[test]
    fn unknown_and_malformed_requests_are_refused_without_change() {
        let mut s = State::default();
        s.apply(&at(1_000, create('a', HOUR_MS))).expect("create");
        let before = s.join_tokens.clone();
        let unknown = refusal(s.apply(&at(2_000, consume('z', "gpu-1", 'c'))));
        assert!(unknown.contains("unknown join token"), "{unknown}");
        assert!(refusal(s.apply(&at(2_000, consume('a', "bad name", 'c')))).contains("not a usable node name"));
        let bad_key = Command::ConsumeJoinToken { sha256: hash('a'), node: "n".into(), public_key_sha256: "k".into() };
        assert!(refusal(s.apply(&at(2_000, bad_key))).contains("public key hash"));
        assert!(
            refusal(s.apply(&at(2_000, Command::CreateJoinToken { sha256: "x".into(), ttl_ms: 1 }))).contains("hash")
        );
        assert!(refusal(s.apply(&at(2_000, create('b', 0)))).contains("lifetime"));
        assert!(refusal(s.apply(&at(2_000, create('a', 5)))).contains("exists already"));
        assert_eq!(s.join_tokens, before);
    }

    #[test]
    fn old_tokens_are_forgotten_when_new_ones_are_made() {
        let mut s = State::default();
        s.apply(&at(1_000, create('a', 1_000))).expect("create");
        let long_after = 2_000 + super::JOIN_TOKEN_RETENTION_MS;
        assert_eq!(s.apply(&at(long_after, create('b', 1_000))), Ok(Outcome::JoinTokenCreated { token_id: 2 }));
        assert_eq!(s.join_tokens.keys().copied().collect::<Vec<_>>(), vec![2]);
        let forgotten = refusal(s.apply(&at(long_after, consume('a', "gpu-1", 'c'))));
        assert!(forgotten.contains("unknown"), "{forgotten}");
    }
}
