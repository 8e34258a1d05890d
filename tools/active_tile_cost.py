"""What the MLP's weight-gradient tile costs a row and a position, timed alone.

    python tools/active_tile_cost.py [--ghz GHZ] [--quick]

hslm.kernels.active_rows_grad (W_up's and W_down's gradients over the ReLU's active
positions) on one block of 36 rows, over all 729 units of hslm-3 with k = 27, its operands
in L1 and L2: for each count n of active positions (the same n in every row, at random
positions), the time of a row, adding into the row's sums (every window after a step's
first) and storing them fresh (the first window); then random masks at p = 0.5, the
step's share (the bench's profile reports 50.0% active); then a straight line fitted to
the times over n >= 1: the row's part and each position's. With --ghz, cycles of a core
at that clock (the bench's measured FMA peak over its flops a cycle gives it) for a
vector and position, against the tile's two floating-point operations: 0.5 cycles on
cores with two multiply and two add pipes of the vector's width. --quick times each case
once, briefly (the tests' check that the tool still runs; its figures mean little).

Built as this process's Numba builds (NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES="" and
a NUMBA_CACHE_DIR of its own time the AVX2 build). No value changes: a timing tool.
"""
from __future__ import annotations

import argparse
import time

import hslm  # noqa: F401  (first, before Numba: hslm's vector width and LLVM options)

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from hslm.kernels import active_rows_grad  # noqa: E402
from hslm.micro import ACTIVE_LANES, ACTIVE_VECS

K, F, D_COLS, BLOCK = 27, 729, 243, 36


@njit(nogil=True, cache=False)
def _rows(M, S, dy, sums, reps, fresh):
    for _ in range(reps):
        for j0 in range(0, F, BLOCK):
            active_rows_grad(M, S, dy, 0, D_COLS, j0, min(j0 + BLOCK, F), sums, fresh)


def _masks(S):
    M = np.zeros((1, F), np.int64)
    for t in range(K):
        M[0] |= (S[t] > 0).astype(np.int64) << t
    return M


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ghz", type=float, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps, rounds = (2, 1) if args.quick else (100, 7)
    hslm.set_llvm_options()  # as in the hslm command, whose kernels this times
    rng = np.random.default_rng(0)
    flat = np.zeros(1 << 20)
    a = (-(flat.ctypes.data % 4096) // 8) % 512  # rows on 64 bytes, as aligned_view makes
    dy = flat[a:a + K * 248].reshape(K, 248)[:, :D_COLS]  # the dense factor [k, 243]
    dy[:] = rng.standard_normal((K, D_COLS))
    sums = flat[a + 16392:a + 16392 + BLOCK * 248].reshape(BLOCK, 248)[:, :D_COLS]

    def ns_a_row(S, fresh):
        M = _masks(S)
        _rows(M, S, dy, sums, 1, fresh)
        best = np.inf
        for _ in range(rounds):
            t0 = time.perf_counter()
            _rows(M, S, dy, sums, reps, fresh)
            best = min(best, time.perf_counter() - t0)
        return best / reps / F * 1e9

    nv = -(-D_COLS // ACTIVE_LANES)

    def per_vp(ns, n):
        return (f"; {ns / (n * nv) * args.ghz:.3f} cycles a vector and position"
                if args.ghz and n else "")
    print(f"tiles of up to {ACTIVE_VECS} vectors of {ACTIVE_LANES} doubles; a row of "
          f"{D_COLS} columns is {nv} vectors in {-(-nv // ACTIVE_VECS)} tiles")
    times = {}
    for n in (0, 1, 7, 13, 14, 20, 27):
        S = np.zeros((K, F))
        for j in range(F):
            S[rng.choice(K, n, replace=False), j] = rng.random(n) + 0.1
        times[n] = ns_a_row(S, False)
        print(f"n = {n:2d}: {times[n]:6.1f} ns a row adding, {ns_a_row(S, True):6.1f} fresh"
              + per_vp(times[n], n), flush=True)
    S = np.where(rng.random((K, F)) < 0.5, rng.random((K, F)) + 0.1, 0.0)
    mean = float(np.mean((S > 0).sum(0)))
    t = ns_a_row(S, False)
    print(f"random, p = 0.5 (n {mean:.2f} on average): {t:6.1f} ns a row" + per_vp(t, mean))
    x = np.array([n for n in times if n], float)
    slope, row = np.polyfit(x, np.array([times[n] for n in times if n]), 1)
    print(f"fit over n >= 1: {row:.1f} ns a row + {slope:.2f} ns a position"
          + (f" ({slope / nv * args.ghz:.3f} cycles a vector and position)" if args.ghz else "")
          + f"; the row's part of a row at p = 0.5: {100 * row / t:.0f}%")


if __name__ == "__main__":
    main()
