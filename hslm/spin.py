"""Waiting on another thread inside a nogil kernel: counters published with release
stores and read with acquire loads (LLVM atomics, as Numba intrinsics).

A window's team (hslm/step.py, threads beyond the batch) splits the window's rows; a row
attends to the keys and values of the rows before it, so before each block's attention
a member waits for the members before it; a weight-gradient chunk waits for every
thread to have passed its backward stage, and threads take chunks by an atomic counter.
The waits stay inside the kernel: a Python barrier or lock per block per thread would
take the GIL each time, a cost that grows with the thread count. A waiter spins on an
acquire load and, every SPINS_PER_YIELD loads, gives up its core (sched_yield), so that a
machine with more threads than cores still makes progress. No order of any sum depends on who waits for whom.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .vector_tiles import declare, make_cycle_counter

SPINS_PER_YIELD = 1024
CYCLES = make_cycle_counter()  # the time-stamp counter (wait_briefly's bound)


def _i64_pointer(builder, addr):
    return builder.inttoptr(addr, ir.IntType(64).as_pointer())


@intrinsic
def load_acquire(typingctx, addr):
    """The int64 at addr, read with acquire ordering: what its writer wrote before its
    release store is visible after this load, and no load of the caller moves above it."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_i64_pointer(builder, args[0]), "acquire", 8)
    return types.int64(types.intp), codegen


@intrinsic
def store_release(typingctx, addr, value):
    """Write the int64 value at addr with release ordering: every write of the caller
    before it is visible to a thread whose acquire load sees the value."""
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], _i64_pointer(builder, args[0]), "release", 8)
        return context.get_dummy_value()
    return types.void(types.intp, types.int64), codegen


@intrinsic
def fetch_add(typingctx, addr, value):
    """Add value to the int64 at addr atomically (sequentially consistent); returns the
    value it held before."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _i64_pointer(builder, args[0]), args[1], "seq_cst")
    return types.int64(types.intp, types.int64), codegen


@intrinsic
def yield_core(typingctx):
    """sched_yield(): let another runnable thread have this core."""
    def codegen(context, builder, signature, args):
        fn = declare(builder, "sched_yield", ir.IntType(32), [])
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def publish(flags, i, value):
    """flags[i] = value, after everything this thread wrote before."""
    store_release(flags.ctypes.data + 8 * i, value)


@njit(cache=True, nogil=True, error_model="numpy")
def add(flags, i, value):
    """flags[i] += value atomically, after everything this thread wrote before; returns
    what flags[i] held before."""
    return fetch_add(flags.ctypes.data + 8 * i, value)


@njit(cache=True, nogil=True, error_model="numpy")
def wait_for(flags, first, step, count, value, abort):
    """Wait until flags[first + j step] >= value for j = 0 .. count-1, or flags[abort] != 0
    (another thread failed). Returns True when the counters got there, False on abort."""
    base = flags.ctypes.data
    for j in range(count):
        spins = 0
        while load_acquire(base + 8 * (first + j * step)) < value:
            if load_acquire(base + 8 * abort) != 0:
                return False
            spins += 1
            if spins == SPINS_PER_YIELD:
                yield_core()
                spins = 0
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def wait_briefly(flags, i, value, abort, loads, cycles):
    """Spin until flags[i] >= value (1), or flags[abort] != 0 (-1), for at most `loads`
    loads of flags[i] or `cycles` of the time-stamp counter, looked at after each yield
    (then 0): a wait in short pieces, so that its caller (hslm/slots.py) can watch the
    clock, and Ctrl-C, between them. A count of loads alone is no time: a yield on a CPU
    another task wants may last a time slice (4,096 yields took 5.7 s beside a busy loop;
    a piece of 65,536 loads 93 ms). Without a counter (it reads 0) only `loads` bounds it."""
    base = flags.ctypes.data
    start = CYCLES()
    for s in range(loads):
        if load_acquire(base + 8 * i) >= value:
            return 1
        if load_acquire(base + 8 * abort) != 0:
            return -1
        if (s + 1) % SPINS_PER_YIELD == 0:
            yield_core()
            if CYCLES() - start > cycles:
                return 0
    return 0


# A gate: the start of a nogil kernel that waits there for a barrier's arrivals
# (hslm/slots.py, SpinBarrier.arrive), so that a thread that waits for the others passes
# the barrier inside the kernel, without the GIL. Its flags: the arrivals at
# GATE_ARRIVALS, nonzero at GATE_BROKEN once the barrier is broken (SpinBarrier's layout).
GATE_ARRIVALS = 0
GATE_BROKEN = 16
# A gate gives up after GATE_CYCLES of the time-stamp counter (2-4 ms at its 2-4 GHz),
# or GATE_LOADS loads where there is no counter (wait_briefly).
GATE_CYCLES = 1 << 23
GATE_LOADS = 1 << 22


@njit(cache=True, nogil=True, error_model="numpy")
def gate_opens(gate, target):
    """True once gate[GATE_ARRIVALS] >= target (at once for target <= 0); False where the
    barrier is broken, or after GATE_CYCLES (or GATE_LOADS loads): its kernel then
    returns without doing anything, and its caller waits in Python (hslm/step.py,
    StepRunner._gated: there the wait can sleep, and Ctrl-C is seen) and calls it again
    with target 0."""
    return target <= 0 or wait_briefly(gate, GATE_ARRIVALS, target, GATE_BROKEN,
                                       GATE_LOADS, GATE_CYCLES) > 0
