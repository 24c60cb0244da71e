//! A cap on the stream port's open TCP connections.
//!
//! Each accepted connection holds a permit for as long as it is open; one accepted
//! while every permit is held is closed at once (the agent sees its connection reset
//! and retries with its backoff) and counted. Without it, connections were bounded only
//! by the process's file descriptors: a client that opens connections and never
//! speaks could exhaust them and shut every agent out, the etcd client and the admin
//! endpoint included.
//!
//! The cap alone still let such clients hold every place for as long as they
//! liked. So a connection must also open a stream (an agent's `Sync`, which the leader
//! and a standby both serve) within the first-stream timeout of its accept, or it is
//! closed and counted as silent: its next read fails, and the HTTP/2 server drops it.
//! Bytes alone do not count: a client that sends the HTTP/2 preface, or a TLS
//! handshake, and then nothing, is as silent as one that sends nothing. The handlers
//! mark their connection with [`mark_stream_opened`], through the connection info
//! tonic puts in each request's extensions ([`ConnInfo`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};

/// The default cap: a fleet of thousands of gateways holds one connection each.
pub const CONNECTIONS_MAX_DEFAULT: usize = 16_384;

/// The default time a connection has to open its first stream: an agent opens its
/// stream as soon as its connection is up (TLS included), well inside it.
pub const FIRST_STREAM_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// Open connections at most, and the time each has to open a stream (see the module
/// docs).
#[derive(Debug)]
pub struct ConnectionCap {
    permits: Arc<Semaphore>,
    max: usize,
    refused: AtomicU64,
    first_stream_timeout: Duration,
    silent: Arc<AtomicU64>,
}

impl ConnectionCap {
    /// A cap of `max` connections (at least 1), each closed unless it opens a stream
    /// within `first_stream_timeout`.
    pub fn new(max: usize, first_stream_timeout: Duration) -> ConnectionCap {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        ConnectionCap {
            permits: Arc::new(Semaphore::new(max)),
            max,
            refused: AtomicU64::new(0),
            first_stream_timeout,
            silent: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Connections closed because they opened no stream within the first-stream
    /// timeout.
    pub fn silent(&self) -> u64 {
        self.silent.load(Ordering::Relaxed)
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
                opened: Arc::new(AtomicBool::new(false)),
                deadline: Some(Box::pin(tokio::time::sleep(self.first_stream_timeout))),
                expired: false,
                silent: Arc::clone(&self.silent),
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

/// An accepted connection holding its place under the cap until it closes, and closed
/// if it opens no stream in time.
#[derive(Debug)]
pub struct CountedStream {
    io: TcpStream,
    _permit: OwnedSemaphorePermit,
    /// Set by [`mark_stream_opened`] through the connection's [`ConnInfo`].
    opened: Arc<AtomicBool>,
    /// Until a stream opened (or the deadline passed); `None` after.
    deadline: Option<Pin<Box<Sleep>>>,
    /// The deadline passed with no stream: every read fails.
    expired: bool,
    silent: Arc<AtomicU64>,
}

impl CountedStream {
    /// Checks the first-stream deadline: an error once it passed with no stream opened.
    fn check_deadline(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let timed_out = || {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "no stream opened within the first-stream timeout",
            )
        };
        if self.expired {
            return Err(timed_out());
        }
        let Some(deadline) = self.deadline.as_mut() else {
            return Ok(());
        };
        if self.opened.load(Ordering::Acquire) {
            self.deadline = None;
            return Ok(());
        }
        if deadline.as_mut().poll(cx).is_ready() {
            self.deadline = None;
            self.expired = true;
            self.silent.fetch_add(1, Ordering::Relaxed);
            return Err(timed_out());
        }
        Ok(())
    }
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Err(e) = self.check_deadline(cx) {
            return Poll::Ready(Err(e));
        }
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

/// What tonic puts in each request's extensions for a [`CountedStream`] (inside a
/// [`TlsConnectInfo`] under TLS): the socket's addresses and the flag
/// [`mark_stream_opened`] sets.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    /// The socket's addresses.
    pub tcp: TcpConnectInfo,
    opened: Arc<AtomicBool>,
}

impl Connected for CountedStream {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            tcp: self.io.connect_info(),
            opened: Arc::clone(&self.opened),
        }
    }
}

/// Marks the connection `request` came on as having opened a stream: the first-stream
/// deadline no longer applies to it. A request from elsewhere (a test's in-process
/// transport) has no [`ConnInfo`] and is left alone.
pub fn mark_stream_opened<T>(request: &tonic::Request<T>) {
    let ext = request.extensions();
    let info = ext.get::<ConnInfo>().or_else(|| {
        ext.get::<TlsConnectInfo<ConnInfo>>()
            .map(TlsConnectInfo::get_ref)
    });
    if let Some(info) = info {
        info.opened.store(true, Ordering::Release);
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
        let cap = Arc::new(ConnectionCap::new(2, FIRST_STREAM_TIMEOUT_DEFAULT));
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
            s4.connect_info().tcp.local_addr(),
            Some(addr),
            "the connection info is the socket's"
        );
        drop(c4);
    }

    /// A connection that opens no stream in time fails its next read (the HTTP/2
    /// server then drops it) and is counted once; one whose stream opened reads on
    /// past the deadline.
    #[tokio::test]
    async fn a_connection_that_opens_no_stream_in_time_fails_and_one_that_did_reads_on() {
        use tokio::io::AsyncWriteExt;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let cap = Arc::new(ConnectionCap::new(4, Duration::from_millis(200)));
        let mut incoming = Box::pin(Arc::clone(&cap).incoming(l));
        // Silent: it sends bytes (the HTTP/2 preface), never a stream.
        let mut c1 = TcpStream::connect(addr).await.unwrap();
        let mut s1: CountedStream = tokio_stream::StreamExt::next(&mut incoming)
            .await
            .unwrap()
            .unwrap();
        c1.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let n = s1
            .read(&mut buf)
            .await
            .expect("bytes before the deadline are read");
        assert_eq!(n, 24);
        let t0 = std::time::Instant::now();
        let e = tokio::time::timeout(Duration::from_secs(5), s1.read(&mut buf))
            .await
            .expect("the deadline wakes the reader")
            .expect_err("no stream: the read fails");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert!(s1.read(&mut buf).await.is_err(), "and every read after");
        assert_eq!(cap.silent(), 1, "counted once");
        // Spoken: a handler marked it; it reads on past the deadline.
        let mut c2 = TcpStream::connect(addr).await.unwrap();
        let mut s2: CountedStream = tokio_stream::StreamExt::next(&mut incoming)
            .await
            .unwrap()
            .unwrap();
        let info = s2.connect_info();
        let mut req = tonic::Request::new(());
        req.extensions_mut().insert(info);
        mark_stream_opened(&req);
        tokio::time::sleep(Duration::from_millis(400)).await;
        c2.write_all(b"late").await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), s2.read(&mut buf))
            .await
            .unwrap()
            .expect("a connection with a stream is not timed out");
        assert_eq!(&buf[..n], b"late");
        assert_eq!(cap.silent(), 1);
        assert_eq!(
            cap.open(),
            2,
            "a failed connection holds its place until dropped"
        );
        drop(s1);
        assert_eq!(cap.open(), 1);
    }
}
