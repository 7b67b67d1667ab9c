//! The kernel modules the test host loads, and the order to `insmod` them in.
//!
//! A Debian kernel package ships no `modules.dep` (`depmod` runs at install time, and we never install), so the
//! dependency chain is read from each module's own `.modinfo` ELF section: its `depends=` entry names the
//! modules whose symbols it uses (see `scripts/mod/modpost.c` in the kernel). Whether a wanted driver is a
//! module at all comes from the package's `/boot/config-*`: `=y` means built in (nothing to load), `=m` means
//! a `.ko` file to load.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

/// Errors from reading the kernel configuration or module files.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// The kernel configuration enables a needed driver neither as module nor built in.
    #[error("kernel config has CONFIG_{symbol}={value:?}; the test host needs it =y or =m")]
    MissingConfig {
        /// Kconfig symbol without the `CONFIG_` prefix.
        symbol: String,
        /// Its value, or "unset".
        value: String,
    },
    /// A module named by the configuration or a `depends=` entry has no `.ko` file in the package.
    #[error("kernel module {0}.ko not found in the kernel package")]
    NotFound(String),
    /// A `.ko` file is not a little-endian ELF64 object with a `.modinfo` section.
    #[error("{path}: not a usable kernel module: {reason}")]
    BadModule {
        /// The module file.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two modules depend on each other.
    #[error("kernel module dependency cycle through {0}")]
    Cycle(String),
    /// Reading a file or directory failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A driver the test host needs, named by its module name and the Kconfig symbol that builds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WantedDriver {
    /// Module name as the kernel spells it (`-` normalized to `_`).
    pub module: &'static str,
    /// Kconfig symbol without the `CONFIG_` prefix.
    pub config: &'static str,
}

/// Drivers the test host loads: KVM for AMD SVM (TCG's `-cpu max` emulates SVM, not VMX), 9p over
/// virtio-pci for the shares, and virtio-console for the control channel. Their dependencies (irqbypass, kvm, ccp, netfs, fscache, 9pnet, virtio,
/// virtio_ring, ...) are found from `.modinfo`, so they are not listed here.
pub const WANTED_DRIVERS: &[WantedDriver] = &[
    WantedDriver {
        module: "kvm_amd",
        config: "KVM_AMD",
    },
    WantedDriver {
        module: "virtio_pci",
        config: "VIRTIO_PCI",
    },
    WantedDriver {
        module: "9pnet_virtio",
        config: "NET_9P_VIRTIO",
    },
    WantedDriver {
        module: "9p",
        config: "9P_FS",
    },
    WantedDriver {
        module: "virtio_console",
        config: "VIRTIO_CONSOLE",
    },
];

/// Normalizes a module or file name to the kernel's module name (`kvm-amd` → `kvm_amd`).
pub fn module_name(name: &str) -> String {
    name.replace('-', "_")
}

/// Parses a kernel `.config` into `symbol → value` (symbols without `CONFIG_`; "is not set" lines → `n`).
pub fn parse_kconfig(text: &str) -> HashMap<String, String> {
    let mut map = HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("CONFIG_") {
            if let Some((sym, val)) = rest.split_once('=') {
                map.insert(sym.to_string(), val.trim_matches('"').to_string());
            }
        } else if let Some(rest) = line.strip_prefix("# CONFIG_") {
            if let Some(sym) = rest.strip_suffix(" is not set") {
                map.insert(sym.to_string(), "n".to_string());
            }
        }
    }
    map
}

/// Returns the module names among `wanted` that the configuration builds as modules (`=m`), in order.
/// Built-in (`=y`) drivers are skipped; anything else is an error.
pub fn modular_roots(
    config: &HashMap<String, String>,
    wanted: &[WantedDriver],
) -> Result<Vec<String>, ModuleError> {
    let mut roots = Vec::new();
    for w in wanted {
        match config.get(w.config).map(String::as_str) {
            Some("m") => roots.push(w.module.to_string()),
            Some("y") => {}
            other => {
                return Err(ModuleError::MissingConfig {
                    symbol: w.config.to_string(),
                    value: other.unwrap_or("unset").to_string(),
                })
            }
        }
    }
    Ok(roots)
}

/// Orders `roots` and their transitive dependencies so that every module comes after all it depends on.
///
/// `depends_of` returns a module's direct dependencies. The order is deterministic: a depth-first post-order
/// that visits roots and each module's dependencies in the order given.
pub fn load_order<F>(roots: &[String], mut depends_of: F) -> Result<Vec<String>, ModuleError>
where
    F: FnMut(&str) -> Result<Vec<String>, ModuleError>,
{
    #[derive(PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    // Iterative DFS: (module, its deps, next dep index).
    let mut marks: HashMap<String, Mark> = HashMap::new();
    let mut order = Vec::new();
    for root in roots {
        if marks.contains_key(root) {
            continue;
        }
        let mut stack = vec![(root.clone(), depends_of(root)?, 0usize)];
        marks.insert(root.clone(), Mark::Visiting);
        while let Some((name, deps, next)) = stack.last_mut() {
            if let Some(dep) = deps.get(*next).cloned() {
                *next += 1;
                match marks.get(&dep) {
                    Some(Mark::Done) => {}
                    Some(Mark::Visiting) => return Err(ModuleError::Cycle(dep)),
                    None => {
                        let dep_deps = depends_of(&dep)?;
                        marks.insert(dep.clone(), Mark::Visiting);
                        stack.push((dep, dep_deps, 0));
                    }
                }
            } else {
                let name = name.clone();
                marks.insert(name.clone(), Mark::Done);
                order.push(name);
                stack.pop();
            }
        }
    }
    Ok(order)
}

/// Reads the `depends=` list from the `.modinfo` section of an ELF64 little-endian kernel module image.
pub fn modinfo_depends(elf: &[u8]) -> Result<Vec<String>, &'static str> {
    let modinfo = elf_section(elf, ".modinfo")?;
    let depends = modinfo
        .split(|b| *b == 0)
        .find_map(|entry| entry.strip_prefix(b"depends="))
        .unwrap_or(b"");
    let text = std::str::from_utf8(depends).map_err(|_| "depends= is not UTF-8")?;
    Ok(text
        .split(',')
        .filter(|s| !s.is_empty())
        .map(module_name)
        .collect())
}

/// Reads a little-endian integer of `N` bytes at `off`.
fn le<const N: usize>(data: &[u8], off: usize) -> Result<u64, &'static str> {
    let bytes = data
        .get(off..off.checked_add(N).ok_or("offset overflow")?)
        .ok_or("truncated ELF")?;
    Ok(bytes
        .iter()
        .rev()
        .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// Returns the contents of the section called `wanted` (ELF64, little endian; see the System V ABI gABI).
fn elf_section<'a>(elf: &'a [u8], wanted: &str) -> Result<&'a [u8], &'static str> {
    if elf.get(0..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return Err("not a little-endian ELF64 file");
    }
    let shoff = le::<8>(elf, 0x28)? as usize;
    let shentsize = le::<2>(elf, 0x3a)? as usize;
    let shnum = le::<2>(elf, 0x3c)? as usize;
    let shstrndx = le::<2>(elf, 0x3e)? as usize;
    let header = |i: usize| -> Result<(u64, &'a [u8]), &'static str> {
        let base = shoff + i * shentsize;
        let name = le::<4>(elf, base)?;
        let off = le::<8>(elf, base + 24)? as usize;
        let size = le::<8>(elf, base + 32)? as usize;
        let data = elf
            .get(off..off.checked_add(size).ok_or("size overflow")?)
            .ok_or("section outside file")?;
        Ok((name, data))
    };
    let (_, strtab) = header(shstrndx)?;
    for i in 0..shnum {
        let (name_off, data) = header(i)?;
        let name = strtab
            .get(name_off as usize..)
            .and_then(|s| s.split(|b| *b == 0).next())
            .ok_or("bad section name")?;
        if name == wanted.as_bytes() {
            return Ok(data);
        }
    }
    Err("no .modinfo section")
}

/// Maps module name → `.ko` path for every module under `dir` (recursively).
pub fn index_modules(dir: &Path) -> Result<BTreeMap<String, PathBuf>, ModuleError> {
    let mut index = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let entries = fs::read_dir(&d).map_err(|source| ModuleError::Io {
            path: d.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| ModuleError::Io {
                path: d.clone(),
                source,
            })?;
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Some(stem) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".ko"))
            {
                index.insert(module_name(stem), path);
            }
        }
    }
    Ok(index)
}

/// Resolves the modules the test host loads from an extracted kernel package: returns `(name, .ko path)`
/// in load order. `modules_dir` is `lib/modules/<release>/kernel`, `config` the package's `boot/config-*`.
pub fn resolve(modules_dir: &Path, config: &Path) -> Result<Vec<(String, PathBuf)>, ModuleError> {
    let text = fs::read_to_string(config).map_err(|source| ModuleError::Io {
        path: config.to_path_buf(),
        source,
    })?;
    let roots = modular_roots(&parse_kconfig(&text), WANTED_DRIVERS)?;
    let index = index_modules(modules_dir)?;
    let path_of = |name: &str| {
        index
            .get(name)
            .cloned()
            .ok_or_else(|| ModuleError::NotFound(name.to_string()))
    };
    let order = load_order(&roots, |name| {
        let path = path_of(name)?;
        let elf = fs::read(&path).map_err(|source| ModuleError::Io {
            path: path.clone(),
            source,
        })?;
        modinfo_depends(&elf).map_err(|reason| ModuleError::BadModule { path, reason })
    })?;
    order
        .into_iter()
        .map(|name| Ok((name.clone(), path_of(&name)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a minimal ELF64 LE image with a `.shstrtab` and a `.modinfo` holding `modinfo`.
    fn fake_module(modinfo: &[u8]) -> Vec<u8> {
        let shstrtab = b"\0.shstrtab\0.modinfo\0";
        let mut elf = vec![0u8; 64];
        elf[0..6].copy_from_slice(b"\x7fELF\x02\x01");
        let strtab_off = elf.len();
        elf.extend_from_slice(shstrtab);
        let modinfo_off = elf.len();
        elf.extend_from_slice(modinfo);
        let shoff = elf.len();
        let mut section = |name: u32, off: usize, size: usize| {
            let mut sh = [0u8; 64];
            sh[0..4].copy_from_slice(&name.to_le_bytes());
            sh[24..32].copy_from_slice(&(off as u64).to_le_bytes());
            sh[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            elf.extend_from_slice(&sh);
        };
        section(0, 0, 0);
        section(1, strtab_off, shstrtab.len());
        section(11, modinfo_off, modinfo.len());
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        elf
    }

    fn deps_table(table: &[(&str, &[&str])]) -> HashMap<String, Vec<String>> {
        table
            .iter()
            .map(|(m, d)| (m.to_string(), d.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    #[test]
    fn modinfo_depends_reads_and_normalizes_the_list() {
        // Arrange
        let elf = fake_module(b"license=GPL\0depends=kvm,ccp,irq-bypass\0name=kvm_amd\0");

        // Act
        let deps = modinfo_depends(&elf).unwrap();

        // Assert
        assert_eq!(deps, vec!["kvm", "ccp", "irq_bypass"]);
    }

    #[test]
    fn modinfo_with_empty_depends_has_no_dependencies() {
        // Arrange
        let elf = fake_module(b"depends=\0name=irqbypass\0");

        // Act
        let deps = modinfo_depends(&elf).unwrap();

        // Assert
        assert!(deps.is_empty());
    }

    #[test]
    fn truncated_elf_is_rejected_not_panicking() {
        // Arrange
        let mut elf = fake_module(b"depends=kvm\0");
        elf.truncate(100);

        // Act
        let result = modinfo_depends(&elf);

        // Assert
        assert!(result.is_err());
    }

    #[test]
    fn load_order_puts_dependencies_first_like_the_debian_kvm_chain() {
        // Arrange: the chain measured in linux-image-6.1.0-57-amd64.
        let table = deps_table(&[
            ("kvm_amd", &["kvm", "ccp"]),
            ("kvm", &["irqbypass"]),
            ("ccp", &[]),
            ("irqbypass", &[]),
            ("9p", &["9pnet", "fscache", "netfs"]),
            ("fscache", &["netfs"]),
            ("netfs", &[]),
            ("9pnet", &[]),
        ]);
        let roots = vec!["kvm_amd".to_string(), "9p".to_string()];

        // Act
        let order = load_order(&roots, |m| Ok(table[m].clone())).unwrap();

        // Assert
        assert_eq!(
            order,
            vec![
                "irqbypass",
                "kvm",
                "ccp",
                "kvm_amd",
                "9pnet",
                "netfs",
                "fscache",
                "9p"
            ]
        );
    }

    #[test]
    fn shared_dependencies_are_loaded_once() {
        // Arrange
        let table = deps_table(&[
            ("virtio_pci", &["virtio_ring", "virtio"]),
            ("9pnet_virtio", &["virtio", "virtio_ring"]),
            ("virtio", &["virtio_ring"]),
            ("virtio_ring", &[]),
        ]);
        let roots = vec!["virtio_pci".to_string(), "9pnet_virtio".to_string()];

        // Act
        let order = load_order(&roots, |m| Ok(table[m].clone())).unwrap();

        // Assert
        assert_eq!(
            order,
            vec!["virtio_ring", "virtio", "virtio_pci", "9pnet_virtio"]
        );
    }

    #[test]
    fn dependency_cycle_is_an_error() {
        // Arrange
        let table = deps_table(&[("a", &["b"]), ("b", &["a"])]);

        // Act
        let result = load_order(&["a".to_string()], |m| Ok(table[m].clone()));

        // Assert
        assert!(matches!(result, Err(ModuleError::Cycle(m)) if m == "a"));
    }

    #[test]
    fn built_in_drivers_are_skipped_and_modules_kept() {
        // Arrange
        let config = parse_kconfig(
            "CONFIG_KVM_AMD=m\nCONFIG_VIRTIO_PCI=y\nCONFIG_NET_9P_VIRTIO=m\nCONFIG_9P_FS=m\n\
             CONFIG_VIRTIO_CONSOLE=y\n",
        );

        // Act
        let roots = modular_roots(&config, WANTED_DRIVERS).unwrap();

        // Assert
        assert_eq!(roots, vec!["kvm_amd", "9pnet_virtio", "9p"]);
    }

    #[test]
    fn disabled_driver_is_reported_by_symbol() {
        // Arrange
        let config = parse_kconfig("# CONFIG_KVM_AMD is not set\n");

        // Act
        let result = modular_roots(&config, WANTED_DRIVERS);

        // Assert
        assert!(
            matches!(result, Err(ModuleError::MissingConfig { symbol, value })
            if symbol == "KVM_AMD" && value == "n")
        );
    }
}
