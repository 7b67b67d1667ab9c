//! `docs/cli.md` checked against clap's command tree, so the reference cannot drift from the
//! code: a flag added without its documentation fails this test, and so does a documented flag
//! that does not exist.
//!
//! The convention of `docs/cli.md`, which is all this test parses:
//!
//! - Every command has a heading `### bulkhead VERB` (`### bulkhead image build` for a nested
//!   one). Its section runs to the next heading of level 1 to 3.
//! - In that section, every flag of the command has a list item that starts with the flag in
//!   backticks, short form first: `` - `--memory MIB`: ... `` or `` - `-e`, `--env K=V`: ... ``.
//!   The items of a section name exactly the command's flags (`--help` and `--version` need
//!   none).
//! - Anywhere on the page, code (an inline code span or a line of a fenced block) that reads
//!   `bulkhead VERB ... --flag ...` must name an existing command and flags of that command. The
//!   check of a command line stops at `--`, a shell operator (`|`, `&&`, `;`, ...) or a comment.
//!   Each code span stays on one line.

use std::collections::BTreeSet;

use clap::CommandFactory;

use crate::Cli;

/// The page under test.
const CLI_MD: &str = include_str!("../../../docs/cli.md");

/// Flags that clap adds and that need no item of their own.
const BUILT_IN: [&str; 4] = ["--help", "-h", "--version", "-V"];

/// One `### bulkhead VERB` section of the page.
#[derive(Debug)]
struct Section {
    /// The command's path below `bulkhead`, words separated by one space ("image build").
    path: String,
    /// 1-based line of the heading.
    line: usize,
    /// The flags its list items name, with their lines.
    flags: Vec<(String, usize)>,
}

/// The command tree, built so that `--help` and `--version` are in it.
fn built(mut root: clap::Command) -> clap::Command {
    root.build();
    root
}

/// Every command below `root`, as paths ("run", "image build"); clap's own `help` is left out.
fn command_paths(cmd: &clap::Command, prefix: &str, out: &mut Vec<String>) {
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let path = format!("{prefix}{}", sub.get_name());
        out.push(path.clone());
        command_paths(sub, &format!("{path} "), out);
    }
}

/// The command at `path` ("image build") below `root`.
fn find<'a>(root: &'a clap::Command, path: &str) -> Option<&'a clap::Command> {
    path.split(' ')
        .try_fold(root, |cmd, word| cmd.find_subcommand(word))
}

/// The flags of `cmd` as written on a command line: `--long` and `-s`.
fn flags_of(cmd: &clap::Command) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for arg in cmd.get_arguments() {
        if arg.is_positional() || arg.is_hide_set() {
            continue;
        }
        if let Some(long) = arg.get_long() {
            flags.insert(format!("--{long}"));
        }
        if let Some(short) = arg.get_short() {
            flags.insert(format!("-{short}"));
        }
    }
    flags
}

/// The flag a code span or command-line word starts with (`--env` of `--env K=V`,
/// `--json` of `--json=x`), if it is one: dashes and then a letter.
fn flag_name(word: &str) -> Option<&str> {
    let rest = word.strip_prefix("--").or_else(|| word.strip_prefix('-'))?;
    if !rest.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return None;
    }
    let word = word.split_whitespace().next()?;
    Some(word.split('=').next().unwrap_or(word))
}

/// The flags a list item names: the code spans it starts with, separated by `, `.
fn item_flags(item: &str) -> Vec<String> {
    let mut flags = Vec::new();
    let mut rest = item;
    while let Some(after) = rest.strip_prefix('`') {
        let Some(end) = after.find('`') else { break };
        match flag_name(&after[..end]) {
            Some(flag) => flags.push(flag.to_owned()),
            None => break,
        }
        match after[end + 1..].strip_prefix(", ") {
            Some(next) => rest = next,
            None => break,
        }
    }
    flags
}

/// The page's `### bulkhead VERB` sections, and the code on it (inline spans and fenced lines)
/// with line numbers; errors for flag items outside a section.
fn parse(doc: &str) -> (Vec<Section>, Vec<(String, usize)>, Vec<String>) {
    let mut sections: Vec<Section> = Vec::new();
    let mut code = Vec::new();
    let mut errors = Vec::new();
    let mut open = false;
    let mut in_fence = false;
    for (i, line) in doc.lines().enumerate() {
        let n = i + 1;
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            code.push((line.to_owned(), n));
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if (1..=3).contains(&level) && line[level..].starts_with(' ') {
            let title = line[level..].trim();
            open = level == 3 && title.starts_with("bulkhead ");
            if open {
                sections.push(Section {
                    path: title["bulkhead ".len()..].trim().to_owned(),
                    line: n,
                    flags: Vec::new(),
                });
            }
        }
        if let Some(item) = line.strip_prefix("- ").filter(|i| i.starts_with("`-")) {
            match sections.last_mut().filter(|_| open) {
                Some(section) => section
                    .flags
                    .extend(item_flags(item).into_iter().map(|f| (f, n))),
                None => errors.push(format!(
                    "docs/cli.md:{n}: a flag item outside a `### bulkhead VERB` section"
                )),
            }
        }
        if line.matches('`').count() % 2 == 1 {
            errors.push(format!(
                "docs/cli.md:{n}: an odd number of backticks (keep each code span on one line)"
            ));
        }
        // Inline code: the odd pieces between backticks.
        code.extend(
            line.split('`')
                .skip(1)
                .step_by(2)
                .map(|span| (span.to_owned(), n)),
        );
    }
    (sections, code, errors)
}

/// Whether `word` ends the command line that a code line shows.
fn ends_command(word: &str) -> bool {
    matches!(word, "--" | "|" | "||" | "&&" | ";" | "&")
        || word.starts_with('#')
        || word.starts_with('>')
        || word.starts_with('<')
        || word.starts_with("2>")
}

/// Checks every `bulkhead ...` command line in `text` (line `n` of the page).
fn check_command_lines(root: &clap::Command, text: &str, n: usize, errors: &mut Vec<String>) {
    let mut from = 0;
    while let Some(at) = text[from..].find("bulkhead ").map(|at| from + at) {
        from = at + "bulkhead ".len();
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || "_-./".contains(c)) {
            continue;
        }
        let mut cmd = root;
        let mut path = String::from("bulkhead");
        let mut saw_flag = false;
        for raw in text[from..].split_whitespace() {
            if ends_command(raw) {
                break;
            }
            let word = raw
                .trim_start_matches(['[', '(', '{'])
                .trim_end_matches("...")
                .trim_end_matches([']', ')', '}', ',', ';']);
            if let Some(flag) = flag_name(word) {
                saw_flag = true;
                let known = flags_of(cmd);
                let unknown: Vec<String> = if flag.starts_with("--") {
                    vec![flag.to_owned()]
                } else {
                    flag[1..].chars().map(|c| format!("-{c}")).collect()
                };
                for flag in unknown.into_iter().filter(|f| !known.contains(f)) {
                    errors.push(format!(
                        "docs/cli.md:{n}: `{path}` has no flag {flag} (in `{}`)",
                        text.trim()
                    ));
                }
            } else if !saw_flag && cmd.has_subcommands() {
                match cmd.find_subcommand(word) {
                    Some(sub) => {
                        cmd = sub;
                        path = format!("{path} {word}");
                    }
                    None => {
                        errors.push(format!(
                            "docs/cli.md:{n}: `{path}` has no subcommand `{word}` (in `{}`)",
                            text.trim()
                        ));
                        break;
                    }
                }
            }
            if raw.ends_with([';', ')']) {
                break;
            }
        }
    }
}

/// Every way `doc` and the command tree under `root` disagree.
fn check(doc: &str, root: clap::Command) -> Vec<String> {
    let root = built(root);
    let (sections, code, mut errors) = parse(doc);
    let mut paths = Vec::new();
    command_paths(&root, "", &mut paths);
    for path in &paths {
        if !sections.iter().any(|s| &s.path == path) {
            errors.push(format!("docs/cli.md has no `### bulkhead {path}` section"));
        }
    }
    let mut seen = BTreeSet::new();
    for section in &sections {
        let heading = format!(
            "docs/cli.md:{}: `### bulkhead {}`",
            section.line, section.path
        );
        if !seen.insert(&section.path) {
            errors.push(format!("{heading} appears twice"));
        }
        let Some(cmd) = find(&root, &section.path) else {
            errors.push(format!("{heading} names no command of `bulkhead --help`"));
            continue;
        };
        let known = flags_of(cmd);
        let documented: BTreeSet<&str> = section.flags.iter().map(|(f, _)| f.as_str()).collect();
        for (flag, n) in &section.flags {
            if !known.contains(flag) {
                errors.push(format!(
                    "docs/cli.md:{n}: `bulkhead {}` has no flag {flag}",
                    section.path
                ));
            }
        }
        for flag in known.iter().filter(|f| !BUILT_IN.contains(&f.as_str())) {
            if !documented.contains(flag.as_str()) {
                errors.push(format!(
                    "{heading}: {flag} has no item (a line starting with \"- `{flag}\")"
                ));
            }
        }
    }
    for (text, n) in &code {
        check_command_lines(&root, text, *n, &mut errors);
    }
    errors
}

/// The errors of `doc` against `root` that the page itself does not have against the real
/// command tree, so that the tests below check the checker whatever state the page is in.
fn new_errors(doc: &str, root: clap::Command) -> Vec<String> {
    let baseline = check(CLI_MD, Cli::command());
    let mut errors = check(doc, root);
    errors.retain(|e| !baseline.contains(e));
    errors
}

#[test]
fn docs_cli_md_documents_exactly_the_flags_of_every_verb() {
    let errors = check(CLI_MD, Cli::command());

    assert!(errors.is_empty(), "docs/cli.md:\n{}", errors.join("\n"));
}

#[test]
fn a_flag_added_without_docs_fails() {
    let root = Cli::command().mut_subcommand("run", |run| {
        run.arg(
            clap::Arg::new("new_flag")
                .long("new-flag")
                .short('Z')
                .action(clap::ArgAction::SetTrue),
        )
    });

    let errors = new_errors(CLI_MD, root);

    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(errors[0].contains("--new-flag has no item"), "{errors:#?}");
    assert!(errors[1].contains("-Z has no item"), "{errors:#?}");
}

#[test]
fn a_verb_added_without_docs_fails() {
    let root = Cli::command().subcommand(clap::Command::new("frobnicate"));

    let errors = new_errors(CLI_MD, root);

    assert_eq!(
        errors,
        ["docs/cli.md has no `### bulkhead frobnicate` section"]
    );
}

#[test]
fn documented_flags_and_verbs_that_do_not_exist_fail() {
    let doc = format!(
        "{CLI_MD}\n### bulkhead frobnicate\n\n- `--fast`: no such verb.\n\n\
         ## Examples\n\n- `--stray`: outside a verb.\n\n\
         Run `bulkhead run --no-such-flag -- true` or `bulkhead exec -i -Q ID -- sh`.\n\n\
         ```sh\nid=$(bulkhead creat --memory 256)\nbulkhead image build debian --sise 512\n```\n"
    );

    let errors = new_errors(&doc, Cli::command());

    let expect = [
        "outside a `### bulkhead VERB` section",
        "`### bulkhead frobnicate` names no command",
        "`bulkhead run` has no flag --no-such-flag",
        "`bulkhead exec` has no flag -Q",
        "`bulkhead` has no subcommand `creat`",
        "`bulkhead image build` has no flag --sise",
    ];
    assert_eq!(errors.len(), expect.len(), "{errors:#?}");
    for (error, expected) in errors.iter().zip(expect) {
        assert!(error.contains(expected), "{error:?} lacks {expected:?}");
    }
}

#[test]
fn items_name_only_their_leading_flags() {
    assert_eq!(
        item_flags("`-e`, `--env K=V`: like `--foo`"),
        ["-e", "--env"]
    );
    assert_eq!(item_flags("`--disk MIB` (with `--image`)"), ["--disk"]);
    assert_eq!(item_flags("`--json=FILE`"), ["--json"]);
    assert!(item_flags("`-` is stdin").is_empty());
}
