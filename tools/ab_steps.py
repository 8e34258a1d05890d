"""Two versions of hslm timed against each other, step by step in turns.

    python tools/ab_steps.py TREE_A TREE_B [--steps 30] [--batch 8] [--threads 1]
                             [--model hslm-3]

TREE_A and TREE_B are folders holding an `hslm` package (a checkout, a `git worktree`;
the same folder twice is the control). Each is run by a worker process of its own, which
imports that tree's hslm and sets up the same seeded run at speed 3 on the built-in
corpus; the two then train one step at a time in turns (A B, B A, A B, ...), one of them
running while the other waits. So a neighbour who slows the machine for a minute slows
both alike: on these shared machines `hslm bench` runs minutes apart differ by 10-20%,
while the ratio of steps taken in turns moves by about 1%. For the whole step and each
phase the step times (the windows' forward and backward, the weight gradients, the
optimiser; on one thread also the parts `hslm bench` times by the cycle counter: the
forward's and backward's products, W_up and W_down's gradients, the dense matrices'
operands, and where the tree times them attention, the norms and the loss) it prints
B / A, the median over the pairs of steps of their ratio, with the quartiles; and
whether both runs ended with the same parameters, byte for byte (exit 1 where they
differ, unless --bits-differ says they should).

(One process holding both packages, as a first version of this tool did, makes the one
imported second pay about 2.5 ms a step of Python: Numba's dispatcher keys its fast path
for an argument's type by the argument's structure, so the second package's namedtuples
of arrays match the first's types, and every call of its kernels goes through Numba's
slow typeof in Python instead: 3.6 against 1.1 ms a step for hslm-tiny, about 5% of
hslm-3's.)

Where a tree's runner can rest its slot threads (StepRunner.rest, since 597ba27), a worker
does after each step, so that they do not spin on a CPU through the other's step: each
multi-thread step then starts with its threads waking, in both trees alike.

The kernels come from each tree's own Numba cache (compiled on the first use, as for
`hslm train`). Environment variables pass through, so `NUMBA_CPU_NAME=haswell
NUMBA_CPU_FEATURES=""` compares the AVX2 builds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np


def worker(tree, model, batch, threads):
    """A worker: the run of `tree`'s hslm, stepped on each "step" line of stdin; answers
    each with a JSON line of its times, and "end" with its parameters' sha256."""
    sys.path.insert(0, os.path.abspath(tree))
    import hslm
    if not os.path.abspath(hslm.__file__).startswith(os.path.abspath(tree) + os.sep):
        sys.exit(f"ab_steps: not {tree}'s hslm but {hslm.__file__} was imported")
    from hslm import hyper, step, train
    cfg = train.resolve_config(model)
    h = hyper.Hyper(batch=batch, seed=1729, loss_positions=cfg.window)
    run = train.Run.fresh(cfg, h, train.load_corpus(None, cfg), plain=False)
    runner = step.StepRunner(cfg, 3, threads)
    try:  # the parts `hslm bench` times by the cycle counter, where the tree has them
        from hslm.bench import cycles_per_second
        hz = cycles_per_second() if threads == 1 else 0
    except ImportError:
        hz = 0
    from hslm import layers  # each clock slot's name (trees before 2026-12-05: four slots)
    names = getattr(layers, "CLOCK_NAMES", ("forward-products", "backward-products",
                                            "Wup-Wdown", "dense-operands"))
    clock = np.zeros(len(names))
    if hz:
        run.state.clock = clock
    run.train_step(runner)  # compiles or loads the kernels, untimed
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "end":
            print(json.dumps({"theta": hashlib.sha256(run.state.theta.tobytes()).hexdigest()}),
                  flush=True)
            break
        runner.timings = {}
        clock[:] = 0.0
        t0 = time.perf_counter()
        run.train_step(runner)
        times = {"step": time.perf_counter() - t0, **runner.timings}
        if hasattr(runner, "rest"):  # (its slot threads do not spin into the other's step)
            runner.rest()
        if hz:
            for k, name in enumerate(names):
                times[name] = clock[k] / hz
        print(json.dumps(times), flush=True)
    runner.close()


class Worker:
    def __init__(self, tree, args):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", tree,
               "--model", args.model, "--batch", str(args.batch), "--threads", str(args.threads)]
        self.tree = tree
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.answer()  # ready: compiled and warmed before the other starts

    def answer(self):
        line = self.p.stdout.readline()
        if not line:
            sys.exit(f"ab_steps: the worker of {self.tree} stopped (its error is above)")
        return json.loads(line)

    def ask(self, what):
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()
        return self.answer()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree_a")
    ap.add_argument("tree_b", nargs="?" if "--worker" in sys.argv else None)
    ap.add_argument("--steps", type=int, default=30, help="pairs of steps (default 30)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="hslm-3")
    ap.add_argument("--bits-differ", action="store_true",
                    help="the versions are meant to end with different parameters")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.tree_a, args.model, args.batch, args.threads)
    for tree in (args.tree_a, args.tree_b):
        if not os.path.isfile(os.path.join(tree, "hslm", "__init__.py")):
            sys.exit(f"ab_steps: {tree} holds no hslm package (hslm/__init__.py)")
    a, b = Worker(args.tree_a, args), Worker(args.tree_b, args)
    times = ([], [])
    for i in range(args.steps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            times[j].append((a, b)[j].ask("step"))
    thetas = [w.ask("end")["theta"] for w in (a, b)]
    for w in (a, b):
        w.p.wait()
    print(f"{args.model}, batch {args.batch}, {args.threads} thread(s), {args.steps} pairs of "
          "steps in turns; B / A, the median over the pairs (and its quartiles):")
    print(f"  {'phase':<18} {'A ms':>8} {'B ms':>8} {'B / A':>7}   (quartiles)")
    phases = [p for p in times[0][0] if p in times[1][0]]  # an older tree may time fewer
    for phase in phases:
        ta = np.array([t[phase] for t in times[0]])
        tb = np.array([t[phase] for t in times[1]])
        if not (ta > 0).all() or not (tb > 0).all():  # a part one tree does not time
            continue
        q1, ratio, q3 = np.quantile(tb / ta, [0.25, 0.5, 0.75])
        print(f"  {phase:<18} {1e3 * np.median(ta):8.2f} {1e3 * np.median(tb):8.2f} "
              f"{ratio:7.4f}   ({q1:.4f}-{q3:.4f})")
    same = thetas[0] == thetas[1]
    print("parameters after the steps: " + ("the same bytes" if same else "DIFFERENT bytes"))
    if same == args.bits_differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
