//! Replays the committed corpora through the harnesses (no fuzzer, no nightly toolchain needed):
//! every seed and every reproducer kept in `fuzz/corpus/<target>/` must run clean, and the seed
//! generator's output must match the committed seeds.

use std::path::{Path, PathBuf};

use bulkhead_fuzz::targets::ALL;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

#[test]
fn committed_seeds_match_the_generator() {
    for (target, name, bytes) in bulkhead_fuzz::seeds::all() {
        let path = corpus_dir(target).join(name);
        let committed = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run the gen_seeds example)", path.display()));
        assert!(
            committed == bytes,
            "{} differs from the generator's seed",
            path.display()
        );
    }
}

#[test]
fn every_corpus_file_runs_clean() {
    for (target, run) in ALL {
        let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
            .unwrap_or_else(|e| panic!("corpus of {target}: {e}"))
            .map(|entry| entry.expect("corpus entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "the corpus of {target} is empty");
        for file in files {
            eprintln!("{target}: {}", file.display());
            run(&std::fs::read(&file).expect("read corpus file"));
        }
    }
}
