//! Generates the cronoq.v1 clients with protox (no protoc needed) from the crate's own proto/,
//! a copy of the repository's that `./dev proto` refreshes (so the packaged crate builds alone);
//! the servers exist only under cfg(test), for the unit tests' in-process fakes.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "proto";
    let files = [
        "cronoq/v1/admin_service.proto",
        "cronoq/v1/schedule_service.proto",
        "cronoq/v1/task.proto",
        "cronoq/v1/task_service.proto",
        "cronoq/v1/worker_service.proto",
    ];
    let fds = protox::compile(files, [proto_dir])?;
    // The servers only for the crate's own unit tests (in-process fakes).
    tonic_prost_build::configure()
        .build_server(true)
        .server_mod_attribute("cronoq.v1", "#[cfg(test)]")
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed={proto_dir}");
    Ok(())
}
