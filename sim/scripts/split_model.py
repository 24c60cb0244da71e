#!/usr/bin/env python3
"""How much of one global token bucket (R, B) a fleet of N separate buckets can admit
when the split is fixed and perfect: no allocator, no messages, no estimation error.

The built-in `steady` and `zipf` loads (1.2 R per key, Poisson arrivals, costs uniform
in 20-200 tokens, R = 20,000/s, B = 4,000 as in the built-ins, then B = R, the rule's
default burst) over N gateways, 10 s, seeds 0-2. Every
bucket starts empty (as an agent's slice does, invariant 2); the ideal bucket starts
full, as the simulator's does. Prints the admitted fraction of what the ideal bucket
admitted for a few splits of rate and burst:

    python3 sim/scripts/split_model.py

This is the ceiling an allocator that splits (R, B) into per-gateway buckets can reach
on these loads, whatever it does between reports: what it loses is refill that falls
into a bucket that is full while another gateway rejects.
"""
import bisect
import math
import random

R, LOAD, T = 20000.0, 1.2, 10.0


def run(rates, bursts, shares, seed, B):
    rnd = random.Random(seed)
    n = len(rates)
    lam = LOAD * R / 110.0
    cum, acc = [], 0.0
    for s in shares:
        acc += s
        cum.append(acc)
    t = ti = 0.0
    ideal, ideal_adm, adm = B, 0, 0
    level, at = [0.0] * n, [0.0] * n
    while True:
        t += rnd.expovariate(lam)
        if t > T:
            break
        c = rnd.randint(20, 200)
        i = min(bisect.bisect_right(cum, rnd.random() * acc), n - 1)
        ideal = min(B, ideal + (t - ti) * R)
        ti = t
        if ideal >= c:
            ideal -= c
            ideal_adm += c
        level[i] = min(bursts[i], level[i] + (t - at[i]) * rates[i])
        at[i] = t
        if level[i] >= c:
            level[i] -= c
            adm += c
    return adm / ideal_adm


def mean(f):
    return sum(f(s) for s in range(3)) / 3


def split(weights, total):
    s = sum(weights)
    return [total * w / s for w in weights]


def main():
    for B, name, skew in [
        (4000.0, "steady", 0.0),
        (4000.0, "zipf", 1.0),
        (R, "steady", 0.0),
        (R, "zipf", 1.0),
    ]:
        for n in [4, 8, 16]:
            shares = split([1 / (r ** skew) for r in range(1, n + 1)], 1.0)
            demand = [LOAD * R * s for s in shares]
            rows = {
                "(R/N, B/N)": ([R / n] * n, [B / n] * n),
                "rate and burst by demand": (split(demand, R), split(demand, B)),
                "rate by demand, burst by sqrt": (
                    split(demand, R),
                    split([math.sqrt(d) for d in demand], B),
                ),
            }
            cells = [
                "{} {:.3f}".format(k, mean(lambda s, r=r, b=b: run(r, b, shares, s, B)))
                for k, (r, b) in rows.items()
            ]
            print("{:6} B={:5.0f} N={:2}: {}".format(name, B, n, "; ".join(cells)))


if __name__ == "__main__":
    main()
