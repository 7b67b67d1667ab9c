//! A debug port ("debugcon", port 0xe9 as in Bochs and QEMU): a channel from guest to host that
//! needs no driver and no serial console.
//!
//! Every byte the guest writes is appended to an optional sink, and the VMM records when the
//! first byte arrived. bulkhead's guest agent and test init write a line here when they start, so
//! the host learns that the guest reached userspace even with the serial console off. Reads
//! return 0xe9, which is how guests detect the port.

use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::devices::bus::BusDevice;

/// The debug port.
pub const DEBUGCON_PORT: u64 = 0xe9;

/// The debug port device.
pub struct DebugCon {
    sink: Option<Box<dyn Write + Send>>,
    first_write: Arc<OnceLock<Instant>>,
}

impl std::fmt::Debug for DebugCon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DebugCon")
            .field("has_sink", &self.sink.is_some())
            .finish_non_exhaustive()
    }
}

impl DebugCon {
    /// A debug port writing to `sink` (or discarding bytes when `None`).
    pub fn new(sink: Option<Box<dyn Write + Send>>) -> Self {
        DebugCon {
            sink,
            first_write: Arc::new(OnceLock::new()),
        }
    }

    /// A handle that holds the time of the guest's first write, once it happened.
    pub fn first_write(&self) -> Arc<OnceLock<Instant>> {
        self.first_write.clone()
    }
}

impl BusDevice for DebugCon {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(DEBUGCON_PORT as u8);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        self.first_write.get_or_init(Instant::now);
        if let Some(sink) = self.sink.as_mut() {
            if let Err(e) = sink.write_all(data).and_then(|()| sink.flush()) {
                tracing::debug!("debug port output failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::Mutex;

    use super::*;

    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn writes_reach_the_sink_and_are_timestamped() {
        let out = SharedBuf::default();
        let mut dev = DebugCon::new(Some(Box::new(out.clone())));
        let first = dev.first_write();
        assert!(first.get().is_none());

        dev.write(0, b"o");
        dev.write(0, b"k");

        assert_eq!(out.0.lock().unwrap().as_slice(), b"ok");
        assert!(first.get().is_some());
    }

    #[test]
    fn reads_identify_the_port() {
        let mut dev = DebugCon::new(None);
        let mut data = [0u8];

        dev.read(0, &mut data);

        assert_eq!(data, [0xe9]);
    }
}
