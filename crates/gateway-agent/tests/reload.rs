//! Rules reloads (`Engine::reload`): new numbers apply without a restart and without a
//! fresh burst; anything else is refused with the field named, and changes nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bursar_agent::testing::engine;
use bursar_agent::{
    AdmitRequest, Completion, CompletionStatus, Config, Cost, Decision, DiscardSink, Engine,
    RejectReason, ReloadError, ReloadSummary, SliceSource, Usage,
};

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const ORG: [(&str, &str); 1] = [("org", "acme")];

/// Two rules: requests per org (`rate`/`burst` as given, `mode`), and a concurrency
/// limit per org (`slots`).
fn rules(rate: u64, burst: u64, mode: &str, slots: u64) -> String {
    format!(
        r#"
[[rule]]
name = "org-rps"
match = {{ org = "*" }}
dimension = "requests"
rate = {rate}
per = "second"
burst = {burst}
mode = "{mode}"

[[rule]]
name = "org-conc"
match = {{ org = "*" }}
dimension = "concurrency"
max_in_flight = {slots}
"#
    )
}

fn config(toml: &str) -> Config {
    Config::from_toml(toml).expect("valid rules")
}

fn admit(e: &Engine, now: u64, id: &str) -> bool {
    let r = AdmitRequest {
        request_id: id,
        domain: None,
        descriptors: &ORG,
        cost: Cost::ONE_REQUEST,
        ttl_ms: None,
    };
    e.admit(now, &r).expect("decided").is_admitted()
}

fn reason(d: &Decision) -> RejectReason {
    match d {
        Decision::Rejected(r) => r.reason,
        Decision::Admitted(_) => panic!("admitted: {d:?}"),
    }
}

fn complete(e: &Engine, now: u64, id: &str) -> Completion {
    e.complete(now, id, Usage::default(), CompletionStatus::Ok)
        .expect("known")
}

/// Admits and completes at once, `n` times; how many were admitted.
fn burst_of(e: &Engine, now: u64, tag: &str, n: usize) -> usize {
    (0..n)
        .filter(|i| {
            let id = format!("{tag}-{i}");
            let ok = admit(e, now, &id);
            if ok {
                complete(e, now, &id);
            }
            ok
        })
        .count()
}

#[test]
fn a_shrink_clamps_at_once_and_a_growth_refills_at_the_new_rate_without_a_fresh_burst() {
    let e = engine(&rules(10, 10, "enforce", 100));
    assert_eq!(burst_of(&e, SEC, "a", 4), 4, "a full bucket of 10 admits 4");
    // Shrink to 5: the 6 left are clamped to 5.
    let s = e.reload(SEC, config(&rules(5, 5, "enforce", 100))).unwrap();
    assert_eq!(s.changed, ["org-rps"]);
    assert_eq!(s.keys_updated, 1, "the one key of the changed rule");
    assert_eq!(burst_of(&e, SEC, "b", 10), 5, "clamped to the new burst");
    // Grow to 100/s, burst 100: the empty bucket is not refilled by the reload...
    e.reload(SEC, config(&rules(100, 100, "enforce", 100)))
        .unwrap();
    assert_eq!(burst_of(&e, SEC, "c", 10), 0, "a growth hands out no burst");
    // ...but refills at the new rate: 100/s for 100 ms is 10.
    assert_eq!(burst_of(&e, SEC + 100 * MS, "d", 20), 10);
    e.check_invariants(SEC + 100 * MS).unwrap();
    assert_eq!(e.reloads(), 2);
}

#[test]
fn a_rule_turned_from_shadow_to_enforce_starts_rejecting() {
    let e = engine(&rules(1, 1, "shadow", 100));
    assert_eq!(burst_of(&e, SEC, "a", 5), 5, "a shadow rule never rejects");
    e.reload(SEC, config(&rules(1, 1, "enforce", 100))).unwrap();
    let r = AdmitRequest {
        request_id: "b",
        domain: None,
        descriptors: &ORG,
        cost: Cost::ONE_REQUEST,
        ttl_ms: None,
    };
    let d = e.admit(SEC, &r).unwrap();
    assert!(
        matches!(reason(&d), RejectReason::RetryLater { .. }),
        "{d:?}"
    );
}

#[test]
fn reservations_held_across_a_reload_settle_once_on_the_new_slot() {
    let e = engine(&rules(10, 10, "enforce", 3));
    for id in ["r1", "r2", "r3"] {
        assert!(admit(&e, SEC, id));
    }
    assert!(!admit(&e, SEC, "r4"), "three slots, three in flight");
    // Down to one slot with three in flight: nothing more until two have ended.
    let s = e.reload(SEC, config(&rules(10, 10, "enforce", 1))).unwrap();
    assert_eq!(s.changed, ["org-conc"]);
    assert_eq!(complete(&e, SEC, "r1"), Completion::Settled);
    assert!(!admit(&e, SEC, "r5"), "two in flight, one slot");
    assert_eq!(complete(&e, SEC, "r2"), Completion::Settled);
    assert!(!admit(&e, SEC, "r6"), "one in flight, one slot");
    assert_eq!(complete(&e, SEC, "r3"), Completion::Settled);
    assert_eq!(complete(&e, SEC, "r3"), Completion::Duplicate);
    assert!(admit(&e, SEC, "r7"), "all released, one slot free");
    complete(&e, SEC, "r7");
    e.check_invariants(SEC).unwrap();
}

#[test]
fn the_rules_in_force_read_the_same_file_do_nothing() {
    let toml = rules(10, 10, "enforce", 3);
    let e = engine(&toml);
    let before = e.rules().canonical();
    assert_eq!(
        e.reload(SEC, config(&toml)).unwrap(),
        ReloadSummary::default()
    );
    assert_eq!(e.rules().canonical(), before);
    assert_eq!(e.reloads(), 0);
}

#[test]
fn a_reload_that_changes_what_keys_are_is_refused_and_changes_nothing() {
    let e = engine(&rules(10, 10, "enforce", 3));
    assert_eq!(burst_of(&e, SEC, "a", 4), 4);
    let version = e.rules().canonical();
    let refused = |toml: &str| e.reload(SEC, config(toml)).unwrap_err();

    let renamed = rules(10, 10, "enforce", 3).replace("org-conc", "org-inflight");
    assert_eq!(
        refused(&renamed).to_string(),
        "the file has rule #2 `org-inflight` where the rules in force have rule #2 \
         `org-conc`; adding, removing, renaming or reordering rules needs a restart of the agent"
    );
    let added = format!(
        "{}\n[[rule]]\nname = \"user-rps\"\nmatch = {{ user = \"*\" }}\n\
         dimension = \"requests\"\nrate = 1\nper = \"second\"\n",
        rules(10, 10, "enforce", 3)
    );
    assert!(matches!(
        refused(&added),
        ReloadError::RulesDiffer { ref found, ref in_force }
            if found == "rule #3 `user-rps`" && in_force == "no rule #3"
    ));
    let matched = rules(10, 10, "enforce", 3).replacen("org = \"*\"", "team = \"*\"", 1);
    assert_eq!(
        refused(&matched),
        ReloadError::Structure {
            rule: "org-rps".into(),
            field: "match"
        }
    );
    let per = rules(10, 10, "enforce", 3).replace("per = \"second\"", "per = \"minute\"");
    assert_eq!(
        refused(&per),
        ReloadError::Structure {
            rule: "org-rps".into(),
            field: "per"
        }
    );
    let settings = format!("[engine]\nmax_keys = 7\n{}", rules(10, 10, "enforce", 3));
    let err = refused(&settings);
    assert_eq!(err, ReloadError::EngineSettings { field: "max_keys" });
    assert!(err.to_string().contains("restart the agent"), "{err}");

    // Nothing moved: the same rules, and the bucket's 6 left.
    assert_eq!(e.rules().canonical(), version);
    assert_eq!(e.reloads(), 0);
    assert_eq!(burst_of(&e, SEC, "b", 10), 6);
}

#[test]
fn an_allocated_engine_keeps_its_grants_and_takes_the_new_never_fits_bound() {
    let mut cfg = config(&rules(1000, 1000, "enforce", 3));
    cfg.engine.slice_source = SliceSource::Allocated;
    let e = Arc::new(Engine::new(
        cfg,
        Arc::new(bursar_agent::MemorySink::new(100)),
    ));
    let r = |id: &'static str, n: u64| AdmitRequest {
        request_id: id,
        domain: None,
        descriptors: &ORG,
        cost: Cost {
            requests: n,
            input_tokens: 0,
            max_output_tokens: None,
        },
        ttl_ms: None,
    };
    // Closed until granted: a retry-later, not a never-fits, for 500 of 1,000.
    let d = e.admit(SEC, &r("a", 500)).unwrap();
    assert!(
        matches!(reason(&d), RejectReason::RetryLater { .. }),
        "{d:?}"
    );
    let mut smaller = config(&rules(100, 100, "enforce", 3));
    smaller.engine.slice_source = SliceSource::Allocated;
    let s = e.reload(SEC, smaller).unwrap();
    assert_eq!(s.keys_updated, 1, "the closed key shows the new limit");
    let d = e.admit(SEC, &r("b", 500)).unwrap();
    assert!(
        matches!(
            reason(&d),
            RejectReason::NeverFits {
                cost: 500,
                burst: 100
            }
        ),
        "{d:?}"
    );
    e.check_invariants(SEC).unwrap();
}

/// Admissions on two threads while a third reloads the limit back and forth: what was
/// admitted in the whole run stays within the largest burst plus the largest rate over
/// the run (invariant 2 across reloads: no reload refills a bucket), and the engine's
/// invariants hold after.
#[test]
fn reloads_under_load_never_hand_out_more_than_the_largest_limit_allows() {
    let e = engine(&rules(50, 50, "enforce", 1_000));
    let clock = Arc::new(AtomicU64::new(SEC));
    let stop = Arc::new(AtomicBool::new(false));
    let admitted = Arc::new(AtomicU64::new(0));
    let reloads = std::thread::scope(|s| {
        for t in 0..2 {
            let (e, clock, stop, admitted) = (&e, &clock, &stop, &admitted);
            s.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let now = clock.load(Ordering::Relaxed);
                    let id = format!("t{t}-{i}");
                    i += 1;
                    if admit(e, now, &id) {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        complete(e, now, &id);
                    }
                }
            });
        }
        let mut reloads = 0;
        // 200 steps of 5 ms (1 s of engine time), a reload at each: 50 and 100 per
        // second, burst 50 and 100, in turn.
        for step in 0..200u64 {
            let big = step % 2 == 0;
            let (rate, burst) = if big { (100, 100) } else { (50, 50) };
            let now = clock.load(Ordering::Relaxed);
            e.reload(now, config(&rules(rate, burst, "enforce", 1_000)))
                .unwrap();
            reloads += 1;
            std::thread::sleep(std::time::Duration::from_micros(200));
            clock.fetch_add(5 * MS, Ordering::Relaxed);
        }
        stop.store(true, Ordering::Relaxed);
        reloads
    });
    let end = clock.load(Ordering::Relaxed);
    e.check_invariants(end).unwrap();
    assert_eq!(e.reloads(), reloads);
    // The first burst (50) plus at most 100/s over the 1 s the clock moved.
    let bound = 50 + 100 * (end - SEC) / SEC;
    let got = admitted.load(Ordering::Relaxed);
    assert!(got <= bound, "admitted {got}, bound {bound}");
    assert!(got >= 50, "the first burst at least: {got}");
}

/// `bursar-agent check-config NEW --reload-from OLD`: a dry run of the reload an agent
/// running OLD would make (exit 0 and what changes, or 1 and why it would refuse).
#[test]
fn check_config_says_whether_a_reload_would_take_the_file() {
    let dir = std::env::temp_dir().join(format!("bursar-reload-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let old = write("old.toml", &rules(10, 10, "enforce", 3));
    let run = |new: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bursar-agent"))
            .arg("check-config")
            .arg(new)
            .arg("--reload-from")
            .arg(&old)
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .output()
            .expect("run bursar-agent");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text)
    };
    let (code, text) = run(&write("numbers.toml", &rules(20, 20, "enforce", 3)));
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("would apply; changed org-rps"), "{text}");
    let (code, text) = run(&write(
        "renamed.toml",
        &rules(10, 10, "enforce", 3).replace("org-conc", "org-slots"),
    ));
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("would be refused") && text.contains("org-slots"),
        "{text}"
    );
    let (code, text) = run(&old);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("no change"), "{text}");
    // A new proxy key (read only at start) with a new number: refused, as the running
    // agent's reload would be.
    let keyed = format!(
        "{}\n[[api_key]]\nsha256 = \"{}\"\ndescriptors = {{ org = \"acme\" }}\n",
        rules(20, 20, "enforce", 3),
        "ab".repeat(32)
    );
    let (code, text) = run(&write("keyed.toml", &keyed));
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("[[api_key]] entries differ"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Review, twenty-fifth session: a retry of a live lease after a reload shrank its
/// rule below the request's cost was answered "never fits" instead of with its lease.
#[test]
fn a_retry_of_a_live_lease_is_answered_with_it_after_a_reload_shrinks_the_rule() {
    let e = Engine::new(
        config(&rules(10, 10, "enforce", 100)),
        Arc::new(DiscardSink),
    );
    let r = AdmitRequest {
        request_id: "big",
        domain: None,
        descriptors: &ORG,
        cost: Cost {
            requests: 5,
            input_tokens: 0,
            max_output_tokens: Some(0),
        },
        ttl_ms: None,
    };
    assert!(e.admit(0, &r).unwrap().is_admitted());
    e.reload(SEC, config(&rules(2, 2, "enforce", 100))).unwrap();
    match e.admit(SEC, &r).unwrap() {
        Decision::Admitted(a) => assert!(a.replayed, "a new admission: {a:?}"),
        d => panic!("the retry was not answered with its lease: {d:?}"),
    }
    assert_eq!(e.leases_in_flight(), 1);
}
