use super::*;

/// A `config.json` as containerd writes it for `ctr run`, trimmed to what matters here, with
/// `extra` merged into its top level.
fn spec(extra: serde_json::Value) -> Spec {
    let mut doc = serde_json::json!({
        "ociVersion": "1.1.0",
        "process": {
            "terminal": true,
            "consoleSize": { "height": 40, "width": 120 },
            "user": { "uid": 1000, "gid": 1001, "additionalGids": [10, 20] },
            "args": ["sh", "-c", "echo hi"],
            "env": ["PATH=/bin:/usr/bin", "TERM=xterm"],
            "cwd": "/srv",
            "rlimits": [{ "type": "RLIMIT_NOFILE", "hard": 1024, "soft": 512 }],
            "noNewPrivileges": true
        },
        "root": { "path": "rootfs" },
        "linux": {}
    });
    if let (Some(doc), Some(extra)) = (doc.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            doc.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(doc).unwrap()
}

fn place(join_pid: Option<u32>) -> Placement<'static> {
    Placement {
        root: "/run/c1",
        join_pid,
        read_only_root: false,
    }
}

#[test]
fn the_oci_process_becomes_a_container_exec_with_every_field() {
    // Arrange
    let spec = spec(serde_json::json!({}));

    // Act
    let req = exec_request(spec.process().as_ref().unwrap(), place(None), true).unwrap();

    // Assert
    let argv: Vec<String> = req
        .argv
        .iter()
        .map(|a| a.to_string_lossy().into())
        .collect();
    assert_eq!(argv, ["sh", "-c", "echo hi"]);
    assert_eq!(req.env, ["PATH=/bin:/usr/bin", "TERM=xterm"]);
    assert_eq!(req.cwd.unwrap(), "/srv");
    assert_eq!(req.user.as_deref(), Some("1000:1001"));
    assert!(req.stdin && req.tty && req.kill_group_on_exit);
    assert_eq!(
        req.window,
        Some(WindowSize {
            rows: 40,
            cols: 120
        })
    );
    let c = req.container.unwrap();
    assert_eq!(c.root, "/run/c1");
    assert_eq!(c.join_pid, None);
    assert_eq!(c.groups, [10, 20]);
    assert_eq!(
        c.rlimits,
        [Rlimit {
            kind: "RLIMIT_NOFILE".into(),
            soft: 512,
            hard: 1024
        }]
    );
    assert!(c.no_new_privileges);
}

#[test]
fn an_exec_joins_the_first_process_and_a_process_without_args_is_refused() {
    // Arrange
    let spec = spec(serde_json::json!({}));
    let mut empty = spec.process().clone().unwrap();
    empty.set_args(Some(Vec::new()));

    // Act
    let joined = exec_request(spec.process().as_ref().unwrap(), place(Some(7)), false);
    let refused = exec_request(&empty, place(None), false);

    // Assert
    let joined = joined.unwrap();
    assert_eq!(joined.container.unwrap().join_pid, Some(7));
    assert!(!joined.stdin);
    assert!(matches!(refused, Err(OciError::NoArgs)));
}

#[test]
fn the_containers_memory_limit_is_the_guests_memory() {
    // Arrange
    let limited = spec(serde_json::json!({
        "linux": { "resources": { "memory": { "limit": 64 * 1024 * 1024 } } }
    }));
    let odd = spec(serde_json::json!({
        "linux": { "resources": { "memory": { "limit": 100 * 1024 * 1024 + 1 } } }
    }));
    let tiny = spec(serde_json::json!({
        "linux": { "resources": { "memory": { "limit": 1024 * 1024 } } }
    }));

    // Act
    let sizes = [&limited, &odd, &tiny, &spec(serde_json::json!({}))].map(vm_size);

    // Assert
    let mibs = sizes.map(|s| s.memory_mib);
    assert_eq!(mibs, [64, 101, MIN_MEMORY_MIB, DEFAULT_MEMORY_MIB]);
}

#[test]
fn pod_annotations_size_the_vm_before_the_containers_resources() {
    // Arrange
    let pod = spec(serde_json::json!({
        "annotations": {
            SANDBOX_MEMORY: "268435456",
            SANDBOX_CPU_QUOTA: "250000",
            SANDBOX_CPU_PERIOD: "100000"
        },
        "linux": { "resources": {
            "memory": { "limit": 64 * 1024 * 1024 },
            "cpu": { "quota": 100000, "period": 100000 }
        } }
    }));
    let container_only = spec(serde_json::json!({
        "linux": { "resources": { "cpu": { "quota": 150000, "period": 100000 } } }
    }));
    let unlimited = spec(serde_json::json!({
        "annotations": { SANDBOX_CPU_QUOTA: "-1", SANDBOX_MEMORY: "0" }
    }));

    // Act
    let sizes = [&pod, &container_only, &unlimited].map(vm_size);

    // Assert
    assert_eq!(
        sizes[0],
        VmSize {
            memory_mib: 256,
            vcpus: 3
        }
    );
    assert_eq!(sizes[1].vcpus, 2);
    assert_eq!(
        sizes[2],
        VmSize {
            memory_mib: DEFAULT_MEMORY_MIB,
            vcpus: 1
        }
    );
}

#[test]
fn a_bundle_without_a_readable_config_is_a_load_error_naming_the_file() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();

    // Act
    let bad = load(dir.path());
    let missing = load(&dir.path().join("nope"));

    // Assert
    let bad = bad.unwrap_err().to_string();
    assert!(bad.contains("config.json"), "{bad}");
    assert!(matches!(missing, Err(OciError::Load { .. })));
}
