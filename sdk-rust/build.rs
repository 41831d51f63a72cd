//! Generates the cronoq.v1 client from ../proto with protox (no protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "../proto";
    let files = [
        "cronoq/v1/task.proto",
        "cronoq/v1/task_service.proto",
        "cronoq/v1/worker_service.proto",
    ];
    let fds = protox::compile(files, [proto_dir])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed={proto_dir}");
    Ok(())
}
