//! Host side of the workspace change-set request ([`crate::workspace`]).

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::{classify, AgentClient, ClientError};
use crate::frame::{read_frame, write_frame, Frame};
use crate::workspace::{ChangeRecord, ChangesEnd, WorkspaceChangesRequest};

/// How long a change-set connection may stay silent (10 min): the agent walks the upper
/// directory and compares copied-up files with the host's before its first record.
pub const CHANGES_READ_TIMEOUT: Duration = Duration::from_secs(600);

/// One step of a change set, in wire order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeEvent {
    /// A changed path. When its `data` is true, [`ChangeEvent::Data`]s and one
    /// [`ChangeEvent::DataEnd`] follow.
    Change(ChangeRecord),
    /// Contents of the last record (file bytes or link target).
    Data(Vec<u8>),
    /// End of the last record's contents.
    DataEnd,
    /// The change set is complete; nothing follows.
    Done(ChangesEnd),
}

/// An open change-set request: read it with [`ChangeStream::next_event`] until
/// [`ChangeEvent::Done`].
#[derive(Debug)]
pub struct ChangeStream {
    reader: BufReader<UnixStream>,
    done: bool,
}

impl ChangeStream {
    /// The next event. After [`ChangeEvent::Done`] or an error, calling again is an error.
    ///
    /// # Errors
    /// [`ClientError::Agent`] when the agent reports a failure (e.g. the sandbox has no clone
    /// workspace), [`ClientError::Unexpected`] for frames that do not belong here,
    /// [`ClientError::Closed`] when the connection ends early, and framing and I/O errors.
    pub fn next_event(&mut self) -> Result<ChangeEvent, ClientError> {
        if self.done {
            return Err(ClientError::Closed(
                "another change (the change set is complete)",
            ));
        }
        let frame = read_frame(&mut self.reader).map_err(classify);
        let event = match frame {
            Ok(Some(Frame::Change(record))) => ChangeEvent::Change(record),
            Ok(Some(Frame::Data(bytes))) => ChangeEvent::Data(bytes),
            Ok(Some(Frame::End)) => ChangeEvent::DataEnd,
            Ok(Some(Frame::ChangesEnd(end))) => ChangeEvent::Done(end),
            Ok(Some(Frame::Error(e))) => {
                self.done = true;
                return Err(ClientError::Agent(e));
            }
            Ok(Some(other)) => {
                self.done = true;
                return Err(ClientError::Unexpected {
                    expected: "Change, Data, End, ChangesEnd or Error",
                    got: other.kind(),
                });
            }
            Ok(None) => {
                self.done = true;
                return Err(ClientError::Closed("the end of the change set"));
            }
            Err(e) => {
                self.done = true;
                return Err(e);
            }
        };
        if matches!(event, ChangeEvent::Done(_)) {
            self.done = true;
        }
        Ok(event)
    }
}

impl AgentClient {
    /// Asks the agent for the change set of the guest's clone workspace. Reads may wait up to
    /// [`CHANGES_READ_TIMEOUT`] (or the client's timeout, if longer).
    ///
    /// # Errors
    /// Connecting or sending the request failed.
    pub fn workspace_changes(
        &self,
        request: &WorkspaceChangesRequest,
    ) -> Result<ChangeStream, ClientError> {
        let stream = self.connect()?;
        stream.set_read_timeout(Some(self.timeout.max(CHANGES_READ_TIMEOUT)))?;
        write_frame(&mut &stream, &Frame::WorkspaceChanges(request.clone())).map_err(classify)?;
        Ok(ChangeStream {
            reader: BufReader::with_capacity(64 * 1024, stream),
            done: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::tests::fake_agent;
    use crate::workspace::{ChangeStatus, EntryKind};
    use crate::PROTOCOL_VERSION;

    fn record(path: &str, data: bool) -> ChangeRecord {
        ChangeRecord {
            path: path.into(),
            status: ChangeStatus::Added,
            kind: EntryKind::File,
            mode: 0o644,
            size: 2,
            data,
        }
    }

    #[test]
    fn a_change_set_arrives_as_records_data_and_the_end() {
        // Arrange
        let end = ChangesEnd {
            changes: 2,
            skipped: Vec::new(),
        };
        let (_dir, client, server) = fake_agent(vec![
            Frame::Change(record("a", true)),
            Frame::Data(b"hi".to_vec()),
            Frame::End,
            Frame::Change(record("b", false)),
            Frame::ChangesEnd(end.clone()),
        ]);
        let request = WorkspaceChangesRequest {
            version: PROTOCOL_VERSION,
            contents: true,
            content_names: Vec::new(),
            link_targets: false,
        };

        // Act
        let mut stream = client.workspace_changes(&request).unwrap();
        let mut events = Vec::new();
        loop {
            let event = stream.next_event().unwrap();
            let done = matches!(event, ChangeEvent::Done(_));
            events.push(event);
            if done {
                break;
            }
        }

        // Assert
        assert_eq!(
            events,
            [
                ChangeEvent::Change(record("a", true)),
                ChangeEvent::Data(b"hi".to_vec()),
                ChangeEvent::DataEnd,
                ChangeEvent::Change(record("b", false)),
                ChangeEvent::Done(end),
            ]
        );
        assert_eq!(server.join().unwrap(), Frame::WorkspaceChanges(request));
        assert!(stream.next_event().is_err());
    }

    #[test]
    fn an_agent_error_and_an_early_close_are_errors() {
        // Arrange
        let (_d1, refusing, _s1) = fake_agent(vec![Frame::error(
            crate::ErrorCode::InvalidRequest,
            "no clone workspace",
        )]);
        let (_d2, closing, _s2) = fake_agent(vec![Frame::Change(record("a", false))]);
        let request = WorkspaceChangesRequest {
            version: PROTOCOL_VERSION,
            contents: false,
            content_names: Vec::new(),
            link_targets: false,
        };

        // Act
        let refused = refusing.workspace_changes(&request).unwrap().next_event();
        let mut cut = closing.workspace_changes(&request).unwrap();
        let first = cut.next_event();
        let second = cut.next_event();

        // Assert
        assert!(
            matches!(&refused, Err(ClientError::Agent(e)) if e.message == "no clone workspace"),
            "{refused:?}"
        );
        assert!(first.is_ok());
        assert!(matches!(second, Err(ClientError::Closed(_))), "{second:?}");
    }
}
