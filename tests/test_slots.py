"""The thread slots of a multi-thread step wait by spinning (hslm/slots.py): the barrier
lets no thread through before all have arrived, breaks on abort, and a slot thread runs
its tasks on its own thread, hands their errors back, and sleeps once idle past
SPIN_SECONDS."""
from __future__ import annotations

import os
import threading
import time

import pytest

from hslm import slots


def _passes(barrier, n, late, passes=3):
    """n threads through `passes` waits of barrier, thread `late` arriving 0.05 s after
    the others each time; the (event, pass, thread) events in the order they happened."""
    events, lock = [], threading.Lock()

    def run(j):
        for p in range(passes):
            if j == late:
                time.sleep(0.05)
            with lock:
                events.append(("arrive", p, j))
            barrier.wait()
            with lock:
                events.append(("leave", p, j))
    threads = [threading.Thread(target=run, args=(j,)) for j in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return events


def _in_step(events, n, passes=3):
    """Whether every thread arrived at pass p before any left it, for every p."""
    for p in range(passes):
        arrivals = [i for i, e in enumerate(events) if e[:2] == ("arrive", p)]
        leaves = [i for i, e in enumerate(events) if e[:2] == ("leave", p)]
        if len(arrivals) != n or len(leaves) != n or max(arrivals) > min(leaves):
            return False
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_spin_barrier_lets_no_thread_through_before_all_arrive(n):
    assert _in_step(_passes(slots.SpinBarrier(n), n, late=n - 1), n)

    class NoBarrier:  # the control: the same run without waiting is seen out of step
        def wait(self):
            pass
    assert not _in_step(_passes(NoBarrier(), n, late=n - 1), n)


def test_spin_barrier_abort_breaks_waits_now_and_later(monkeypatch):
    monkeypatch.setattr(slots, "SPIN_SECONDS", 0.01)  # (past it, the wait sleeps and polls)
    barrier = slots.SpinBarrier(2)
    raised = []

    def waiter():
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            raised.append(time.perf_counter())
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    assert not raised and t.is_alive()  # waiting for the second thread
    t0 = time.perf_counter()
    barrier.abort()
    t.join(5)
    assert raised and raised[0] - t0 < 0.5
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait()


def _cpu_seconds(native_id):
    """A thread's CPU time so far (Linux: /proc/self/task/ID/stat, user + system ticks)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_slot_threads_run_tasks_on_their_own_threads_and_sleep_when_idle(monkeypatch):
    monkeypatch.setattr(slots, "SPIN_SECONDS", 0.3)
    pool = slots.SlotThreads(3)
    try:
        ran = {}

        def task(j):
            ran[j] = threading.get_native_id()
        for _ in range(3):
            ran.clear()
            pool.submit(task, 3)
            assert pool.join() == []
            assert sorted(ran) == [1, 2]
            assert len({ran[1], ran[2], threading.get_native_id()}) == 3
        pool.submit(task, 2)  # fewer slots than threads: slot 2 gets nothing
        ran.clear()
        pool.join()
        assert sorted(ran) == [1]

        failure = ValueError("slot failed")

        def failing(j):
            if j == 2:
                raise failure
        pool.submit(failing, 3)
        assert pool.join() == [failure]
        assert pool.join() == []  # each error once

        if os.path.exists(f"/proc/self/task/{ran[1]}/stat"):
            pool.submit(task, 3)
            pool.join()
            c0 = _cpu_seconds(ran[1])
            time.sleep(0.2)  # within SPIN_SECONDS: spinning (the control)
            c1 = _cpu_seconds(ran[1])
            time.sleep(0.4)  # past it: asleep
            c2 = _cpu_seconds(ran[1])
            time.sleep(0.5)
            c3 = _cpu_seconds(ran[1])
            assert c1 - c0 >= 0.05, (c0, c1)
            assert c3 - c2 <= 0.02, (c2, c3)
            pool.submit(task, 3)  # and wakes for the next task
            assert pool.join() == [] and sorted(ran) == [1, 2]
            pool.rest()  # asleep at once, within SPIN_SECONDS
            time.sleep(0.05)
            c4 = _cpu_seconds(ran[1])
            time.sleep(0.2)
            c5 = _cpu_seconds(ran[1])
            assert c5 - c4 <= 0.02, (c4, c5)
            ran.clear()
            pool.submit(task, 3)
            assert pool.join() == [] and sorted(ran) == [1, 2]
            c6 = _cpu_seconds(ran[1])
            time.sleep(0.2)  # and spins again after it (the rest lasts until a submit)
            assert _cpu_seconds(ran[1]) - c6 >= 0.05
    finally:
        pool.close()
    assert not any(t.is_alive() for t in pool.threads)
    pool.close()  # (twice: nothing more)


def test_a_step_runner_dropped_without_close_ends_its_slot_threads():
    import gc

    from hslm.config import PRESETS
    from hslm.step import StepRunner
    runner = StepRunner(PRESETS["hslm-tiny"], 3, 3)
    threads = list(runner.slot_threads.threads)
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    del runner
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def _joined(pool, seconds=5.0):
    """pool.join()'s errors, or None where it had not returned within `seconds` (a hang
    fails the test instead of stopping it)."""
    out = []
    t = threading.Thread(target=lambda: out.append(pool.join()), daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else None


def test_a_submit_waits_for_a_task_still_running_and_a_lost_wake_up_costs_only_time(
        monkeypatch):
    """After a join a second Ctrl-C cut short, the next submit waits for the task still
    running (its end had cleared the new one, and the thread had ended); and a Ctrl-C
    between a task's hand-over and the notify leaves a sleeping slot thread to wake on
    its own (a timed sleep) and run it."""
    monkeypatch.setattr(slots, "SPIN_SECONDS", 0.01)
    pool = slots.SlotThreads(2)
    try:
        ran = []
        pool.submit(lambda j: (time.sleep(0.3), ran.append("A")), 2)
        time.sleep(0.05)  # (as if the join after it had been interrupted)
        pool.submit(lambda j: ran.append("B"), 2)
        assert _joined(pool) == [] and ran == ["A", "B"] and pool.threads[0].is_alive()

        time.sleep(0.1)  # the slot thread asleep
        real_add = slots.add
        interrupted = []

        def add_then_interrupt(flags, i, value):
            out = real_add(flags, i, value)
            if not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt
            return out
        monkeypatch.setattr(slots, "add", add_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            pool.submit(lambda j: ran.append("C"), 2)
        monkeypatch.setattr(slots, "add", real_add)
        assert _joined(pool, 1.0) == [] and ran[-1] == "C"
    finally:
        if _joined(pool) is not None:  # (a pool left hanging is not closed)
            pool.close()


def test_a_long_wait_sleeps_past_spin_seconds(monkeypatch):
    """Past SPIN_SECONDS a wait looks once a POLL_SECONDS' sleep: little CPU; within it, it
    spins (the control)."""
    import numpy as np

    from hslm.spin import publish
    flags = np.zeros(3 * slots.LINE, np.int64)
    slots.wait_until(flags, 0, 0, slots.LINE)  # (compiled)

    def cpu_of_a_wait(seconds):
        used = []

        def waiter():
            c0 = time.thread_time()
            slots.wait_until(flags, 0, 1, slots.LINE)
            used.append(time.thread_time() - c0)
        flags[0] = 0
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(seconds)
        publish(flags, 0, 1)
        t.join()
        return used[0]
    monkeypatch.setattr(slots, "SPIN_SECONDS", 10.0)
    assert cpu_of_a_wait(0.5) > 0.25  # spinning
    monkeypatch.setattr(slots, "SPIN_SECONDS", 0.01)
    assert cpu_of_a_wait(1.0) < 0.1  # asleep but for a look every POLL_SECONDS


def test_a_gated_kernel_passes_the_barrier_inside_and_falls_back_to_python():
    """A phase's kernel may wait for a barrier at its start (spin.gate_opens), so that no
    thread needs the GIL the moment the last one arrives (StepRunner._gated). The gate
    opens once the arrivals reach the target (at once for target 0), gives up where the
    barrier is broken or after GATE_LOADS loads (the kernel then does nothing and says
    so), and _gated then waits in Python and calls again: threads arriving 2 ms late (the
    gate opens inside) and 0.3 s late (past the gate's spin) are both kept in step; a call
    that ignores its gate is seen out of step (the control); a barrier broken while a
    thread waits raises BrokenBarrierError."""
    import numpy as np

    from hslm.spin import GATE_BROKEN, gate_opens
    from hslm.step import StepRunner

    flags = np.zeros(3 * slots.LINE, np.int64)
    assert gate_opens(flags, 0) and not gate_opens(flags, 1)  # (the second after its spin)
    flags[0] = 2
    assert gate_opens(flags, 2) and not gate_opens(flags, 3)
    flags[GATE_BROKEN] = 1
    assert not gate_opens(flags, 2 + 1)

    def run(n, late, delay, honest=True, passes=3):
        barrier, events, lock, calls = slots.SpinBarrier(n), [], threading.Lock(), []

        def call(gate, target):  # a kernel's gate, then its "work": the leave event
            calls.append(target)
            if honest and not gate_opens(gate, target):
                return False
            with lock:
                events.append(("leave", p_of[threading.get_ident()], j_of[threading.get_ident()]))
            return True
        p_of, j_of = {}, {}

        def slot(j):
            j_of[threading.get_ident()] = j
            for p in range(passes):
                p_of[threading.get_ident()] = p
                if j == late:
                    time.sleep(delay)
                with lock:
                    events.append(("arrive", p, j))
                StepRunner._gated(barrier, barrier.arrive(), call)
        threads = [threading.Thread(target=slot, args=(j,)) for j in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return events, calls

    for n in (2, 3):
        events, calls = run(n, n - 1, 0.002)
        assert _in_step(events, n)
        events, calls = run(n, n - 1, 0.3, passes=2)
        assert _in_step(events, n, passes=2) and 0 in calls  # (gave up, called again)
        assert not _in_step(run(n, n - 1, 0.05, honest=False)[0], n)

    barrier = slots.SpinBarrier(2)
    raised = []

    def waiter():
        try:
            StepRunner._gated(barrier, barrier.arrive(),
                              lambda gate, target: gate_opens(gate, target))
        except threading.BrokenBarrierError:
            raised.append(True)
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    barrier.abort()
    t.join(5)
    assert not t.is_alive() and raised == [True]


def test_the_optimiser_kernel_does_nothing_until_its_gate_opens():
    """adamw_tensors with a gate whose barrier has not had its arrivals returns False and
    leaves every array as it was (byte for byte); once they are in, it updates."""
    import numpy as np

    from hslm.optim import adamw_tensors

    rng = np.random.default_rng(0)
    theta, g = rng.standard_normal(6), rng.standard_normal(6)
    m, v = np.zeros(6), np.zeros(6)
    arrays = [theta, g, m, v]
    before = [a.tobytes() for a in arrays]
    args = (np.array([0, 2, 6]), np.array([True, False]), 0.1, 0.001, 0.01, 0.1, np.zeros(2),
            np.zeros(2), np.zeros(2), np.array([0, 1], np.int64))
    barrier = slots.SpinBarrier(2)
    target = barrier.arrive()  # one of two arrived
    assert adamw_tensors(theta, g, m, v, *args, None, barrier.flags, target) is False
    assert [a.tobytes() for a in arrays] == before
    barrier.flags[0] += 1  # the other arrives
    assert adamw_tensors(theta, g, m, v, *args, None, barrier.flags, target) is True
    assert theta.tobytes() != before[0] and m.tobytes() != before[2]
