//! Membership and failure detection with foca (SWIM) over QUIC datagrams. foca is
//! sans-IO: this task owns it, feeds it packets and timers, and carries out what it
//! asks (sends, timers, notifications) through an accumulating runtime. The member
//! list it maintains is what push and pull choose peers from; no data rides on it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use foca::{AccumulatingRuntime, Config, Foca, OwnedNotification, PostcardCodec, Timer};
use rand::SeedableRng as _;
use tokio::sync::mpsc;

use super::Inner;

/// A node's identity in SWIM: its gossip address, its id, and a generation that grows
/// on every start and every renewal (so a restarted node, or one wrongly declared
/// down, wins over its old identity at the same address).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Ident {
    /// Gossip (QUIC) address.
    pub addr: SocketAddr,
    /// Node id (informational; empty for a seed not yet heard from).
    pub id: String,
    /// Generation.
    pub generation: u64,
}

impl foca::Identity for Ident {
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(Ident {
            generation: self.generation + 1,
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.generation > adversary.generation
    }
}

/// What the membership task reacts to.
#[derive(Debug)]
pub enum Input {
    /// A SWIM packet from a peer.
    Data(bytes::Bytes),
    /// A timer foca asked for, now due.
    Timer(Timer<Ident>),
    /// Leave the cluster (shutdown).
    Leave,
}

/// foca's packet size: at or below QUIC's datagram size right after the handshake
/// (FIELD-NOTES: 1162 before path MTU discovery).
pub const PACKET_MAX: usize = 1100;

fn config() -> Config {
    let mut c = Config::new_lan(NonZeroU32::new(8).expect("8 > 0"));
    c.max_packet_size = PACKET_MAX.try_into().expect("> 0");
    // Faster than memberlist's LAN defaults: ledger clusters are small, and a healed
    // partition should rejoin within seconds.
    c.probe_period = Duration::from_millis(500);
    c.probe_rtt = Duration::from_millis(250);
    c.suspect_to_down_after = Duration::from_secs(3);
    c.periodic_announce_to_down_members = Some(foca::PeriodicParams {
        frequency: Duration::from_secs(2),
        num_members: 2.try_into().expect("> 0"),
    });
    c
}

fn send(inner: &Arc<Inner>, to: SocketAddr, packet: bytes::Bytes) {
    if inner.isolated() {
        return;
    }
    match inner.cached(to) {
        Some(c) => {
            let _ = c.send_datagram(packet);
        }
        None => inner.dial_in_background(to, Some(packet)),
    }
}

/// The membership task.
pub(crate) async fn run(inner: Arc<Inner>, mut rx: mpsc::Receiver<Input>) {
    let generation = inner.cfg.generation.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1)
    });
    let me = Ident {
        addr: inner.cfg.identity_addr(),
        id: inner.cfg.node_id.clone(),
        generation,
    };
    let rng = rand::rngs::SmallRng::seed_from_u64(inner.cfg.rng_seed);
    let mut foca = Foca::new(me, config(), rng, PostcardCodec);
    let mut rt = AccumulatingRuntime::new();
    let announce = |foca: &mut Foca<Ident, PostcardCodec, rand::rngs::SmallRng, _>,
                    rt: &mut AccumulatingRuntime<Ident>,
                    inner: &Arc<Inner>| {
        let members = inner.members.lock().expect("members").clone();
        let seeds = inner.seed_addrs.lock().expect("seeds").clone();
        for s in &seeds {
            if !members.contains_key(s) {
                let _ = foca.announce(
                    Ident {
                        addr: *s,
                        id: String::new(),
                        generation: 0,
                    },
                    &mut *rt,
                );
            }
        }
    };
    announce(&mut foca, &mut rt, &inner);
    let mut reannounce = tokio::time::interval(Duration::from_secs(2));
    reannounce.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            input = rx.recv() => {
                let Some(input) = input else { return };
                let r = match input {
                    Input::Data(b) => foca.handle_data(&b, &mut rt),
                    Input::Timer(t) => foca.handle_timer(t, &mut rt),
                    Input::Leave => {
                        let _ = foca.leave_cluster(&mut rt);
                        drain(&inner, &mut rt);
                        return;
                    }
                };
                // A malformed or stray packet is an error here and changes nothing.
                let _ = r;
            }
            _ = reannounce.tick() => {
                if !inner.isolated() {
                    announce(&mut foca, &mut rt, &inner);
                }
            }
        }
        drain(&inner, &mut rt);
    }
}

fn drain(inner: &Arc<Inner>, rt: &mut AccumulatingRuntime<Ident>) {
    while let Some((to, packet)) = rt.to_send() {
        send(inner, to.addr, packet);
    }
    while let Some((after, timer)) = rt.to_schedule() {
        let tx = inner.foca_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            // foca requires every timer to be delivered: wait for room.
            let _ = tx.send(Input::Timer(timer)).await;
        });
    }
    while let Some(n) = rt.to_notify() {
        apply(&mut inner.members.lock().expect("members"), n);
    }
}

/// Applies one of foca's notifications to the live members, by address.
fn apply(members: &mut HashMap<SocketAddr, Ident>, n: OwnedNotification<Ident>) {
    match n {
        OwnedNotification::MemberUp(id) => {
            members.insert(id.addr, id);
        }
        // A newer generation at the same address stays (it already replaced this one).
        OwnedNotification::MemberDown(id)
            if members
                .get(&id.addr)
                .is_some_and(|m| m.generation <= id.generation) =>
        {
            members.remove(&id.addr);
        }
        // The new identity takes the old one's place only if the old one was live:
        // foca renames a down member to a newer down one without a `MemberDown` (and
        // a down one to a live one with a `MemberUp` after this), so inserting here
        // unconditionally kept a dead peer as a member for good.
        OwnedNotification::Rename(old, new) if members.remove(&old.addr).is_some() => {
            members.insert(new.addr, new);
        }
        _ => {}
    }
}

/// Resolves the seeds (`HOST:PORT` or `IP:PORT`) now and every 2 s, so a peer whose
/// name does not resolve yet (a pod still starting) is found when it does.
pub(crate) async fn resolve_seeds(inner: Arc<Inner>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut found = Vec::new();
        for s in &inner.cfg.seeds {
            let r =
                tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(s.as_str()))
                    .await;
            if let Ok(Ok(addrs)) = r {
                let own = (inner.cfg.listen, inner.cfg.identity_addr());
                found.extend(addrs.filter(|a| *a != own.0 && *a != own.1));
            }
        }
        found.sort();
        found.dedup();
        *inner.seed_addrs.lock().expect("seeds") = found;
    }
}

/// Feeds a connection's datagrams to the membership task until it closes.
pub(crate) async fn datagram_loop(inner: Arc<Inner>, conn: quinn::Connection) {
    while let Ok(b) = conn.read_datagram().await {
        if inner.isolated() {
            continue;
        }
        // A full queue drops the packet, as a lossy network would.
        let _ = inner.foca_tx.try_send(Input::Data(b));
    }
    let addr = conn.remote_address();
    let mut conns = inner.conns.lock().expect("conns");
    if conns
        .get(&addr)
        .is_some_and(|c| c.stable_id() == conn.stable_id())
    {
        conns.remove(&addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(port: u16, generation: u64) -> Ident {
        Ident {
            addr: SocketAddr::from(([10, 0, 0, 1], port)),
            id: format!("n{port}"),
            generation,
        }
    }

    #[test]
    fn a_down_member_renamed_to_a_newer_down_one_stays_gone() {
        let mut m = HashMap::new();
        apply(&mut m, OwnedNotification::MemberUp(id(1, 1)));
        apply(&mut m, OwnedNotification::MemberDown(id(1, 1)));
        assert!(m.is_empty());
        // It restarted (generation 2) elsewhere and died again: foca says only Rename.
        apply(&mut m, OwnedNotification::Rename(id(1, 1), id(1, 2)));
        assert!(m.is_empty(), "a dead peer must not come back: {m:?}");
    }

    #[test]
    fn renames_of_live_members_and_rejoins_keep_the_newest_identity() {
        let mut m = HashMap::new();
        apply(&mut m, OwnedNotification::MemberUp(id(1, 1)));
        // Live to live: only the rename.
        apply(&mut m, OwnedNotification::Rename(id(1, 1), id(1, 2)));
        assert_eq!(m[&id(1, 0).addr].generation, 2);
        // Down, then back: rename, then up.
        apply(&mut m, OwnedNotification::MemberDown(id(1, 2)));
        apply(&mut m, OwnedNotification::Rename(id(1, 2), id(1, 3)));
        apply(&mut m, OwnedNotification::MemberUp(id(1, 3)));
        assert_eq!(m[&id(1, 0).addr].generation, 3);
        // Live to down: rename, then down.
        apply(&mut m, OwnedNotification::Rename(id(1, 3), id(1, 4)));
        apply(&mut m, OwnedNotification::MemberDown(id(1, 4)));
        assert!(m.is_empty());
        // An older generation's down does not remove a newer live one.
        apply(&mut m, OwnedNotification::MemberUp(id(2, 5)));
        apply(&mut m, OwnedNotification::MemberDown(id(2, 4)));
        assert_eq!(m.len(), 1);
    }
}
