//! The shim process: containerd's `start` and `delete` subcommands and the serving loop, on the
//! `containerd-shim` crate's async [`Shim`] trait.
//!
//! * `start` (run by containerd in the bundle directory) decides which shim serves the container:
//!   the pod's ([`crate::pod_id`] of the bundle's annotations). The crate's `spawn` names the
//!   shim's socket after that grouping, so the first container of a pod starts a shim process and
//!   the others find its socket and answer its address.
//! * `delete` is what containerd runs when a shim died without cleaning up: it takes down the
//!   container's root mount (and its pod's roots directory when it was the last,
//!   [`crate::pod_roots::remove_stale`]) and the cgroup its spec names
//!   ([`crate::pod_cgroup::remove_stale`]), and reports the task killed (status 137). The dead
//!   shim's VMMs stopped with it (they are started with a parent-death signal). containerd 1.6
//!   also runs it after every task's ordinary delete (closing that task's connection to the
//!   shim looks to it like a shim that died), while the pod's shim may still serve the pod's
//!   other containers in the pod's VM, whose cgroup is the one the first container's spec
//!   names: so `delete` first asks whether the shim at the bundle's `address` still answers,
//!   and then leaves everything to it ([`shim_answers`]).
//! * Otherwise the process serves the task API ([`TtrpcTask`]) until `Shutdown` finds no
//!   container left, publishing events to containerd through [`RemoteSink`].

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::asynchronous::util::write_str_to_file;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::{Config, Error, Flags, StartOpts};
use containerd_shim_protos::api::DeleteResponse;
use containerd_shim_protos::ttrpc::context::Context;
use tokio::sync::mpsc;

use crate::events::{EventSink, TaskEvent};
use crate::pod_roots::remove_stale;
use crate::service::TaskService;
use crate::ttrpc::{bundle_annotations, event_message, timestamp, TtrpcTask};
use crate::vm::{SharedVmBackend, VmBackend};

/// The exit status `delete` reports for a task whose shim is gone: 128 + SIGKILL.
const KILLED_STATUS: u32 = 128 + 9;

/// Whether a shim accepts connections on the socket named in `bundle`'s `address` file (which
/// `start` wrote: `unix://PATH`): the pod's shim is alive and owns the pod's VM, roots and
/// cgroup. False without the file, for another scheme, and when nothing listens there.
pub fn shim_answers(bundle: &Path) -> bool {
    let Ok(address) = std::fs::read_to_string(bundle.join("address")) else {
        return false;
    };
    let Some(path) = address.trim().strip_prefix("unix://") else {
        return false;
    };
    std::os::unix::net::UnixStream::connect(path).is_ok()
}

/// An [`EventSink`] that forwards events, in order, to containerd's event service.
#[derive(Debug, Clone)]
pub struct RemoteSink {
    queue: mpsc::UnboundedSender<TaskEvent>,
}

impl RemoteSink {
    /// Starts the forwarding task (on the current tokio runtime) for `namespace`.
    pub fn start(publisher: RemotePublisher, namespace: String) -> RemoteSink {
        let (queue, mut events) = mpsc::unbounded_channel::<TaskEvent>();
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                let message = event_message(&event);
                let sent =
                    publisher.publish(Context::default(), event.topic(), &namespace, message);
                if let Err(e) = sent.await {
                    tracing::warn!("publishing {}: {e}", event.topic());
                }
            }
        });
        RemoteSink { queue }
    }
}

impl EventSink for RemoteSink {
    fn publish(&self, event: TaskEvent) {
        if self.queue.send(event).is_err() {
            tracing::warn!("the event queue is closed: an event was dropped");
        }
    }
}

/// The shim (see the module documentation).
pub struct BulkheadShim {
    exit: Arc<ExitSignal>,
    namespace: String,
    id: String,
    bundle: String,
}

impl std::fmt::Debug for BulkheadShim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkheadShim")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Shim for BulkheadShim {
    type T = TtrpcTask<SharedVmBackend>;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        BulkheadShim {
            exit: Arc::new(ExitSignal::default()),
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            bundle: args.bundle.clone(),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        // containerd runs `start` in the bundle directory.
        let annotations = bundle_annotations(Path::new(".")).unwrap_or_default();
        let grouping = crate::pod_id(&opts.id, &annotations).to_owned();
        let address = spawn(opts, &grouping, Vec::new()).await?;
        write_str_to_file("address", &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> Result<DeleteResponse, Error> {
        let bundle = match self.bundle.is_empty() {
            true => Path::new("."),
            false => Path::new(&self.bundle),
        };
        if !shim_answers(bundle) {
            let annotations = bundle_annotations(bundle).unwrap_or_default();
            let pod = crate::pod_id(&self.id, &annotations);
            remove_stale(&VmBackend::new(None).pods_dir(), pod, &self.id);
            // The dead shim's VMM stopped with it (parent-death signal); its cgroup is left.
            if let Ok(spec) = crate::oci::load(bundle) {
                crate::pod_cgroup::remove_stale(&spec);
            }
        }
        Ok(DeleteResponse {
            exit_status: KILLED_STATUS,
            exited_at: timestamp(SystemTime::now()),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        let sink = RemoteSink::start(publisher, self.namespace.clone());
        let backend = SharedVmBackend(Arc::new(VmBackend::new(None)));
        let service = TaskService::new(backend, Arc::new(sink));
        TtrpcTask::new(service, Arc::clone(&self.exit))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn a_shim_answers_only_where_the_bundles_address_has_a_listener() {
        // Arrange: bundles whose address names a listening socket, a socket whose listener is
        // gone (a killed shim), another scheme, and none at all.
        let dir = tempfile::tempdir().unwrap();
        let bundle = |name: &str, address: Option<String>| {
            let path = dir.path().join(name);
            std::fs::create_dir(&path).unwrap();
            if let Some(address) = address {
                std::fs::write(path.join("address"), address).unwrap();
            }
            path
        };
        let (live_socket, dead_socket) =
            (dir.path().join("live.sock"), dir.path().join("dead.sock"));
        let _listener = UnixListener::bind(&live_socket).unwrap();
        drop(UnixListener::bind(&dead_socket).unwrap());
        let live = bundle("live", Some(format!("unix://{}\n", live_socket.display())));
        let dead = bundle("dead", Some(format!("unix://{}", dead_socket.display())));
        let other = bundle("other", Some("ttrpc+vsock://3:1024".into()));
        let none = bundle("none", None);

        // Act
        let answers = [&live, &dead, &other, &none].map(|b| shim_answers(b));

        // Assert
        assert_eq!(answers, [true, false, false, false]);
    }
}
