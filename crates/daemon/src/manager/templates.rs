//! Sandboxes restored from templates: `"template": NAME` in a create request names a snapshot
//! directory `<state_dir>/templates/NAME/` (`state`, `memory`, `sandbox.json`; what
//! `bulkhead template create` makes, copied or created there by an operator). The sandbox is
//! restored from it instead of booted (`bulkhead_sandbox::Sandbox::restore`), with the
//! template's guest memory and vCPUs, in a cgroup of its own with the limits a boot of that size
//! would get.
//!
//! Every restore maps the template's `memory` file copy-on-write, so the files must stay as they
//! are while sandboxes of the template run: replace a template by creating a new directory and
//! renaming it over the old one, never by rewriting its files in place.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use bulkhead_client::types::{DEFAULT_MEMORY_MIB, DEFAULT_VCPUS};
use bulkhead_client::{CreateSandbox, WorkspaceMode};
use bulkhead_sandbox::snapshot::{Manifest, ShareSlots};

use super::ManagerError;
use crate::config::Config;

/// Longest template name, characters.
pub const MAX_NAME_LEN: usize = 64;

/// A template that a create request names, found and read.
#[derive(Debug, Clone)]
pub struct Template {
    /// Its name.
    pub name: String,
    /// Its directory, `<state_dir>/templates/<name>`.
    pub dir: PathBuf,
    /// Its manifest (`sandbox.json`): memory, vCPUs, the agent's readiness.
    pub manifest: Manifest,
    /// Its share slots: how many mounts (and whether a clone workspace) a restore can attach.
    pub slots: ShareSlots,
}

/// Templates read before, each with the stamps of the files it was read from, so that a create
/// naming one again reads only their metadata. Reading a template parses and digests its state
/// file for the share slots: 2.6-3.2 ms of a pooled create's ~10 ms in the test host.
#[derive(Debug, Default)]
pub struct TemplateCache(Mutex<HashMap<String, Cached>>);

/// A template as read, with the stamps its files had just before.
#[derive(Debug)]
struct Cached {
    stamps: Stamps,
    template: Template,
}

/// Which file, of which size, last changed when (`st_ctime`, which no one can set back): a
/// file that was rewritten, replaced or renamed over has another stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    ctime_s: i64,
    ctime_ns: i64,
}

/// The stamps of the two files a template is read from: its manifest and its state file.
type Stamps = [FileStamp; 2];

/// The files [`resolve`] reads in a template's directory.
const READ_FILES: [&str; 2] = [
    bulkhead_sandbox::snapshot::MANIFEST_FILE,
    bulkhead_vmm::snapshot::STATE_FILE,
];

fn stamps_of(dir: &Path) -> Option<Stamps> {
    let stamp = |file: &str| {
        let m = std::fs::metadata(dir.join(file)).ok()?;
        Some(FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            ctime_s: m.ctime(),
            ctime_ns: m.ctime_nsec(),
        })
    };
    Some([stamp(READ_FILES[0])?, stamp(READ_FILES[1])?])
}

impl TemplateCache {
    /// [`resolve`], from memory when the template's files still have the stamps they had
    /// when it was last read.
    ///
    /// # Errors
    /// Those of [`resolve`].
    pub fn resolve(&self, config: &Config, name: &str) -> Result<Template, ManagerError> {
        let stamps = is_valid_name(name)
            .then(|| stamps_of(&config.templates_dir().join(name)))
            .flatten();
        if let Some(cached) = self.lock().get(name).filter(|c| Some(c.stamps) == stamps) {
            return Ok(cached.template.clone());
        }
        // Stamped before the read: a file that changes during it has a newer stamp next time.
        let template = resolve(config, name)?;
        let mut cache = self.lock();
        match stamps {
            Some(stamps) => {
                let template = template.clone();
                cache.insert(name.to_owned(), Cached { stamps, template });
            }
            None => {
                cache.remove(name);
            }
        }
        Ok(template)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Cached>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether `name` is a template name: 1-64 of `A-Z a-z 0-9 . _ -`, starting with a letter or
/// digit (so it stays one path component inside the templates directory).
pub fn is_valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Finds template `name` in `config`'s templates directory and reads its manifest.
///
/// # Errors
/// [`ManagerError::Invalid`] for a malformed name, [`ManagerError::UnknownName`] (404, naming
/// the templates there are) when there is no such directory, [`ManagerError::Internal`] when
/// the directory is not a readable snapshot.
pub fn resolve(config: &Config, name: &str) -> Result<Template, ManagerError> {
    if !is_valid_name(name) {
        return Err(ManagerError::Invalid(format!(
            "template: invalid name {name:?} (1-{MAX_NAME_LEN} characters of A-Z a-z 0-9 . _ -, \
             starting with a letter or digit)"
        )));
    }
    let root = config.templates_dir();
    let dir = root.join(name);
    if !dir.is_dir() {
        return Err(ManagerError::UnknownName {
            what: "template",
            message: format!(
                "unknown template {name:?}: {} has {} (an operator copies a directory made by \
                 `bulkhead template create` there)",
                root.display(),
                names_text(&root)
            ),
        });
    }
    let manifest = Manifest::read(&dir)
        .map_err(|e| ManagerError::Internal(format!("template {name}: {e}")))?;
    let slots = ShareSlots::of_snapshot(&dir)
        .map_err(|e| ManagerError::Internal(format!("template {name}: {e}")))?;
    Ok(Template {
        name: name.to_owned(),
        dir,
        manifest,
        slots,
    })
}

/// `request` as a restore of `template` can honour it: its vCPUs and memory become the
/// template's (a request's default values mean "the template's").
///
/// # Errors
/// [`ManagerError::Invalid`] for vCPUs or memory other than the template's, for more mounts
/// than the template has share slots (mounts and a workspace are attached to them when it is
/// restored), and for settings a restore cannot honour yet (kernel, image, scratch disk). A
/// `network` is kept: the clone gets an egress proxy of its own.
pub fn fit(request: &CreateSandbox, template: &Template) -> Result<CreateSandbox, ManagerError> {
    let unsupported = [
        ("kernel", request.kernel.is_some()),
        ("image", request.image.is_some()),
        ("disk_mib", request.disk_mib.is_some()),
    ];
    if let Some((field, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(ManagerError::Invalid(format!(
            "{field}: not supported with a template yet (the sandbox continues the template's VM)"
        )));
    }
    let clone_ws = request
        .workspace
        .as_ref()
        .is_some_and(|w| w.mode == WorkspaceMode::Clone);
    let mounts = request.mounts.len() + usize::from(request.workspace.is_some() && !clone_ws);
    template
        .slots
        .check(mounts, clone_ws)
        .map_err(|e| ManagerError::Invalid(format!("template {}: {e}", template.name)))?;
    let m = &template.manifest;
    let vcpus = size(
        ("vcpus", DEFAULT_VCPUS, request.vcpus),
        m.vcpus,
        &template.name,
    )?;
    let memory_mib = size(
        ("memory_mib", DEFAULT_MEMORY_MIB, request.memory_mib),
        m.memory_mib,
        &template.name,
    )?;
    Ok(CreateSandbox {
        vcpus,
        memory_mib,
        ..request.clone()
    })
}

/// The template's value of a size field `(name, default, asked)`: the default asks for it,
/// another value must equal it.
fn size<T: PartialEq + Copy + std::fmt::Display>(
    (field, default, asked): (&str, T, T),
    template_value: T,
    template: &str,
) -> Result<T, ManagerError> {
    if asked == default || asked == template_value {
        return Ok(template_value);
    }
    Err(ManagerError::Invalid(format!(
        "{field}: {asked} differs from template {template}'s {template_value} (a restore cannot \
         change it; leave {field} out to take the template's)"
    )))
}

/// The names of the templates in `root`, sorted, as text for an error message.
fn names_text(root: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.path().is_dir())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|n| is_valid_name(n))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    match names.is_empty() {
        true => "no templates".to_owned(),
        false => format!("the templates {}", names.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use bulkhead_client::MountSpec;
    use bulkhead_protocol::{BootTimestamps, Ready, PROTOCOL_VERSION};

    use super::*;

    fn template(vcpus: u8, memory_mib: u32) -> Template {
        Template {
            name: "py".into(),
            dir: PathBuf::from("/nonexistent"),
            manifest: Manifest {
                bulkhead_version: "0".into(),
                created_unix_ms: 0,
                memory_mib,
                vcpus,
                ready: Ready {
                    version: PROTOCOL_VERSION,
                    agent_version: "0".into(),
                    init_started: BootTimestamps::default(),
                    listening: BootTimestamps::default(),
                },
                disks: Vec::new(),
            },
            slots: ShareSlots {
                mounts: 1,
                workspace: true,
            },
        }
    }

    #[test]
    fn default_sizes_take_the_templates_and_other_sizes_must_match() {
        // Arrange
        let t = template(2, 512);
        let same = CreateSandbox {
            vcpus: 2,
            memory_mib: 512,
            ..CreateSandbox::default()
        };
        let other = CreateSandbox {
            memory_mib: 1024,
            ..CreateSandbox::default()
        };

        // Act
        let defaults = fit(&CreateSandbox::default(), &t).unwrap();
        let same = fit(&same, &t).unwrap();
        let other = fit(&other, &t);

        // Assert
        assert_eq!((defaults.vcpus, defaults.memory_mib), (2, 512));
        assert_eq!((same.vcpus, same.memory_mib), (2, 512));
        let Err(ManagerError::Invalid(message)) = other else {
            panic!("expected a 400: {other:?}");
        };
        assert!(message.contains("memory_mib: 1024 differs"), "{message}");
    }

    #[test]
    fn mounts_pass_to_the_restore_and_disks_are_refused_with_a_template() {
        // Arrange
        let t = template(1, 256);
        let mounts = CreateSandbox {
            mounts: vec![MountSpec {
                host: "/srv".into(),
                guest: "/srv".into(),
                ro: true,
            }],
            ..CreateSandbox::default()
        };
        let disk = CreateSandbox {
            disk_mib: Some(64),
            ..CreateSandbox::default()
        };

        // Act
        let kept = fit(&mounts, &t);
        let refused = fit(&disk, &t);

        let two = CreateSandbox {
            mounts: vec![mounts.mounts[0].clone(), mounts.mounts[0].clone()],
            ..CreateSandbox::default()
        };
        let too_many = fit(&two, &t);

        // Assert
        assert_eq!(kept.unwrap().mounts, mounts.mounts);
        let Err(ManagerError::Invalid(message)) = too_many else {
            panic!("expected a 400: {too_many:?}");
        };
        assert!(message.contains("1 share slots"), "{message}");
        let Err(ManagerError::Invalid(message)) = refused else {
            panic!("expected a 400: {refused:?}");
        };
        assert!(
            message.contains("disk_mib: not supported with a template yet"),
            "{message}"
        );
    }

    #[test]
    fn names_stay_one_path_component() {
        // Arrange / Act / Assert
        assert!(is_valid_name("python-3.12_base"));
        for bad in ["", ".", "..", ".hidden", "a/b", "-x", &"x".repeat(65)] {
            assert!(!is_valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn an_unknown_template_is_a_404_naming_those_there_are() {
        // Arrange
        let state = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(state.path().join("templates/node")).unwrap();
        let config = Config {
            state_dir: state.path().to_owned(),
            ..Config::default()
        };

        // Act
        let result = resolve(&config, "py");

        // Assert
        let Err(ManagerError::UnknownName { what, message }) = result else {
            panic!("expected a 404: {result:?}");
        };
        assert_eq!(what, "template");
        assert!(message.contains("the templates node"), "{message}");
    }
}
