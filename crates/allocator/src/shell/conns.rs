//! A cap on the stream port's open TCP connections.
//!
//! Each accepted connection holds a permit for as long as it is open; one accepted
//! while every permit is held is closed at once (the agent sees its connection reset
//! and retries with its backoff) and counted. Without it, connections were bounded only
//! by the process's file descriptors: a client that opens connections and never
//! speaks could exhaust them and shut every agent out, the etcd client and the admin
//! endpoint included.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The default cap: a fleet of thousands of gateways holds one connection each.
pub const CONNECTIONS_MAX_DEFAULT: usize = 16_384;

/// Open connections at most (see the module docs).
#[derive(Debug)]
pub struct ConnectionCap {
    permits: Arc<Semaphore>,
    max: usize,
    refused: AtomicU64,
}

impl ConnectionCap {
    /// A cap of `max` connections (at least 1).
    pub fn new(max: usize) -> ConnectionCap {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        ConnectionCap {
            permits: Arc::new(Semaphore::new(max)),
            max,
            refused: AtomicU64::new(0),
        }
    }

    /// The cap.
    pub fn max(&self) -> u64 {
        self.max as u64
    }

    /// Connections open now.
    pub fn open(&self) -> u64 {
        self.max.saturating_sub(self.permits.available_permits()) as u64
    }

    /// Connections closed at accept because the cap was reached.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// `stream`, counted, or `None` (and the stream closed) at the cap.
    pub fn admit(&self, stream: TcpStream) -> Option<CountedStream> {
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => Some(CountedStream {
                io: stream,
                _permit: permit,
            }),
            Err(_) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// The connections `listener` accepts, with `TCP_NODELAY` (a small grant must not
    /// wait on Nagle's algorithm and the agent's delayed ACK, ~40 ms), within the cap.
    pub fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
    ) -> impl Stream<Item = io::Result<CountedStream>> + Send + 'static {
        tokio_stream::StreamExt::filter_map(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            move |conn| match conn {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    self.admit(s).map(Ok)
                }
                Err(e) => Some(Err(e)),
            },
        )
    }
}

/// An accepted connection holding its place under the cap until it closes.
#[derive(Debug)]
pub struct CountedStream {
    io: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl Connected for CountedStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// Past the cap a connection is closed at once and counted; one closing frees its
    /// place.
    #[tokio::test]
    async fn connections_past_the_cap_are_closed_and_a_closed_one_frees_its_place() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let cap = Arc::new(ConnectionCap::new(2));
        let mut incoming = Box::pin(Arc::clone(&cap).incoming(l));
        let c1 = TcpStream::connect(addr).await.unwrap();
        let s1 = tokio_stream::StreamExt::next(&mut incoming)
            .await
            .unwrap()
            .unwrap();
        let _c2 = TcpStream::connect(addr).await.unwrap();
        let _s2 = tokio_stream::StreamExt::next(&mut incoming)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((cap.open(), cap.refused()), (2, 0));
        // The third is accepted and closed: its client reads end-of-stream.
        let mut c3 = TcpStream::connect(addr).await.unwrap();
        let waiting = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            tokio_stream::StreamExt::next(&mut incoming),
        )
        .await;
        assert!(waiting.is_err(), "nothing yielded past the cap");
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), c3.read(&mut byte))
            .await
            .expect("closed at once");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
        assert!(cap.refused() >= 1);
        assert_eq!(cap.open(), 2);
        // One closes: the next connection gets its place.
        drop(s1);
        drop(c1);
        let c4 = TcpStream::connect(addr).await.unwrap();
        let s4 = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            tokio_stream::StreamExt::next(&mut incoming),
        )
        .await
        .expect("admitted once a place is free")
        .unwrap()
        .unwrap();
        assert_eq!(cap.open(), 2);
        assert_eq!(
            s4.connect_info().local_addr(),
            Some(addr),
            "the connection info is the socket's"
        );
        drop(c4);
    }
}
