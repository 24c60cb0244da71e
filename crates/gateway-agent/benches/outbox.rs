//! What the durable usage outbox costs the completion path: `Engine::complete` with the
//! outbox as sink, beside the same engine with the discarding sink. Two outbox rows:
//! the caller's own cost (the record is copied into a queue slot; the writer is not
//! running), and the same with the writer thread mapping, encoding and committing the
//! records to a real redb file meanwhile (on a 2-core machine it competes for the CPU).
//! Only the completions are timed; admitting them, and waiting for the commit between
//! batches, are not.
//!
//! Run: `cargo bench -p bursar-agent --bench outbox`
#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::sync::Arc;
use std::time::{Duration, Instant};

use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
use bursar_agent::testing::THREE_DIMENSIONS;
use bursar_agent::{
    AdmitRequest, CompletionStatus, Config, Cost, DiscardSink, Engine, Usage, UsageSink,
};
use criterion::{Criterion, criterion_group, criterion_main};

const BATCH: u64 = 2_048;

fn run(engine: &Engine, outbox: Option<&Outbox>, iters: u64, n: &mut u64) -> Duration {
    let mut timed = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let k = BATCH.min(iters - done);
        let ids: Vec<String> = (0..k).map(|i| format!("req-{}", *n + i)).collect();
        *n += k;
        let now = *n * 1_000;
        for id in &ids {
            let d = engine
                .admit(
                    now,
                    &AdmitRequest {
                        request_id: id,
                        domain: None,
                        descriptors: &[("org", "acme")],
                        cost: Cost {
                            requests: 1,
                            input_tokens: 100,
                            max_output_tokens: Some(50),
                        },
                        ttl_ms: None,
                    },
                )
                .expect("admit");
            assert!(d.is_admitted());
        }
        let usage = Usage {
            input_tokens: 90,
            cached_input_tokens: 0,
            output_tokens: 20,
        };
        let t = Instant::now();
        for id in &ids {
            engine
                .complete(now, id, usage, CompletionStatus::Ok)
                .expect("complete");
        }
        timed += t.elapsed();
        done += k;
        engine.maintain(now);
        if let Some(ob) = outbox {
            assert!(ob.durable_blocking(ob.ticket(), Duration::from_secs(30)));
            // One pretend ledger holds everything: the file stays small.
            ob.ack("bench-ledger", ob.last_seq());
        }
    }
    timed
}

fn complete(c: &mut Criterion) {
    let config = Config::from_toml(THREE_DIMENSIONS).expect("rules");
    let mut g = c.benchmark_group("complete (3 dimensions)");

    let discard = Engine::new(config.clone(), Arc::new(DiscardSink));
    let mut n = 0;
    g.bench_function("discard sink", |b| {
        b.iter_custom(|iters| run(&discard, None, iters, &mut n))
    });

    // The caller's own cost: a fresh engine and outbox per batch, the writer not
    // started, so nothing else runs while the completions are timed.
    let base = std::env::temp_dir().join(format!("bursar-bench-caller-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let mut batch_no = 0u64;
    let mut n = 0;
    g.bench_function("outbox sink, caller only (writer idle)", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                let k = BATCH.min(iters - done);
                batch_no += 1;
                let mut cfg = OutboxConfig::new(base.join(batch_no.to_string()), 1);
                cfg.queue_max = BATCH as usize;
                cfg.events_max = BATCH;
                let outbox = Arc::new(Outbox::open(cfg).expect("outbox"));
                let engine = Engine::new(config.clone(), Arc::clone(&outbox) as Arc<dyn UsageSink>);
                timed += run(&engine, None, k, &mut n);
                assert_eq!(outbox.queued() as u64, k);
                done += k;
                drop(engine);
                drop(outbox);
                let _ = std::fs::remove_dir_all(base.join(batch_no.to_string()));
            }
            timed
        })
    });

    let dir = std::env::temp_dir().join(format!("bursar-bench-outbox-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = OutboxConfig::new(dir.clone(), 1);
    cfg.queue_max = 4 * BATCH as usize;
    let outbox = Arc::new(Outbox::open(cfg).expect("outbox"));
    let engine = Engine::new(config.clone(), Arc::clone(&outbox) as Arc<dyn UsageSink>);
    outbox.start(
        config.rules.clone(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64,
    );
    let mut n = 0;
    g.bench_function("outbox sink, writer committing meanwhile", |b| {
        b.iter_custom(|iters| run(&engine, Some(&outbox), iters, &mut n))
    });
    g.finish();
    assert_eq!(outbox.dropped(), 0);
    outbox.close();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = complete
}
criterion_main!(benches);
