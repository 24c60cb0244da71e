//! Exchanges over QUIC streams: push of new batches, and the anti-entropy round (the
//! steps of [`crate::reconcile`] carried over one bidirectional stream). Every event
//! received is applied through the node's single writer, durably, before the
//! exchange moves on: a peer's acknowledgement means the events are on its disk.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::RngExt as _;
use tokio::sync::mpsc;

use super::Inner;
use super::frame::{self, EventBatch, FrameError, Msg, WireBucket};
use crate::digest::Bucket;
use crate::event::Event;
use crate::merge::ApplyReport;
use crate::reconcile::{self, Offer};

/// Why an exchange ended early. Nothing after the failing step was applied; whatever
/// was applied before it was applied durably and is correct on its own (merge is a
/// set union).
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// A malformed frame.
    #[error("{0}")]
    Frame(#[from] FrameError),
    /// The connection or stream failed.
    #[error("transport: {0}")]
    Transport(String),
    /// The peer sent an unexpected message or an error.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The local store or writer failed.
    #[error("local: {0}")]
    Local(String),
    /// The deadline passed.
    #[error("timed out")]
    Timeout,
}

fn transport(e: impl std::fmt::Display) -> ExchangeError {
    ExchangeError::Transport(e.to_string())
}

/// One side of a stream.
pub(crate) struct Channel<'a> {
    inner: &'a Inner,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl Channel<'_> {
    async fn send(&mut self, msg: &Msg) -> Result<usize, ExchangeError> {
        let b = frame::encode(msg);
        self.send.write_all(&b).await.map_err(transport)?;
        self.inner
            .stats
            .bytes_sent
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok(b.len())
    }

    async fn recv(&mut self) -> Result<Msg, ExchangeError> {
        let mut head = [0u8; frame::HEADER_BYTES];
        read_exact(&mut self.recv, &mut head).await?;
        let h = frame::decode_header(&head, self.inner.cfg.frame_max).inspect_err(|_| {
            self.inner
                .stats
                .frames_rejected
                .fetch_add(1, Ordering::Relaxed);
        })?;
        let payload = read_payload(&mut self.recv, h.len).await?;
        self.inner
            .stats
            .bytes_received
            .fetch_add((frame::HEADER_BYTES + h.len) as u64, Ordering::Relaxed);
        let msg = frame::decode_payload(h, &payload).inspect_err(|_| {
            self.inner
                .stats
                .frames_rejected
                .fetch_add(1, Ordering::Relaxed);
        })?;
        if let Msg::Error(e) = msg {
            return Err(ExchangeError::Protocol(format!("peer: {e}")));
        }
        Ok(msg)
    }

    fn events(&self, b: &EventBatch) -> Result<Vec<Event>, ExchangeError> {
        frame::decode_events(
            b,
            &self.inner.cfg.limits,
            message_events_max(&self.inner.cfg.reconcile),
            message_bytes_max(&self.inner.cfg.reconcile).max(PUSH_BYTES_MAX),
        )
        .inspect_err(|_| {
            self.inner
                .stats
                .frames_rejected
                .fetch_add(1, Ordering::Relaxed);
        })
        .map_err(ExchangeError::from)
    }

    async fn finish(mut self) {
        let _ = self.send.finish();
        // Give the peer a moment to read the last frame before the stream is dropped.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.send.stopped()).await;
    }
}

/// A frame's payload of `len` bytes, the buffer grown as the bytes arrive: a header
/// alone (12 bytes claiming the 32 MiB bound) commits no memory; a peer must send the
/// bytes it claims. (It was allocated whole from the header, before the first byte.)
async fn read_payload(r: &mut quinn::RecvStream, len: usize) -> Result<Vec<u8>, ExchangeError> {
    const CHUNK: usize = 64 << 10;
    let mut buf = Vec::with_capacity(len.min(CHUNK));
    while buf.len() < len {
        match r
            .read_chunk((len - buf.len()).min(CHUNK), true)
            .await
            .map_err(transport)?
        {
            Some(c) => buf.extend_from_slice(&c.bytes),
            None => return Err(ExchangeError::Frame(FrameError::Truncated("stream ended"))),
        }
    }
    Ok(buf)
}

async fn read_exact(r: &mut quinn::RecvStream, buf: &mut [u8]) -> Result<(), ExchangeError> {
    r.read_exact(buf).await.map_err(|e| match e {
        quinn::ReadExactError::FinishedEarly(_) => {
            ExchangeError::Frame(FrameError::Truncated("stream ended"))
        }
        quinn::ReadExactError::ReadError(e) => transport(e),
    })
}

/// An answer as the responder sends it.
pub(crate) fn answer_msg(ans: &reconcile::Answer) -> Msg {
    Msg::Answer {
        events: frame::encode_events(&ans.events),
        want: ans.want.iter().map(WireBucket::from).collect(),
        split: ans
            .split
            .iter()
            .map(|(b, subs)| {
                (
                    WireBucket::from(b),
                    subs.iter().map(|d| d.to_bytes().to_vec()).collect(),
                )
            })
            .collect(),
        truncated: ans.truncated,
    }
}

/// Most events in one push batch.
pub const PUSH_EVENTS_MAX: usize = 50_000;

/// This node's reconcile bounds for one round, with the next window seed: a sub-bucket
/// too large for one message sends a different window of its events every round, and
/// successive seeds spread the windows evenly (random ones left stretches unvisited for
/// many rounds).
fn round_limits(inner: &Inner) -> reconcile::ReconcileLimits {
    static WINDOW_SEEDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    reconcile::ReconcileLimits {
        window_seed: WINDOW_SEEDS.fetch_add(1, Ordering::Relaxed),
        ..inner.cfg.reconcile
    }
}

/// Most events one message may carry: what a receiver accepts, and what every sender
/// keeps to (a message over it is refused whole, and the same round would be refused
/// again each time).
pub fn message_events_max(limits: &reconcile::ReconcileLimits) -> usize {
    limits.events_max.max(PUSH_EVENTS_MAX) * 2
}

/// Most bytes of events (by `reconcile::event_wire_bytes`) one message carries: its
/// own events (`bytes_max`) and the conflict winners it returns (a third as much
/// again). With the answer's lists of buckets it stays inside the frame
/// ([`crate::cluster::ClusterConfig::validate`] checks it).
pub fn message_bytes_max(limits: &reconcile::ReconcileLimits) -> usize {
    limits.bytes_max + limits.bytes_max / 3
}

/// Cuts `events` to `limits`' message bounds, by count and by bytes. Only returned
/// conflict winners are ever cut (what comes before them is within `events_max` and
/// `bytes_max`): their buckets still differ, so the next round sends them again.
fn cut_to(events: &mut Vec<Event>, limits: &reconcile::ReconcileLimits) -> bool {
    let (max, bytes_max) = (message_events_max(limits), message_bytes_max(limits));
    let mut bytes = 0usize;
    let keep = events
        .iter()
        .take(max)
        .position(|e| {
            bytes += reconcile::event_wire_bytes(e);
            bytes > bytes_max
        })
        .unwrap_or(events.len().min(max));
    let cut = keep < events.len();
    events.truncate(keep);
    cut
}

async fn apply(inner: &Inner, events: Vec<Event>) -> Result<ApplyReport, ExchangeError> {
    if events.is_empty() {
        return Ok(ApplyReport::default());
    }
    let w = inner
        .writer()
        .ok_or_else(|| ExchangeError::Local("shutting down".into()))?;
    w.apply_from_peer(events)
        .await
        .map_err(ExchangeError::Local)
}

async fn blocking<T: Send + 'static>(
    inner: &Arc<Inner>,
    f: impl FnOnce(&crate::RedbStore) -> Result<T, crate::StoreError> + Send + 'static,
) -> Result<T, ExchangeError> {
    let store = inner.store.clone();
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(|e| ExchangeError::Local(e.to_string()))?
        .map_err(|e| ExchangeError::Local(e.to_string()))
}

// ---- Serving peers ----

/// Serves a connection's incoming streams until it closes.
pub(crate) async fn serve_streams(inner: Arc<Inner>, conn: quinn::Connection) {
    while let Ok((send, recv)) = conn.accept_bi().await {
        if inner.isolated() {
            conn.close(1u32.into(), b"isolated");
            return;
        }
        let inner = inner.clone();
        tokio::spawn(async move {
            let timeout = inner.cfg.exchange_timeout;
            let mut ch = Channel {
                inner: &inner,
                send,
                recv,
            };
            let r = tokio::time::timeout(timeout, respond(&inner, &mut ch)).await;
            let r = r.unwrap_or(Err(ExchangeError::Timeout));
            inner.stats.exchanges_served.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = r {
                // Bounded too: a peer that does not read (the exchange may have timed
                // out on exactly that) would hold this task and its stream for ever.
                let told = tokio::time::timeout(
                    Duration::from_secs(1),
                    ch.send(&Msg::Error(e.to_string())),
                )
                .await;
                if !matches!(told, Ok(Ok(_))) {
                    let _ = ch.send.reset(0u32.into());
                    return;
                }
            }
            ch.finish().await;
        });
    }
}

async fn respond(inner: &Arc<Inner>, ch: &mut Channel<'_>) -> Result<(), ExchangeError> {
    match ch.recv().await? {
        Msg::Push(batch) => {
            let events = ch.events(&batch)?;
            let r = apply(inner, events).await?;
            ch.send(&Msg::PushAck {
                new: r.new,
                duplicate: r.duplicate,
                conflict: r.conflict,
            })
            .await?;
            Ok(())
        }
        Msg::Root(root) => {
            let theirs = frame::digest(&root)?;
            let mine = blocking(inner, crate::Store::root).await?;
            if mine == theirs {
                ch.send(&Msg::Done).await?;
                return Ok(());
            }
            let Some(_slot) = inner.try_round() else {
                ch.send(&Msg::Busy).await?;
                return Ok(());
            };
            ch.send(&Msg::Differ).await?;
            let Msg::Offer {
                root,
                buckets,
                from_hour,
                from_tenant,
                to_hour,
                to_tenant,
            } = ch.recv().await?
            else {
                return Err(ExchangeError::Protocol("expected an offer".into()));
            };
            let offer = Offer {
                root: frame::digest(&root)?,
                buckets: frame::digests(buckets)?,
                from: Bucket {
                    hour: from_hour,
                    tenant: from_tenant,
                },
                to: Bucket {
                    hour: to_hour,
                    tenant: to_tenant,
                },
            };
            let limits = round_limits(inner);
            let ans = blocking(inner, move |s| reconcile::answer(s, &offer, &limits)).await?;
            inner
                .stats
                .sync_events_sent
                .fetch_add(ans.events.len() as u64, Ordering::Relaxed);
            ch.send(&answer_msg(&ans)).await?;
            let Msg::Serve { events, sub_wants } = ch.recv().await? else {
                return Err(ExchangeError::Protocol("expected serve".into()));
            };
            let events = ch.events(&events)?;
            inner
                .stats
                .sync_events_received
                .fetch_add(events.len() as u64, Ordering::Relaxed);
            let wants: Vec<(Bucket, Vec<u8>)> = sub_wants
                .into_iter()
                .map(|(b, s)| (Bucket::from(b), s))
                .collect();
            // Serve the sub-buckets before applying, so the initiator does not get its
            // own events back.
            let mut back =
                blocking(inner, move |s| reconcile::serve_subs(s, &wants, &limits)).await?;
            let report = apply(inner, events.clone()).await?;
            let won = blocking(inner, move |s| reconcile::winners(s, &events, &report)).await?;
            back.extend(won);
            cut_to(&mut back, &limits);
            inner
                .stats
                .sync_events_sent
                .fetch_add(back.len() as u64, Ordering::Relaxed);
            ch.send(&Msg::Back(frame::encode_events(&back))).await?;
            let Msg::Last(last) = ch.recv().await? else {
                return Err(ExchangeError::Protocol("expected last".into()));
            };
            let last = ch.events(&last)?;
            inner
                .stats
                .sync_events_received
                .fetch_add(last.len() as u64, Ordering::Relaxed);
            apply(inner, last).await?;
            ch.send(&Msg::Done).await?;
            Ok(())
        }
        other => Err(ExchangeError::Protocol(format!(
            "unexpected first message (type {})",
            other.type_byte()
        ))),
    }
}

// ---- Initiating ----

async fn open(
    inner: &Arc<Inner>,
    peer: SocketAddr,
) -> Result<(quinn::SendStream, quinn::RecvStream), ExchangeError> {
    let conn = inner
        .exchange_connection(peer)
        .await
        .map_err(ExchangeError::Transport)?;
    conn.open_bi().await.map_err(transport)
}

/// Pushes `batch` (already encoded) to `peer`; returns the peer's counts.
pub(crate) async fn push_to(
    inner: &Arc<Inner>,
    peer: SocketAddr,
    batch: &EventBatch,
) -> Result<(u64, u64, u64), ExchangeError> {
    let (send, recv) = open(inner, peer).await?;
    let mut ch = Channel { inner, send, recv };
    let bytes = ch.send(&Msg::Push(batch.clone())).await?;
    inner
        .stats
        .push_bytes
        .fetch_add(bytes as u64, Ordering::Relaxed);
    let r = match ch.recv().await? {
        Msg::PushAck {
            new,
            duplicate,
            conflict,
        } => Ok((new, duplicate, conflict)),
        _ => Err(ExchangeError::Protocol("expected a push ack".into())),
    };
    ch.finish().await;
    r
}

/// What one anti-entropy round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// The roots were equal: nothing was exchanged beyond them.
    pub in_sync: bool,
    /// One side was in another round; nothing was exchanged.
    pub busy: bool,
    /// Events sent.
    pub sent: u64,
    /// Events received.
    pub received: u64,
    /// The round was cut at a bound or covered only part of the range: run another.
    pub more: bool,
}

/// One anti-entropy round with `peer`, as initiator.
pub(crate) async fn sync_with(
    inner: &Arc<Inner>,
    peer: SocketAddr,
) -> Result<RoundReport, ExchangeError> {
    let (send, recv) = open(inner, peer).await?;
    let mut ch = Channel { inner, send, recv };
    let root = blocking(inner, crate::Store::root).await?;
    ch.send(&Msg::Root(root.to_bytes().to_vec())).await?;
    match ch.recv().await? {
        Msg::Done => {
            ch.finish().await;
            *inner.sync_to.lock().expect("sync_to") = reconcile::newest_end();
            return Ok(RoundReport {
                in_sync: true,
                ..RoundReport::default()
            });
        }
        Msg::Differ => {}
        Msg::Busy => {
            ch.finish().await;
            return Ok(RoundReport {
                busy: true,
                ..RoundReport::default()
            });
        }
        _ => return Err(ExchangeError::Protocol("expected done or differ".into())),
    }
    let limits = round_limits(inner);
    let to = inner.sync_to.lock().expect("sync_to").clone();
    let offer = blocking(inner, move |s| reconcile::offer(s, &to, &limits)).await?;
    ch.send(&frame::offer_msg(&offer)).await?;
    let Msg::Answer {
        events,
        want,
        split,
        truncated,
    } = ch.recv().await?
    else {
        return Err(ExchangeError::Protocol("expected an answer".into()));
    };
    let theirs = ch.events(&events)?;
    let want: Vec<Bucket> = want.into_iter().map(Bucket::from).collect();
    let mut split_in = Vec::with_capacity(split.len());
    for (b, subs) in split {
        let subs = subs
            .iter()
            .map(|d| frame::digest(d))
            .collect::<Result<Vec<_>, _>>()?;
        if subs.len() != reconcile::SUB_BUCKETS {
            return Err(ExchangeError::Protocol("wrong sub-digest count".into()));
        }
        split_in.push((Bucket::from(b), subs));
    }
    let nothing_differs = want.is_empty() && split_in.is_empty();
    let (mut mine, serve_cut, sub_wants) = blocking(inner, move |s| {
        let (mut events, cut) = reconcile::serve(s, &want, &limits)?;
        // The sub-buckets' events share the serve's `events_max` and `bytes_max`, so
        // that with the winners below the message stays within its bounds.
        let bytes: usize = events.iter().map(reconcile::event_wire_bytes).sum();
        let room = reconcile::ReconcileLimits {
            events_max: limits.events_max.saturating_sub(events.len()),
            bytes_max: limits.bytes_max.saturating_sub(bytes),
            ..limits
        };
        let (sub_wants, sub_events) = reconcile::split_request(s, &split_in, &room)?;
        events.extend(sub_events);
        Ok((events, cut, sub_wants))
    })
    .await?;
    let received_first = theirs.len() as u64;
    let report = apply(inner, theirs.clone()).await?;
    let won = blocking(inner, move |s| reconcile::winners(s, &theirs, &report)).await?;
    mine.extend(won);
    let winners_cut = cut_to(&mut mine, &limits);
    let sent_first = mine.len() as u64;
    ch.send(&Msg::Serve {
        events: frame::encode_events(&mine),
        sub_wants: sub_wants
            .into_iter()
            .map(|(b, s)| (WireBucket::from(&b), s))
            .collect(),
    })
    .await?;
    let Msg::Back(back) = ch.recv().await? else {
        return Err(ExchangeError::Protocol("expected back".into()));
    };
    let back = ch.events(&back)?;
    let received_back = back.len() as u64;
    let report = apply(inner, back.clone()).await?;
    let mut last = blocking(inner, move |s| reconcile::winners(s, &back, &report)).await?;
    let last_cut = cut_to(&mut last, &limits);
    let sent_last = last.len() as u64;
    ch.send(&Msg::Last(frame::encode_events(&last))).await?;
    match ch.recv().await? {
        Msg::Done => {}
        _ => return Err(ExchangeError::Protocol("expected done".into())),
    }
    ch.finish().await;
    let cut_short = truncated || serve_cut || winners_cut || last_cut;
    *inner.sync_to.lock().expect("sync_to") =
        reconcile::next_to(&offer, nothing_differs, cut_short);
    let r = RoundReport {
        in_sync: false,
        busy: false,
        sent: sent_first + sent_last,
        received: received_first + received_back,
        more: truncated
            || serve_cut
            || winners_cut
            || last_cut
            || nothing_differs
            || !mine.is_empty()
            // The responder's sub-bucket events may have stopped at its bound too (a
            // large one-sided split bucket drains a message per round, back to back).
            || received_back > 0,
    };
    inner
        .stats
        .sync_events_sent
        .fetch_add(r.sent, Ordering::Relaxed);
    inner
        .stats
        .sync_events_received
        .fetch_add(r.received, Ordering::Relaxed);
    Ok(r)
}

// ---- Background loops ----

/// Pushes newly committed local batches to `push_fanout` random live peers.
pub(crate) async fn push_loop(inner: Arc<Inner>, mut rx: mpsc::Receiver<Vec<Event>>) {
    while let Some(mut events) = rx.recv().await {
        // Coalesce what is waiting, up to one push's bound.
        while events.len() < PUSH_EVENTS_MAX {
            match rx.try_recv() {
                Ok(mut more) => events.append(&mut more),
                Err(_) => break,
            }
        }
        if inner.isolated() {
            inner.stats.push_failed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        // One group commit may hold more than a push's bound: push it in parts (a
        // batch over the receiver's bound is refused whole).
        for part in push_parts(&events) {
            push_part(&inner, part).await;
        }
    }
}

/// Most bytes of events (by `reconcile::event_wire_bytes`) in one push batch: well
/// inside the frame. A count alone was no bound: 50,000 events of long ids and
/// descriptors are 35 MB, and a receiver refuses a frame over 32 MiB whole.
pub const PUSH_BYTES_MAX: usize = 8 << 20;

/// `events` in runs of at most [`PUSH_EVENTS_MAX`] events and [`PUSH_BYTES_MAX`] bytes
/// (one event at least).
fn push_parts(events: &[Event]) -> impl Iterator<Item = &[Event]> {
    let mut rest = events;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (mut n, mut bytes) = (0, 0);
        while n < rest.len() && n < PUSH_EVENTS_MAX {
            let b = reconcile::event_wire_bytes(&rest[n]);
            if n > 0 && bytes + b > PUSH_BYTES_MAX {
                break;
            }
            bytes += b;
            n += 1;
        }
        let (run, tail) = rest.split_at(n);
        rest = tail;
        Some(run)
    })
}

/// Pushes one batch of at most [`PUSH_EVENTS_MAX`] events to `push_fanout` random
/// live peers.
async fn push_part(inner: &Arc<Inner>, events: &[Event]) {
    let batch = Arc::new(frame::encode_events(events));
    let n = events.len() as u64;
    let peers = inner.pick_peers(inner.cfg.push_fanout);
    let mut tasks = Vec::with_capacity(peers.len());
    for p in peers {
        let inner = inner.clone();
        let batch = batch.clone();
        tasks.push(tokio::spawn(async move {
            let t = inner.cfg.exchange_timeout;
            let r = tokio::time::timeout(t, push_to(&inner, p, &batch)).await;
            match r {
                Ok(Ok(_)) => {
                    inner.stats.push_ok.fetch_add(1, Ordering::Relaxed);
                    inner.stats.push_events.fetch_add(n, Ordering::Relaxed);
                }
                _ => {
                    inner.stats.push_failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Runs an anti-entropy round with a random live peer every `sync_interval` (with
/// jitter), and again at once while rounds move data.
pub(crate) async fn sync_loop(inner: Arc<Inner>) {
    loop {
        let base = inner.cfg.sync_interval;
        let jitter = {
            let mut rng = inner.rng.lock().expect("rng");
            rng.random_range(0..=base.as_millis() as u64 / 4)
        };
        tokio::time::sleep(base + Duration::from_millis(jitter)).await;
        if inner.isolated() {
            continue;
        }
        let Some(peer) = inner.pick_peers(1).pop() else {
            continue;
        };
        let Some(_slot) = inner.try_round() else {
            inner.stats.sync_busy.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        for _ in 0..64 {
            let t = inner.cfg.exchange_timeout;
            match tokio::time::timeout(t, sync_with(&inner, peer)).await {
                Ok(Ok(r)) if r.busy => {
                    inner.stats.sync_busy.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Ok(Ok(r)) if r.in_sync => {
                    inner.stats.sync_in_sync.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Ok(Ok(r)) => {
                    inner.stats.sync_reconciled.fetch_add(1, Ordering::Relaxed);
                    if !r.more {
                        break;
                    }
                }
                Ok(Err(e)) => {
                    inner.stats.sync_failed.fetch_add(1, Ordering::Relaxed);
                    let _ = e;
                    break;
                }
                Err(_) => {
                    inner.stats.sync_failed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}
