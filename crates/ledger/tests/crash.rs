//! Crash test: `kill -9` the real binary during ingest, restart it on the same data
//! directory, and check that every acknowledged event is present exactly once.
//!
//! Two client threads post batches continuously (retrying, after each restart, the
//! batch that was in flight when the node died, as a real client would). Each batch
//! is *acknowledged* (a 200 arrived), or *indeterminate* (sent, no answer: it may or
//! may not have committed). After the last restart the whole ledger is exported and
//! compared with what the clients saw. Jepsen-style counts are printed (run with
//! `cargo test -p bursar-ledger --test crash -- --nocapture`): attempted,
//! acknowledged (including retries after restarts), indeterminate at a kill, lost,
//! duplicated and phantom (present but never sent); the last three must be 0.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use common::{Node, export_all, now_ms, request, window};
use serde_json::{Value, json};

const CYCLES: usize = 3;
const BATCH: usize = 200;
const CLIENTS: usize = 2;

#[derive(Default)]
struct Tally {
    attempted: HashSet<String>,
    acknowledged: HashSet<String>,
    indeterminate: HashSet<String>,
}

fn batch(ids: &[String]) -> Vec<u8> {
    let t = now_ms() - 1000;
    let events: Vec<Value> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            json!({"request_id": id, "origin": "crash-client", "seq": i, "tenant": "acme",
                   "model": "m", "time_ms": t, "status": "ok",
                   "input_tokens": 10, "cached_input_tokens": 0, "output_tokens": 1})
        })
        .collect();
    serde_json::to_vec(&events).unwrap()
}

#[test]
fn every_acknowledged_event_survives_kill_9_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut tally = Tally::default();
    // The batch each client had in flight when the node died: retried after restart.
    let mut in_flight: Vec<Option<Vec<String>>> = vec![None; CLIENTS];
    let mut kills_mid_request = 0;
    let mut retried_found_committed = 0u64;
    for cycle in 0..CYCLES {
        let node = Node::start(dir.path(), &[]);
        let addr = node.addr;
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let retry = in_flight[c].take();
                let stop = stop.clone();
                thread::spawn(move || {
                    let mut mine = Tally::default();
                    let mut pending = None;
                    let mut next = 0usize;
                    let mut retry = retry;
                    let mut already_committed = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let is_retry = retry.is_some();
                        let ids: Vec<String> = retry.take().unwrap_or_else(|| {
                            next += 1;
                            (0..BATCH)
                                .map(|i| format!("c{cycle}-t{c}-b{next}-{i}"))
                                .collect()
                        });
                        mine.attempted.extend(ids.iter().cloned());
                        match request(addr, "POST", "/v1/events", &batch(&ids)) {
                            Ok(r) if r.status == 200 => {
                                if is_retry {
                                    // Committed before the kill, but never acknowledged.
                                    already_committed += r.json()["duplicate"].as_u64().unwrap();
                                }
                                mine.acknowledged.extend(ids);
                            }
                            Ok(r) => panic!("unexpected answer {}: {}", r.status, r.text()),
                            Err(_) => {
                                // The node died with this batch in flight.
                                pending = Some(ids);
                                break;
                            }
                        }
                    }
                    (mine, pending, already_committed)
                })
            })
            .collect();
        // Let ingest run, then kill -9 while the clients are still posting.
        thread::sleep(Duration::from_millis(400 + 300 * cycle as u64));
        let mut node = node;
        node.kill9();
        stop.store(true, Ordering::Relaxed);
        for (c, h) in handles.into_iter().enumerate() {
            let (mine, pending, committed) = h.join().unwrap();
            retried_found_committed += committed;
            tally.attempted.extend(mine.attempted);
            tally.acknowledged.extend(mine.acknowledged);
            if let Some(p) = pending {
                kills_mid_request += 1;
                tally.indeterminate.extend(p.iter().cloned());
                in_flight[c] = Some(p);
            }
        }
    }
    // Restart once more, retry what was in flight at the last kill, and read back.
    let node = Node::start(dir.path(), &[]);
    for ids in in_flight.into_iter().flatten() {
        let r = node.post("/v1/events", &batch(&ids));
        assert_eq!(r.status, 200, "{}", r.text());
        retried_found_committed += r.json()["duplicate"].as_u64().unwrap();
        tally.acknowledged.extend(ids);
    }
    let (from, to) = window();
    let exported = export_all(&node, from, to, 100_000);
    let mut seen: HashMap<String, u32> = HashMap::new();
    for e in &exported {
        *seen
            .entry(e["request_id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    let lost = tally
        .acknowledged
        .iter()
        .filter(|id| !seen.contains_key(*id))
        .count();
    let duplicated = seen.values().filter(|&&n| n > 1).count();
    let phantom = seen
        .keys()
        .filter(|id| !tally.attempted.contains(*id))
        .count();
    let root = node.get("/v1/digest").json()["root"]["events"]
        .as_u64()
        .unwrap();
    println!(
        "crash test: cycles={CYCLES} kills_mid_request={kills_mid_request} \
         attempted={} acknowledged={} indeterminate_at_kill={} \
         (of which committed before the kill, found on retry: {retried_found_committed}) \
         present={} lost={lost} duplicated={duplicated} phantom={phantom}",
        tally.attempted.len(),
        tally.acknowledged.len(),
        tally.indeterminate.len(),
        seen.len(),
    );
    assert!(kills_mid_request > 0, "no kill landed during a request");
    assert!(
        tally.acknowledged.len() >= CYCLES * BATCH,
        "too little was ingested for the test to mean anything"
    );
    assert_eq!(lost, 0, "acknowledged events lost");
    assert_eq!(duplicated, 0, "events present more than once");
    assert_eq!(phantom, 0, "events present that no client sent");
    assert_eq!(root, seen.len() as u64, "the digest counts another number");
    // Every retried in-flight batch ended up acknowledged, so all attempted are present.
    assert_eq!(seen.len(), tally.attempted.len());
}
