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
