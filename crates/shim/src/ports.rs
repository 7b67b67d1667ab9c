//! Ingress for a pod: the ports its annotation [`PORTS_ANNOTATION`] declares are listened on in
//! the pod's network namespace, and each connection is carried over vsock to the server on that
//! port in the pod's VM ([`bulkhead_sandbox::ingress`]), so a Service reaches a server in the
//! microVM although the VM has no network device.
//!
//! The annotation is the pod's first container's (under Kubernetes the pod sandbox's: containerd
//! passes pod annotations to it when the runtime's `pod_annotations` lists them, e.g.
//! `pod_annotations = ["bulkhead.io/*"]`). Its value is a comma-separated list of `PORT` or
//! `HOST_PORT:GUEST_PORT`, e.g. `bulkhead.io/ports: "8080,9090:80"`; the host side listens on
//! all addresses of the pod's network namespace (the one `linux.namespaces` names by path; the
//! shim's own when the spec names none, as with `ctr run`).

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use bulkhead_sandbox::ingress::{bind_all, IngressError, PortMapping};
use oci_spec::runtime::{LinuxNamespaceType, Spec};

/// The pod annotation that declares the ports to forward.
pub const PORTS_ANNOTATION: &str = "bulkhead.io/ports";

/// Errors of a pod's ports.
#[derive(Debug, thiserror::Error)]
pub enum PortsError {
    /// The annotation holds something other than port mappings.
    #[error("annotation {PORTS_ANNOTATION}: {0}")]
    Annotation(IngressError),
    /// An entry names an address: a pod's ports listen on every address of its network
    /// namespace, never on one it picks.
    #[error("annotation {PORTS_ANNOTATION}: {0:?} names an address; give HOST_PORT:GUEST_PORT or PORT (the pod's ports listen on every address of its network namespace)")]
    Address(String),
    /// A host port is listed twice.
    #[error("annotation {PORTS_ANNOTATION}: host port {0} is listed twice")]
    Duplicate(u16),
    /// A port could not be bound.
    #[error(transparent)]
    Bind(IngressError),
    /// The pod's network namespace could not be entered.
    #[error("network namespace {path}: {source}")]
    Netns {
        /// The namespace's path from the spec.
        path: PathBuf,
        /// What open(2) or setns(2) reported.
        source: std::io::Error,
    },
}

/// The mappings `spec`'s [`PORTS_ANNOTATION`] declares (none without it).
///
/// # Errors
/// [`PortsError::Annotation`] for an entry that is not `PORT` or `HOST_PORT:GUEST_PORT`.
pub fn mappings(spec: &Spec) -> Result<Vec<PortMapping>, PortsError> {
    let annotations = spec.annotations().clone().unwrap_or_default();
    let Some(value) = annotations.get(PORTS_ANNOTATION) else {
        return Ok(Vec::new());
    };
    let any = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    let found: Vec<PortMapping> = value
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            // An address would let a pod pick the node's interfaces: ports only.
            match entry.split(':').count() {
                1 | 2 => PortMapping::parse(entry, any).map_err(PortsError::Annotation),
                _ => Err(PortsError::Address(entry.to_owned())),
            }
        })
        .collect::<Result<_, _>>()?;
    let mut ports: Vec<u16> = found.iter().map(|m| m.host.port()).collect();
    ports.sort_unstable();
    match ports.windows(2).find(|w| w[0] == w[1] && w[0] != 0) {
        Some(twice) => Err(PortsError::Duplicate(twice[0])),
        None => Ok(found),
    }
}

/// The path of the network namespace `spec` joins, if it names one.
fn netns_path(spec: &Spec) -> Option<PathBuf> {
    let namespaces = spec.linux().as_ref()?.namespaces().clone()?;
    namespaces
        .into_iter()
        .find(|ns| ns.typ() == LinuxNamespaceType::Network)
        .and_then(|ns| ns.path().clone())
}

/// Binds `mappings` in `spec`'s network namespace (on a thread that enters it and ends, so the
/// shim stays where it was; a socket keeps the namespace it was made in).
///
/// # Errors
/// [`PortsError::Netns`], [`PortsError::Bind`]; nothing is left bound.
pub fn bind(spec: &Spec, mappings: &[PortMapping]) -> Result<Vec<(TcpListener, u16)>, PortsError> {
    if mappings.is_empty() {
        return Ok(Vec::new());
    }
    let netns = netns_path(spec);
    let mappings = mappings.to_vec();
    let binding = std::thread::spawn(move || {
        if let Some(path) = &netns {
            let enter = File::open(path).and_then(|ns| {
                // SAFETY: setns(2) on a descriptor we own, for this thread only (CLONE_NEWNET).
                match unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
            enter.map_err(|source| PortsError::Netns {
                path: path.clone(),
                source,
            })?;
        }
        bind_all(&mappings).map_err(PortsError::Bind)
    });
    binding.join().unwrap_or_else(|_| {
        Err(PortsError::Netns {
            path: PathBuf::new(),
            source: std::io::Error::other("the binding thread panicked"),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotated(value: Option<&str>) -> Spec {
        let mut spec = Spec::default();
        let annotations = value
            .map(|v| [(PORTS_ANNOTATION.to_owned(), v.to_owned())].into())
            .unwrap_or_default();
        spec.set_annotations(Some(annotations));
        spec
    }

    #[test]
    fn the_annotation_lists_ports_on_every_address_of_the_pod() {
        // Act
        let ports = mappings(&annotated(Some("8080, 9090:80,"))).unwrap();
        let none = mappings(&annotated(None)).unwrap();

        // Assert
        assert_eq!(
            ports,
            [
                PortMapping::same_port(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 8080),
                PortMapping {
                    host: "0.0.0.0:9090".parse().unwrap(),
                    guest: 80
                }
            ]
        );
        assert!(none.is_empty());
    }

    #[test]
    fn addresses_and_bad_ports_in_the_annotation_are_refused() {
        for bad in ["0", "http", "80:"] {
            // Act
            let result = mappings(&annotated(Some(bad)));

            // Assert
            assert!(
                matches!(result, Err(PortsError::Annotation(_))),
                "{bad:?}: {result:?}"
            );
        }
        let address = mappings(&annotated(Some("127.0.0.1:80:80"))).unwrap_err();
        let twice = mappings(&annotated(Some("8080, 9090:80, 8080:81"))).unwrap_err();
        assert!(matches!(address, PortsError::Address(_)), "{address:?}");
        assert!(!address.to_string().contains("[ADDRESS:]"), "{address}");
        assert!(matches!(twice, PortsError::Duplicate(8080)), "{twice:?}");
    }

    #[test]
    fn ports_bind_in_the_shims_namespace_without_a_path_and_nothing_stays_bound_on_an_error() {
        // Arrange: a free port, and one that is taken.
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let mapping = |port| PortMapping::same_port(IpAddr::V4(Ipv4Addr::LOCALHOST), port);

        // Act
        let bound = bind(&Spec::default(), &[mapping(0)]).unwrap();
        let clash = bind(
            &Spec::default(),
            &[mapping(0), mapping(taken.local_addr().unwrap().port())],
        );

        // Assert
        assert_eq!(bound.len(), 1);
        assert!(matches!(clash, Err(PortsError::Bind(_))), "{clash:?}");
    }

    /// A spec whose network namespace is the file at `path` (as the CRI plugin names a CNI
    /// pod's: `/var/run/netns/cni-...`).
    fn in_netns(path: &str) -> Spec {
        use oci_spec::runtime::{LinuxBuilder, LinuxNamespaceBuilder};
        let netns = LinuxNamespaceBuilder::default()
            .typ(LinuxNamespaceType::Network)
            .path(path)
            .build()
            .unwrap();
        let mut spec = Spec::default();
        spec.set_linux(Some(
            LinuxBuilder::default()
                .namespaces(vec![netns])
                .build()
                .unwrap(),
        ));
        spec
    }

    #[test]
    fn ports_bind_in_the_network_namespace_the_spec_names_not_the_shims_needs_root() {
        // Arrange: a thread in a network namespace of its own (a pod's), named by its /proc path.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            // SAFETY: unshare(2) moves only this thread into a new network namespace.
            let unshared = match unsafe { libc::unshare(libc::CLONE_NEWNET) } {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            };
            // SAFETY: gettid(2) has no preconditions and cannot fail.
            let tid = unsafe { libc::gettid() };
            ready_tx.send((unshared, tid)).unwrap();
            done_rx.recv().ok();
        });
        let (unshared, tid) = ready_rx.recv().unwrap();
        unshared.expect("unshare(CLONE_NEWNET) (needs root)");
        let spec = in_netns(&format!("/proc/{}/task/{tid}/ns/net", std::process::id()));
        let any = |port| PortMapping::same_port(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);

        // Act
        let bound = bind(&spec, &[any(0)]).unwrap();
        let port = bound[0].0.local_addr().unwrap().port();
        let again_in_the_pod = bind(&spec, &[any(port)]);
        let in_the_shims = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port));
        let missing = bind(&in_netns("/proc/self/no-such-netns"), &[any(0)]);

        // Assert: the port is taken in the pod's namespace, free in the shim's own.
        assert!(
            matches!(again_in_the_pod, Err(PortsError::Bind(_))),
            "{again_in_the_pod:?}"
        );
        assert!(in_the_shims.is_ok(), "{in_the_shims:?}");
        assert!(
            matches!(missing, Err(PortsError::Netns { .. })),
            "{missing:?}"
        );
        done_tx.send(()).unwrap();
        holder.join().unwrap();
    }
}
