//! Generates the persisted-state messages from ../../proto/state.proto with the vendored protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = dir.join("state.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    prost_build::Config::new()
        .protoc_executable(protoc_bin_vendored::protoc_bin_path()?)
        .btree_map(["."])
        .compile_protos(&[file], &[dir])?;
    Ok(())
}
