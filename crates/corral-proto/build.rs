//! Generates the gRPC and protobuf code of the wire protocol (corral.proto, raft.proto) from
//! ../../proto with the vendored protoc, and their file descriptor set (server reflection).
//! state.proto, the persisted format, is corral-raft's.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = ["corral.proto", "raft.proto"].map(|f| dir.join(f));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let descriptors = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("corral_descriptor.bin");
    tonic_prost_build::configure()
        .btree_map(".")
        // A Raft entry's command and a snapshot chunk: shared with the log, not copied.
        .bytes(".corral.raft.v1")
        .file_descriptor_set_path(descriptors)
        .compile_protos(&files, &[dir])?;
    Ok(())
}
