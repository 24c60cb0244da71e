#!/usr/bin/env python3
"""Compares two bursar-sim executables on every built-in scenario, seeds 1-3: whether
their JSON reports are identical (the `speed` section aside) and, where not, the
summary figures side by side. For changes meant to move no decision (speed work) and
for those meant to move some (the rows that differ).

    cp target/release/bursar-sim /tmp/sim-old      # before the change
    cargo build -p bursar-sim --release
    python3 sim/scripts/compare_builds.py /tmp/sim-old target/release/bursar-sim

Compares the built-ins both executables list, and names those only one lists.
"""
import json
import subprocess
import sys
import tempfile

SEEDS = [1, 2, 3]
FIELDS = [
    ("utilization_vs_ideal", "util", "{:.3f}"),
    ("overshoot_max_fraction_of_burst", "over", "{:.2f}"),
    ("realloc_p95_ms", "realloc", "{}"),
    ("violations", "viol", "{}"),
    ("control_messages_per_agent_per_s", "msgs", "{:.1f}"),
    ("control_bytes_per_agent_per_s", "bytes", "{:.0f}"),
]


def scenarios(exe):
    out = subprocess.run([exe, "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def run(exe, scenario, seed):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            [exe, "run", scenario, "--seed", str(seed), "--json", f.name],
            capture_output=True,
            text=True,
        )
        with open(f.name) as fh:
            report = json.load(fh)
    report.pop("speed", None)
    return report


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = sys.argv[1], sys.argv[2]
    names_old, names_new = scenarios(old), scenarios(new)
    names = [n for n in names_new if n in names_old]
    for n in names_new:
        if n not in names_old:
            print(f"{n}: only in {new}, not compared", flush=True)
    for n in names_old:
        if n not in names_new:
            print(f"{n}: only in {old}, not compared", flush=True)
    differ = 0
    for name in names:
        for seed in SEEDS:
            a, b = run(old, name, seed), run(new, name, seed)
            if a == b:
                print(f"{name} seed {seed}: identical", flush=True)
                continue
            differ += 1
            sa, sb = a["summary"], b["summary"]
            cells = []
            for key, label, fmt in FIELDS:
                va, vb = sa.get(key), sb.get(key)
                if va == vb:
                    continue
                fa = "n/a" if va is None else fmt.format(va)
                fb = "n/a" if vb is None else fmt.format(vb)
                cells.append(f"{label} {fa} -> {fb}")
            detail = ", ".join(cells) if cells else "summary equal, details differ"
            print(f"{name} seed {seed}: {detail}", flush=True)
    print(f"{differ} of {len(names) * len(SEEDS)} runs differ")


if __name__ == "__main__":
    main()
