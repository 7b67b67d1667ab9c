//! `bulkhead template create NAME [-- CMD ARGS...]`: boot a sandbox exactly as `bulkhead run`
//! boots one with the same flags, run the preparation command in it (output streamed, no stdin),
//! and snapshot it into the template store once the command has exited 0.

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use bulkhead_image::manifest::rfc3339_utc;
use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::mounts::MAX_MOUNTS;
use bulkhead_sandbox::spec::new_id;
use bulkhead_sandbox::{Recipe, Sandbox, SandboxSpec};
use bulkhead_vmm::config::DiskConfig;

use super::store::{format_size, size_on_disk, TemplateManifest, TemplateStore};
use crate::machine::MachineArgs;
use crate::run;
use crate::rundir;
use crate::signals::SignalRouter;

/// Arguments of `bulkhead template create`.
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// The template's name: 1 to 64 of a-z, 0-9, `.`, `_`, `-`, starting with a letter or digit.
    #[arg(value_parser = super::parse_name)]
    name: String,
    #[command(flatten)]
    machine: MachineArgs,
    /// Idle shared-directory devices kept in the template, so that `run --template` and
    /// `create --template` can attach --mount directories (and a direct --workspace) to them,
    /// 0 to 8; any slot also gives one for a clone --workspace. Each costs the template a
    /// virtio-fs device and the boot a moment.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SHARE_SLOTS,
          value_parser = clap::value_parser!(u8).range(0..=MAX_MOUNTS as i64))]
    share_slots: u8,
    /// Root filesystem image, as `run --image`: a name from `bulkhead image ls` or the path of
    /// an ext4 file. Its writable layer lives in guest RAM and is saved with the template;
    /// clones open the image file again (read-only), so an image built again under the same
    /// name makes the template unusable (clones refuse to start; make it again).
    #[arg(long, value_name = "NAME|PATH")]
    image: Option<String>,
    /// Keep the writable layer of --image on a scratch disk of this many MiB (as `run --disk`)
    /// instead of guest RAM: for preparations that write more than the guest's memory holds.
    /// The disk is saved with the template (holes kept) and every clone writes to its own copy.
    #[arg(long = "disk", value_name = "MIB", requires = "image", value_parser = run::parse_scratch_mib)]
    scratch_mib: Option<u64>,
    /// Attach a raw disk image as an extra virtio-blk disk, as `run --disk-file` (repeatable).
    /// Read-only (`:ro`): every clone opens the file again and is refused once it changed. Else
    /// the preparation writes to the file itself, and the snapshot saves a copy of it (holes
    /// kept) with the template: every clone writes to its own copy-on-write disk over that
    /// copy, never to the file. Must be a regular file.
    #[arg(long = "disk-file", value_name = "PATH[:ro]")]
    disk_files: Vec<DiskConfig>,
    /// The preparation command and its arguments, run before the snapshot; it must exit 0.
    #[arg(last = true, value_name = "CMD")]
    prepare: Vec<String>,
}

/// Share slots of a template unless `--share-slots` says otherwise.
pub const DEFAULT_SHARE_SLOTS: u8 = 2;

/// Creates the template; returns the exit status: 0, the preparation command's non-zero
/// status, or 128+N when signal N came during the snapshot (nothing is saved then).
///
/// # Errors
/// Bad input (an existing name, missing boot files), a failed boot or snapshot;
/// nothing is left in the store then.
pub fn create(store: &TemplateStore, args: &CreateArgs) -> Result<u8, String> {
    let id = new_id().map_err(|e| format!("cannot make a sandbox ID: {e}"))?;
    // Checked again when the create begins and, atomically, when the template gets its name.
    store.check_free(&args.name)?;
    check_writable_disks(&args.disk_files, store)?;
    let recipe = recipe(args, &id)?;
    run::require_bootable_kvm(&file_dirs(args))?;
    let started = Instant::now();
    let partial = store.begin(&args.name)?;
    let run_dir = rundir::create(&recipe.config.runtime_dir)?;
    let mut config = recipe.config.clone();
    config.runtime_dir = run_dir.path().to_owned();
    config.share_slots = args.share_slots;
    let router = SignalRouter::install(run_dir.path().to_owned())?;
    let mut sandbox = match Sandbox::start_with(&config, &recipe.storage) {
        Ok(sandbox) => sandbox,
        Err(e) => {
            router.boot_failed();
            return Err(e.to_string());
        }
    };
    if !args.prepare.is_empty() {
        let request = prepare_request(&recipe, &args.prepare);
        let patience = run::agent_patience(args.machine.boot_timeout);
        let outcome = run::execute(&mut sandbox, &request, &router, patience);
        let code = outcome.map(|o| run::outcome_code(&o));
        if code != Ok(0) {
            let _ = sandbox.destroy();
            return abort(code, &args.name);
        }
    }
    sandbox
        .snapshot_into(partial.path(), &config)
        .map_err(|e| format!("cannot snapshot the sandbox: {e}"))?;
    if let Some(signal) = router.signal_after_end() {
        // The partial template is removed with `partial`.
        eprintln!(
            "bulkhead: signal {signal} during the snapshot; template {} was not created",
            args.name
        );
        return Ok(u8::try_from(128 + signal).unwrap_or(1));
    }
    manifest(args, &recipe).write(partial.path())?;
    let dir = partial.commit()?;
    eprintln!(
        "bulkhead: template {} created in {:.1} s: {} MiB, {} vCPU, {} on disk",
        args.name,
        started.elapsed().as_secs_f64(),
        config.memory_mib,
        config.vcpus,
        format_size(size_on_disk(&dir))
    );
    Ok(0)
}

/// The preparation command's request: as `bulkhead run` would send it, but without stdin, and
/// with `docker exec`'s end: processes it leaves running (their output redirected away) are
/// kept in the template.
fn prepare_request(recipe: &Recipe, command: &[String]) -> ExecRequest {
    let mut request = recipe
        .exec
        .request(command.to_vec(), &Default::default(), None, None);
    request.stdin = false;
    request.kill_group_on_exit = false;
    request
}

/// The end of a create whose preparation command failed: its non-zero status (a message on
/// stderr), or the run's error.
fn abort(code: Result<u8, String>, name: &str) -> Result<u8, String> {
    let code = code?;
    eprintln!(
        "bulkhead: the preparation command exited with status {code}; template {name} was not \
         created"
    );
    Ok(code)
}

/// The recipe of the template's sandbox `id`: `bulkhead run`'s with the machine flags and
/// `--image` (everything checked, nothing started).
fn recipe(args: &CreateArgs, id: &str) -> Result<Recipe, String> {
    let spec = SandboxSpec {
        image: args.image.as_deref().map(run::image_ref),
        disk_mib: args.scratch_mib,
        disk_files: args.disk_files.clone(),
        ..args.machine.spec()
    };
    bulkhead_sandbox::build(&spec, &args.machine.host(), id).map_err(|e| e.to_string())
}

/// Refuses, before anything boots, a writable data disk that the snapshot could not save (one
/// that is no regular file: a block device) or that belongs to a template of `store` (the
/// preparation would change that template's saved disk under its clones). Missing files are
/// the recipe's to report.
fn check_writable_disks(disks: &[DiskConfig], store: &TemplateStore) -> Result<(), String> {
    let writable = disks.iter().filter(|d| !d.read_only);
    for disk in writable {
        if store.holds(&disk.path) {
            return Err(format!(
                "--disk-file {}: this file belongs to a template; a preparation writing to it \
                 would change that template under its clones (attach it read-only with `:ro`, \
                 or a copy)",
                disk.path.display()
            ));
        }
        let special = std::fs::metadata(&disk.path).is_ok_and(|m| !m.is_file());
        if special {
            return Err(format!(
                "--disk-file {}: a template saves a copy of each writable disk, which only a \
                 regular file allows; attach it read-only (`:ro`) or use a disk image file",
                disk.path.display()
            ));
        }
    }
    Ok(())
}

/// The directories the nested test host must share: the machine flags' files', an image given
/// as a path and the data disks'.
fn file_dirs(args: &CreateArgs) -> Vec<PathBuf> {
    let mut dirs = args.machine.file_dirs();
    let image = args
        .image
        .as_deref()
        .filter(|i| i.contains('/'))
        .map(Path::new);
    let files = image
        .into_iter()
        .chain(args.disk_files.iter().map(|d| d.path.as_path()));
    for file in files {
        let dir = std::path::absolute(file)
            .ok()
            .and_then(|abs| abs.parent().map(Path::to_owned));
        if let Some(dir) = dir.filter(|d| !dirs.contains(d)) {
            dirs.push(dir);
        }
    }
    dirs
}

/// The manifest of the template `args` create.
fn manifest(args: &CreateArgs, recipe: &Recipe) -> TemplateManifest {
    TemplateManifest {
        image: recipe.storage.root_image.as_deref().map(absolute),
        disk_mib: recipe.storage.scratch_mib,
        disk_files: args
            .disk_files
            .iter()
            .map(|d| DiskConfig {
                path: absolute(&d.path),
                ..d.clone()
            })
            .collect(),
        name: args.name.clone(),
        kernel: absolute(&recipe.config.kernel),
        initrd: absolute(&recipe.config.initrd),
        memory_mib: recipe.config.memory_mib,
        vcpus: recipe.config.vcpus,
        created: rfc3339_utc(SystemTime::now()),
        bulkhead_version: env!("CARGO_PKG_VERSION").to_owned(),
        prepare: args.prepare.clone(),
    }
}

/// `path` made absolute against the working directory (as it was when it was booted).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(path: &str, read_only: bool) -> DiskConfig {
        DiskConfig {
            path: path.into(),
            read_only,
            id: None,
            backing: None,
        }
    }

    #[test]
    fn a_templates_own_disk_is_refused_as_a_writable_disk_but_not_read_only() {
        // Arrange: a template store holding a saved disk, reached through a symbolic link too.
        let dir = tempfile::tempdir().unwrap();
        let saved = dir.path().join("templates/t/disk-0.img");
        std::fs::create_dir_all(saved.parent().unwrap()).unwrap();
        std::fs::write(&saved, [0u8; 512]).unwrap();
        let link = dir.path().join("link.img");
        std::os::unix::fs::symlink(&saved, &link).unwrap();
        let store = TemplateStore::new(dir.path().join("templates"));
        let (saved, link) = (saved.to_str().unwrap(), link.to_str().unwrap());

        // Act
        let direct = check_writable_disks(&[disk(saved, false)], &store);
        let linked = check_writable_disks(&[disk(link, false)], &store);
        let read_only = check_writable_disks(&[disk(saved, true)], &store);

        // Assert
        for refused in [direct, linked] {
            let message = refused.unwrap_err();
            assert!(message.contains("belongs to a template"), "{message}");
        }
        assert_eq!(read_only, Ok(()));
    }

    #[test]
    fn a_writable_device_disk_is_refused_before_boot_and_a_read_only_one_or_a_file_is_not() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.img");
        std::fs::write(&file, [0u8; 512]).unwrap();
        let file = file.to_str().unwrap();

        // Act
        let store = TemplateStore::new(dir.path().join("templates"));
        let device = check_writable_disks(&[disk(file, false), disk("/dev/null", false)], &store);
        let read_only_device = check_writable_disks(&[disk("/dev/null", true)], &store);
        let plain = check_writable_disks(&[disk(file, false)], &store);

        // Assert
        let message = device.unwrap_err();
        assert!(
            message.contains("/dev/null") && message.contains("regular file"),
            "{message}"
        );
        assert_eq!(read_only_device, Ok(()));
        assert_eq!(plain, Ok(()));
    }
}
