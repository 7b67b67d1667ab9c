//! Kubernetes' view of the containerd shim: containerd's CRI plugin, driven as the kubelet drives
//! it (`bulkhead-cri-check`, tests/cri), runs pods with the runtime handler `bulkhead` in the
//! test host, through `scripts/containerd-demo.sh --cri`.

use bulkhead_tests::containerd::demo;
use bulkhead_tests::{describe, guest_test};

guest_test!(
    fn cri_pods_get_one_microvm_each_shared_by_their_containers_and_go_with_it() {
        // Arrange
        let client = bulkhead_tests::profile_dir().join("bulkhead-cri-check");
        let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let client = client.to_str().unwrap();

        // Act: two pods (a: containers a1 and a2; b: b1), ExecSync in each, then both removed.
        let run = demo(&["--cri"], &[client]).output().unwrap();

        // Assert
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        let shown = describe(&run);
        assert!(run.status.success(), "{shown}");
        let field = |line: &str, key: &str| -> String {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(line))
                .unwrap_or_else(|| panic!("no {line} line: {shown}"));
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{key}=")))
                .unwrap_or_else(|| panic!("no {key}= in {line:?}: {shown}"))
                .to_owned()
        };
        // The containers of a pod share its VM (one guest boot); another pod has its own.
        let (a1, a2, b1) = (
            field("boot:", "a1"),
            field("boot:", "a2"),
            field("boot:", "b1"),
        );
        assert_eq!(a1.len(), 36, "{shown}");
        assert_eq!(a1, a2, "{shown}");
        assert_ne!(a1, b1, "{shown}");
        let kernel = stdout.lines().find_map(|l| l.strip_prefix("kernel: "));
        assert!(
            kernel.is_some_and(|k| !k.is_empty() && k != host_release.trim()),
            "{shown}"
        );
        // ExecSync carries stdout, stderr and the exit code.
        assert!(
            stdout.contains("exec: code=3 stdout=out stderr=err"),
            "{shown}"
        );
        // UpdateContainerResources reaches the pod VM's cgroup: 1 GiB plus the VMM's allowance,
        // a quota of 1.5 CPUs, 512 shares as a weight; 64 MiB, below the guest's RAM, is refused.
        let memory =
            (1024 + u64::from(bulkhead_sandbox::spec::DEFAULT_VMM_MEMORY_OVERHEAD_MIB)) << 20;
        assert!(
            stdout.contains(&format!(
                "update: ok=true memory.max={memory} cpu.max=150000 100000 cpu.weight=20"
            )),
            "{shown}"
        );
        assert!(stdout.contains("update-below-ram: refused"), "{shown}");
        // One VMM per pod while they run; none once they are removed.
        assert!(stdout.contains("vmms: running=2 after=0"), "{shown}");
    }
);
