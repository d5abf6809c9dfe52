//! The process's memory allocator, chosen once before its first allocation: mimalloc for the
//! daemons (`corral coordinator`, `corral worker`, `corral dev`), glibc's malloc for every
//! other command.
//!
//! mimalloc serves a long-lived coordinator well: the apply path and the stores allocate and
//! free small buffers at a high rate, and under glibc a quarter of a coordinator's CPU went to
//! malloc and free (arena scans, chunk consolidation) while its freed memory stayed resident in
//! per-thread arenas. A client command lives a few milliseconds and allocates little, and there
//! mimalloc's start (its arenas' bitmaps and first pages: 90 page faults) was a third of what
//! `corral --version` cost. Without transparent huge pages (mimalloc's `no_thp`): with them the
//! first allocations faulted in, and zeroed, two 2 MiB pages.
//!
//! Every allocation and every free of the process must go to the same allocator, so the choice
//! is made once and never changes: by a constructor that reads the command line before `main`
//! (glibc passes `argc, argv` to `.init_array` functions, as std itself reads them), or, were
//! anything to allocate before it runs, by that first allocation, which takes mimalloc for
//! good. Where the command line cannot be read so early (not glibc), everything uses mimalloc.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

const UNDECIDED: u8 = 0;
const MIMALLOC: u8 = 1;
const SYSTEM: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNDECIDED);

/// The commands that run for long and allocate much: they get mimalloc.
const DAEMONS: [&[u8]; 3] = [b"coordinator", b"worker", b"dev"];

/// Whether a command line (its arguments after the program name) starts a daemon: any word
/// before `--` that names one. A client command that merely carries such a word (`corral
/// submit --name worker`) gets mimalloc too, which only costs it its start.
pub(crate) fn runs_daemon<'a>(args: impl IntoIterator<Item = &'a [u8]>) -> bool {
    args.into_iter().take_while(|a| *a != b"--").any(|a| DAEMONS.contains(&a))
}

/// The global allocator: mimalloc or glibc's malloc, as [`CHOICE`] says.
pub(crate) struct ByRole;

impl ByRole {
    #[inline]
    fn mimalloc() -> bool {
        match CHOICE.load(Ordering::Relaxed) {
            MIMALLOC => true,
            SYSTEM => false,
            // The first allocation before the constructor ran: mimalloc from now on.
            _ => match CHOICE.compare_exchange(UNDECIDED, MIMALLOC, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => true,
                Err(chosen) => chosen == MIMALLOC,
            },
        }
    }
}

// SAFETY: each call goes whole to one allocator, and the choice never changes once a call has
// read it, so every block is freed or resized by the allocator that gave it out.
unsafe impl GlobalAlloc for ByRole {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if Self::mimalloc() {
            unsafe { mimalloc::MiMalloc.alloc(layout) }
        } else {
            unsafe { System.alloc(layout) }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if Self::mimalloc() {
            unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
        } else {
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if Self::mimalloc() {
            unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
        } else {
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if Self::mimalloc() {
            unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
        } else {
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }
}

/// Runs before `main` (and before any allocation, unless another constructor allocates first):
/// chooses glibc's malloc for a command that does not start a daemon.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[used]
#[unsafe(link_section = ".init_array")]
static CHOOSE: extern "C" fn(libc::c_int, *const *const libc::c_char, *const *const libc::c_char) = choose;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
extern "C" fn choose(argc: libc::c_int, argv: *const *const libc::c_char, _env: *const *const libc::c_char) {
    let count = usize::try_from(argc).unwrap_or(0);
    if argv.is_null() || count == 0 {
        return;
    }
    // SAFETY: glibc calls `.init_array` functions with the program's `argc` and `argv`: `argc`
    // pointers to NUL-terminated strings. Nothing here allocates.
    let args = (1..count).filter_map(|i| {
        let arg = unsafe { *argv.add(i) };
        (!arg.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(arg) }.to_bytes())
    });
    let chosen = if runs_daemon(args) { MIMALLOC } else { SYSTEM };
    // Lost to an allocation that came first: that one chose, for good.
    let _ = CHOICE.compare_exchange(UNDECIDED, chosen, Ordering::Relaxed, Ordering::Relaxed);
}

/// Which allocator this process uses: `"mimalloc"` or `"glibc"`.
#[cfg(test)]
fn chosen() -> &'static str {
    if ByRole::mimalloc() {
        "mimalloc"
    } else {
        "glibc"
    }
}

#[cfg(test)]
mod tests {
    use super::runs_daemon;

    fn daemon(line: &str) -> bool {
        runs_daemon(line.split_whitespace().map(str::as_bytes))
    }

    #[test]
    fn the_daemons_get_mimalloc_and_client_commands_do_not() {
        assert!(daemon("coordinator --config c.toml"));
        assert!(daemon("worker --config w.toml"));
        assert!(daemon("--endpoint 127.0.0.1:7070 dev --gpus 8"));
        assert!(!daemon("--version"));
        assert!(!daemon("sbatch --hold job.sh"));
        assert!(!daemon("queue --me"));
        assert!(!daemon("worker-guard --cgroup-root /sys/fs/cgroup"));
        assert!(!daemon("submit -- sh -c dev"), "the job's own command is not ours");
        assert!(daemon("node drain worker"), "a word that names a daemon errs towards mimalloc");
    }

    #[test]
    fn a_test_process_allocates_through_the_allocator_its_command_line_chose() {
        // The constructor read this test binary's command line before its first allocation
        // (a filter such as `worker` makes it a "daemon" too).
        let args: Vec<Vec<u8>> = std::env::args().skip(1).map(String::into_bytes).collect();
        let daemon = runs_daemon(args.iter().map(Vec::as_slice));
        let expected =
            if daemon || cfg!(not(all(target_os = "linux", target_env = "gnu"))) { "mimalloc" } else { "glibc" };
        assert_eq!(super::chosen(), expected);
        let v: Vec<u64> = (0..10_000).collect();
        assert_eq!(v.iter().sum::<u64>(), 49_995_000);
        assert_eq!(super::chosen(), expected, "the choice never changes");
    }
}
