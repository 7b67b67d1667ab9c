//! One HTTP/1.1 exchange over a new Unix-socket connection.

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::Error;

/// Connects to `socket`, sends the request and returns the response with its body unread. The
/// connection lives until the body is read or dropped.
pub(crate) async fn send(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Bytes>,
    headers: &[(&str, &str)],
) -> Result<Response<Incoming>, Error> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| Error::Connect {
            path: socket.to_owned(),
            source,
        })?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // Errors surface through `send_request` or the body; nothing to add here.
        // With upgrades, so an attached exec (101) keeps its connection.
        let _ = connection.with_upgrades().await;
    });
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, "bulkheadd");
    if body.is_some()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        let is_file = path.contains("/files");
        let kind = if is_file {
            "application/octet-stream"
        } else {
            "application/json"
        };
        request = request.header(CONTENT_TYPE, kind);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(body.unwrap_or_default()))
        .map_err(|e| Error::Decode(format!("cannot build the request: {e}")))?;
    Ok(sender.send_request(request).await?)
}

/// Reads the whole body.
pub(crate) async fn collect(response: Response<Incoming>) -> Result<(StatusCode, Bytes), Error> {
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body))
}
