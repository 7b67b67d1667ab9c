//! Directory transfers (tar archives) and the files API beyond whole files: list, stat,
//! mkdir, remove.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, ReadBuf};

use crate::types::{ArchiveWritten, FileInfo, FileList};
use crate::{api_error, check, encode_bytes, parse, sandbox_path, Client, Error};

/// The error code of a guest path that does not exist (`404`), as opposed to `not_found`
/// for a sandbox that does not exist.
pub const PATH_NOT_FOUND: &str = "path_not_found";

impl Client {
    /// `PUT /v1/sandboxes/{id}/archive?path=`: streams the tar archive read from `source` to
    /// be extracted into the existing guest directory `path`.
    pub async fn put_archive(
        &self,
        id: &str,
        path: impl AsRef<[u8]>,
        source: impl AsyncRead + Send + Unpin + 'static,
    ) -> Result<ArchiveWritten, Error> {
        let uri = format!(
            "{}?path={}",
            sandbox_path(id, "/archive"),
            encode_bytes(path.as_ref())
        );
        let stream = self.connections.connect_stream().await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            // Errors surface through `send_request`; nothing to add here.
            let _ = connection.await;
        });
        let request = Request::builder()
            .method(Method::PUT)
            .uri(uri)
            .header(HOST, "bulkheadd")
            .header(CONTENT_TYPE, "application/x-tar")
            .body(ReaderBody::new(source))
            .map_err(|e| Error::Decode(format!("cannot build the request: {e}")))?;
        let response = sender.send_request(request).await?;
        let (status, body) = crate::http::collect(response).await?;
        parse(&check(status, &body)?)
    }

    /// `GET /v1/sandboxes/{id}/archive?path=`: streams a tar archive of the guest `path` (file,
    /// symlink or directory tree; entries start with its last component) into `sink`. The
    /// archive is the guest's: extract it with care (`bulkhead_protocol::archive::unpack`).
    /// On error `sink` may hold part of it.
    pub async fn get_archive(
        &self,
        id: &str,
        path: impl AsRef<[u8]>,
        sink: &mut (impl tokio::io::AsyncWrite + Unpin),
    ) -> Result<(), Error> {
        use http_body_util::BodyExt as _;
        use tokio::io::AsyncWriteExt as _;
        let uri = format!(
            "{}?path={}",
            sandbox_path(id, "/archive"),
            encode_bytes(path.as_ref())
        );
        let call = crate::http::Call {
            method: Method::GET,
            path: &uri,
            body: None,
            headers: &[],
        };
        let response = self.connections.send(call).await?;
        let status = response.status();
        if !status.is_success() {
            let (_, body) = crate::http::collect(response).await?;
            return Err(api_error(status, &body));
        }
        let mut body = response.into_body();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Error::Interrupted(e.to_string()))?;
            if let Ok(data) = frame.into_data() {
                sink.write_all(&data).await.map_err(Error::Sink)?;
            }
        }
        sink.flush().await.map_err(Error::Sink)?;
        Ok(())
    }

    /// `GET /v1/sandboxes/{id}/files/list?path=`: the entries of a guest directory.
    pub async fn list_files(
        &self,
        id: &str,
        path: impl AsRef<[u8]>,
    ) -> Result<Vec<FileInfo>, Error> {
        let uri = format!(
            "{}?path={}",
            sandbox_path(id, "/files/list"),
            encode_bytes(path.as_ref())
        );
        let list: FileList = self.json(Method::GET, &uri, None).await?;
        Ok(list.entries)
    }

    /// `GET /v1/sandboxes/{id}/files/stat?path=`: the guest path itself (a symlink is not
    /// followed), or `None` when it does not exist.
    pub async fn stat(&self, id: &str, path: impl AsRef<[u8]>) -> Result<Option<FileInfo>, Error> {
        let uri = format!(
            "{}?path={}",
            sandbox_path(id, "/files/stat"),
            encode_bytes(path.as_ref())
        );
        match self.json(Method::GET, &uri, None).await {
            Ok(info) => Ok(Some(info)),
            Err(Error::Api { code, .. }) if code == PATH_NOT_FOUND => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether the guest path exists (as [`Self::stat`]).
    pub async fn exists(&self, id: &str, path: impl AsRef<[u8]>) -> Result<bool, Error> {
        Ok(self.stat(id, path).await?.is_some())
    }

    /// `POST /v1/sandboxes/{id}/files/mkdir?path=&parents=`: creates a guest directory; with
    /// `parents`, missing parents too and no error when it exists.
    pub async fn make_dir(
        &self,
        id: &str,
        path: impl AsRef<[u8]>,
        parents: bool,
    ) -> Result<(), Error> {
        let uri = format!(
            "{}?path={}&parents={parents}",
            sandbox_path(id, "/files/mkdir"),
            encode_bytes(path.as_ref())
        );
        let (status, body) = self.raw(Method::POST, &uri, None, &[]).await?;
        check(status, &body).map(drop)
    }

    /// `DELETE /v1/sandboxes/{id}/files?path=&recursive=`: removes a guest path (a symlink
    /// itself); a non-empty directory needs `recursive`.
    pub async fn remove(
        &self,
        id: &str,
        path: impl AsRef<[u8]>,
        recursive: bool,
    ) -> Result<(), Error> {
        let uri = format!(
            "{}?path={}&recursive={recursive}",
            sandbox_path(id, "/files"),
            encode_bytes(path.as_ref())
        );
        let (status, body) = self.raw(Method::DELETE, &uri, None, &[]).await?;
        check(status, &body).map(drop)
    }
}

/// A request body read from an [`AsyncRead`] in chunks of up to 64 KiB.
struct ReaderBody<R> {
    reader: R,
    buf: Vec<u8>,
}

impl<R> ReaderBody<R> {
    fn new(reader: R) -> Self {
        Self {
            reader,
            buf: vec![0; 64 * 1024],
        }
    }
}

impl<R: AsyncRead + Unpin> Body for ReaderBody<R> {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let mut buf = ReadBuf::new(&mut this.buf);
        match Pin::new(&mut this.reader).poll_read(cx, &mut buf) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Ready(Ok(())) if buf.filled().is_empty() => Poll::Ready(None),
            Poll::Ready(Ok(())) => {
                Poll::Ready(Some(Ok(Frame::data(Bytes::copy_from_slice(buf.filled())))))
            }
        }
    }
}
