"""Threads against one thread, sorted by how far apart the cores were at the time.

    python tools/threads_by_placement.py [--minutes 5] [--threads 2] [--batch 1,8]
                                         [--model hslm-3] [--steps 20]

On a virtual machine the hypervisor decides where the CPUs lie, and may move them while
a run goes on: on a shared 2-core AMD Zen 4 (2026-12-05) the two were on one die (a
cache line's round trip 57-107 ns) for minutes, then on two (310-750 ns) for seconds
to minutes, and batch 1 on two threads ran 1.70-1.79x one thread in the first case and
1.14-1.59x in the second. One `hslm bench` run takes a few rounds in whichever case the
machine is in; this tool takes many short rounds over some minutes and sorts them.

A round, for each batch: the speed-3 run on one thread takes --steps steps, then the run
on --threads threads takes as many, hslm/cores.py's probe measuring the farthest round
trip just before and just after the multi-thread part. A round counts as "near" when both
probes are under twice the smallest probe of the whole run, "far" when both are over
three times it, and is left out otherwise (the CPUs moved during the round). For each
batch and case it prints the rounds, the median step times and their ratio, and the
median of the rounds' ratios (each round's one-thread steps against its own
multi-thread ones, a minute's neighbour falling on both).

Beside the round trips, hslm/cores.py's fma_together measures just before and just after
each round whether every CPU had a core's arithmetic to itself (the FMA loop on all at
once, the slowest's pace against one alone). On the shared 2-core Intel Xeon
(2026-12-05) the two virtual CPUs were at moments one core's two hardware threads (a
round trip of 40 ns, the loop at half its pace on each), and a neighbour's thread on a
CPU's core halves it the same way. Rounds with a pace under HALF_CORE before or after
are counted apart ("half a core") and left out of both cases.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# after PYTHONPATH, so that PYTHONPATH=TREE measures that tree's hslm
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HALF_CORE = 0.75  # fma_together under this: a CPU shared its core's FMA pipes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--model", default="hslm-3")
    p.add_argument("--steps", type=int, default=20, help="steps a round, per run")
    a = p.parse_args(argv)

    import hslm  # noqa: F401 - before numba: hslm sets the vector width
    from hslm.bench import start_run
    from hslm.cores import farthest_round_trip_ns, fma_together
    from hslm.hyper import Hyper
    from hslm.train import load_corpus, resolve_config

    if farthest_round_trip_ns() is None:
        sys.exit("threads_by_placement: no round trip can be measured here (one CPU, or "
                 "threads cannot be pinned)")
    cfg = resolve_config(a.model)
    corpus = load_corpus(None, cfg)
    batches = [int(b) for b in a.batch.split(",")]
    runs = {(b, t): start_run(cfg, Hyper(batch=b, loss_positions=cfg.window, seed=1729),
                              corpus, 3, t)
            for b in batches for t in (1, a.threads)}

    def steps(b, t, n):
        run, runner = runs[(b, t)]["run"], runs[(b, t)]["runner"]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            run.train_step(runner)
            out.append(time.perf_counter() - t0)
        return float(np.median(out)) * 1e3

    # (one thread ms, threads ms, probe before, after, FMA pace before, after)
    rounds = {b: [] for b in batches}
    began = time.gmtime()
    end = time.time() + 60 * a.minutes
    try:
        while time.time() < end:
            for b in batches:
                n = max(2, a.steps // b)  # about as long a round whatever the batch
                one = steps(b, 1, n)
                before, pace = farthest_round_trip_ns(), fma_together()
                many = steps(b, a.threads, n)
                rounds[b].append((one, many, before, farthest_round_trip_ns(), pace,
                                  fma_together()))
    finally:
        for e in runs.values():
            e["runner"].close()

    probes = [x for rs in rounds.values() for r in rs for x in r[2:4] if x is not None]
    least = min(probes)
    print(f"{a.model}, speed 3, {a.threads} threads against 1, {a.minutes:g} minutes "
          f"({time.strftime('%Y-%m-%d %H:%M', began)}-{time.strftime('%H:%M UTC', time.gmtime())}"
          f"); the smallest round trip "
          f"seen {least:.0f} ns: near < {2 * least:.0f} ns, far > {3 * least:.0f} ns")
    def half_core(r):
        return any(x is not None and x < HALF_CORE for x in r[4:6])

    def case_of(r):  # "near", "far", or None: the CPUs moved during the round, or no probe
        if None in r[2:4]:
            return None
        if half_core(r):
            return "half a core"
        if max(r[2:4]) < 2 * least:
            return "near"
        return "far" if min(r[2:4]) > 3 * least else None

    for b in batches:
        for case in ("near", "far", "half a core"):
            rs = [r for r in rounds[b] if case_of(r) == case]
            if not rs:
                if case != "half a core":
                    print(f"  batch {b:>3}, {case}: no round")
                continue
            one, many = (float(np.median([r[k] for r in rs])) for k in (0, 1))
            ratio = float(np.median([r[0] / r[1] for r in rs]))
            spread = [min(r[0] / r[1] for r in rs), max(r[0] / r[1] for r in rs)]
            ns = [min(min(r[2:4]) for r in rs), max(max(r[2:4]) for r in rs)]
            paces = [x for r in rs for x in r[4:6] if x is not None]
            pace = f", FMA pace {min(paces):.2f}-{max(paces):.2f}" if paces else ""
            print(f"  batch {b:>3}, {case} ({ns[0]:.0f}-{ns[1]:.0f} ns{pace}), {len(rs):>3} "
                  f"rounds: 1 thread {one:7.2f} ms, {a.threads} threads {many:7.2f} ms a step; "
                  f"{ratio:.2f}x (rounds {spread[0]:.2f}-{spread[1]:.2f}x)")
        left = sum(1 for r in rounds[b] if case_of(r) is None)
        if left:
            print(f"  batch {b:>3}: {left} round(s) left out (the CPUs moved, or no probe)")


if __name__ == "__main__":
    main()
