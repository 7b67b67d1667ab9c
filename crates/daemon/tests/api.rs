//! The API end to end over the daemon's real socket: through the Rust client and through
//! `curl --unix-socket`. Sandboxes use the fake VMM (see tests/common).

mod common;

use std::collections::BTreeMap;
use std::process::Command;

use bulkhead_client::{ExecEvent, ExecSpec, SandboxState};
use common::{rt, spec_with_labels, TestDaemon};

#[test]
fn a_client_creates_lists_runs_copies_and_deletes() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let file = daemon.dir.path().join("guest-file");

    // Act
    let (created, listed, other_label, out, collected, read_back, logs, gone) =
        rt.block_on(async {
            let created = client
                .create(&spec_with_labels(&[("team", "a")]))
                .await
                .unwrap();
            let _other = client
                .create(&spec_with_labels(&[("team", "b")]))
                .await
                .unwrap();
            let team_a = BTreeMap::from([("team".to_owned(), "a".to_owned())]);
            let listed = client.list(&team_a).await.unwrap();
            let other_label = client
                .list(&BTreeMap::from([("team".to_owned(), "c".to_owned())]))
                .await
                .unwrap();
            let mut stream = client
                .exec(
                    &created.id,
                    &ExecSpec::new(["sh", "-c", "echo out; echo err >&2; exit 7"]),
                )
                .await
                .unwrap();
            let mut events = Vec::new();
            while let Some(event) = stream.next_event().await.unwrap() {
                events.push(event);
            }
            let mut spec = ExecSpec::new(["sh", "-c", "cat; echo \"$GREETING\""]);
            spec.stdin = Some("aW5wdXQK".into()); // "input\n"
            spec.env.insert("GREETING".into(), "hello".into());
            let collected = client.exec_collect(&created.id, &spec).await.unwrap();
            let path = file.to_str().unwrap();
            client
                .write_file(&created.id, path, 0o600, &b"\x00binary\xff"[..])
                .await
                .unwrap();
            let read_back = client.read_file(&created.id, path).await.unwrap();
            let logs = client.logs(&created.id, 50).await.unwrap();
            client.delete(&created.id).await.unwrap();
            let gone = client.get(&created.id).await.unwrap_err();
            (
                created,
                listed,
                other_label,
                events,
                collected,
                read_back,
                logs,
                gone,
            )
        });

    // Assert
    assert_eq!(created.state, SandboxState::Running);
    assert_eq!(
        listed.iter().map(|s| s.id.clone()).collect::<Vec<_>>(),
        vec![created.id.clone()]
    );
    assert!(other_label.is_empty());
    let stdout: Vec<u8> = out
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stdout(b) => Some(b.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let stderr: Vec<u8> = out
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stderr(b) => Some(b.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(stdout, b"out\n");
    assert_eq!(stderr, b"err\n");
    assert!(
        matches!(out.last(), Some(ExecEvent::Exit(exit)) if exit.code == Some(7)),
        "{out:?}"
    );
    assert_eq!(collected.stdout, b"input\nhello\n");
    assert!(collected.exit.success());
    assert_eq!(read_back, b"\x00binary\xff");
    assert!(logs.contains("fake-vmm: agent ready"), "{logs}");
    assert_eq!(gone.status(), Some(404));
}

fn curl(daemon: &TestDaemon, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "--unix-socket"])
        .arg(&daemon.socket)
        .args(args)
        .output()
        .expect("curl is installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.parse().unwrap(), body.to_owned())
}

#[test]
fn every_endpoint_answers_curl_on_the_socket() {
    // Arrange
    let daemon = TestDaemon::start();
    let base = "http://bulkheadd";
    let (status, body) = curl(
        &daemon,
        &[
            "-X",
            "POST",
            &format!("{base}/v1/sandboxes"),
            "-d",
            r#"{"memory_mib":64,"labels":{"via":"curl"}}"#,
        ],
    );
    assert_eq!(status, 201, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).unwrap();
    let id = info["id"].as_str().unwrap().to_owned();
    let sb = format!("{base}/v1/sandboxes/{id}");
    let file = daemon.dir.path().join("curl-file");
    let files = format!("{sb}/files?path={}", file.display());

    // Act
    let results = [
        curl(&daemon, &[&format!("{base}/healthz")]),
        curl(&daemon, &[&format!("{base}/metrics")]),
        curl(&daemon, &[&format!("{base}/openapi.json")]),
        curl(&daemon, &[&format!("{base}/v1/sandboxes?label=via=curl")]),
        curl(&daemon, &[&sb]),
        curl(
            &daemon,
            &[
                "-X",
                "POST",
                &format!("{sb}/exec"),
                "-d",
                r#"{"argv":["echo","streamed"]}"#,
            ],
        ),
        curl(
            &daemon,
            &[
                "-X",
                "POST",
                &format!("{sb}/exec/collect"),
                "-d",
                r#"{"argv":["echo","collected"]}"#,
            ],
        ),
        curl(
            &daemon,
            &[
                "-X",
                "PUT",
                &files,
                "-H",
                "x-bulkhead-mode: 640",
                "--data-binary",
                "from curl",
            ],
        ),
        curl(&daemon, &[&files]),
        curl(&daemon, &[&format!("{sb}/logs?lines=5")]),
        curl(&daemon, &["-X", "DELETE", &sb]),
        curl(&daemon, &["-X", "DELETE", &sb]),
    ];

    // Assert
    let codes: Vec<u16> = results.iter().map(|(c, _)| *c).collect();
    assert_eq!(
        codes,
        [200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 204, 204],
        "{results:?}"
    );
    assert!(results[0].1.contains(r#""status":"ok""#));
    assert!(
        results[1]
            .1
            .contains("bulkhead_sandboxes{state=\"running\"} 1"),
        "{}",
        results[1].1
    );
    assert!(results[2].1.contains(r#""openapi":"3.1"#));
    assert!(results[3].1.contains(&id));
    assert!(
        results[5].1.contains(r#"{"stdout":"c3RyZWFtZWQK"}"#),
        "{}",
        results[5].1
    ); // "streamed\n"
    assert!(
        results[5]
            .1
            .trim_end()
            .ends_with(r#"{"exit":{"code":0,"signal":null,"timed_out":false}}"#),
        "{}",
        results[5].1
    );
    assert!(results[6].1.contains(r#""stdout":"Y29sbGVjdGVkCg==""#)); // "collected\n"
    assert_eq!(results[7].1, r#"{"bytes":9}"#);
    assert_eq!(results[8].1, "from curl");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o640);
}

#[test]
fn metrics_count_creates_execs_and_vm_exits() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();

    // Act
    let text = rt.block_on(async {
        let a = client.create(&spec_with_labels(&[])).await.unwrap();
        client
            .exec_collect(&a.id, &ExecSpec::new(["true"]))
            .await
            .unwrap();
        client
            .exec_collect(&a.id, &ExecSpec::new(["true"]))
            .await
            .unwrap();
        client.delete(&a.id).await.unwrap();
        client.metrics().await.unwrap()
    });

    // Assert
    assert!(
        text.contains("bulkhead_sandbox_create_seconds_count 1"),
        "{text}"
    );
    assert!(
        text.contains("bulkhead_execs_total{result=\"started\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("bulkhead_vm_exits_total{reason=\"destroyed\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("bulkhead_sandboxes{state=\"running\"} 0"),
        "{text}"
    );
}

#[test]
fn a_unique_id_prefix_names_a_sandbox_and_an_ambiguous_one_is_refused() {
    // Arrange: create sandboxes until two IDs share their first digit (by pigeonhole, at most
    // 17), so that every other ID differs from both in its first digit.
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let (a, b) = rt.block_on(async {
        let mut ids: Vec<String> = Vec::new();
        loop {
            let id = client.create(&spec_with_labels(&[])).await.unwrap().id;
            if let Some(twin) = ids.iter().find(|other| other[..1] == id[..1]) {
                return (twin.clone(), id);
            }
            ids.push(id);
        }
    });
    let shared = a.len() - a.chars().zip(b.chars()).skip_while(|(x, y)| x == y).count();
    let common = &a[..shared];
    let only_a = &a[..shared + 1];
    let only_b = &b[..shared + 1];

    // Act
    let (by_prefix, ambiguous, refused_delete, exec, deleted_a, b_after) = rt.block_on(async {
        let by_prefix = client.get(only_a).await.unwrap();
        let ambiguous = client.get(common).await.unwrap_err();
        let refused_delete = client.delete(common).await.unwrap_err();
        let exec = client
            .exec_collect(only_b, &ExecSpec::new(["sh", "-c", "echo via-prefix"]))
            .await
            .unwrap();
        client.delete(only_a).await.unwrap();
        let deleted_a = client.get(&a).await.unwrap_err();
        let b_after = client.get(&b).await.unwrap();
        (
            by_prefix,
            ambiguous,
            refused_delete,
            exec,
            deleted_a,
            b_after,
        )
    });

    // Assert
    assert_eq!(by_prefix.id, a);
    assert_eq!(ambiguous.status(), Some(400), "{ambiguous}");
    let message = ambiguous.to_string();
    assert!(
        message.contains("ambiguous_id") && message.contains(&a) && message.contains(&b),
        "{message}"
    );
    assert_eq!(refused_delete.status(), Some(400), "{refused_delete}");
    assert_eq!(exec.stdout, b"via-prefix\n");
    assert_eq!(deleted_a.status(), Some(404));
    assert_eq!(b_after.state, SandboxState::Running);
}
