//! Builds an image into a store, printing progress: a stand-in for `bulkhead image build`.
//!
//! ```sh
//! sudo -E cargo run -p bulkhead-image --example build-image -- NAME AGENT_BINARY [DATA_DIR]
//! ```

use std::process::ExitCode;

use bulkhead_image::{BuildSpec, ImageStore};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(name), Some(agent)) = (args.first(), args.get(1)) else {
        eprintln!("usage: build-image NAME AGENT_BINARY [DATA_DIR]");
        return ExitCode::from(2);
    };
    let store = match args.get(2) {
        Some(dir) => ImageStore::new(dir),
        None => match ImageStore::open_default() {
            Ok(store) => store,
            Err(e) => {
                eprintln!("build-image: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let spec = BuildSpec::new(name, agent);
    let result = store.build(&spec, &mut |p| {
        let percent = p.fraction.map(|f| format!("{:3.0}%", f * 100.0));
        eprintln!(
            "[{}] {}",
            percent.unwrap_or_else(|| "    ".into()),
            p.message
        );
    });
    match result {
        Ok(manifest) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&manifest).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("build-image: {e}");
            ExitCode::FAILURE
        }
    }
}
