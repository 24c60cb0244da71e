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

/// A fresh directory for one test's files, removed when dropped (also when the test
/// fails).
fn scratch(test: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("bursar-sim-{test}-"))
        .tempdir()
        .expect("temp dir")
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
fn threads_are_one_or_two_and_either_gives_the_same_report() {
    for bad in ["0", "3", "two"] {
        let (code, _, err) = sim(&["run", "steady", "--threads", bad]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("--threads"), "{err}");
    }
    let dir = scratch("threads");
    let reports: Vec<serde_json::Value> = ["1", "2"]
        .iter()
        .map(|t| {
            let path = dir.path().join(format!("t{t}.json"));
            let args = [
                "run",
                "lossy",
                "--duration-s",
                "3",
                "--threads",
                t,
                "--json",
            ];
            let (code, _, err) = sim(&[&args[..], &[path.to_str().unwrap()]].concat());
            assert_eq!(code, 0, "{err}");
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            v.as_object_mut().unwrap().remove("speed"); // wall time: the one thing that differs
            v
        })
        .collect();
    assert_eq!(reports[0], reports[1]);
    assert!(reports[0]["counters"]["events"].as_u64().unwrap() > 0);
}

#[test]
fn a_missing_file_and_an_unknown_field_are_clear_errors() {
    let (code, _, err) = sim(&["run", "/nonexistent/x.toml"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/x.toml"), "{err}");

    let dir = scratch("cli");
    let path = dir.path().join("bad.toml");
    let text = include_str!("../scenarios/steady.toml").replace("keys = 4", "keys = 4\nkeyz = 1");
    std::fs::write(&path, text).unwrap();
    let (code, _, err) = sim(&["run", path.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown field `keyz`"), "{err}");

    let (code, _, err) = sim(&["run", "steady", "--gateways", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("`gateways`"), "{err}");

    for flag in ["--latency-ms", "--jitter-ms"] {
        let (code, _, err) = sim(&["compare", "steady", "--seeds", "1", flag, "-5"]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("must be 0 to 3,600,000"), "{err}");
    }
}

#[test]
fn slower_links_from_the_command_line_slow_a_new_keys_first_admission() {
    let dir = scratch("latency");
    let first_admit = |extra: &[&str]| {
        let path = dir.path().join("l.json");
        let mut args = vec![
            "run",
            "cold-keys",
            "--gateways",
            "4",
            "--duration-s",
            "1",
            "--json",
            path.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = sim(&args);
        assert_eq!(code, 0, "{out}{err}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["summary"]["violations"], 0);
        v["summary"]["cold_first_admit_p95_ms"].as_f64().unwrap()
    };
    let near = first_admit(&[]);
    // A new key waits for a report to reach the allocator and a grant to come back:
    // two one-way trips of at least 100 ms each.
    let far = first_admit(&["--latency-ms", "100", "--jitter-ms", "0"]);
    assert!(far >= near + 150.0, "near {near} ms, far {far} ms");
}

#[test]
fn a_run_writes_a_json_report_with_the_summary_fields() {
    let dir = scratch("json");
    let path = dir.path().join("r.json");
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
        "utilization_second_half",
        "realloc_p95_ms",
        "jain_fairness",
        "violations",
    ] {
        assert!(v["summary"].get(f).is_some(), "summary lacks {f}");
    }
    assert_eq!(v["summary"]["violations"], 0);
}

#[test]
fn a_sweep_prints_bound_beside_measured_per_point_and_writes_json() {
    let dir = scratch("sweep");
    let path = dir.path().join("sweep.json");
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
        let (lo, hi) = (
            p["utilization_second_half_min"].as_f64().unwrap(),
            p["utilization_second_half_max"].as_f64().unwrap(),
        );
        assert!(0.0 < lo && lo <= hi, "{p}");
    }
    // The overdraft point states a larger bound than the same point without it.
    let b0 = points[1]["bound_fraction_of_burst"].as_f64().unwrap();
    let b1 = points[3]["bound_fraction_of_burst"].as_f64().unwrap();
    assert_eq!(points[3]["overdraft_permille"], 100);
    assert!(b1 > b0, "O * T adds to the bound: {b0} -> {b1}");
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

/// Checks that `doc` is well-formed XML (the subset an SVG writer produces: a prolog,
/// elements with double-quoted attributes, escaped text) with one `svg` root, and
/// returns the `points` attribute of every `polyline`.
fn well_formed_svg(doc: &str) -> Result<Vec<String>, String> {
    let body = doc
        .strip_prefix("<?xml version=\"1.0\" encoding=\"UTF-8\"?>")
        .ok_or("no XML prolog")?;
    let mut stack: Vec<String> = Vec::new();
    let mut roots = 0;
    let mut polylines = Vec::new();
    let mut rest = body;
    while let Some(lt) = rest.find('<') {
        let text = &rest[..lt];
        check_text(text)?;
        if stack.is_empty() && !text.trim().is_empty() {
            return Err(format!("text outside the root: {text:?}"));
        }
        let gt = rest[lt..].find('>').ok_or("unterminated tag")? + lt;
        let tag = &rest[lt + 1..gt];
        rest = &rest[gt + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().ok_or(format!("</{name}> closes nothing"))?;
            if open != name.trim() {
                return Err(format!("<{open}> closed by </{name}>"));
            }
            continue;
        }
        let (tag, self_closed) = match tag.strip_suffix('/') {
            Some(t) => (t, true),
            None => (tag, false),
        };
        let name_end = tag.find(char::is_whitespace).unwrap_or(tag.len());
        let name = &tag[..name_end];
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(format!("bad element name in <{tag}>"));
        }
        let attrs = parse_attrs(&tag[name_end..])?;
        if stack.is_empty() {
            roots += 1;
            if name != "svg" {
                return Err(format!("root is <{name}>"));
            }
        }
        if name == "polyline" {
            let p = attrs
                .iter()
                .find(|(k, _)| k == "points")
                .ok_or("polyline without points")?;
            polylines.push(p.1.clone());
        }
        if !self_closed {
            stack.push(name.to_string());
        }
    }
    check_text(rest)?;
    if !rest.trim().is_empty() {
        return Err("text after the root".into());
    }
    if roots != 1 || !stack.is_empty() {
        return Err(format!("{roots} roots, unclosed: {stack:?}"));
    }
    Ok(polylines)
}

fn check_text(text: &str) -> Result<(), String> {
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        let semi = rest[amp..].find(';').ok_or("bare &")? + amp;
        let entity = &rest[amp + 1..semi];
        if !["amp", "lt", "gt", "quot", "apos"].contains(&entity) {
            return Err(format!("unknown entity &{entity};"));
        }
        rest = &rest[semi + 1..];
    }
    Ok(())
}

fn parse_attrs(mut s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out: Vec<(String, String)> = Vec::new();
    loop {
        s = s.trim_start();
        if s.is_empty() {
            return Ok(out);
        }
        let eq = s.find('=').ok_or(format!("attribute without value: {s}"))?;
        let name = s[..eq].to_string();
        if name.is_empty() || name.contains(char::is_whitespace) || name.contains('"') {
            return Err(format!("bad attribute name {name:?}"));
        }
        let v = s[eq + 1..].strip_prefix('"').ok_or("unquoted attribute")?;
        let end = v.find('"').ok_or("unterminated attribute")?;
        let value = &v[..end];
        if value.contains('<') {
            return Err("< in an attribute".into());
        }
        check_text(value)?;
        if out.iter().any(|(k, _)| *k == name) {
            return Err(format!("attribute {name} twice"));
        }
        out.push((name, value.to_string()));
        s = &v[end + 1..];
    }
}

#[test]
fn plot_writes_three_well_formed_svg_charts_with_the_runs_data() {
    // A directory that does not exist yet: `--plot` creates it.
    let tmp = scratch("plot");
    let dir = tmp.path().join("plot");
    let (code, out, err) = sim(&[
        "run",
        "partition-one",
        "--gateways",
        "4",
        "--keys",
        "2",
        "--duration-s",
        "6",
        "--plot",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let mut counts = Vec::new();
    for name in ["admitted.svg", "slices.svg", "overshoot.svg"] {
        let doc = std::fs::read_to_string(dir.join(name)).unwrap();
        let lines = well_formed_svg(&doc).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Every line has points, and at least one line moves (it carries data).
        let ys: Vec<Vec<f64>> = lines
            .iter()
            .map(|p| {
                p.split(' ')
                    .map(|xy| xy.split_once(',').unwrap().1.parse::<f64>().unwrap())
                    .collect()
            })
            .collect();
        assert!(ys.iter().all(|l| !l.is_empty()), "{name}: an empty line");
        assert!(
            ys.iter().any(|l| l.iter().any(|&y| y != l[0])),
            "{name}: every line is flat"
        );
        counts.push((lines.len(), ys.iter().map(Vec::len).max().unwrap()));
    }
    // admitted: offered, ideal, fleet and the limit; 6 s in 100 ms bins.
    assert_eq!(counts[0].0, 4);
    assert_eq!(counts[0].1, 60);
    // slices: the sum, R and one line per agent; one point per 50 ms sample.
    assert_eq!(counts[1].0, 2 + 4);
    assert!(counts[1].1 >= 120, "{counts:?}");
    // overshoot: bound, measured, instantaneous deficit (gateway 0 is cut off from
    // 2 s, its lease lapses, and the bound rises).
    assert_eq!(counts[2].0, 3);
    assert!(well_formed_svg("<?xml version=\"1.0\" encoding=\"UTF-8\"?><svg><g></svg>").is_err());
    assert!(
        well_formed_svg("<?xml version=\"1.0\" encoding=\"UTF-8\"?><svg a=\"x & y\"/>").is_err()
    );
}

#[test]
fn compare_runs_every_policy_and_fails_only_on_the_real_allocator() {
    let dir = scratch("compare");
    let path = dir.path().join("c.json");
    let (code, out, err) = sim(&[
        "compare",
        "steady",
        "--seeds",
        "1",
        "--gateways",
        "4",
        "--keys",
        "1",
        "--duration-s",
        "2",
        "--json",
        path.to_str().unwrap(),
    ]);
    // The Gubernator-like baseline overshoots (a violation of the bound it does not
    // state), but only the real allocator's violations fail the command.
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ps = v["policies"].as_array().unwrap();
    let names: Vec<&str> = ps.iter().map(|p| p["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["bursar", "static", "doorman", "gubernator"]);
    assert_eq!(ps[0]["violations"], 0);
    assert!(ps[3]["violations"].as_u64().unwrap() > 0, "{out}");
    for p in ps {
        let late = p["utilization_second_half_max"].as_f64().unwrap();
        assert!(late > 0.0 && late >= p["utilization_second_half_min"].as_f64().unwrap());
    }
    assert!(out.contains("second half"), "{out}");
    for n in names {
        assert!(out.lines().any(|l| l.starts_with(n)), "{out}");
    }
}
