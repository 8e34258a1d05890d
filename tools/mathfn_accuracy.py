"""Accuracy and speed of hslm.mathfn's exp and log against a correctly rounded reference.

    python tools/mathfn_accuracy.py [N]      (default N = 1,000,000 per range)

The reference is Python's `decimal` at 40 digits (its exp and ln are correctly
rounded), so the error of each result is measured in ulps of the true value.
Ranges: those the model uses (softmax and log-sum-exp: exp on [-50, 0], log on
[1, 6561]) and wide ones (exp on [-745, 709], log on all positive doubles).
"""
from __future__ import annotations

import math
import sys
import time
from decimal import Decimal, getcontext

import numpy as np

from hslm.mathfn import exp_array, log_array

getcontext().prec = 40


def ulp_error(got: float, exact: Decimal) -> float:
    if exact == 0:
        return 0.0 if got == 0 else math.inf
    f = float(exact)
    ulp = math.ulp(f) if abs(exact) >= abs(Decimal(f)) else math.ulp(math.nextafter(f, 0.0))
    return float(abs(Decimal(got) - exact) / Decimal(ulp))


def measure(name, fn, ref, xs):
    got = fn(xs, np.empty_like(xs))
    worst, worst_x, n_exact = 0.0, None, 0
    for x, g in zip(xs.tolist(), got.tolist()):
        e = ulp_error(g, ref(Decimal(x)))
        n_exact += e <= 0.5
        if e > worst:
            worst, worst_x = e, x
    print(f"{name:28s} {len(xs):>9,} args: max error {worst:.3f} ulp (at {worst_x!r}), "
          f"correctly rounded {100 * n_exact / len(xs):.2f}%")
    return worst


def speed(fn, np_fn, xs):
    """ns per call, best of 5 runs over xs, for ours and for the C library's through Numba."""
    out = np.empty_like(xs)
    libm = _libm_loop(np_fn)
    best = {}
    for name, f in (("ours", fn), ("libm", libm)):
        f(xs[:10], out[:10])
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f(xs, out)
            times.append(time.perf_counter() - t)
        best[name] = min(times) / len(xs) * 1e9
    return best["ours"], best["libm"]


def _libm_loop(which):
    from numba import njit

    if which == "exp":
        @njit
        def f(xs, out):
            for i in range(xs.shape[0]):
                out[i] = math.exp(xs[i])
            return out
    else:
        @njit
        def f(xs, out):
            for i in range(xs.shape[0]):
                out[i] = math.log(xs[i])
            return out
    return f


def main():
    try:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    except ValueError:
        sys.exit("usage: python tools/mathfn_accuracy.py [SAMPLES]   (default 1000000)")
    rng = np.random.Generator(np.random.PCG64(12345))
    worst = max(
        measure("exp on [-50, 0]", exp_array, Decimal.exp, rng.uniform(-50.0, 0.0, n)),
        measure("exp on [-745, 709]", exp_array, Decimal.exp, rng.uniform(-745.0, 709.0, n)),
        measure("log on [1, 6561]", log_array, Decimal.ln, rng.uniform(1.0, 6561.0, n)),
        measure("log on all positive doubles", log_array, Decimal.ln,
                np.abs(rng.integers(1, 0x7FEFFFFFFFFFFFFF, n, dtype=np.int64)).view(np.float64)),
    )
    big = rng.uniform(-50.0, 0.0, 4_000_000)
    e_ours, e_libm = speed(exp_array, "exp", big)
    l_ours, l_libm = speed(log_array, "log", big + 51.0)
    print(f"speed in a Numba loop: exp {e_ours:.2f} ns (math.exp {e_libm:.2f} ns), "
          f"log {l_ours:.2f} ns (math.log {l_libm:.2f} ns)")
    print(f"worst error over all ranges: {worst:.3f} ulp")


if __name__ == "__main__":
    main()
