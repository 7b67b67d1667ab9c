//! Sandboxes restored from a template: `bulkhead run --template NAME` ([`run`]) and the
//! configuration `bulkhead bench --template NAME` restores with ([`restore_recipe`]).
//!
//! A restore gives the clone the template's memory and vCPUs, a fresh hostname, entropy and
//! clock (see `bulkhead_sandbox::snapshot`), and the run's environment, user, working directory,
//! console, limits, mounts and workspace (attached to the template's share slots) and network
//! (an egress proxy of its own); its root filesystem image, if any, is the template's. It cannot
//! yet give it disks or another image.

use bulkhead_sandbox::spec::{egress_settings, hostname_of, limits_of, new_id, resolve_shares};
use bulkhead_sandbox::{
    ExecDefaults, HostSettings, Recipe, Sandbox, SandboxConfig, SandboxSpec, Storage,
};

use super::store::{Template, TemplateManifest, TemplateStore};
use crate::run::{self, limits, RunArgs};
use crate::rundir;
use crate::signals::SignalRouter;

/// Runs `args`' command in a clone of template `name`, as `bulkhead run` runs it in a booted
/// sandbox; returns the exit status for the process.
///
/// # Errors
/// A message for everything that is bulkhead's failure rather than the command's.
pub fn run(args: &RunArgs, name: &str) -> Result<u8, String> {
    let template = TemplateStore::local().open(name)?;
    let id = new_id().map_err(|e| format!("cannot make a sandbox ID: {e}"))?;
    let (vcpus, memory_mib) = sizes(args.machine.vcpus, args.machine.memory, &template.manifest)?;
    let spec = SandboxSpec {
        vcpus,
        memory_mib,
        ..run::sandbox_spec(args)?
    };
    let host = run::host_settings(args, &spec)?;
    let mut recipe = restore_recipe(&spec, &host, &template, &id)?;
    let export_to = crate::run_export::target(
        args.export_patch.as_deref(),
        args.export_tar.as_deref(),
        recipe.config.workspace.as_ref(),
    )?;
    if let Some(console) = &args.console {
        crate::run_export::check_output_file("the console", console)?;
    }
    limits::check_allowed(&recipe)?;
    run::require_bootable_kvm_for(&run::user_words(), args)?;
    let run_dir = rundir::create(&recipe.config.runtime_dir)?;
    recipe.config.runtime_dir = run_dir.path().to_owned();
    let _cgroup = limits::apply(&mut recipe)?;
    let ports = run::publish::bind(&args.publish)?;
    let router = SignalRouter::install(run_dir.path().to_owned())?;
    let mut sandbox = match Sandbox::restore(&recipe.config, &template.dir) {
        Ok(sandbox) => sandbox,
        Err(e) => {
            router.boot_failed();
            return Err(e.to_string());
        }
    };
    let _published = match run::publish::serve(&sandbox, ports) {
        Ok(published) => published,
        Err(e) => {
            let _ = sandbox.destroy_timed();
            return Err(e);
        }
    };
    // With a network, the proxy's variables and the secrets' placeholders exist only now.
    let defaults = recipe.exec.clone().with_network(sandbox.egress_env());
    let request = run::exec_request(args, &defaults);
    let patience = run::agent_patience(args.machine.boot_timeout);
    let outcome = run::execute(&mut sandbox, &request, &router, patience);
    let exported = match (&outcome, &export_to) {
        (Ok(run::Outcome::Exited(_)), Some(target)) => crate::run_export::export(&sandbox, target),
        _ => Ok(()),
    };
    let destroyed = sandbox.destroy_timed();
    let status = outcome?;
    exported?;
    match destroyed {
        Ok(timings) if args.timings => run::print_timings(&timings, Some(name)),
        Ok(_) => {}
        Err(e) => eprintln!("bulkhead: warning: {e}"),
    }
    Ok(run::outcome_code(&status))
}

/// The vCPUs and memory (MiB) of a clone of the template `manifest` describes: the
/// template's. A `--vcpus` or `--memory` given must say the same: a restore cannot change them.
///
/// # Errors
/// Which one differs, and what to do.
pub fn sizes(
    vcpus: Option<u8>,
    memory_mib: Option<u32>,
    manifest: &TemplateManifest,
) -> Result<(u8, u32), String> {
    let name = &manifest.name;
    if let Some(mib) = memory_mib.filter(|m| *m != manifest.memory_mib) {
        return Err(format!(
            "template {name} has {} MiB of guest memory, and a restore cannot change it: leave \
             --memory out, or create a template with --memory {mib}",
            manifest.memory_mib
        ));
    }
    if let Some(n) = vcpus.filter(|n| *n != manifest.vcpus) {
        return Err(format!(
            "template {name} has {} vCPUs, and a restore cannot change them: leave --vcpus out, \
             or create a template with --vcpus {n}",
            manifest.vcpus
        ));
    }
    Ok((manifest.vcpus, manifest.memory_mib))
}

/// The recipe of sandbox `id` restored from `template`: `spec`'s sizes (the template's, see
/// [`sizes`]), hostname, environment, user, working directory, limits, mounts, workspace and
/// network on `host` (VMM, runtime directory, console, timeout, jail, secrets). Its kernel and
/// initramfs are the template's, for the record: a restore reads neither. Nothing is started.
///
/// # Errors
/// An invalid spec (environment, hostname, limits, shares, network rules, unknown secrets).
pub fn restore_recipe(
    spec: &SandboxSpec,
    host: &HostSettings,
    template: &Template,
    id: &str,
) -> Result<Recipe, String> {
    spec.validate().map_err(|e| e.to_string())?;
    let (mounts, workspace) = resolve_shares(spec, host).map_err(|e| e.to_string())?;
    let config = SandboxConfig {
        kernel: template.manifest.kernel.clone(),
        initrd: template.manifest.initrd.clone(),
        vcpus: spec.vcpus,
        memory_mib: spec.memory_mib,
        hostname: Some(hostname_of(spec, id)),
        console: host.console.clone(),
        vmm_binary: host.vmm_binary.clone(),
        runtime_dir: host.runtime_dir.clone(),
        ready_timeout: host.ready_timeout,
        kill_on_parent_exit: host.kill_on_parent_exit,
        jail: host.jail,
        mounts,
        workspace,
        egress: egress_settings(spec, host).map_err(|e| e.to_string())?,
        ..SandboxConfig::default()
    };
    Ok(Recipe {
        id: id.to_owned(),
        config,
        storage: Storage::default(),
        exec: ExecDefaults::of(spec),
        limits: limits_of(spec, host),
        requested_limits: spec.limits,
    })
}
