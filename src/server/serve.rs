//! Serving connections: hyper's HTTP/1 connection builder with a timer, so that a
//! client that sends half a header (or nothing after its last response) is closed after
//! [`ServerConfig::header_timeout`]; a cap on open connections
//! ([`ServerConfig::max_connections`]; beyond it new connections wait in the kernel's
//! accept queue until one closes); and a write timeout
//! ([`ServerConfig::write_timeout`]) that closes a connection whose client stopped
//! reading.
//!
//! axum's own `serve` gives hyper no timer (so hyper's header timeout is off) and has no
//! connection cap, hence this loop. The write timeout is hand-written (a small wrapper
//! around the socket, below) because neither hyper nor hyper-util has one, and the crate
//! that does (`tokio-io-timeout`) is not otherwise in the dependency tree.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Sleep;
use tower::Layer;

use super::Server;

#[cfg(doc)]
use super::ServerConfig;

impl Server {
    /// Serves this server's routes on `listener` until `shutdown` resolves, then lets
    /// the open connections finish their current request (callers bound that wait:
    /// [`Server::drain`] first, then a timeout around this future).
    ///
    /// # Errors
    ///
    /// Only if the connection cap's semaphore closes, which it never does.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let config = &self.shared.config;
        let max_connections = config.max_connections;
        let write_timeout = config.write_timeout;
        let permits = Arc::new(Semaphore::new(max_connections));
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(config.header_timeout)
            .keep_alive(true);
        let app = self.router();
        let (close_tx, close_rx) = watch::channel(false);
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => permit.map_err(io::Error::other)?,
                () = &mut shutdown => break,
            };
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, or a connection reset before it was
                        // accepted: wait a little rather than spin.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let _ = stream.set_nodelay(true);
            let io = TokioIo::new(WriteTimeout::new(stream, write_timeout));
            // Every request of the connection knows its peer (the tenant of requests
            // without an API key).
            let service = TowerToHyperService::new(
                axum::Extension(super::routes::Peer(peer.ip())).layer(app.clone()),
            );
            let conn = builder.serve_connection(io, service);
            let mut close = close_rx.clone();
            tokio::spawn(async move {
                let _permit = permit;
                tokio::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => {}
                    _ = close.changed() => {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            });
        }
        let _ = close_tx.send(true);
        // Every connection gives its permit back when it ends.
        let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
        let _ = permits.acquire_many(all).await;
        Ok(())
    }
}

/// A socket whose writes fail with [`io::ErrorKind::TimedOut`] once one has been
/// pending (the client not reading) for longer than the limit; hyper then closes the
/// connection, which drops the response stream and cancels its request.
struct WriteTimeout {
    inner: TcpStream,
    limit: Duration,
    /// Running while a write is pending.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl WriteTimeout {
    fn new(inner: TcpStream, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    /// Called when a write is pending: an error once it has been pending too long.
    fn check(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read its response in time (--write-timeout)",
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    fn track<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Pending => self.check(cx).map(Err),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl AsyncRead for WriteTimeout {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteTimeout {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.track(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.track(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.track(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
