//! VM configuration.
