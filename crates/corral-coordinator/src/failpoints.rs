//! Failpoints for tests: with the `failpoints` feature, `FAILPOINTS` (`name=action;...`, the
//! fail crate's syntax) configures them once per process; without it, nothing is read.

/// Configures the failpoints named in `FAILPOINTS`, once per process.
#[cfg(feature = "failpoints")]
pub(crate) fn setup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(spec) = std::env::var("FAILPOINTS") else { return };
        for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((name, action)) = entry.split_once('=') else {
                tracing::error!(entry, "FAILPOINTS entries are name=action");
                continue;
            };
            match fail::cfg(name.trim(), action.trim()) {
                Ok(()) => tracing::warn!(failpoint = name.trim(), action = action.trim(), "failpoint configured"),
                Err(e) => tracing::error!(entry, error = %e, "bad failpoint action"),
            }
        }
    });
}

/// Release builds: failpoints compile to nothing and the environment is not read.
#[cfg(not(feature = "failpoints"))]
pub(crate) fn setup() {}
