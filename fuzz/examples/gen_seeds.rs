//! Writes the seed corpora to `fuzz/corpus/<target>/<name>` (or under the directory given as the
//! first argument): `cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds`.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let root = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    for (target, name, bytes) in bulkhead_fuzz::seeds::all() {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), &bytes)?;
        println!("{target}/{name}: {} bytes", bytes.len());
    }
    Ok(())
}
