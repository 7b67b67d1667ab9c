//! `containerd-shim-bulkhead-v2`: containerd starts it for runtime `io.containerd.bulkhead.v2`
//! (see `docs/kubernetes.md`).

use bulkhead_shim::shim::BulkheadShim;
use bulkhead_shim::RUNTIME_NAME;

#[tokio::main]
async fn main() {
    if std::env::args()
        .skip(1)
        .any(|a| a == "-v" || a == "--version" || a == "-version")
    {
        println!(
            "containerd-shim-bulkhead-v2 {} ({RUNTIME_NAME})",
            env!("CARGO_PKG_VERSION")
        );
        return;
    }
    // containerd starts a shim with its ttrpc address in the environment; without it (a shim
    // run by hand) containerd-shim would only print `Env(NotPresent)`.
    if std::env::var_os("TTRPC_ADDRESS").is_none() {
        eprintln!(
            "containerd-shim-bulkhead-v2: containerd starts this shim for runtime {RUNTIME_NAME} \
             (TTRPC_ADDRESS is not set: it was not started by containerd); see \
             docs/kubernetes.md. `-v` prints its version."
        );
        std::process::exit(2);
    }
    // The shim reaps nothing implicitly: each VMM is the child of the sandbox that started it,
    // which waits for it itself (an implicit `waitpid(-1)` on SIGCHLD would take its status).
    let config = containerd_shim::Config {
        no_reaper: true,
        ..Default::default()
    };
    containerd_shim::asynchronous::run::<BulkheadShim>(RUNTIME_NAME, Some(config)).await;
}
