//! `bulkhead template create | ls | rm`: sandbox templates, snapshots of a booted and prepared
//! sandbox in `<data dir>/templates/<name>/` ([`store`]), from which `bulkhead run --template`
//! and `bulkhead bench --template` restore clones ([`restore`]) instead of booting.

pub(crate) mod create;
pub(crate) mod restore;
pub(crate) mod store;

use std::process::ExitCode;

use crate::run::closed_stdio::print_stdout;
use store::{format_size, Listed, TemplateStore};

/// Longest template name.
pub const MAX_NAME_LEN: usize = 64;

/// Arguments of `bulkhead template`.
#[derive(Debug, clap::Args)]
pub struct TemplateArgs {
    #[command(subcommand)]
    command: TemplateCommand,
}

#[derive(Debug, clap::Subcommand)]
enum TemplateCommand {
    /// Boot a sandbox as `bulkhead run` would, run a preparation command in it, and save it as
    /// template NAME.
    #[command(allow_negative_numbers = true)]
    Create(create::CreateArgs),
    /// List the templates.
    Ls(LsArgs),
    /// Delete templates.
    Rm(RmArgs),
}

#[derive(Debug, clap::Args)]
struct LsArgs {
    /// Print the templates' manifests, with `size_on_disk` in bytes, as a JSON array.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct RmArgs {
    /// Say nothing about names that name no template.
    #[arg(short, long)]
    force: bool,
    /// The templates' names.
    #[arg(required = true, value_name = "NAME")]
    names: Vec<String>,
}

impl TemplateArgs {
    /// Whether the verb only prints a listing (`ls`, `rm`), and so should end silently when its
    /// reader goes away; `create` streams its preparation command's output and handles a closed
    /// stdout itself, as `run` does.
    pub fn dies_of_sigpipe(&self) -> bool {
        !matches!(self.command, TemplateCommand::Create(_))
    }
}

/// Runs `bulkhead template ...`: 0 when done; `create` exits with the preparation command's
/// status when that is not 0; any other failure is 125.
pub fn template(args: TemplateArgs) -> ExitCode {
    let store = TemplateStore::local();
    let result = match args.command {
        TemplateCommand::Create(args) => create::create(&store, &args),
        TemplateCommand::Ls(args) => ls(&store, &args).map(|()| 0),
        TemplateCommand::Rm(args) => Ok(rm(&store, &args)),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("bulkhead: error: {e}");
            ExitCode::from(crate::EXIT_BULKHEAD_ERROR)
        }
    }
}

/// A template name: `[a-z0-9][a-z0-9._-]{0,63}` (it is a directory name, and shows in
/// commands and tables as it is).
///
/// # Errors
/// What is wrong with it.
pub fn parse_name(s: &str) -> Result<String, String> {
    let rule = "a template name is 1 to 64 of a-z, 0-9, `.`, `_` and `-`, starting with a letter \
                or digit";
    let mut chars = s.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || ".-_".contains(c));
    if first_ok && rest_ok && s.len() <= MAX_NAME_LEN {
        Ok(s.to_owned())
    } else {
        Err(format!("{s:?} is not a template name: {rule}"))
    }
}

fn ls(store: &TemplateStore, args: &LsArgs) -> Result<(), String> {
    let (listed, broken) = store.list()?;
    for message in &broken {
        eprintln!("bulkhead: warning: {message}");
    }
    if args.json {
        let json = serde_json::to_string_pretty(&listed).map_err(|e| e.to_string())?;
        return print_stdout(&format!("{json}\n"));
    }
    print_stdout(&ls_table(&listed))
}

/// The `template ls` table: name, memory, vCPUs, creation time and size on disk.
fn ls_table(templates: &[Listed]) -> String {
    let mut out = format!(
        "{:<24} {:>10} {:>5} {:<20} {:>9}\n",
        "NAME", "MEMORY", "VCPUS", "CREATED", "SIZE"
    );
    for t in templates {
        let m = &t.manifest;
        out.push_str(&format!(
            "{:<24} {:>6} MiB {:>5} {:<20} {:>9}\n",
            m.name,
            m.memory_mib,
            m.vcpus,
            m.created,
            format_size(t.size_on_disk)
        ));
    }
    out
}

/// `bulkhead template rm`: deletes each template in turn; a name that names none (or is no
/// template name) is an error, unless `--force`, that does not stop the others, as
/// `bulkhead rm` does. Returns the exit status: 125 when any failed.
fn rm(store: &TemplateStore, args: &RmArgs) -> u8 {
    let mut failed = false;
    for name in &args.names {
        let removed = parse_name(name).and_then(|name| match store.path(&name).exists() {
            false if args.force => Ok(()),
            _ => store.remove(&name),
        });
        if let Err(e) = removed {
            eprintln!("bulkhead: error: {e}");
            failed = true;
        }
    }
    if failed {
        crate::EXIT_BULKHEAD_ERROR
    } else {
        0
    }
}

#[cfg(test)]
mod tests;
