//! HTTP/1.1 exchanges over the daemon's Unix socket, reusing connections (keep-alive).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Waker};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::Error;

/// The sending half of one connection.
type Sender = SendRequest<Full<Bytes>>;

/// The connection itself: the future that reads and writes its socket.
type Conn = Connection<TokioIo<UnixStream>, Full<Bytes>>;

/// Most idle connections kept per client.
const MAX_IDLE: usize = 4;

/// Connections to one daemon socket. An exchange whose answer is read whole leaves its
/// connection idle here, and the next request takes it instead of connecting and handshaking
/// again (1.3-2.4 ms per request in the nested test host). An idle connection is driven only
/// inside an exchange, by the task that makes it. Its socket, though, is registered with the
/// I/O driver of the runtime that connected it, so only connections made on a multi-thread
/// runtime are kept: that driver runs on its workers, whichever runtime uses the connection
/// next. A current-thread runtime drives its I/O only inside its `block_on`, and a client
/// used from two of them would wait forever on the other's socket. When the connecting
/// runtime is gone, the kept connection fails its first poll and a new one is made. Streamed
/// answers (exec output, downloads, an attached exec) get a connection driven by a task of
/// their own, never kept.
#[derive(Debug)]
pub(crate) struct Connections {
    socket: PathBuf,
    idle: Mutex<Vec<Idle>>,
}

/// A connection that waits for its next request.
#[derive(Debug)]
struct Idle {
    sender: Sender,
    conn: Conn,
    /// Made on a multi-thread runtime, so it may be kept.
    keepable: bool,
}

/// One request: method, path with query, body and extra headers.
pub(crate) struct Call<'a> {
    /// The method.
    pub method: Method,
    /// The path and query string.
    pub path: &'a str,
    /// The body, if any.
    pub body: Option<Bytes>,
    /// Extra headers.
    pub headers: &'a [(&'a str, &'a str)],
}

/// How an exchange on a kept connection ended.
enum Outcome {
    /// Answered; the connection can take another request when it is `Some`.
    Answered((StatusCode, Bytes), Option<Box<Idle>>),
    /// The connection was closed before it took the request: send it on another.
    Unsent(Request<Full<Bytes>>),
    /// Failed after the request went out.
    Failed(Error),
}

impl Connections {
    /// No connection yet to `socket`.
    pub(crate) fn new(socket: PathBuf) -> Self {
        Connections {
            socket,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The daemon's socket.
    pub(crate) fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends `call` and returns the response with its body unread; the connection lives until
    /// the body is read or dropped, and is not kept.
    pub(crate) async fn send(&self, call: Call<'_>) -> Result<Response<Incoming>, Error> {
        let mut request = build(call)?;
        while let Some(Idle {
            mut sender, conn, ..
        }) = self.take_idle()
        {
            spawn_driver(conn);
            match sender.try_send_request(request).await {
                Ok(response) => return Ok(response),
                Err(mut e) => match e.take_message() {
                    Some(unsent) => request = unsent,
                    None => return Err(e.into_error().into()),
                },
            }
        }
        let Idle {
            mut sender, conn, ..
        } = self.connect().await?;
        spawn_driver(conn);
        Ok(sender.send_request(request).await?)
    }

    /// Sends `call` and reads the whole answer; the connection then waits for the next request.
    pub(crate) async fn exchange(&self, call: Call<'_>) -> Result<(StatusCode, Bytes), Error> {
        let mut request = build(call)?;
        loop {
            let (idle, fresh) = match self.take_idle() {
                Some(idle) => (idle, false),
                None => (self.connect().await?, true),
            };
            match exchange_on(idle, request).await {
                Outcome::Answered(answer, idle) => {
                    self.keep(idle);
                    return Ok(answer);
                }
                // A kept connection may have been closed meanwhile; a new one may not.
                Outcome::Unsent(unsent) if !fresh => request = unsent,
                Outcome::Unsent(_) => {
                    return Err(Error::Interrupted(
                        "the daemon closed a new connection before taking the request".into(),
                    ))
                }
                Outcome::Failed(e) => return Err(e),
            }
        }
    }

    /// An idle connection that the daemon has not closed, as far as it can tell without waiting.
    fn take_idle(&self) -> Option<Idle> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(mut candidate) = idle.pop() {
            // One poll reads what came in while it was idle: a close ends the connection.
            let mut cx = Context::from_waker(Waker::noop());
            let open = Pin::new(&mut candidate.conn).poll(&mut cx).is_pending();
            if open && candidate.sender.is_ready() {
                return Some(candidate);
            }
        }
        None
    }

    fn keep(&self, idle: Option<Box<Idle>>) {
        let mut kept = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(idle) = idle.filter(|i| i.keepable && kept.len() < MAX_IDLE) {
            kept.push(*idle);
        }
    }

    /// A new connection to the daemon's socket, before the HTTP handshake.
    pub(crate) async fn connect_stream(&self) -> Result<UnixStream, Error> {
        UnixStream::connect(&self.socket)
            .await
            .map_err(|source| Error::Connect {
                path: self.socket.clone(),
                source,
            })
    }

    async fn connect(&self) -> Result<Idle, Error> {
        let stream = self.connect_stream().await?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let keepable = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        Ok(Idle {
            sender,
            conn,
            keepable,
        })
    }
}

/// Drives `conn` in a task of its own until it closes; with upgrades, so an attached exec
/// (101) keeps its connection.
fn spawn_driver(conn: Conn) {
    tokio::spawn(async move {
        // Errors surface through `send_request` or the body; nothing to add here.
        let _ = conn.with_upgrades().await;
    });
}

/// Sends `request` on `idle` and reads the whole answer, driving the connection meanwhile;
/// then waits until the connection can take another request.
async fn exchange_on(idle: Idle, request: Request<Full<Bytes>>) -> Outcome {
    let Idle {
        mut sender,
        mut conn,
        keepable,
    } = idle;
    let (result, conn) = {
        let work = send_and_collect(&mut sender, request);
        tokio::pin!(work);
        let finished_first = tokio::select! {
            result = &mut work => Some(result),
            _ = &mut conn => None,
        };
        match finished_first {
            Some(result) => (result, Some(conn)),
            None => {
                // Closed, maybe after the answer came in: without the connection, what the
                // request got so far ends its channels.
                drop(conn);
                ((&mut work).await, None)
            }
        }
    };
    let answer = match result {
        Ok(answer) => answer,
        Err(outcome) => return outcome,
    };
    let Some(mut conn) = conn else {
        return Outcome::Answered(answer, None);
    };
    // Ready once the connection has taken in the end of the answer.
    let reusable = tokio::select! {
        ready = sender.ready() => ready.is_ok(),
        _ = &mut conn => false,
    };
    let idle = Idle {
        sender,
        conn,
        keepable,
    };
    Outcome::Answered(answer, reusable.then(|| Box::new(idle)))
}

/// Sends `request` with `sender` and reads the whole answer.
async fn send_and_collect(
    sender: &mut Sender,
    request: Request<Full<Bytes>>,
) -> Result<(StatusCode, Bytes), Outcome> {
    let response = match sender.try_send_request(request).await {
        Ok(response) => response,
        Err(mut e) => {
            return Err(match e.take_message() {
                Some(unsent) => Outcome::Unsent(unsent),
                None => Outcome::Failed(e.into_error().into()),
            })
        }
    };
    collect(response).await.map_err(Outcome::Failed)
}

/// `call` as a request to the daemon.
fn build(call: Call<'_>) -> Result<Request<Full<Bytes>>, Error> {
    let mut request = Request::builder()
        .method(call.method)
        .uri(call.path)
        .header(HOST, "bulkheadd");
    if call.body.is_some()
        && !call
            .headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        let kind = if call.path.contains("/files") {
            "application/octet-stream"
        } else {
            "application/json"
        };
        request = request.header(CONTENT_TYPE, kind);
    }
    for (name, value) in call.headers {
        request = request.header(*name, *value);
    }
    request
        .body(Full::new(call.body.unwrap_or_default()))
        .map_err(|e| Error::Decode(format!("cannot build the request: {e}")))
}

/// Reads the whole body.
pub(crate) async fn collect(response: Response<Incoming>) -> Result<(StatusCode, Bytes), Error> {
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use hyper::service::service_fn;

    use super::*;

    /// Serves `200 ok` on a new Unix socket in `dir`, closing each connection after one answer
    /// unless `keep_alive`; returns the socket and the number of connections accepted so far.
    fn serve(dir: &Path, keep_alive: bool) -> (PathBuf, Arc<AtomicUsize>) {
        let socket = dir.join("d.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let answer = service_fn(|_| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .keep_alive(keep_alive)
                        .serve_connection(TokioIo::new(stream), answer),
                );
            }
        });
        (socket, accepted)
    }

    fn get(path: &str) -> Call<'_> {
        Call {
            method: Method::GET,
            path,
            body: None,
            headers: &[],
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn answered_requests_share_one_connection() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let (socket, accepted) = serve(dir.path(), true);
        let connections = Connections::new(socket);

        // Act
        let first = connections.exchange(get("/a")).await.unwrap();
        let second = connections.exchange(get("/b")).await.unwrap();

        // Assert
        assert_eq!((first.0, &first.1[..]), (StatusCode::OK, &b"ok"[..]));
        assert_eq!((second.0, &second.1[..]), (StatusCode::OK, &b"ok"[..]));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An exchange on `first_rt`, then a streamed request on a new current-thread runtime
    /// while `first_rt` lives on, idle; returns both statuses and the connections accepted.
    fn exchange_then_stream_elsewhere(
        first_rt: &tokio::runtime::Runtime,
    ) -> (StatusCode, StatusCode, usize) {
        let dir = tempfile::tempdir().unwrap();
        let server = tokio::runtime::Runtime::new().unwrap();
        let (socket, accepted) = server.block_on(async { serve(dir.path(), true) });
        let connections = Connections::new(socket);
        let first = first_rt.block_on(connections.exchange(get("/a"))).unwrap();
        let second = current_thread()
            .block_on(async {
                let streamed = connections.send(get("/stream")).await?;
                collect(streamed).await
            })
            .unwrap();
        (first.0, second.0, accepted.load(Ordering::SeqCst))
    }

    #[test]
    fn a_connection_kept_on_a_multi_thread_runtime_serves_another_runtime() {
        // Arrange
        let first_rt = tokio::runtime::Runtime::new().unwrap();

        // Act
        let (first, second, accepted) = exchange_then_stream_elsewhere(&first_rt);

        // Assert
        assert_eq!((first, second), (StatusCode::OK, StatusCode::OK));
        assert_eq!(accepted, 1);
    }

    #[test]
    fn a_current_thread_runtimes_connection_is_not_kept_for_another_one() {
        // Arrange
        let first_rt = current_thread();

        // Act: were it kept, the stream would wait forever on the idle runtime's socket.
        let (first, second, accepted) = exchange_then_stream_elsewhere(&first_rt);

        // Assert
        assert_eq!((first, second), (StatusCode::OK, StatusCode::OK));
        assert_eq!(accepted, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_connection_the_daemon_closed_is_replaced() {
        // Arrange: a server that closes every connection after its answer.
        let dir = tempfile::tempdir().unwrap();
        let (socket, accepted) = serve(dir.path(), false);
        let connections = Connections::new(socket);

        // Act
        let first = connections.exchange(get("/a")).await.unwrap();
        let second = connections.exchange(get("/b")).await.unwrap();

        // Assert
        assert_eq!((first.0, second.0), (StatusCode::OK, StatusCode::OK));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_streamed_answer_keeps_its_connection_to_itself() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let (socket, accepted) = serve(dir.path(), true);
        let connections = Connections::new(socket);

        // Act: an answer left unread, then an exchange beside it.
        let streamed = connections.send(get("/stream")).await.unwrap();
        let beside = connections.exchange(get("/b")).await.unwrap();
        let streamed_body = collect(streamed).await.unwrap();

        // Assert
        assert_eq!(
            (&streamed_body.1[..], &beside.1[..]),
            (&b"ok"[..], &b"ok"[..])
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }
}
