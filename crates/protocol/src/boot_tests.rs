use super::*;

fn share(tag: &str, dir: &str, read_only: bool) -> Share {
    Share {
        tag: tag.into(),
        guest_dir: dir.into(),
        read_only,
    }
}

fn everything() -> BootParams {
    BootParams {
        hostname: Some("bh-0123abcd".into()),
        root: Some(RootParam {
            device: "/dev/vda".into(),
            overlay: Overlay::Device("/dev/vdb".into()),
        }),
        workspace: Some(share("workspace", "/work space", false)),
        mounts: vec![
            share("mount1", "/work", false),
            share("mount0", "/work/in:ner%dir", true),
        ],
        egress: true,
    }
}

#[test]
fn every_field_round_trips_through_the_command_line() {
    // Arrange
    let params = everything();

    // Act
    let encoded = params.to_params().unwrap();
    let cmdline = format!("console=ttyS0 reboot=k {} quiet\n", encoded.join(" "));
    let parsed = BootParams::parse(&cmdline).unwrap();

    // Assert
    assert_eq!(parsed, params);
    assert_eq!(
        encoded,
        [
            "bulkhead.hostname=bh-0123abcd",
            "bulkhead.root=/dev/vda",
            "bulkhead.overlay=/dev/vdb",
            "bulkhead.workspace=workspace:/work%20space:clone",
            "bulkhead.mount=mount1:/work",
            "bulkhead.mount=mount0:/work/in%3Aner%25dir:ro",
            "bulkhead.egress=on",
        ]
    );
}

#[test]
fn a_command_line_without_bulkhead_keys_is_empty_params() {
    // Arrange
    let cmdline = "console=ttyS0 reboot=k panic=1 quiet bulkheadx=1 bulkhead.future=7";

    // Act
    let parsed = BootParams::parse(cmdline).unwrap();

    // Assert
    assert_eq!(parsed, BootParams::default());
}

#[test]
fn a_root_alone_gets_a_tmpfs_overlay_and_an_explicit_tmpfs_is_the_same() {
    // Arrange
    let alone = "bulkhead.root=/dev/vda";
    let explicit = "bulkhead.root=/dev/vda bulkhead.overlay=tmpfs";

    // Act
    let a = BootParams::parse(alone).unwrap();
    let b = BootParams::parse(explicit).unwrap();

    // Assert
    let expected = Some(RootParam {
        device: "/dev/vda".into(),
        overlay: Overlay::Tmpfs,
    });
    assert_eq!(a.root, expected);
    assert_eq!(b.root, expected);
}

#[test]
fn malformed_values_are_refused_naming_their_key() {
    // Arrange
    let cases = [
        ("bulkhead.hostname=bad/name", HOSTNAME_KEY),
        ("bulkhead.hostname=", HOSTNAME_KEY),
        ("bulkhead.root=vda", ROOT_KEY),
        ("bulkhead.root=/dev/../etc/shadow", ROOT_KEY),
        ("bulkhead.root=/dev/", ROOT_KEY),
        ("bulkhead.root=/dev/vda bulkhead.overlay=ramfs", OVERLAY_KEY),
        (
            "bulkhead.root=/dev/vda bulkhead.overlay=/dev/vda",
            OVERLAY_KEY,
        ),
        ("bulkhead.mount=notag", MOUNT_KEY),
        ("bulkhead.mount=:/work", MOUNT_KEY),
        ("bulkhead.mount=t/x:/work", MOUNT_KEY),
        ("bulkhead.mount=t:work", MOUNT_KEY),
        ("bulkhead.mount=t:/", MOUNT_KEY),
        ("bulkhead.mount=t:/a/../etc", MOUNT_KEY),
        ("bulkhead.mount=t:/a/./b", MOUNT_KEY),
        ("bulkhead.mount=t:/a%2", MOUNT_KEY),
        ("bulkhead.mount=t:/a%zz", MOUNT_KEY),
        ("bulkhead.mount=t:/a%+1", MOUNT_KEY),
        ("bulkhead.mount=t:/a%00", MOUNT_KEY),
        ("bulkhead.workspace=workspace:/workspace", WORKSPACE_KEY),
        (
            "bulkhead.workspace=workspace:/workspace:ro:clone",
            WORKSPACE_KEY,
        ),
        ("bulkhead.workspace=workspace:/a/../b:clone", WORKSPACE_KEY),
        ("bulkhead.workspace=bad/tag:/workspace:clone", WORKSPACE_KEY),
        ("bulkhead.egress=off", EGRESS_KEY),
    ];

    // Act
    let results: Vec<_> = cases
        .iter()
        .map(|(cmdline, _)| BootParams::parse(cmdline))
        .collect();

    // Assert
    for ((cmdline, key), result) in cases.iter().zip(results) {
        assert!(
            matches!(&result, Err(BootParamError::Invalid { key: k, .. }) if k == key),
            "{cmdline}: {result:?}"
        );
    }
}

#[test]
fn single_valued_keys_given_twice_and_an_overlay_without_a_root_are_refused() {
    // Arrange
    let cases = [
        "bulkhead.hostname=a bulkhead.hostname=b",
        "bulkhead.root=/dev/vdc bulkhead.root=/dev/vda",
        "bulkhead.root=/dev/vda bulkhead.overlay=tmpfs bulkhead.overlay=/dev/vdb",
        "bulkhead.workspace=w:/a:clone bulkhead.workspace=w:/b:clone",
        "bulkhead.egress=on bulkhead.egress=on",
        "bulkhead.overlay=/dev/vdb",
    ];

    // Act
    let results: Vec<_> = cases.iter().map(|c| BootParams::parse(c)).collect();

    // Assert
    for (cmdline, result) in cases.iter().zip(&results[..5]) {
        assert!(
            matches!(result, Err(BootParamError::Repeated(_))),
            "{cmdline}: {result:?}"
        );
    }
    assert_eq!(results[5], Err(BootParamError::OverlayWithoutRoot));
}

#[test]
fn values_the_agent_would_refuse_are_refused_by_the_encoder_too() {
    // Arrange
    let bad_host = BootParams {
        hostname: Some("two words".into()),
        ..BootParams::default()
    };
    let bad_tag = BootParams {
        mounts: vec![share("a:b", "/x", false)],
        ..BootParams::default()
    };
    let relative = BootParams {
        mounts: vec![share("t", "x", false)],
        ..BootParams::default()
    };
    let read_only_clone = BootParams {
        workspace: Some(share("workspace", "/workspace", true)),
        ..BootParams::default()
    };

    // Act
    let results = [bad_host, bad_tag, relative, read_only_clone].map(|p| p.to_params());

    // Assert
    for result in results {
        assert!(
            matches!(result, Err(BootParamError::Invalid { .. })),
            "{result:?}"
        );
    }
}

#[test]
fn encoded_parameters_never_contain_white_space() {
    // Arrange
    let params = BootParams {
        mounts: vec![share("t", "/tab\there/new\nline/sp ace", false)],
        ..BootParams::default()
    };

    // Act
    let encoded = params.to_params().unwrap();

    // Assert
    assert!(encoded.iter().all(|p| !p.chars().any(char::is_whitespace)));
    assert_eq!(BootParams::parse(&encoded.join(" ")).unwrap(), params);
}

#[test]
fn only_bulkhead_keys_count_as_bulkhead_parameters() {
    // Arrange / Act / Assert
    assert!(is_bulkhead_param("bulkhead.hostname=x"));
    assert!(is_bulkhead_param("bulkhead.anything"));
    assert!(!is_bulkhead_param("loglevel=7"));
    assert!(!is_bulkhead_param("console=bulkhead.x"));
}

#[test]
fn share_params_carry_only_the_shares_and_read_back() {
    // Arrange
    let params = everything();

    // Act
    let encoded = params.share_params().unwrap();
    let decoded = BootParams::parse_shares(&encoded).unwrap();

    // Assert
    assert!(encoded
        .iter()
        .all(|p| p.starts_with("bulkhead.workspace=") || p.starts_with("bulkhead.mount=")));
    assert_eq!(decoded.workspace, params.workspace);
    assert_eq!(decoded.mounts, params.mounts);
    assert_eq!(
        (decoded.hostname, decoded.root, decoded.egress),
        (None, None, false)
    );
}

#[test]
fn share_params_refuse_other_keys_and_smuggled_words() {
    // Arrange
    let bad = [
        "bulkhead.hostname=x",
        "bulkhead.egress=on",
        "bulkhead.mountx=mount0:/a",
        "bulkhead.mount=mount0:/a bulkhead.egress=on",
        "loglevel=7",
    ];

    // Act / Assert
    for word in bad {
        let result = BootParams::parse_shares(&[word.to_owned()]);
        assert!(
            matches!(result, Err(BootParamError::NotAShare(_))),
            "{word}: {result:?}"
        );
    }
    assert!(matches!(
        BootParams::parse_shares(&["bulkhead.mount=mount0:relative".to_owned()]),
        Err(BootParamError::Invalid { .. })
    ));
}
