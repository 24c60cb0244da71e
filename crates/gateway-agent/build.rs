//! Generates the Envoy RLS *client* used by the integration tests, from an independent
//! single-file definition of Envoy's protocol (tests/proto/envoy_rls_client.proto), so
//! the test checks our server against field numbers written separately from the
//! server's own .proto (crates/proto). protox: no system protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "tests/proto/envoy_rls_client.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["tests/proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
