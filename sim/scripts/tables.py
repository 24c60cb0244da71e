#!/usr/bin/env python3
"""Regenerates the tables in docs/simulation.md ("Results", "Policies") from runs of the
release binary: every built-in, seeds 1-3, under each policy. Prints Markdown.

    cargo build -p bursar-sim --release
    python3 sim/scripts/tables.py results      # the results table (real allocator)
    python3 sim/scripts/tables.py policies     # bursar / static / doorman / gubernator

Each run is `target/release/bursar-sim run <scenario> --seed <s> --policy <p> --json F`;
the tables give min-max over the seeds (max alone for overshoot).
"""
import json
import subprocess
import sys
import tempfile

BIN = "target/release/bursar-sim"
SEEDS = [1, 2, 3]


def built_ins():
    out = subprocess.run([BIN, "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def run(scenario, seed, policy):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        # Exit code 1 (a violation) still writes the report.
        subprocess.run(
            [BIN, "run", scenario, "--seed", str(seed), "--policy", policy, "--json", f.name],
            capture_output=True,
            text=True,
        )
        return json.load(open(f.name))


def rng(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else fmt.format(lo) + "-" + fmt.format(hi)


def results():
    print("| scenario | overshoot max | bound | utilization vs ideal | second half | realloc p95 ms | "
          "cold first admit p95 ms | Jain (min) | msgs/agent/s | bytes/agent/s | violations | events/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for sc in built_ins():
        rs = [run(sc, s, "bursar") for s in SEEDS]
        su = [r["summary"] for r in rs]
        realloc = [x["realloc_p95_ms"] for x in su]
        realloc_s = "n/a" if all(x is None for x in realloc) else ", ".join(f"{x:.0f}" for x in realloc)
        jain = [x["jain_fairness"] for x in su if x["jain_fairness"] is not None]
        print("| {} | {:.3f} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            sc,
            max(x["overshoot_max_fraction_of_burst"] for x in su),
            rng([x["bound_fraction_of_burst"] for x in su], "{:.2f}"),
            rng([x["utilization_vs_ideal"] for x in su], "{:.3f}"),
            rng([x["utilization_second_half"] for x in su], "{:.3f}"),
            realloc_s,
            rng([x["cold_first_admit_p95_ms"] for x in su], "{:.0f}"),
            f"{min(jain):.3f}" if jain else "n/a",
            rng([x["control_messages_per_agent_per_s"] for x in su], "{:.0f}"),
            rng([x["control_bytes_per_agent_per_s"] / 1000 for x in su], "{:.1f}k"),
            sum(x["violations"] for x in su),
            rng([r["speed"]["events_per_s"] / 1000 for r in rs], "{:.0f}k"),
        ))


POLICIES = ["bursar", "static", "doorman", "gubernator"]


def policies():
    print("| scenario | bursar | static R/N | doorman-like | gubernator-like | "
          "msgs/agent/s (bursar / doorman / gubernator) | realloc p95 ms (bursar / static / doorman / gubernator) |")
    print("|---|---|---|---|---|---|---|")
    for sc in built_ins():
        cells, msgs, realloc = [], [], []
        for p in POLICIES:
            su = [run(sc, s, p)["summary"] for s in SEEDS]
            over = max(x["overshoot_max_fraction_of_burst"] for x in su)
            viol = sum(x["violations"] for x in su)
            cell = "{:.2f} / {}".format(over, rng([x["utilization_vs_ideal"] for x in su], "{:.2f}"))
            if viol:
                cell += " (**{} violations**)".format(viol)
            cells.append(cell)
            if p != "static":
                msgs.append(rng([x["control_messages_per_agent_per_s"] for x in su], "{:.0f}"))
            realloc.append(rng([x["realloc_p95_ms"] for x in su], "{:.0f}"))
        print("| {} | {} | {} | {} |".format(
            sc, " | ".join(cells), " / ".join(msgs),
            "n/a" if all(r == "n/a" for r in realloc) else " / ".join(realloc)))


if __name__ == "__main__":
    {"results": results, "policies": policies}[sys.argv[1]]()
