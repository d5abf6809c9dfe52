//! The replicated deny list of worker certificates: `corral node remove` (a `RemoveNode` with
//! `revoke_certificates`) refuses, on every coordinator, each certificate naming the node that
//! was issued before the removal, whoever issued it (a join, a renewal, `corral certs init`).
//!
//! By node name and issue time, not by serial: the cluster never learns the serials of the
//! certificates an operator issued offline, nor of every renewal a worker made, while every
//! worker certificate carries its node name and when it was issued (its notBefore). A node that
//! joins again under the same name gets a certificate issued after the removal, which the entry
//! does not refuse.
//!
//! Times are whole seconds since the Unix epoch, as certificates carry them. A removal's
//! threshold lies strictly after every issue time a coordinator handed out before it was
//! applied ([`State::worker_certificate_issue_s`]: at most the second of the latest applied
//! timestamp, `last_ts`, which only grows in log order): a renewal signed from the state before
//! a removal is refused by it, whatever the clocks, and a certificate signed from a state that
//! holds the removal is not.
//!
//! Invariant: apply reads no clock: the threshold comes from `Request.ts` and `last_ts` only.

use crate::State;
use corral_types::Timestamp;

/// How long a revocation is kept: longer than any certificate corral issues lives (ten years),
/// so an entry is forgotten only once every certificate it refuses has expired.
pub const REVOCATION_RETENTION_S: u64 = 3660 * 24 * 3600;

impl State {
    /// Whether a worker certificate of `node` issued at `issued_at_s` is refused: the node was
    /// removed after it was issued.
    pub fn worker_certificate_revoked(&self, node: &str, issued_at_s: u64) -> bool {
        self.revoked_workers.get(node).is_some_and(|&revoked_before| issued_at_s < revoked_before)
    }

    /// The issue time a certificate for `node` signed now carries: the second of the latest
    /// applied timestamp, or the node's last removal if that is later (a node joining again
    /// right after its removal).
    pub fn worker_certificate_issue_s(&self, node: &str) -> u64 {
        let now = self.last_ts.physical_ms() / 1000;
        self.revoked_workers.get(node).map_or(now, |&revoked_before| now.max(revoked_before))
    }

    /// Refuses from now on every certificate of `node` issued so far (see the module docs), and
    /// forgets revocations older than [`REVOCATION_RETENTION_S`].
    pub(crate) fn revoke_worker_certificates(&mut self, ts: Timestamp, node: &str) {
        let after_every_issue = self.last_ts.max(ts).physical_ms() / 1000 + 1;
        let revoked_before = match self.revoked_workers.get(node) {
            Some(&earlier) => after_every_issue.max(earlier + 1),
            None => after_every_issue,
        };
        self.revoked_workers.retain(|_, &mut t| t.saturating_add(REVOCATION_RETENTION_S) > after_every_issue);
        self.revoked_workers.insert(node.to_string(), revoked_before);
    }
}

#[cfg(test)]
mod tests {
    use crate::apply::tests::node;
    use crate::{Command, Request, State};
    use corral_types::{NodeMode, Timestamp};

    fn at(ms: u64, command: Command) -> Request {
        Request { ts: Timestamp::compose(ms, 0), command }
    }

    /// Nodes n1 and n2, registered at 1 s.
    fn two_nodes() -> State {
        let mut s = crate::apply::tests::cluster();
        s.apply(&at(1_000, Command::RegisterNode { spec: node("n2", 2) })).expect("register");
        s
    }

    fn cordoned(s: &mut State, ms: u64, name: &str) {
        let cordon = Command::SetNodeMode {
            node: name.into(),
            mode: NodeMode::Cordoned,
            reason: String::new(),
            drain_deadline: None,
        };
        s.apply(&at(ms, cordon)).expect("cordon");
    }

    #[test]
    fn a_removal_revokes_what_was_issued_before_it_and_nothing_after() {
        let mut s = two_nodes();
        cordoned(&mut s, 10_000, "n1");
        // A certificate issued from this state (a renewal on the leader, say).
        let renewed = s.worker_certificate_issue_s("n1");
        assert_eq!(renewed, 10);
        // An old-style removal keeps the certificates valid (entries written before the deny
        // list replay as they did).
        let mut old = s.clone();
        old.apply(&at(10_500, Command::RemoveNode { node: "n1".into(), revoke_certificates: false })).expect("remove");
        assert!(!old.worker_certificate_revoked("n1", renewed));

        s.apply(&at(10_500, Command::RemoveNode { node: "n1".into(), revoke_certificates: true })).expect("remove");
        assert!(s.worker_certificate_revoked("n1", renewed), "issued in the same second, before the removal");
        assert!(s.worker_certificate_revoked("n1", 0));
        assert!(!s.worker_certificate_revoked("n2", renewed), "another node");
        // The node joins again: its new certificate is issued after the removal.
        let rejoined = s.worker_certificate_issue_s("n1");
        assert!(!s.worker_certificate_revoked("n1", rejoined));
        assert_eq!(rejoined, 11);

        // Removed again within the same second: the new certificate is refused too.
        s.apply(&at(10_600, Command::RegisterNode { spec: node("n1", 2) })).expect("register");
        cordoned(&mut s, 10_700, "n1");
        s.apply(&at(10_800, Command::RemoveNode { node: "n1".into(), revoke_certificates: true })).expect("remove");
        assert!(s.worker_certificate_revoked("n1", rejoined));
        assert!(!s.worker_certificate_revoked("n1", s.worker_certificate_issue_s("n1")));

        // A refused removal revokes nothing.
        let before = s.revoked_workers.clone();
        assert!(s.apply(&at(20_000, Command::RemoveNode { node: "n2".into(), revoke_certificates: true })).is_err());
        assert_eq!(s.revoked_workers, before);
    }

    #[test]
    fn revocations_are_forgotten_once_every_certificate_they_refuse_expired() {
        let mut s = two_nodes();
        cordoned(&mut s, 1_000, "n1");
        s.apply(&at(2_000, Command::RemoveNode { node: "n1".into(), revoke_certificates: true })).expect("remove");
        let later = 2_000 + super::REVOCATION_RETENTION_S * 1000;
        cordoned(&mut s, later, "n2");
        s.apply(&at(later + 1, Command::RemoveNode { node: "n2".into(), revoke_certificates: true })).expect("remove");
        assert_eq!(s.revoked_workers.keys().collect::<Vec<_>>(), ["n2"]);
    }
}
