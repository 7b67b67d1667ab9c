//! Stream wrappers: byte meters with an activity clock (for the idle timeout and the log's byte
//! counts) and a stream that first replays bytes already read (the buffered ClientHello).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes each way and the time of the last byte, shared by the streams of one connection.
#[derive(Debug)]
pub(crate) struct Meter {
    epoch: Instant,
    /// Milliseconds since `epoch` of the last read or write.
    last_ms: AtomicU64,
    /// Bytes towards the upstream.
    up: AtomicU64,
    /// Bytes towards the guest.
    down: AtomicU64,
}

impl Meter {
    /// A meter whose clock starts now.
    pub fn new() -> Arc<Meter> {
        Arc::new(Meter {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
            up: AtomicU64::new(0),
            down: AtomicU64::new(0),
        })
    }

    fn touch(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Counts `n` bytes moved towards the upstream outside a [`Metered`] stream.
    pub fn count_up(&self, n: usize) {
        self.up.fetch_add(n as u64, Ordering::Relaxed);
        self.touch();
    }

    /// Counts `n` bytes moved towards the guest outside a [`Metered`] stream.
    pub fn count_down(&self, n: usize) {
        self.down.fetch_add(n as u64, Ordering::Relaxed);
        self.touch();
    }

    /// Bytes towards the upstream so far.
    pub fn up(&self) -> u64 {
        self.up.load(Ordering::Relaxed)
    }

    /// Bytes towards the guest so far.
    pub fn down(&self) -> u64 {
        self.down.load(Ordering::Relaxed)
    }

    /// Resolves once no byte has moved for `timeout`.
    pub async fn idle(&self, timeout: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let quiet = self.epoch.elapsed().saturating_sub(last);
            if quiet >= timeout {
                return;
            }
            tokio::time::sleep(timeout - quiet).await;
        }
    }
}

/// Which way reads and writes of a [`Metered`] stream count.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Side {
    /// The guest's stream: reads go up, writes go down.
    Guest,
    /// An upstream stream: reads go down, writes go up.
    Upstream,
}

/// A stream that counts its bytes into a [`Meter`].
#[derive(Debug)]
pub(crate) struct Metered<S> {
    inner: S,
    meter: Arc<Meter>,
    side: Side,
}

impl<S> Metered<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, meter: Arc<Meter>, side: Side) -> Metered<S> {
        Metered { inner, meter, side }
    }

    /// The wrapped stream.
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn count(&self, n: usize, reading: bool) {
        let counter = match (self.side, reading) {
            (Side::Guest, true) | (Side::Upstream, false) => &self.meter.up,
            (Side::Guest, false) | (Side::Upstream, true) => &self.meter.down,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        self.meter.touch();
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.count(n, true);
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = poll {
            self.count(n, false);
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A stream that yields `prefix` before reading from `inner` (writes go straight to `inner`).
#[derive(Debug)]
pub(crate) struct Prefixed<S> {
    prefix: Vec<u8>,
    offset: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    /// Replays `prefix`, then reads `inner`.
    pub fn new(prefix: Vec<u8>, inner: S) -> Prefixed<S> {
        Prefixed {
            prefix,
            offset: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.offset < self.prefix.len() {
            let n = (self.prefix.len() - self.offset).min(buf.remaining());
            let start = self.offset;
            buf.put_slice(&self.prefix[start..start + n]);
            self.offset += n;
            if self.offset == self.prefix.len() {
                self.prefix = Vec::new();
                self.offset = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
