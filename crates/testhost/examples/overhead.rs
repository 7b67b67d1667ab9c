//! Measures boot-to-ready and the per-command round trip of the test host.
//!
//! `cargo run -p bulkhead-testhost --example overhead [-- --single-tcg]`

use std::time::{Duration, Instant};

use bulkhead_testhost::{TcgThreads, TestHost, TestHostConfig};

fn main() -> Result<(), bulkhead_testhost::Error> {
    let single = std::env::args().any(|a| a == "--single-tcg");
    let host = TestHost::start(TestHostConfig {
        tcg_threads: if single {
            TcgThreads::Single
        } else {
            TcgThreads::Multi
        },
        ..TestHostConfig::default()
    })?;
    println!(
        "boot-to-ready (incl. cached prepare): {:?}",
        host.boot_time()
    );
    let t = Duration::from_secs(60);
    for (label, script) in [
        ("true", "true"),
        ("echo", "echo hi"),
        ("/bin/true exec", "/bin/true"),
    ] {
        host.run(script, t)?;
        let n = 20;
        let started = Instant::now();
        for _ in 0..n {
            host.run(script, t)?;
        }
        println!("{label:>15}: {:?} per command", started.elapsed() / n);
    }
    let started = Instant::now();
    host.shutdown()?;
    println!("shutdown: {:?}", started.elapsed());
    Ok(())
}
