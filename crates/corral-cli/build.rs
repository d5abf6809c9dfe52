//! Link settings of the `corral` binary.

fn main() {
    // Relative relocations packed (DT_RELR, glibc 2.36 and GNU ld 2.38 or lld 15 on): the
    // dynamic loader reads a few KiB of bitmaps at each start instead of 1.3 MiB of RELA
    // entries, 56 000 of them, which every command, `corral --version` included, paid for.
    // The binary stays position-independent (ASLR). An older GNU ld ignores the option with a
    // warning.
    let target = std::env::var("TARGET").unwrap_or_default();
    if target.contains("linux-gnu") {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
