//! The documentation stays usable: the README stays short, and every relative link in
//! `README.md` and `docs/*.md` leads somewhere.
//!
//! - `README.md` has at most [`README_MAX_LINES`] lines, and no paragraph (a run of non-blank
//!   lines outside fenced code blocks and tables) longer than [`PARAGRAPH_MAX_LINES`].
//! - Every link `[text](target)` and reference definition `[label]: target` outside code, whose
//!   target is not a URL (`scheme://`, `mailto:`), names an existing file or directory relative
//!   to the page; a `#anchor` must be a heading of the target page (GitHub's anchors: lower case,
//!   punctuation dropped, spaces as `-`, `-1`, `-2` ... for repeated headings).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Most lines the README may have.
const README_MAX_LINES: usize = 150;

/// Most lines of one README paragraph.
const PARAGRAPH_MAX_LINES: usize = 12;

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `README.md` and every `docs/*.md`, relative to the root.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| Path::new("docs").join(p.file_name().expect("a file name")))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

fn read(page: &Path) -> String {
    fs::read_to_string(root().join(page)).unwrap_or_else(|e| panic!("{}: {e}", page.display()))
}

/// The page's lines with whether each is inside a fenced code block (fence lines count as
/// inside).
fn lines_with_fences(text: &str) -> Vec<(&str, bool)> {
    let mut in_fence = false;
    text.lines()
        .map(|line| {
            let fence =
                line.trim_start().starts_with("```") || line.trim_start().starts_with("~~~");
            if fence {
                in_fence = !in_fence;
                return (line, true);
            }
            (line, in_fence)
        })
        .collect()
}

/// `line` without its inline code spans.
fn without_code(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut anchors = BTreeSet::new();
    for (line, in_fence) in lines_with_fences(text) {
        let level = line.chars().take_while(|&c| c == '#').count();
        if in_fence || !(1..=6).contains(&level) || !line[level..].starts_with(' ') {
            continue;
        }
        let base = slug(line[level..].trim().trim_end_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while anchors.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        anchors.insert(anchor);
    }
    anchors
}

/// The link targets on a line of text outside code: `](target)` and `[label]: target`.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        // `target "title"`: the target is the first word.
        if let Some(target) = after[..end].split_whitespace().next() {
            targets.push(target.trim_matches(['<', '>']).to_owned());
        }
        rest = &after[end..];
    }
    let trimmed = line.trim_start();
    if let Some(close) = trimmed.find("]: ").filter(|_| trimmed.starts_with('[')) {
        if let Some(target) = trimmed[close + 3..].split_whitespace().next() {
            targets.push(target.trim_matches(['<', '>']).to_owned());
        }
    }
    targets
}

/// What is wrong with `target` on `page`, if anything.
fn check_target(page: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
    let file = if path.is_empty() {
        root().join(page)
    } else {
        root()
            .join(page.parent().unwrap_or(Path::new("")))
            .join(path)
    };
    if !file.exists() {
        return Some(format!("{target}: no such file"));
    }
    let is_markdown = file.extension().is_some_and(|e| e == "md");
    if anchor.is_empty() || !is_markdown {
        return None;
    }
    let text = fs::read_to_string(&file).ok()?;
    (!anchors(&text).contains(anchor))
        .then(|| format!("{target}: no heading with the anchor #{anchor}"))
}

#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let mut errors = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = read(&page);
        for (n, (line, in_fence)) in lines_with_fences(&text).into_iter().enumerate() {
            if in_fence {
                continue;
            }
            for target in link_targets(&without_code(line)) {
                checked += 1;
                if let Some(error) = check_target(&page, &target) {
                    errors.push(format!("{}:{}: {error}", page.display(), n + 1));
                }
            }
        }
    }

    assert!(errors.is_empty(), "broken links:\n{}", errors.join("\n"));
    assert!(
        checked > 20,
        "only {checked} links found: is the parser broken?"
    );
}

#[test]
fn the_readme_is_short() {
    let readme = read(Path::new("README.md"));

    let lines = readme.lines().count();

    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move details to docs/"
    );
}

#[test]
fn no_readme_paragraph_is_longer_than_12_lines() {
    let readme = read(Path::new("README.md"));
    let mut long = Vec::new();
    let mut start = 0;
    let mut len = 0;
    for (n, (line, in_fence)) in lines_with_fences(&readme).into_iter().enumerate() {
        let prose = !in_fence && !line.trim().is_empty() && !line.trim_start().starts_with('|');
        if prose {
            if len == 0 {
                start = n + 1;
            }
            len += 1;
        } else {
            len = 0;
        }
        if len == PARAGRAPH_MAX_LINES + 1 {
            long.push(format!("README.md:{start}"));
        }
    }

    assert!(
        long.is_empty(),
        "paragraphs longer than {PARAGRAPH_MAX_LINES} lines at {long:?}"
    );
}

#[test]
fn the_readme_keeps_the_two_commands() {
    let readme = read(Path::new("README.md"));

    // `.ci/run` runs the test command; a newcomer needs both commands near the top.
    for command in ["scripts/setup.sh", "scripts/test.sh"] {
        assert!(readme.contains(command), "README.md lost {command}");
    }
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug("The data directory and other paths"),
        "the-data-directory-and-other-paths"
    );
    assert_eq!(slug("Configuration (TOML)"), "configuration-toml");
    assert_eq!(slug("bulkhead image build"), "bulkhead-image-build");
    assert_eq!(
        slug("Experiments of 2026-12-02, part 6: Firecracker's reference guest on bulkhead-vmm"),
        "experiments-of-2026-12-02-part-6-firecrackers-reference-guest-on-bulkhead-vmm"
    );
    let page = "# A\n## B `c`\n## B `c`\n```\n# not a heading\n```\n";
    assert_eq!(
        anchors(page),
        BTreeSet::from(["a".into(), "b-c".into(), "b-c-1".into()])
    );
}

#[test]
fn links_are_found_outside_code_only() {
    assert_eq!(
        link_targets(&without_code(
            "see [a](docs/a.md#x) and `[b](nope.md)`, [c](c.md \"title\")"
        )),
        ["docs/a.md#x", "c.md"]
    );
    assert_eq!(link_targets("[ref]: ../x.md"), ["../x.md"]);
}
