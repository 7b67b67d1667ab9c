//! The writes a guest tries on a read-only share, shared by the virtio-fs tests and the escape
//! suite.

/// Every kind of write tried on a read-only share, as shell commands run in the share's root,
/// which holds the file `a.txt` and the directory `sub/` (with `b.txt` in it). Each must fail.
pub const WRITE_ATTEMPTS: [&str; 13] = [
    "echo x > new",
    "echo x > a.txt",
    "echo x >> a.txt",
    "truncate -s 0 a.txt",
    "mv a.txt moved",
    "rm a.txt",
    "mkdir newdir",
    "rmdir sub",
    "ln -s a.txt symlink",
    "ln a.txt hardlink",
    "chmod 600 a.txt",
    "touch a.txt",
    "mknod fifo p",
];

/// A shell script that runs each of `attempts` in a subshell and prints exactly one line per
/// attempt: `OK <attempt>` when it succeeded, else `ERR <attempt>: <its output on one line>`.
pub fn attempts_script(attempts: &[&str]) -> String {
    attempts
        .iter()
        .map(|op| {
            format!(
                "if out=$( ({op}) 2>&1); then echo \"OK {op}\"; \
                 else echo \"ERR {op}: $out\" | tr '\\n' ' '; echo; fi\n"
            )
        })
        .collect()
}
