//! Name resolution on the host.
//!
//! The guest has no resolver: the proxy resolves every name itself through a [`Resolve`]
//! implementation, vets every address it gets, and connects to exactly those addresses (no
//! second lookup, so a DNS answer cannot change between the check and the connection).

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;

use hickory_resolver::TokioResolver;

use crate::policy::HostName;

/// Most addresses kept from one answer.
const MAX_ADDRESSES: usize = 32;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The name does not exist or has no A/AAAA records.
    #[error("{name} does not resolve")]
    NotFound {
        /// The name.
        name: String,
    },
    /// The lookup failed (server unreachable, timeout, ...).
    #[error("resolving {name} failed: {why}")]
    Failed {
        /// The name.
        name: String,
        /// The resolver's message.
        why: String,
    },
    /// The system resolver configuration cannot be read.
    #[error("cannot set up the host resolver: {0}")]
    Setup(String),
}

/// A boxed future of a lookup.
pub type ResolveFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<IpAddr>, ResolveError>> + Send + 'a>>;

/// Resolves a host name to addresses (A and AAAA). Implement it to inject answers in tests.
pub trait Resolve: Send + Sync + std::fmt::Debug + 'static {
    /// All addresses of `name` (the proxy checks every one).
    fn resolve<'a>(&'a self, name: &'a HostName) -> ResolveFuture<'a>;
}

/// The host's resolver (hickory-resolver with `/etc/resolv.conf` and `/etc/hosts`). Names are
/// looked up fully qualified (with a trailing dot), so the host's search domains never turn a
/// guest's `db` into `db.corp.internal`.
#[derive(Debug)]
pub struct SystemResolver {
    inner: TokioResolver,
}

impl SystemResolver {
    /// Reads the system configuration.
    ///
    /// # Errors
    /// [`ResolveError::Setup`].
    pub fn new() -> Result<SystemResolver, ResolveError> {
        let builder =
            TokioResolver::builder_tokio().map_err(|e| ResolveError::Setup(e.to_string()))?;
        Ok(SystemResolver {
            inner: builder.build(),
        })
    }
}

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a HostName) -> ResolveFuture<'a> {
        Box::pin(async move {
            let fqdn = format!("{}.", name.as_str());
            match self.inner.lookup_ip(fqdn).await {
                Ok(lookup) => {
                    let addrs: Vec<IpAddr> = lookup.iter().take(MAX_ADDRESSES).collect();
                    if addrs.is_empty() {
                        return Err(ResolveError::NotFound {
                            name: name.to_string(),
                        });
                    }
                    Ok(addrs)
                }
                Err(e) if e.is_no_records_found() => Err(ResolveError::NotFound {
                    name: name.to_string(),
                }),
                Err(e) => Err(ResolveError::Failed {
                    name: name.to_string(),
                    why: e.to_string(),
                }),
            }
        })
    }
}

/// Fixed answers (tests, and callers that pin names to addresses).
#[derive(Debug, Default, Clone)]
pub struct StaticResolver {
    answers: HashMap<String, Vec<IpAddr>>,
}

impl StaticResolver {
    /// An empty table: every name is [`ResolveError::NotFound`].
    pub fn new() -> StaticResolver {
        StaticResolver::default()
    }

    /// Adds `name` (normalised like a request's host; an invalid name is kept as given and never
    /// matches) with `addrs`.
    pub fn with(mut self, name: &str, addrs: &[IpAddr]) -> StaticResolver {
        let key = HostName::parse(name).map_or_else(|_| name.to_owned(), |n| n.to_string());
        self.answers.insert(key, addrs.to_vec());
        self
    }
}

impl StaticResolver {
    /// Whether the table has an answer for `name`.
    pub fn contains(&self, name: &HostName) -> bool {
        self.answers.contains_key(name.as_str())
    }
}

impl Resolve for StaticResolver {
    fn resolve<'a>(&'a self, name: &'a HostName) -> ResolveFuture<'a> {
        let answer = self.answers.get(name.as_str()).cloned();
        Box::pin(async move {
            answer.ok_or_else(|| ResolveError::NotFound {
                name: name.to_string(),
            })
        })
    }
}

/// Names pinned to addresses first (a sandbox's `extra_hosts`, like `docker run --add-host`),
/// then the host's resolver ([`SystemResolver`], made on first use inside the proxy's runtime).
/// Pinned addresses are vetted like any other answer.
#[derive(Debug)]
pub struct HostsResolver {
    pinned: StaticResolver,
    system: std::sync::OnceLock<Result<SystemResolver, String>>,
}

impl HostsResolver {
    /// A resolver answering `pinned` names from the table and the rest from the host's.
    pub fn new(pinned: StaticResolver) -> HostsResolver {
        HostsResolver {
            pinned,
            system: std::sync::OnceLock::new(),
        }
    }
}

impl Resolve for HostsResolver {
    fn resolve<'a>(&'a self, name: &'a HostName) -> ResolveFuture<'a> {
        if self.pinned.contains(name) {
            return self.pinned.resolve(name);
        }
        Box::pin(async move {
            let system = self
                .system
                .get_or_init(|| SystemResolver::new().map_err(|e| e.to_string()));
            match system {
                Ok(system) => system.resolve(name).await,
                Err(why) => Err(ResolveError::Setup(why.clone())),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pinned_names_are_answered_from_the_table() {
        // Arrange
        let addr: IpAddr = "127.0.0.1".parse().unwrap();
        let resolver = HostsResolver::new(StaticResolver::new().with("API.test.", &[addr]));
        let name = HostName::parse("api.test").unwrap();

        // Act
        let answer = resolver.resolve(&name).await;

        // Assert
        assert_eq!(answer.unwrap(), vec![addr]);
    }
}
