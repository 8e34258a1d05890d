"""How far apart this machine's cores are: a core-to-core round trip, measured.

Threads that share a window (hslm/step.py, threads beyond the batch) pass each other
keys, values, records and gradients through the caches, so how long a cache line takes
to go from one core to another and back decides part of a multi-thread step's time. On
a shared 2-core AMD Zen 4 (2026-12-05) the two virtual CPUs were at times on one die
(a round trip of 57-107 ns) and at times on two (310-750 ns), the hypervisor moving
them every few seconds or minutes: batch 1 on two threads ran 1.70-1.79x one thread on
one die and 1.14-1.59x on two, batch 8 1.88-1.90x and 1.82-1.88x. So hslm bench
measures the round trip beside each multi-thread round, and a figure says which case
it was (tools/threads_by_placement.py sorts many rounds by it).

Two threads, each pinned to one CPU, pass a counter back and forth in one cache line
(an acquire load spins until the value is its turn's, then a release store hands it
on): n such exchanges take n round trips. The loop is LLVM IR compiled by llvmlite
(hslm/peak.py's compiled_ir), so measuring compiles no Numba kernel; ctypes releases the
GIL while it runs.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

# A wait gives up after this many loads of the counter (a second or so: the other
# thread never started, or was not scheduled), and the probe then reports nothing.
SPIN_LIMIT = 1 << 28
WARM_TRIPS = 2000  # untimed, first: both threads running, the line in play
TRIPS = 5000  # timed, three times: 1-8 ms a pair at 60-500 ns a trip
MAX_PAIRS = 16  # the CPUs a probe pairs with the first, spread over those allowed

_IR = """
define i64 @pingpong(i64* %flag, i64 %me, i64 %first, i64 %n, i64 %limit) {
entry:
  br label %trip
trip:
  %i = phi i64 [ %first, %entry ], [ %inext, %got ]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %start, label %done
start:
  %twice = shl i64 %i, 1
  %want = add i64 %twice, %me
  br label %spin
spin:
  %s = phi i64 [ 0, %start ], [ %snext, %again ]
  %v = load atomic i64, i64* %flag acquire, align 8
  %mine = icmp eq i64 %v, %want
  br i1 %mine, label %got, label %again
again:
  %snext = add i64 %s, 1
  %late = icmp sge i64 %snext, %limit
  br i1 %late, label %gave_up, label %spin
got:
  %pass = add i64 %want, 1
  store atomic i64 %pass, i64* %flag release, align 8
  %inext = add i64 %i, 1
  br label %trip
done:
  ret i64 %n
gave_up:
  ret i64 %i
}
"""
# pingpong(flag, me, first, n, limit): exchanges first .. n-1; in exchange i the thread
# `me` = 0 waits for 2i and writes 2i + 1, the thread `me` = 1 waits for 2i + 1 and
# writes 2i + 2. Returns n, or the exchange whose wait ran past `limit` loads.

_compiled = None  # (engine, function): the engine must outlive the function pointer
_lock = threading.Lock()


def _pingpong():
    global _compiled
    with _lock:
        if _compiled is None:
            from .peak import compiled_ir
            _compiled = compiled_ir(_IR, "pingpong", ctypes.CFUNCTYPE(
                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_int64))
    return _compiled[1]


def _on_cpus(body, cpus):
    """body(i, pinned) on a thread of its own for each cpus[i], all at once, each pinned to
    its CPU first (pinned: whether that took); returns once every one has ended."""
    def pinned_body(i, cpu):
        try:
            os.sched_setaffinity(0, {cpu})  # this thread only (Linux)
        except OSError:
            body(i, False)
            return
        body(i, True)

    threads = [threading.Thread(target=pinned_body, args=(i, c), daemon=True)
               for i, c in enumerate(cpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def round_trip_ns(cpu_a: int, cpu_b: int, trips: int = TRIPS):
    """Nanoseconds a round trip of a cache line from CPU cpu_a to cpu_b and back takes
    (the median of three timings of `trips`), or None where the threads cannot be pinned
    to them, or where one waited past SPIN_LIMIT."""
    if not hasattr(os, "sched_setaffinity") or cpu_a == cpu_b:
        return None
    allowed = os.sched_getaffinity(0)
    if cpu_a not in allowed or cpu_b not in allowed:
        return None
    try:
        fn = _pingpong()
    except Exception:  # noqa: BLE001 - an llvmlite without MCJIT: no figure, nothing else
        return None
    line = (ctypes.c_int64 * 16)()  # 128 bytes: the counter alone in its line
    flag = ctypes.addressof(line) + (-ctypes.addressof(line)) % 64
    rounds = 3
    total = WARM_TRIPS + rounds * trips
    results = {}

    def player(me, pinned):
        if not pinned:  # (the other one's wait then runs to SPIN_LIMIT)
            results[me] = None
            return
        if me == 1:
            results[me] = fn(flag, 1, 0, total, SPIN_LIMIT) == total
            return
        times = []
        done = fn(flag, 0, 0, WARM_TRIPS, SPIN_LIMIT) == WARM_TRIPS
        start = WARM_TRIPS
        for _ in range(rounds):
            if not done:
                break
            t0 = time.perf_counter()
            done = fn(flag, 0, start, start + trips, SPIN_LIMIT) == start + trips
            times.append(time.perf_counter() - t0)
            start += trips
        results[me] = sorted(times)[1] / trips * 1e9 if done else None

    _on_cpus(player, (cpu_a, cpu_b))
    return results.get(0) if results.get(1) else None


def farthest_round_trip_ns():
    """The longest round_trip_ns from the first CPU this process may run on to each of
    up to MAX_PAIRS others (spread over the ones it may use), or None with fewer than
    two CPUs or no figure: how far apart a multi-thread run's threads may be."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(cpus) < 2:
        return None
    others = cpus[1:]
    step = max(1, len(others) // MAX_PAIRS)
    figures = [round_trip_ns(cpus[0], c) for c in others[::step][:MAX_PAIRS]]
    figures = [f for f in figures if f is not None]
    return max(figures) if figures else None


# Whether the CPUs have a core's arithmetic each: hslm/peak.py's FMA loop on every CPU at
# once, against one alone. On the shared 2-core Intel Xeon (2026-12-05) the two virtual
# CPUs were at times one core's two hardware threads (a round trip of 40 ns against
# 115-230 ns otherwise): the loop ran at 56 GFLOP/s on each at once against 107 alone,
# and batch 1 on two threads at 1.03x one thread in a bench round. A neighbour's thread
# on a CPU's core shows the same way, and the round trip does not see it.
FMA_SECONDS = 0.02  # each timing of the loop: alone, on every CPU at once, alone again
MAX_TOGETHER = 64  # CPUs a probe loads at once (a thread each)

_fma = None  # (engine, function, multiplicands, iterations) of hslm/peak.py's FMA loop


def _fma_loop():
    global _fma
    with _lock:
        if _fma is None:
            from .micro import wide_vectors
            from .peak import XS, _compiled, _iterations
            engine, fn = _compiled(8 if wide_vectors() else 4, True)
            xs = (ctypes.c_double * XS)(*[1e-9 * (1 + j / XS) for j in range(XS)])
            _fma = (engine, fn, xs, _iterations(fn, xs, FMA_SECONDS))
    return _fma


def fma_together(cpus=None):
    """The FMA loop's pace (hslm/peak.py) with a copy pinned to each of `cpus` at once
    (default: every CPU this process may use, at most MAX_TOGETHER), the slowest copy's,
    as a share of its pace on the first CPU alone (the faster of a run just before and
    one just after): about 1.0 where each CPU has a core's FMA pipes to itself, about
    0.5 where two are one core's two hardware threads, or where another guest's thread
    was busy on a CPU's core. None with fewer than two CPUs, or where threads cannot be
    pinned or the loop cannot be built."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
        _, fn, xs, n = _fma_loop()
    except Exception:  # noqa: BLE001 - an llvmlite without MCJIT: no figure, nothing else
        return None
    cpus = cpus[:MAX_TOGETHER]
    if len(cpus) < 2:
        return None

    def timed(cpus):
        start = threading.Barrier(len(cpus))
        seconds = [None] * len(cpus)

        def copy(i, pinned):
            if not pinned:
                start.abort()
                return
            try:
                start.wait()
            except threading.BrokenBarrierError:
                return
            t0 = time.perf_counter()
            fn(n, 0.9999999, 1e-9, ctypes.addressof(xs))
            seconds[i] = time.perf_counter() - t0

        _on_cpus(copy, cpus)
        return None if None in seconds else max(seconds)

    # alone before and after (the faster: a neighbour's moment on the first CPU's core
    # during one of them would read as more than one core's pace at once)
    alone = timed(cpus[:1])
    together = timed(cpus) if alone is not None else None
    again = timed(cpus[:1]) if together is not None else None
    return None if again is None else min(alone, again) / together
