//! The binary's interface: `list`, bad input as clear errors with exit code 2, and a
//! passing run with its JSON report.

use std::process::Command;

fn sim(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bursar-sim"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn list_names_every_built_in() {
    let (code, out, _) = sim(&["list"]);
    assert_eq!(code, 0);
    for name in [
        "steady",
        "zipf",
        "whale",
        "shift",
        "cold-keys",
        "partition-one",
    ] {
        assert!(out.contains(name), "{out}");
    }
}

#[test]
fn a_missing_file_and_an_unknown_field_are_clear_errors() {
    let (code, _, err) = sim(&["run", "/nonexistent/x.toml"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/x.toml"), "{err}");

    let dir = std::env::temp_dir().join(format!("bursar-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    let text = include_str!("../scenarios/steady.toml").replace("keys = 4", "keys = 4\nkeyz = 1");
    std::fs::write(&path, text).unwrap();
    let (code, _, err) = sim(&["run", path.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown field `keyz`"), "{err}");

    let (code, _, err) = sim(&["run", "steady", "--gateways", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("`gateways`"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_writes_a_json_report_with_the_summary_fields() {
    let dir = std::env::temp_dir().join(format!("bursar-sim-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("r.json");
    let (code, out, err) = sim(&[
        "run",
        "steady",
        "--seed",
        "3",
        "--gateways",
        "2",
        "--keys",
        "1",
        "--duration-s",
        "1",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["scenario"], "steady");
    assert_eq!(v["seed"], 3);
    assert_eq!(v["policy"], "bursar");
    for f in [
        "overshoot_max_fraction_of_burst",
        "bound_fraction_of_burst",
        "utilization_vs_ideal",
        "realloc_p95_ms",
        "jain_fairness",
        "violations",
    ] {
        assert!(v["summary"].get(f).is_some(), "summary lacks {f}");
    }
    assert_eq!(v["summary"]["violations"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sweep_prints_bound_beside_measured_per_point_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("bursar-sim-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sweep.json");
    let (code, out, err) = sim(&[
        "sweep",
        "partition-one",
        "--gateways",
        "4",
        "--keys",
        "1",
        "--duration-s",
        "4",
        "--report-interval-ms",
        "100,250",
        "--lease-ms",
        "1000",
        "--burst",
        "4000",
        "--overdraft-permille",
        "0,100",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("overshoot/B") && out.contains("bound/B"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let points = v["points"].as_array().unwrap();
    // One axis at a time around the scenario's (250 ms, 2 s, 4000, 0): 100 ms, the
    // scenario's own point, a 1 s lease, O = 100.
    assert_eq!(points.len(), 4, "{out}");
    assert_eq!(points[0]["report_interval_ms"], 100);
    assert_eq!(points[2]["lease_ms"], 1000);
    for p in points {
        assert_eq!(p["within"], true);
        let (m, b) = (
            p["overshoot_max_fraction_of_burst"].as_f64().unwrap(),
            p["bound_fraction_of_burst"].as_f64().unwrap(),
        );
        assert!(m <= b, "{p}");
        assert!(p["utilization_max"].as_f64().unwrap() > 0.0);
    }
    // The overdraft point states a larger bound than the same point without it.
    let b0 = points[1]["bound_fraction_of_burst"].as_f64().unwrap();
    let b1 = points[3]["bound_fraction_of_burst"].as_f64().unwrap();
    assert_eq!(points[3]["overdraft_permille"], 100);
    assert!(b1 > b0, "O * T adds to the bound: {b0} -> {b1}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sweep_exits_non_zero_when_a_point_measures_above_its_bound() {
    // The Gubernator-like policy states no bound, and its sync lag overshoots.
    let (code, out, _) = sim(&[
        "sweep",
        "steady",
        "--policy",
        "gubernator",
        "--gateways",
        "4",
        "--keys",
        "1",
        "--duration-s",
        "2",
        "--report-interval-ms",
        "250",
        "--lease-ms",
        "2000",
        "--burst",
        "4000",
        "--overdraft-permille",
        "0",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("ABOVE BOUND"), "{out}");
    assert!(
        out.contains("FAILED: replay with: bursar-sim run steady --seed 1 --gateways 4"),
        "{out}"
    );
}

#[test]
fn a_sweep_refuses_an_impossible_point_before_running_anything() {
    let (code, out, err) = sim(&["sweep", "steady", "--burst", "100"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("--burst 100") && err.contains("cost_max"),
        "{err}"
    );
}
