//! The shim's own messages reach containerd: the shim installs no tracing subscriber, so its
//! `tracing` events must become `log` records, the only ones containerd-shim's logger writes to
//! the FIFO containerd reads a shim's log from.

use std::sync::Mutex;

/// Every message logged in this process.
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{} {}", record.level(), record.args());
        SEEN.lock().unwrap_or_else(|p| p.into_inner()).push(line);
    }

    fn flush(&self) {}
}

#[test]
fn a_shim_warning_without_a_tracing_subscriber_is_a_log_record() {
    // Arrange: a `log` logger, as containerd-shim installs one, and no tracing subscriber.
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Info);

    // Act
    tracing::warn!("undoing the create of c1: test");

    // Assert
    let seen = SEEN.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|l| l == "WARN undoing the create of c1: test"),
        "{seen:?}"
    );
}
