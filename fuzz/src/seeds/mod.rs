//! The seed corpora: a handful of valid inputs per target, built with the same encoders the
//! harnesses decode with. `cargo run --example gen_seeds` writes them to `fuzz/corpus/<target>/`;
//! the corpus replay test checks that the committed files still match.
//!
//! Each seed is one normal use of its door (a read, a connection, a device bring-up, a FUSE
//! session, an exec answer) so that the fuzzer starts from deep, valid states and mutates from
//! there.

mod agent;
mod archive;
mod boot;
mod devices;
mod fs;
mod snapshot;

/// One seed: target name, file name, contents.
pub type Seed = (&'static str, &'static str, Vec<u8>);

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut seeds = Vec::new();
    seeds.extend(devices::blk());
    seeds.extend(devices::vsock());
    seeds.extend(devices::mmio());
    seeds.extend(fs::seeds());
    seeds.extend(agent::seeds());
    seeds.extend(boot::seeds());
    seeds.extend(snapshot::seeds());
    seeds.extend(archive::seeds());
    seeds
}
