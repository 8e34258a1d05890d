"""Two versions of hslm timed against each other in one process, step by step.

    python tools/ab_steps.py TREE_A TREE_B [--steps 30] [--batch 8] [--threads 1]
                             [--model hslm-3]

TREE_A and TREE_B are folders holding an `hslm` package (a checkout, a `git worktree`).
Each is copied under a name of its own (hslm_a, hslm_b) into a temporary folder, both are
imported into one process, and each trains the same seeded run at speed 3 on the
built-in corpus, the two taking turns step by step (A B, B A, A B, ...). So a neighbour
who slows the machine for a minute slows both alike: on these shared machines `hslm
bench` run minutes apart moves by 10-20%, while the ratio of steps taken side by side
moves by about 1%.

The version loaded second ran about 5% slower than the first with identical code (the
same tree twice, on an AMD Zen 4, 2026-12-04: its steps 1.046-1.059x the first's, the
quartiles of 30 pairs; a third copy as slow as the second, while two runs of one package
showed no difference: docs/performance-history.md), so the comparison is made twice, in
two processes, A loaded first and then B first, and each ratio given is sqrt(r1 / r2): r1 = B / A with B
loaded second, r2 = A / B with A loaded second; a bias of the load order cancels. Each
r is the median over the pairs of steps of their ratio, for the whole step and for each
phase the step times (the windows' forward and backward, the weight gradients, the
optimiser). Both versions must end with the same parameters, byte for byte (checked,
and said); where a change is meant to move bits, say so with --bits-differ.

Needs Numba's cache to be warm for neither: each process compiles what it lacks (a
NUMBA_CACHE_DIR of its own keeps the copies apart from a checkout's cache). Environment
variables pass through, so `NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""` compares the
AVX2 builds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time


def load(tree: str, name: str, into: str):
    """The hslm package of `tree`, imported as `name` (a copy in `into`)."""
    shutil.copytree(os.path.join(tree, "hslm"), os.path.join(into, name),
                    ignore=shutil.ignore_patterns("__pycache__"))
    if into not in sys.path:
        sys.path.insert(0, into)
    return importlib.import_module(name)


def side_by_side(trees, steps, batch, threads, model):
    """Steps of the two trees in turns, in this process: per tree its step times and
    phase times (lists of seconds), and each tree's parameters' bytes at the end."""
    into = tempfile.mkdtemp(prefix="hslm-ab-")
    runs = []
    try:
        for tree, name in zip(trees, ("hslm_a", "hslm_b")):
            pkg = load(tree, name, into)
            train = importlib.import_module(f"{pkg.__name__}.train")
            hyper = importlib.import_module(f"{pkg.__name__}.hyper")
            step = importlib.import_module(f"{pkg.__name__}.step")
            cfg = train.resolve_config(model)
            h = hyper.Hyper(batch=batch, seed=1729, loss_positions=cfg.window)
            run = train.Run.fresh(cfg, h, train.load_corpus(None, cfg), plain=False)
            runner = step.StepRunner(cfg, 3, threads)
            run.train_step(runner)  # compiles (or loads), untimed
            runs.append((run, runner))
        times = [{"step": []}, {"step": []}]
        for i in range(steps):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                run, runner = runs[j]
                runner.timings = {}
                t0 = time.perf_counter()
                run.train_step(runner)
                times[j]["step"].append(time.perf_counter() - t0)
                for phase, seconds in runner.timings.items():
                    times[j].setdefault(phase, []).append(seconds)
        return times, [run.state.theta.tobytes() for run, _ in runs]
    finally:
        for _, runner in runs:
            runner.close()
        shutil.rmtree(into, ignore_errors=True)


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def one_order(args):
    """This process's half: the second tree's median step ratio to the first's, per
    phase, and the medians themselves; printed as JSON for the parent."""
    times, thetas = side_by_side([args.first, args.second], args.steps, args.batch,
                                 args.threads, args.model)
    out = {"same_bits": thetas[0] == thetas[1], "phases": {}}
    for phase in times[0]:
        a, b = times[0][phase], times[1][phase]
        out["phases"][phase] = {"ratio": median([y / x for x, y in zip(a, b)]),
                                "first_ms": 1e3 * median(a), "second_ms": 1e3 * median(b)}
    print(json.dumps(out))


def run_order(first, second, args):
    cmd = [sys.executable, __file__, "--one-order", first, second, "--steps", str(args.steps),
           "--batch", str(args.batch), "--threads", str(args.threads), "--model", args.model]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ab_steps: the run with {first} loaded first failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree_a")
    ap.add_argument("tree_b")
    ap.add_argument("--steps", type=int, default=30, help="pairs of steps (default 30)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="hslm-3")
    ap.add_argument("--bits-differ", action="store_true",
                    help="the versions are meant to end with different parameters")
    ap.add_argument("--one-order", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_order:
        args.first, args.second = args.tree_a, args.tree_b
        return one_order(args)
    for tree in (args.tree_a, args.tree_b):
        if not os.path.isfile(os.path.join(tree, "hslm", "__init__.py")):
            sys.exit(f"ab_steps: {tree} holds no hslm package (hslm/__init__.py)")
    ab = run_order(args.tree_a, args.tree_b, args)  # B loaded second: B / A
    ba = run_order(args.tree_b, args.tree_a, args)  # A loaded second: A / B
    print(f"{args.model}, batch {args.batch}, {args.threads} thread(s), {args.steps} pairs of "
          f"steps in each load order; B / A, the load order's bias taken out:")
    print(f"  {'phase':<18} {'A ms':>8} {'B ms':>8} {'B / A':>7}   (B second: {'B / A':>6}; "
          f"A second: {'A / B':>6})")
    for phase, r1 in ab["phases"].items():
        r2 = ba["phases"][phase]
        a_ms = median([r1["first_ms"], r2["second_ms"]])
        b_ms = median([r1["second_ms"], r2["first_ms"]])
        ratio = math.sqrt(r1["ratio"] / r2["ratio"])
        print(f"  {phase:<18} {a_ms:8.2f} {b_ms:8.2f} {ratio:7.4f}   ({r1['ratio']:17.4f}; "
              f"{r2['ratio']:16.4f})")
    same = ab["same_bits"] and ba["same_bits"]
    print("parameters after the steps: " + ("the same bytes" if same else "DIFFERENT bytes"))
    if same == args.bits_differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
