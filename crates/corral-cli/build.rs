//! Link settings of the `corral` binary.

fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    if target.contains("linux-gnu") {
        // Position-dependent by default, as Go links its daemons (etcd, the kubelet): a
        // position-independent `corral` spent 1.5 of the 3.4 ms that `corral --version` takes in
        // the dynamic loader, which copies and relocates the 0.9 MiB of pointer tables (vtables,
        // static strings) in every process, client commands included, 240 page faults of the
        // 430. Without it the tables are read from the file as they are touched. The cost is
        // ASLR of the binary's own code and data (libraries, stack and heap stay randomized);
        // `CORRAL_PIE=1 cargo build` keeps it, and packs the relocations (DT_RELR, glibc 2.36
        // and GNU ld 2.38 or lld 15 on) so the loader reads a few KiB of bitmaps instead of
        // 1.3 MiB of RELA entries.
        if std::env::var("CORRAL_PIE").is_ok_and(|v| v == "1") {
            println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
        } else {
            println!("cargo:rustc-link-arg-bins=-no-pie");
        }
    }
    println!("cargo:rerun-if-env-changed=CORRAL_PIE");
    println!("cargo:rerun-if-changed=build.rs");
}
