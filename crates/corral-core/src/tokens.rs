//! Tenant and admin access tokens, replicated. Only the SHA-256 of each secret is stored: a
//! leaked snapshot or log does not reveal a usable token.

use crate::{ApplyError, Outcome, State};
use corral_types::Timestamp;
use serde::{Deserialize, Serialize};

/// Most tokens (revoked ones included) the state keeps.
pub const MAX_TOKENS: usize = 10_000;

/// One issued token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub id: u64,
    /// The tenant its holder acts as (empty for an admin token).
    pub tenant: String,
    /// An admin sees and controls every tenant and manages tokens and the cluster.
    pub admin: bool,
    /// Lower-case hex SHA-256 of the secret.
    pub sha256: String,
    pub created: Timestamp,
    /// Unix milliseconds after which the token is refused (`None`: never expires).
    pub expires_at_ms: Option<u64>,
    pub revoked: bool,
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl State {
    /// The token whose secret hashes to `sha256` (revoked or expired ones included: the caller
    /// says why it is refused).
    pub fn token_by_hash(&self, sha256: &str) -> Option<&TokenRecord> {
        self.tokens.values().find(|t| t.sha256 == sha256)
    }

    pub(crate) fn create_token(
        &mut self,
        ts: Timestamp,
        tenant: &str,
        admin: bool,
        sha256: &str,
        expires_at_ms: Option<u64>,
    ) -> Result<Outcome, ApplyError> {
        if !is_sha256_hex(sha256) {
            return Err(ApplyError::InvalidToken("the token hash must be 64 lower-case hex digits".into()));
        }
        if admin && !tenant.is_empty() {
            return Err(ApplyError::InvalidToken("an admin token belongs to no tenant".into()));
        }
        if !admin && !self.config.tenants.iter().any(|t| t == tenant) {
            return Err(ApplyError::UnknownTenant {
                tenant: tenant.to_string(),
                known: self.config.tenants.join(", "),
            });
        }
        if self.token_by_hash(sha256).is_some() {
            return Err(ApplyError::InvalidToken("a token with this secret exists already".into()));
        }
        if self.tokens.len() >= MAX_TOKENS {
            return Err(ApplyError::InvalidToken(format!("at most {MAX_TOKENS} tokens: revoke and prune old ones")));
        }
        let id = self.next_token_id.max(1);
        self.next_token_id = id + 1;
        self.tokens.insert(
            id,
            TokenRecord {
                id,
                tenant: tenant.to_string(),
                admin,
                sha256: sha256.to_string(),
                created: ts,
                expires_at_ms,
                revoked: false,
            },
        );
        Ok(Outcome::TokenCreated { token_id: id })
    }

    pub(crate) fn revoke_token(&mut self, token_id: u64) -> Result<Outcome, ApplyError> {
        let token = self.tokens.get_mut(&token_id).ok_or(ApplyError::NoSuchToken(token_id))?;
        if token.revoked {
            return Ok(Outcome::Stale);
        }
        token.revoked = true;
        Ok(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use crate::{ApplyError, ClusterConfig, Command, Outcome, Request, State};
    use corral_types::Timestamp;

    fn req(ts: u64, command: Command) -> Request {
        Request { ts: Timestamp(ts), command }
    }

    fn hash(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn create(tenant: &str, admin: bool, sha256: String) -> Command {
        Command::CreateToken { tenant: tenant.into(), admin, sha256, expires_at_ms: None }
    }

    #[test]
    fn tokens_are_created_looked_up_and_revoked() {
        let mut s = State::default();
        s.apply(&req(1, Command::Configure(ClusterConfig::dev_defaults()))).unwrap();
        assert_eq!(s.apply(&req(2, create("team-a", false, hash('a')))), Ok(Outcome::TokenCreated { token_id: 1 }));
        assert_eq!(s.apply(&req(3, create("", true, hash('b')))), Ok(Outcome::TokenCreated { token_id: 2 }));
        let t = s.token_by_hash(&hash('a')).expect("token");
        assert_eq!((t.tenant.as_str(), t.admin, t.revoked), ("team-a", false, false));
        assert_eq!(s.apply(&req(4, Command::RevokeToken { token_id: 1 })), Ok(Outcome::Done));
        assert_eq!(s.apply(&req(5, Command::RevokeToken { token_id: 1 })), Ok(Outcome::Stale));
        assert!(s.token_by_hash(&hash('a')).expect("kept").revoked);
        assert_eq!(s.apply(&req(6, Command::RevokeToken { token_id: 9 })), Err(ApplyError::NoSuchToken(9)));
    }

    #[test]
    fn bad_tokens_are_refused() {
        let mut s = State::default();
        s.apply(&req(1, Command::Configure(ClusterConfig::dev_defaults()))).unwrap();
        assert!(matches!(s.apply(&req(2, create("nobody", false, hash('a')))), Err(ApplyError::UnknownTenant { .. })));
        assert!(matches!(s.apply(&req(3, create("team-a", false, "secret".into()))), Err(ApplyError::InvalidToken(_))));
        assert!(matches!(s.apply(&req(4, create("team-a", true, hash('c')))), Err(ApplyError::InvalidToken(_))));
        s.apply(&req(5, create("team-a", false, hash('d')))).unwrap();
        assert!(matches!(s.apply(&req(6, create("team-b", false, hash('d')))), Err(ApplyError::InvalidToken(_))));
        assert!(s.tokens.len() == 1);
    }
}
