//! Compiles the protobuf definitions with `protox` (pure Rust: no system `protoc`) and
//! generates prost messages and tonic services with `tonic-prost-build`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/envoy/service/ratelimit/v3/rls.proto",
        "proto/bursar/allocator/v1/allocator.proto",
        "proto/etcd/v3election.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
