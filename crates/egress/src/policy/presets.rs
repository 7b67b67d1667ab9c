//! Named sets of allow rules (`@name`) users can start from; `bulkhead network presets` prints
//! [`presets`].

/// A named set of host rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    /// The name, with its `@`, as written in an allow list.
    pub name: &'static str,
    /// One line saying what it is for.
    pub description: &'static str,
    /// The host rules (`HOST[:PORT]`, the rule syntax).
    pub hosts: &'static [&'static str],
}

const PYPI: &[&str] = &["pypi.org", "files.pythonhosted.org"];
const NPM: &[&str] = &["registry.npmjs.org", "registry.yarnpkg.com"];
const CRATES: &[&str] = &["crates.io", "static.crates.io", "index.crates.io"];
const GO: &[&str] = &["proxy.golang.org", "sum.golang.org"];
const DEBIAN: &[&str] = &["deb.debian.org", "security.debian.org"];
const UBUNTU: &[&str] = &[
    "archive.ubuntu.com",
    "security.ubuntu.com",
    "ports.ubuntu.com",
];
const GITHUB: &[&str] = &[
    "github.com",
    "api.github.com",
    "codeload.github.com",
    "objects.githubusercontent.com",
    "raw.githubusercontent.com",
];
const PACKAGE_REGISTRIES: &[&str] = &[
    "pypi.org",
    "files.pythonhosted.org",
    "registry.npmjs.org",
    "registry.yarnpkg.com",
    "crates.io",
    "static.crates.io",
    "index.crates.io",
    "proxy.golang.org",
    "sum.golang.org",
    "deb.debian.org",
    "security.debian.org",
    "archive.ubuntu.com",
    "security.ubuntu.com",
    "ports.ubuntu.com",
];

const PRESETS: &[Preset] = &[
    Preset {
        name: "@package-registries",
        description: "PyPI, npm, crates.io, Go's module proxy, Debian and Ubuntu archives",
        hosts: PACKAGE_REGISTRIES,
    },
    Preset {
        name: "@pypi",
        description: "Python Package Index (pip, uv, poetry)",
        hosts: PYPI,
    },
    Preset {
        name: "@npm",
        description: "npm registry (npm, yarn, pnpm)",
        hosts: NPM,
    },
    Preset {
        name: "@crates",
        description: "crates.io (cargo): API, downloads and sparse index",
        hosts: CRATES,
    },
    Preset {
        name: "@go",
        description: "Go module proxy and checksum database",
        hosts: GO,
    },
    Preset {
        name: "@debian",
        description: "Debian archive and security updates (apt)",
        hosts: DEBIAN,
    },
    Preset {
        name: "@ubuntu",
        description: "Ubuntu archive, ports and security updates (apt)",
        hosts: UBUNTU,
    },
    Preset {
        name: "@github",
        description: "GitHub: git over HTTPS, API, release and raw downloads (also allows pushes)",
        hosts: GITHUB,
    },
];

/// Every preset, in the order `bulkhead network presets` prints them.
pub fn presets() -> &'static [Preset] {
    PRESETS
}

/// The preset called `name` (with its `@`).
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}
