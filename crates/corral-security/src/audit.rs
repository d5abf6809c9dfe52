//! The audit log: one JSON line per denial or admin action, appended to a file (tests and
//! operators read it) and logged under the tracing target `corral::audit`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One audited event.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AuditEvent {
    /// "denied" or "admin".
    pub outcome: &'static str,
    /// What was attempted: a gRPC method ("/corral.v1.Corral/CancelJob") or "tls-handshake".
    pub action: String,
    /// Who: the peer's role and name and address, and the token's tenant when known.
    pub peer: String,
    pub principal: String,
    /// Why it was refused, or what the admin action did.
    pub detail: String,
}

impl AuditEvent {
    pub fn denied(
        action: impl Into<String>,
        peer: impl Into<String>,
        principal: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self::new("denied", action.into(), peer.into(), principal.into(), detail.into())
    }

    pub fn admin(
        action: impl Into<String>,
        peer: impl Into<String>,
        principal: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self::new("admin", action.into(), peer.into(), principal.into(), detail.into())
    }

    fn new(outcome: &'static str, action: String, peer: String, principal: String, detail: String) -> Self {
        AuditEvent { outcome, action, peer, principal, detail }
    }
}

/// Appends audit events to `<dir>/audit.jsonl` (or only logs them, without a file).
#[derive(Debug, Default)]
pub struct AuditLog {
    path: Option<PathBuf>,
    file: Mutex<Option<std::fs::File>>,
}

#[derive(serde::Serialize)]
struct Line<'a> {
    ts_ms: u64,
    #[serde(flatten)]
    event: &'a AuditEvent,
}

impl AuditLog {
    /// Audit into `<dir>/audit.jsonl`.
    pub fn in_dir(dir: &Path) -> AuditLog {
        AuditLog { path: Some(dir.join("audit.jsonl")), file: Mutex::new(None) }
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn record(&self, event: AuditEvent) {
        tracing::warn!(
            target: "corral::audit",
            outcome = event.outcome,
            action = %event.action,
            peer = %event.peer,
            principal = %event.principal,
            detail = %event.detail,
            "audit"
        );
        let Some(path) = &self.path else { return };
        let ts_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let Ok(mut text) = serde_json::to_string(&Line { ts_ms, event: &event }) else { return };
        text.push('\n');
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if file.is_none() {
            let mut options = std::fs::OpenOptions::new();
            options.create(true).append(true);
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            match options.open(path) {
                Ok(f) => *file = Some(f),
                Err(e) => {
                    tracing::error!(target: "corral::audit", path = %path.display(), error = %e, "cannot open the audit log");
                    return;
                }
            }
        }
        if let Some(f) = file.as_mut() {
            if let Err(e) = f.write_all(text.as_bytes()) {
                tracing::error!(target: "corral::audit", path = %path.display(), error = %e, "cannot append to the audit log");
                *file = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_appended_as_json_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = AuditLog::in_dir(dir.path());
        log.record(AuditEvent::denied(
            "/corral.v1.Corral/CancelJob",
            "client c at 127.0.0.1:1",
            "tenant team-a",
            "not yours",
        ));
        log.record(AuditEvent::admin("token-create", "admin a", "admin", "tenant team-b"));
        let text = std::fs::read_to_string(dir.path().join("audit.jsonl")).expect("audit file");
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["outcome"], "denied");
        assert_eq!(lines[0]["principal"], "tenant team-a");
        assert_eq!(lines[1]["outcome"], "admin");
        assert!(lines[1]["ts_ms"].as_u64().is_some());
    }
}
