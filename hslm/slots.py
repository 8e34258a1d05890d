"""The thread slots of a multi-thread step, which wait by spinning rather than sleeping.

A multi-thread step (hslm/step.py, StepRunner._run_slots) runs one task per thread
slot: slot 0 on the calling thread, slot j on a thread of its own (SlotThreads), with a
barrier between the step's phases (SpinBarrier). Waiting by sleeping (a futex, as
threading.Barrier and a thread pool's queue do) cost more than the wait itself on a
shared 2-core Intel Xeon (KVM, 2026-12-05): two one-thread runs in two processes,
stepping in lockstep through a sleeping barrier once a step, each ran 8-12% slower in
every phase than running free, and as fast as free through a spinning one (a CPU that
goes idle comes back slower; the hypervisor may give its core to someone else). So
these waits spin (hslm/spin.py's acquire loads, without the GIL, yielding the core every
SPINS_PER_YIELD loads, so that more threads than cores still make progress) for up to
SPIN_SECONDS, then look once every POLL_SECONDS of sleep; a slot thread with no task
for that long sleeps until the next one (as OpenMP's runtimes spin for a while before
they sleep: KMP_BLOCKTIME, GOMP_SPINCOUNT). A wait changes when a thread goes on, never
what it computes: no bit depends on it.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .spin import GATE_ARRIVALS, GATE_BROKEN, add, gate_opens, publish, wait_briefly

SPIN_SECONDS = 0.02  # a wait spins this long before it sleeps (a step's gaps: 0.2-1 ms)
SPIN_LOADS = 1 << 16  # loads of the counter a piece of a spin (tens of microseconds)
SPIN_CYCLES = 1 << 20  # and time-stamp cycles (0.3-0.5 ms: a piece where yields are slow)
POLL_SECONDS = 1e-3  # past SPIN_SECONDS, a wait looks again after this sleep
LINE = 8  # int64s a cache line: each counter on a line of its own
# The gate of a kernel call with no barrier before it (its target 0: open at once); an
# int64 array as a SpinBarrier's flags are, so that the kernels compile once.
NO_GATE = np.zeros(3 * LINE, np.int64)


def compile_waits():
    """Compile (or load) the kernels the waits here call (a first run's compile jobs do it
    ahead, hslm/precompile.py: the optimiser's job)."""
    flags = np.zeros(1, np.int64)
    wait_briefly(flags, 0, 0, 0, 1, SPIN_CYCLES)
    add(flags, 0, 0)
    publish(flags, 0, 0)
    gate_opens(flags, 0)


def wait_until(flags, i, value, abort, sleep_after=True) -> int:
    """Wait until flags[i] >= value (returns 1) or flags[abort] != 0 (-1): spinning for
    SPIN_SECONDS, then looking once every POLL_SECONDS of sleep, or, with sleep_after
    False, giving up then (0)."""
    deadline = time.perf_counter() + SPIN_SECONDS
    loads = SPIN_LOADS
    while True:
        r = wait_briefly(flags, i, value, abort, loads, SPIN_CYCLES)
        if r != 0:
            return r
        if loads == 1 or time.perf_counter() > deadline:
            if not sleep_after:
                return 0
            loads = 1  # from now on a look between sleeps, not a spin
            time.sleep(POLL_SECONDS)


class SpinBarrier:
    """A barrier for n threads, waiting as wait_until does, with threading.Barrier's
    wait() (returning nothing) and abort(), and arrive() and wait_target(), which
    StepRunner uses with a kernel's gate in between (below). Each
    thread counts its own passes (a thread passes the k-th time once n k threads have
    arrived), so one barrier serves any number of passes by the same n threads. Unlike
    threading.Barrier's, a wait that fails (a Ctrl-C) does not break it: the caller
    aborts it (StepRunner._run_slots).

    wait() is arrive() then wait_target(its target). A thread may instead hand the
    target to the next phase's kernel, whose gate (spin.gate_opens on flags) waits for
    it inside the kernel: in wait(), every thread but the last returned to Python at the
    same moment, and each took the GIL in turn; on the 2-core Xeon a thread that found
    it taken slept in CPython's GIL wait and passed 0.13-0.18 ms after the last arrival
    (hslm/step.py, StepRunner._gated)."""

    def __init__(self, n: int):
        self.n = n
        # arrivals at GATE_ARRIVALS, broken at GATE_BROKEN (spin.gate_opens reads them)
        self.flags = np.zeros(3 * LINE, np.int64)
        self._passes = threading.local()

    def arrive(self) -> int:
        """Count this thread in; returns the arrivals its pass waits for."""
        if self.flags[GATE_BROKEN] != 0:
            raise threading.BrokenBarrierError
        k = getattr(self._passes, "k", 0) + 1
        self._passes.k = k
        add(self.flags, GATE_ARRIVALS, 1)
        return k * self.n

    def wait_target(self, target: int):
        """Wait until `target` threads have arrived (BrokenBarrierError if it breaks)."""
        if wait_until(self.flags, GATE_ARRIVALS, target, GATE_BROKEN) < 0:
            raise threading.BrokenBarrierError

    def wait(self):
        self.wait_target(self.arrive())

    def abort(self):
        """Break the barrier: every wait, now and later, raises BrokenBarrierError."""
        publish(self.flags, GATE_BROKEN, 1)


class SlotThreads:
    """Threads for slots 1..n-1, kept for a run: submit(task, m) has slots 1..m-1 run
    task(j) and join() waits for them; between tasks a thread spins (wait_until), then
    sleeps on a condition until the next submit or close."""

    def __init__(self, n: int):
        self.n = n
        # given[j] at LINE j (tasks submitted to slot j), done[j] at LINE (n + j)
        self.flags = np.zeros(LINE * (2 * n + 2), np.int64)
        self.never = LINE * 2 * n  # an abort counter that stays 0
        self.resting = LINE * (2 * n + 1)  # nonzero: an idle thread sleeps at once (rest)
        self.tasks = [None] * n
        self.errors = [None] * n
        self.given = [0] * n
        self.wake = threading.Condition()
        self.closed = False
        compile_waits()  # (now, not in a step)
        self.threads = [threading.Thread(target=self._serve, args=(j,), daemon=True,
                                         name=f"hslm-slot-{j}") for j in range(1, n)]
        for t in self.threads:
            t.start()

    def _serve(self, j):
        k = 0
        while True:
            k += 1
            if wait_until(self.flags, LINE * j, k, self.resting, sleep_after=False) <= 0:
                with self.wake:  # (submit bumps the counter, then notifies under the lock;
                    while self.flags[LINE * j] < k:  # the timeout: a notify a Ctrl-C lost)
                        self.wake.wait(0.05)
            task = self.tasks[j]
            if task is None:
                return
            try:
                task(j)
            except BaseException as e:  # noqa: BLE001 - raised by join, in the caller
                self.errors[j] = e
            finally:  # (holding no task while it waits: a task's closure holds its arrays)
                self.tasks[j] = task = None
                add(self.flags, LINE * (self.n + j), 1)

    def submit(self, task, m: int):
        """task(j) on slots j = 1..m-1 (m <= n), each on its own thread, once every task
        before has ended (one a second Ctrl-C left running: its end would clear the new
        one)."""
        self._wait_for_tasks()
        publish(self.flags, self.resting, 0)
        try:
            for j in range(1, m):
                self.tasks[j], self.errors[j] = task, None
                self.given[j] += 1
                add(self.flags, LINE * j, 1)
        finally:  # (even if a Ctrl-C lands between a bump and here)
            with self.wake:
                self.wake.notify_all()

    def rest(self):
        """Until the next submit, a thread with no task sleeps at once instead of spinning
        (a run that hands the machine to another for a while: hslm bench's rounds)."""
        publish(self.flags, self.resting, 1)

    def _wait_for_tasks(self):
        """Until every task submitted has ended."""
        for j in range(1, self.n):
            wait_until(self.flags, LINE * (self.n + j), self.given[j], self.never)

    def join(self) -> list:
        """Wait until every submitted task has ended; returns their exceptions (each once)."""
        self._wait_for_tasks()
        errors = []
        for j in range(1, self.n):
            if self.errors[j] is not None:
                errors.append(self.errors[j])
                self.errors[j] = None
        return errors

    def close(self):
        """End the threads (after their tasks)."""
        if self.closed:
            return
        self.join()
        self.closed = True
        for j in range(1, self.n):
            self.given[j] += 1
            add(self.flags, LINE * j, 1)  # with no task: the thread returns
        with self.wake:
            self.wake.notify_all()
        for t in self.threads:
            t.join()
