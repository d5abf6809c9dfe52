//! NVIDIA's XID catalogue, as far as the worker acts on it: whose fault each XID error is.
//! The one table the worker reads, after NVIDIA's "XID Errors" documentation (the GPU
//! deployment and management guide's table of XIDs and their likely causes).
//!
//! An XID the job causes (an illegal memory access, a bad kernel, its own cleanup) ends or
//! troubles that job only: the card is fine for the next one. A hardware or driver XID means the
//! card cannot be trusted with the run (its results may be wrong, or it stopped): the worker
//! stops the run, it is requeued without counting a restart and credited per policy, and the
//! GPU leaves placement until it checks clean again. An XID the table does not know is logged
//! and otherwise treated as the job's: a catalogue entry (or `health.fatal-xids`) is needed
//! before a code takes a GPU out of the pool.

/// Whose fault an XID error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The application's own error: no action beyond the job's own fate.
    Job,
    /// A hardware or driver fault of the card: the run is stopped and the GPU leaves placement.
    Card,
}

/// One catalogue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Xid {
    pub code: u64,
    pub blame: Blame,
    /// NVIDIA's short description.
    pub what: &'static str,
}

const fn job(code: u64, what: &'static str) -> Xid {
    Xid { code, blame: Blame::Job, what }
}

const fn card(code: u64, what: &'static str) -> Xid {
    Xid { code, blame: Blame::Card, what }
}

/// The catalogue, in code order.
pub const CATALOGUE: &[Xid] = &[
    card(8, "GPU stopped processing"),
    job(13, "graphics engine exception (an illegal instruction or address in the application)"),
    job(31, "GPU memory page fault (the application accessed an illegal address)"),
    card(32, "invalid or corrupted push buffer stream"),
    card(38, "driver firmware error"),
    job(43, "GPU stopped processing (the application's channel was reset)"),
    job(45, "preemptive cleanup after earlier errors (the application was ended)"),
    card(48, "double-bit ECC error"),
    card(56, "display engine error"),
    card(57, "error programming video memory interface"),
    card(58, "unstable video memory interface detected"),
    card(61, "internal micro-controller breakpoint/warning"),
    card(62, "internal micro-controller halt"),
    card(63, "ECC page retirement or row remapping recording event"),
    card(64, "ECC page retirement or row remapping recording failure"),
    job(68, "video processor exception (NVDEC, often bad input)"),
    card(69, "graphics engine class error"),
    card(74, "NVLink error"),
    card(79, "GPU has fallen off the bus"),
    card(92, "high single-bit ECC error rate"),
    card(94, "contained ECC error"),
    card(95, "uncontained ECC error"),
    card(119, "GSP RPC timeout"),
    card(120, "GSP error"),
    card(121, "C2C link corrected error"),
    card(140, "unrecovered ECC error"),
];

/// The catalogue entry of `code`, if NVIDIA documents it here.
pub fn lookup(code: u64) -> Option<&'static Xid> {
    CATALOGUE.binary_search_by_key(&code, |x| x.code).ok().map(|i| &CATALOGUE[i])
}

/// The codes the catalogue blames on the card: `health.fatal-xids` by default.
pub fn card_codes() -> Vec<u64> {
    CATALOGUE.iter().filter(|x| x.blame == Blame::Card).map(|x| x.code).collect()
}

/// One line naming `code` for logs, reports and `corral nodes`: `XID 79 (GPU has fallen off
/// the bus)`.
pub fn describe(code: u64) -> String {
    match lookup(code) {
        Some(x) => format!("XID {code} ({})", x.what),
        None => format!("XID {code} (not in the catalogue)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_is_sorted_without_duplicates() {
        assert!(CATALOGUE.windows(2).all(|w| w[0].code < w[1].code));
    }

    #[test]
    fn application_errors_are_the_jobs_and_hardware_faults_the_cards() {
        for code in [13, 31, 43, 45] {
            assert_eq!(lookup(code).map(|x| x.blame), Some(Blame::Job), "XID {code}");
        }
        for code in [48, 63, 64, 74, 79, 92, 94, 95, 119, 120] {
            assert_eq!(lookup(code).map(|x| x.blame), Some(Blame::Card), "XID {code}");
        }
        assert_eq!(lookup(12345), None);
        assert!(card_codes().contains(&79) && !card_codes().contains(&13));
    }

    #[test]
    fn descriptions_name_the_code() {
        assert_eq!(describe(79), "XID 79 (GPU has fallen off the bus)");
        assert_eq!(describe(7777), "XID 7777 (not in the catalogue)");
    }
}
