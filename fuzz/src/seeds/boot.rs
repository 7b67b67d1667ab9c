//! Seeds of `boot_params`: the command lines the host writes.

use super::Seed;

/// Seeds of `boot_params`.
pub fn seeds() -> Vec<Seed> {
    let line = |s: &str| s.as_bytes().to_vec();
    vec![
        (
            "boot_params",
            "daemon-image-scratch",
            line(
                "console=ttyS0 reboot=k panic=1 quiet bulkhead.hostname=bh-0123456789ab \
                 bulkhead.root=/dev/vda bulkhead.overlay=/dev/vdb",
            ),
        ),
        (
            "boot_params",
            "clone-workspace-and-mounts",
            line(
                "quiet bulkhead.workspace=workspace:/workspace:clone \
                 bulkhead.mount=mount1:/work bulkhead.mount=mount0:/work/in%20ner%3Adir:ro",
            ),
        ),
        ("boot_params", "plain", line("console=ttyS0 quiet")),
    ]
}
