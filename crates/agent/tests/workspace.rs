//! The `WorkspaceChanges` request end to end over a Unix socket: a test-mode agent serving the
//! change set of directories laid out like an overlay's upper and lower layers.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::path::Path;

use bulkhead_protocol::client::{ChangeEvent, ClientError};
use bulkhead_protocol::{
    ChangeRecord, ChangeStatus, EntryKind, WorkspaceChangesRequest, PROTOCOL_VERSION,
};
use common::Agent;

/// An agent whose workspace layers are `<dir>/upper` and `<dir>/lower`.
fn agent_with_layers(dir: &Path) -> Agent {
    let (upper, lower) = (dir.join("upper"), dir.join("lower"));
    Agent::start_with(&[
        OsStr::new("--workspace-upper"),
        upper.as_os_str(),
        OsStr::new("--workspace-lower"),
        lower.as_os_str(),
    ])
}

fn request(contents: bool, names: &[&str]) -> WorkspaceChangesRequest {
    WorkspaceChangesRequest {
        version: PROTOCOL_VERSION,
        contents,
        content_names: names.iter().map(|n| n.to_string()).collect(),
        link_targets: false,
    }
}

/// Every record with the contents that followed it, until `ChangesEnd`.
fn collect(agent: &Agent, req: &WorkspaceChangesRequest) -> Vec<(ChangeRecord, Option<Vec<u8>>)> {
    let mut stream = agent.client().workspace_changes(req).unwrap();
    let mut out: Vec<(ChangeRecord, Option<Vec<u8>>)> = Vec::new();
    loop {
        match stream.next_event().unwrap() {
            ChangeEvent::Change(record) => out.push((record, None)),
            ChangeEvent::Data(bytes) => {
                let last = out.last_mut().unwrap();
                last.1
                    .get_or_insert_with(Vec::new)
                    .extend_from_slice(&bytes);
            }
            ChangeEvent::DataEnd => {
                out.last_mut().unwrap().1.get_or_insert_with(Vec::new);
            }
            ChangeEvent::Done(end) => {
                assert_eq!(end.changes, out.len() as u64);
                return out;
            }
        }
    }
}

fn layout(dir: &Path) {
    for layer in ["upper", "lower"] {
        fs::create_dir_all(dir.join(layer)).unwrap();
    }
    fs::write(dir.join("lower/package.json"), r#"{"scripts":{}}"#).unwrap();
    fs::write(dir.join("lower/README"), "old\n").unwrap();
    fs::write(dir.join("upper/package.json"), r#"{"scripts":{"x":"y"}}"#).unwrap();
    fs::write(dir.join("upper/README"), "new\n").unwrap();
    std::os::unix::fs::symlink("README", dir.join("upper/link")).unwrap();
}

#[test]
fn the_change_set_carries_contents_and_link_targets_when_asked() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    layout(dir.path());
    let agent = agent_with_layers(dir.path());

    // Act
    let changes = collect(&agent, &request(true, &[]));

    // Assert
    let summary: Vec<(&str, ChangeStatus, EntryKind, Option<&[u8]>)> = changes
        .iter()
        .map(|(r, d)| (r.path.as_str(), r.status, r.kind, d.as_deref()))
        .collect();
    assert_eq!(
        summary,
        [
            (
                "README",
                ChangeStatus::Modified,
                EntryKind::File,
                Some(&b"new\n"[..])
            ),
            (
                "link",
                ChangeStatus::Added,
                EntryKind::Symlink,
                Some(&b"README"[..])
            ),
            (
                "package.json",
                ChangeStatus::Modified,
                EntryKind::File,
                Some(&br#"{"scripts":{"x":"y"}}"#[..])
            ),
        ]
    );
    assert!(changes.iter().all(|(r, _)| r.data));
}

#[test]
fn without_contents_only_the_named_files_carry_data() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    layout(dir.path());
    let agent = agent_with_layers(dir.path());

    // Act
    let changes = collect(&agent, &request(false, &["package.json"]));

    // Assert
    let with_data: Vec<&str> = changes
        .iter()
        .filter(|(r, d)| r.data && d.is_some())
        .map(|(r, _)| r.path.as_str())
        .collect();
    assert_eq!(with_data, ["package.json"]);
    assert_eq!(changes.len(), 3);
}

#[test]
fn link_targets_come_without_the_other_contents_when_asked() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    layout(dir.path());
    let agent = agent_with_layers(dir.path());
    let req = WorkspaceChangesRequest {
        link_targets: true,
        ..request(false, &[])
    };

    // Act
    let changes = collect(&agent, &req);

    // Assert
    let with_data: Vec<(&str, Option<&[u8]>)> = changes
        .iter()
        .filter(|(r, _)| r.data)
        .map(|(r, d)| (r.path.as_str(), d.as_deref()))
        .collect();
    assert_eq!(with_data, [("link", Some(&b"README"[..]))]);
}

#[test]
fn an_agent_without_a_clone_workspace_says_so() {
    // Arrange
    let agent = Agent::start();

    // Act
    let result = agent
        .client()
        .workspace_changes(&request(false, &[]))
        .unwrap()
        .next_event();

    // Assert
    assert!(
        matches!(&result, Err(ClientError::Agent(m)) if m.message.contains("no clone workspace") && m.code == bulkhead_protocol::ErrorCode::InvalidRequest),
        "{result:?}"
    );
}
