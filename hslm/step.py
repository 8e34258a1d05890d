"""A training step's gradient: windows to threads, sums added in window order.

The step's gradient is G = ((0 + S_w0) + S_w1) + ... in window order (each
S_w summed over its scored positions in position order, spec section 9),
whatever the thread count. Each thread has its own scratch, allocated once per
run, chosen by the thread's slot, never by a thread id.

Each speed is one entry of SPEEDS, which says its loop order, its matrix kernel,
the weight layouts it reads and which of two reductions it uses:

* "window buffers" (the per-position loop): each window streams its positions'
  products into its own accumulator S_w. With one thread the window adds S_w
  into G directly. With N threads the windows run in groups of N, each into its
  own zeroed buffer (the buffer chosen by the window's place in its group); the
  group's buffers are then added into G in window order, the flat vector split
  into N ranges.
* "gradient units" (the layerwise loop) runs in two phases. (1) Each window's forward and
  backward through the layers' inputs, on any thread, into that window's own record. (2) The
  weight-gradient phase: the gradient is cut into units (a block of 36 rows of
  a matrix, for Wup the rows of one active-row tile, or a whole small tensor:
  gradient_units), and each unit writes its part of G: the
  first window's sum stored as 0.0 + S, then every other window's added in window
  order (a small tensor is zeroed just before); threads take contiguous runs of
  units. G is written once per step, and no thread needs a copy of it. With more
  threads than windows (StepRunner._gradient_teams) the threads form a team per
  window and split its rows; the backward runs in stages, and the threads take a
  stage's units as soon as every row has passed it, each first the units of the
  tensors it then updates in the optimiser. A slot's phases, and its share of the
  optimiser's update (gradient's `then`), run in one task a step, with barriers
  between them, each waited for inside the next phase's kernel (StepRunner._gated).

Threads are plain Python threads running nogil Numba kernels: no Numba
threading layer is involved, so forking and Ctrl-C behave as in any Python
program, and nothing depends on which layer a machine has. Thread slots 1..N-1
run on threads kept for the run (at every speed), which wait by spinning, between
the step's phases and between steps, rather than by sleeping (hslm/slots.py).
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import NamedTuple

import numpy as np

from .config import TENSORS_PER_BLOCK
from .jit import kernel_entry
from .kernels import WGRAD_ROW_BLOCK, active_span, active_tiles
from .layers import RELU_OUTPUT, alloc_acts, alloc_record, alloc_scratch, relu_side
from .slots import NO_GATE, SlotThreads, SpinBarrier
from .speeds import KERNEL_PANELS, PER_POSITION, SPEEDS
from .vsa import vsa_window
from .windows import (every_block_forward, gradients_from_records, mean_losses, team_counters,
                      team_slot, window_per_position, windows_backward, windows_embed,
                      windows_forward, windows_head, windows_layerwise, windows_loss)

# The share of the MLP's weight-gradient products that are summed: the ReLU's active
# positions, about half of them (measured over 300 steps of hslm-3: 0.42-0.64 a block).
ACTIVE_SHARE = 0.5


def gradient_units(cfg):
    """[(tensor, row0, row1)] covering the gradient, and each unit's cost (multiply-adds
    per scored position): blocks of WGRAD_ROW_BLOCK rows of each ternary matrix (Wup:
    one unit per tile of its active rows, kernels.active_span), and each other tensor
    whole."""
    units, cost = [], []
    dims = cfg.dims()
    for t, (_, shape, kind) in enumerate(cfg.tensors()):
        if kind == "ternary":
            rows = [(r0, min(r0 + WGRAD_ROW_BLOCK, shape[0]))
                    for r0 in range(0, shape[0], WGRAD_ROW_BLOCK)]
            side = relu_side(dims, t)
            relu = side != 0  # windows.relu_weight_grads: over the active positions
            if side == RELU_OUTPUT:
                # Wup's units are its rows i, the columns of its active-row tiles: one a tile
                rows = [active_span(shape[0], q) for q in range(active_tiles(shape[0]))]
            for r0, r1 in rows:
                units.append((t, r0, r1))
                cost.append((r1 - r0) * shape[1] * (ACTIVE_SHARE if relu else 1.0))
        else:
            units.append((t, 0, shape[0]))
            cost.append(shape[-1])
    return np.array(units, np.int64), np.array(cost, np.float64)


def unit_stages(cfg, units):
    """Per gradient unit: the stage of the layerwise backward after which its records are
    final: 0 for the head (loss and head backward), blocks - b for block b, and blocks
    for the embedding (after block 0). Non-increasing along the units (tensor order)."""
    t_out = len(cfg.tensors()) - 2
    out = []
    for t, _, _ in units:
        if t == 0:
            out.append(cfg.blocks)
        elif t >= t_out:
            out.append(0)
        else:
            out.append(cfg.blocks - (t - 1) // TENSORS_PER_BLOCK)
    return np.array(out, np.int64)


def unit_spans(cfg, units):
    """[(e0, e1)] per gradient unit: its elements in the flat gradient. Units follow
    each other with no gap, so a run of units lo..hi-1 is G[spans[lo][0]:spans[hi-1][1]]."""
    offs = cfg.offsets()
    shapes = [s for _, s, _ in cfg.tensors()]
    spans = []
    for t, r0, r1 in units:
        cols = int(np.prod(shapes[t][1:])) if len(shapes[t]) > 1 else 1
        spans.append((int(offs[t] + r0 * cols), int(offs[t] + r1 * cols)))
    return spans


def split_by_cost(cost, n):
    """n contiguous ranges of units with about equal cost: [(lo, hi)]."""
    cum = np.concatenate([[0.0], np.cumsum(cost)])
    cuts = [0] + [int(np.searchsorted(cum, cum[-1] * r / n)) for r in range(1, n)] + [len(cost)]
    return [(cuts[r], max(cuts[r], cuts[r + 1])) for r in range(n)]


# A team member's rows: with fewer, the ternary kernels' row tiles run mostly empty, and
# each member reads every matrix once more.
MIN_TEAM_ROWS = 3
# The cost of row p in team_rows: its forward, its backward if scored, and attention's,
# which grows with the keys before it (TEAM_ATTENTION x (p + 1) / L: a rough weight, not
# fitted to a measurement).
TEAM_ATTENTION = 1.0


def team_rows(L, k, T):
    """Consecutive row ranges [(p0, p1)] of a window for a team of T threads, of about
    equal cost; at most L // MIN_TEAM_ROWS members get rows, the others (L, L)."""
    s = L - k
    n = min(T, max(1, L // MIN_TEAM_ROWS))
    cost = np.array([1.0 + (p >= s) + TEAM_ATTENTION * (p + 1) / L for p in range(L)])
    return split_by_cost(cost, n) + [(L, L)] * (T - n)


# Requantising an element of a ternary matrix costs about this share of its AdamW update
# (measured when the optimiser's shares were balanced, b99e69f, on the 2-core Xeon: 3.35 ms
# for the 1.95 M ternary elements, 5.74 ms AdamW for all 2.13 M, one thread).
REQUANTISE_COST = 0.6


def optimiser_cost(cfg):
    """Per tensor, the optimiser's work: AdamW on every element, and requantisation on
    a ternary matrix's."""
    sizes = np.diff(cfg.offsets()).astype(np.float64)
    ternary = np.array([kind == "ternary" for _, _, kind in cfg.tensors()])
    return sizes * (1.0 + REQUANTISE_COST * ternary)


def tensor_parts(cfg, n, t0=0, t1=None):
    """Tensors t0..t1-1 in n contiguous runs of about equal optimiser_cost: [(lo, hi)]
    (the optimiser's elementwise work, split between MPI ranks)."""
    cost = optimiser_cost(cfg)
    t1 = len(cost) if t1 is None else t1
    return [(t0 + a, t0 + b) for a, b in split_by_cost(cost[t0:t1], n)]


def optimiser_shares(cfg, n):
    """The optimiser's tensors for n threads: per thread, its tensors as an increasing
    int64 array (it updates and requantises them). Each tensor goes, largest first, to
    the thread with the least optimiser_cost so far: contiguous runs could not balance
    hslm-3 on 2 threads better than 4.9 against 4.2 ms, a tensor being up to 5% of the
    work. The shares then go heaviest first to slot 0, the calling thread, which starts
    its step first (slot j's thread wakes and waits for the GIL: 0.14-0.19 ms later on
    the 2-core Xeon): there, at batch 1, slot 1's update had taken 3.75 ms against slot
    0's 3.26 with the heavier share (hslm-3: 1.689 against 1.611 M of cost), and 3.57
    against 3.32 with the lighter (medians of 300 steps)."""
    cost = optimiser_cost(cfg)
    load = [0.0] * n
    mine = [[] for _ in range(n)]
    for t in sorted(range(len(cost)), key=lambda t: (-cost[t], t)):
        j = min(range(n), key=lambda j: (load[j], j))
        load[j] += cost[t]
        mine[j].append(t)
    order = sorted(range(n), key=lambda j: (-load[j], j))
    return [np.array(sorted(mine[j]), np.int64) for j in order]


class Worker:
    """Scratch for one thread: everything a window writes besides the step's gradient."""

    def __init__(self, cfg, speed: int):
        dims = cfg.dims()
        self.cfg = cfg
        self.speed = SPEEDS[speed]
        self.scr = alloc_scratch(dims)
        self.acts = alloc_acts(dims, 1)
        self.rec = alloc_record(dims, 1)
        self.vsa = np.zeros((cfg.blocks, cfg.window, cfg.width))
        # per position: the window's accumulator, added into the output at the end
        self.acc = np.zeros(cfg.n_params if self.speed.loop == PER_POSITION else 0)
        self.units, _ = gradient_units(cfg)

    def window(self, model, vsa_table, tokens, k, scale, out):
        """Add one window's gradient into out; return the window's mean loss."""
        sp = self.speed
        if sp.loop == PER_POSITION:
            vsa_window(vsa_table, tokens, model.dims.blocks, model.dims.width, self.vsa)
            return window_per_position(model, tokens, self.vsa, k, scale, self.acts, self.rec,
                                       self.scr, self.acc, out, sp.recompute_prefix,
                                       sp.kv_only_unscored, sp.kernel)
        losses = np.zeros(1)
        windows = tokens.reshape(1, -1)
        windows_layerwise(model, vsa_table, windows, self.vsa.reshape((1,) + self.vsa.shape), k,
                          scale, self.acts, self.rec, self.scr, 0, 1, losses, sp.kernel)
        gradients_from_records(model, self.acts, self.rec, windows, k, self.units, 0,
                               len(self.units), out, self.scr.xt, self.scr.dy_panels, False,
                               NO_GATE, 0)
        return losses[0]

    def vsa_rows(self, p1):
        """[nb, p1, d]: this thread's VSA stream buffer for rows 0..p1-1, contiguous (a
        team member's, windows.window_rows_forward)."""
        nb = self.vsa.shape[0]
        return self.vsa.reshape(-1)[:self.vsa[:, :p1].size].reshape(nb, p1, -1)

    @property
    def logits(self):
        """[L, V]: the last window's logits (valid at its scored positions)."""
        return self.acts.logits[0]

    def dx0(self, k):
        """[k, d]: the last window's dloss/dx_0 at its scored positions."""
        return self.rec.d_x0[0, :k]

    def window_loss(self, model, vsa_table, tokens, k):
        """Forward only: the window's mean loss and mean plain cross-entropy over its last
        k positions ([2], windows_loss)."""
        windows = tokens.reshape(1, -1)
        losses = np.zeros((1, 2))
        windows_forward(model, vsa_table, windows, self.vsa.reshape((1,) + self.vsa.shape), k,
                        self.acts, 0, 1, KERNEL_PANELS)
        windows_loss(windows, k, self.acts, self.scr, 0, 1, losses)
        return losses[0]


@kernel_entry
def add_in_order(G, bufs, n, lo, hi):
    """G[lo:hi] += bufs[0], then bufs[1], ... bufs[n-1]: window order."""
    for w in range(n):
        B = bufs[w]
        for e in range(lo, hi):
            G[e] += B[e]


class ValidLosses(NamedTuple):
    """A validation's means over its windows' scored positions (each window's mean, then
    the windows' in order): loss, the training objective (label-smoothed, docs/model.md),
    and cross_entropy, the plain -log p of the next token in nats, whose exp is the
    perplexity."""
    loss: float
    cross_entropy: float

    @classmethod
    def of(cls, losses, mean) -> "ValidLosses":
        """From the windows' [n, 2] rows (Worker.window_loss) and a mean in order."""
        return cls(mean(losses[:, 0]), mean(losses[:, 1]))


def ordered_mean(values) -> float:
    total = 0.0
    for v in values:
        total += float(v)
    return total / len(values)


class StepRunner:
    """Computes the gradient of a batch of windows at one speed on N threads."""

    def __init__(self, cfg, speed: int, threads: int = 1, world=None):
        self.cfg = cfg
        self.world = world  # MPI (hslm/distributed.py): None in one process
        self.speed = SPEEDS[speed]
        self.threads = max(1, int(threads))
        self.workers = [Worker(cfg, speed) for _ in range(self.threads)]
        # slots 1..N-1's threads (_run_slots; _map and map_parts too), ended by close() or
        # once the runner is gone (they hold no reference to it)
        self.slot_threads = SlotThreads(self.threads) if self.threads > 1 else None
        if self.slot_threads is not None:
            weakref.finalize(self, self.slot_threads.close)
        self.bufs = None  # per position, several threads: one buffer per thread slot
        if self.speed.reduction == "window buffers" and self.threads > 1:
            self.bufs = np.zeros((self.threads, cfg.n_params))
        self.batch = 0  # layerwise: per-window activations and records, for the batch size
        self.units, self.unit_cost = gradient_units(cfg)
        self.parts = split_by_cost(self.unit_cost, self.threads)
        self.optimiser_shares = optimiser_shares(cfg, self.threads)  # per thread
        self.timings = None  # set to a dict to collect per-phase seconds (layerwise)
        self._staged_chunks = None
        self._team_rows_for = None  # (batch, k) of the team rows below

    def close(self):
        if self.slot_threads is not None:
            self.slot_threads.close()

    def rest(self):
        """The slot threads sleep at once until the next step, rather than spin (the
        machine goes to another run for a while: hslm bench's rounds)."""
        if self.slot_threads is not None:
            self.slot_threads.rest()

    def map_parts(self, fn, parts):
        """[fn(part) for part in parts], spread over the thread slots as _map spreads them
        (elementwise work: who takes which part changes no bit)."""
        return self._map(lambda i: fn(parts[i]), len(parts))

    def _map(self, fn, n):
        """[fn(i) for i in range(n)]: slot j takes i = j, j + m, ... (m = min(n, threads);
        slot 0 on this thread, the others on the slot threads, _run_slots)."""
        if self.slot_threads is None or n <= 1:
            return [fn(i) for i in range(n)]
        out = [None] * n
        m = min(n, self.threads)

        def work(j):
            for i in range(j, n, m):
                out[i] = fn(i)
        self._run_slots(work, m, None)
        return out

    def _run_slots(self, work, n, barrier, abort=None):
        """work(j) for thread slots j = 0..n-1 at once, each to its end: slot 0 on this
        thread (already running), the others on the slot threads (hslm/slots.py: they
        spin between tasks rather than sleep). Where one raises, or this thread is
        interrupted (Ctrl-C) anywhere in here, the barrier the slots wait at is broken
        and abort() called (a team's kernels stop waiting), so that no slot waits for
        ever; every slot has ended before the first error that is not that breaking is
        raised (unless a second Ctrl-C interrupts that wait: then the next submit waits
        for the slot, SlotThreads.submit)."""
        def stop():
            try:
                if barrier is not None:
                    barrier.abort()
            finally:  # (even if a second Ctrl-C lands in the first)
                if abort is not None:
                    abort()

        def guarded(j):
            try:
                work(j)
            except BaseException:
                stop()
                raise
        errors = []
        try:
            if n > 1:
                self.slot_threads.submit(guarded, n)
            work(0)
            if n > 1:
                errors += self.slot_threads.join()
        except BaseException as e:
            errors.append(e)
            try:
                stop()
            finally:
                if n > 1:
                    errors += self.slot_threads.join()
        if errors:  # a slot's own error rather than the barrier it broke for the others
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                       errors[0])

    def _optimise(self, then, barrier, marks, j):
        """Slot j's part of a step once its gradient part is written: then(its optimiser
        share), which waits at the barrier for every slot's part (_gated); slot 0 marks
        when its own part was written (the optimiser's start, for the profile: with one
        thread the same moment; with several, the wait at the barrier counts in the
        optimiser's time)."""
        target = barrier.arrive() if barrier is not None else 0
        if j == 0:
            marks["optimiser"] = time.perf_counter()
        self._gated(barrier, target,
                    lambda gate, target: then(self.optimiser_shares[j], gate, target))

    @staticmethod
    def _gated(barrier, target, call):
        """call(gate, target), a kernel that first waits inside itself for the barrier's
        `target` arrivals (spin.gate_opens), with no Python or GIL between the last
        arrival and its work: where threads waited in SpinBarrier.wait and then called
        the kernel, every thread but the last came back to Python at the same moment and
        took the GIL in turn, and on the 2-core Xeon one passed 0.13-0.18 ms after the
        last arrival at each barrier (a thread that finds the GIL taken sleeps in
        CPython's wait for it); with N threads such a pass costs about N times that.
        Where the gate gives up (a wait of milliseconds, or a broken barrier) the call
        returns False having done nothing: the wait goes on in Python (which may sleep,
        sees Ctrl-C and raises if the barrier broke), then the call runs ungated."""
        if barrier is None:
            call(NO_GATE, 0)
        elif call(barrier.flags, target) is False:
            barrier.wait_target(target)
            call(NO_GATE, 0)

    def gradient(self, model, vsa_table, windows: np.ndarray, k: int, G: np.ndarray,
                 then=None) -> float:
        """G = the batch's gradient (scaled by 1/(k B)); returns the step's mean loss.

        then: None, or the optimiser's update of a share of the tensors, then(share,
        gate, target), run once G is whole for each thread slot j's share
        (self.optimiser_shares[j]). It waits for the barrier first, inside its kernel
        (spin.gate_opens(gate, target): at once for target 0), and returns False, having
        done nothing, only where that gate did not open (_gated then waits in Python
        and calls it again with target 0); anything else counts as done.
        The layerwise speeds run it in slot j's own task, after a barrier: one task per
        slot and step instead of a round trip through the calling thread after each
        phase, and slot j updates the tensors whose gradient it summed last
        (staged_chunks' owners) on the same thread, as designed (a pool's tasks had gone
        to whichever thread was free). On the 2-core AMD Zen 4, steps taken in turns
        (tools/ab_steps.py): batch 1 on two threads 0.981x and 0.986x, batch 8 0.996x;
        then slot 0 on the calling thread (_run_slots): batch 1 0.978x and 0.995x more,
        batch 8 0.996x."""
        if self.world is not None:  # MPI: this rank's windows, summed in window order
            if then is not None:
                raise ValueError("StepRunner.gradient: MPI runs update through their world")
            return self.world.gradient(self, model, vsa_table, windows, k, G)
        B = windows.shape[0]
        scale = 1.0 / (k * B)
        losses = np.zeros(B)
        if self.speed.reduction != "gradient units":
            G[:] = 0.0  # (by gradient units, each unit writes its part whole)
        if self.speed.reduction == "gradient units":
            self._gradient_layerwise(model, vsa_table, windows, k, scale, G, losses, then)
            return ordered_mean(losses)
        if self.threads == 1:
            w = self.workers[0]
            for i in range(B):
                losses[i] = w.window(model, vsa_table, windows[i], k, scale, G)
        else:
            N = self.threads
            P = self.cfg.n_params
            cuts = [P * r // N for r in range(N + 1)]
            for g0 in range(0, B, N):
                n = min(N, B - g0)

                def one(j):
                    buf = self.bufs[j]
                    buf[:] = 0.0
                    return self.workers[j].window(model, vsa_table, windows[g0 + j], k, scale, buf)

                losses[g0:g0 + n] = self._map(one, n)
                self._map(lambda r: add_in_order(G, self.bufs, n, cuts[r], cuts[r + 1]), N)
        if then is not None:
            t0 = time.perf_counter()
            self.map_parts(lambda share: then(share, NO_GATE, 0), self.optimiser_shares)
            self.add_timing("optimiser", time.perf_counter() - t0)
        return ordered_mean(losses)

    def add_timing(self, phase, seconds):
        """Adds seconds to the phase's time where hslm bench's profile collects them."""
        if self.timings is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    def _gradient_layerwise(self, model, vsa_table, windows, k, scale, G, losses, then):
        B, N = windows.shape[0], self.threads
        if self.batch != B:
            self.acts_b = alloc_acts(self.cfg.dims(), B)
            self.rec_b = alloc_record(self.cfg.dims(), B)
            self.vsa_b = np.zeros((B, self.cfg.blocks, self.cfg.window, self.cfg.width))
            self.batch = B
        kernel = self.speed.kernel
        if N > B:  # threads beyond the batch: teams split each window's rows
            return self._gradient_teams(model, vsa_table, windows, k, scale, G, losses, then)

        def run_windows(j):  # thread slot j takes windows j, j + N, ...
            windows_layerwise(model, vsa_table, windows, self.vsa_b, k, scale, self.acts_b,
                              self.rec_b, self.workers[j].scr, j, N, losses, kernel,
                              self.timings if j == 0 else None)

        def run_units(j, target):  # once the barrier has every slot's windows (_gated)
            lo, hi = self.parts[j]
            scr = self.workers[j].scr
            self._gated(barrier, target, lambda gate, target: gradients_from_records(
                model, self.acts_b, self.rec_b, windows, k, self.units, lo, hi, G, scr.xt,
                scr.dy_panels, True, gate, target))

        # the phases in one task per slot, a barrier after each (a new one each step: one
        # an error broke stays broken), so the windows' records are whole before any unit
        # reads them, and G before any slot updates; each phase's kernel waits for it
        barrier = SpinBarrier(N) if N > 1 else None
        marks = {}

        def slot(j):
            run_windows(j)
            target = barrier.arrive() if barrier is not None else 0
            if j == 0:  # (its windows done: with several threads the wait counts below)
                marks["windows"] = time.perf_counter()
            run_units(j, target)
            if then is not None:
                self._optimise(then, barrier, marks, j)

        t0 = time.perf_counter()
        self._run_slots(slot, N, barrier)
        t_end = time.perf_counter()
        t2 = marks.get("optimiser", t_end)
        self.add_timing("windows", marks["windows"] - t0)
        self.add_timing("weight gradients", t2 - marks["windows"])
        if then is not None:
            self.add_timing("optimiser", t_end - t2)

    def _gradient_teams(self, model, vsa_table, windows, k, scale, G, losses, then):
        """The layerwise gradient when threads outnumber the windows (N > B): slot j joins
        window j % B's team as member j // B. The members split the window's rows
        (team_rows) and run the forward over them (a member waits, inside the kernel, for
        the members before it to put each block's keys and values into the cache), then
        their rows' backward in stages (the head, then each block from the last down). A
        weight-gradient chunk (a run of units of one stage's tensors) is ready once every
        slot has passed its stage, since its records are then final; a slot takes the
        chunks of the tensors it updates in the optimiser first (staged_chunks' owners),
        the head's first, then what is left of the others'. All of it is one kernel call
        per slot (windows.team_slot: its waits and its chunk counters are atomics, not Python),
        so no thread needs the GIL during the step. Every row gets the bits of the whole
        window's layers, each unit its windows in window order: who computes what, and
        when, changes no bit. Then (then: the optimiser) each slot updates its share once
        every slot has passed a barrier (gradient)."""
        B, N, nb = windows.shape[0], self.threads, self.cfg.blocks
        chunks = self.staged_chunks
        rows = self.team_slot_rows(B, k)
        sync = team_counters(N, nb)
        row_losses = np.empty((B, k))
        barrier = SpinBarrier(N) if then is not None else None
        marks = {}

        def slot(j):
            p0, p1 = rows[j]
            worker = self.workers[j]
            team_slot(model, vsa_table, windows, k, scale, self.acts_b, self.rec_b,
                      worker.scr, worker.vsa_rows(p1), j, p0, p1, row_losses, sync,
                      self.units, chunks, G, self.speed.kernel)
            if then is not None:
                self._optimise(then, barrier, marks, j)

        def stop_waiting():  # a slot failed: the others' kernels stop waiting (return False)
            sync[N] = 1

        t0 = time.perf_counter()
        self._run_slots(slot, N, barrier, abort=stop_waiting)
        t_end = time.perf_counter()
        if then is not None:
            self.add_timing("optimiser", t_end - marks["optimiser"])
        self.add_timing("windows and weight gradients", marks.get("optimiser", t_end) - t0)
        mean_losses(row_losses, k, 0, 1, losses)

    def team_slot_rows(self, B, k):
        """Per thread slot j: the rows (p0, p1) of window j % B that it runs (team_rows)."""
        key = (B, k)
        if self._team_rows_for != key:
            N, L = self.threads, self.cfg.window
            teams = [team_rows(L, k, len(range(w, N, B))) for w in range(B)]
            self._team_rows = [teams[j % B][j // B] for j in range(N)]
            self._team_rows_for = key
        return self._team_rows

    @property
    def staged_chunks(self):
        """[C, 4] int64: chunks of gradient units (u0, u1, stage, owner) for the teams
        (windows.team_slot): owner o is the thread slot whose optimiser share holds the
        chunk's tensors, so that what it writes of G it reads again in the optimiser, from
        its own caches. Grouped by owner, each owner's in the order taken (the head's stage
        first, units from the last down); each chunk within one stage and one owner's run
        of consecutive units, about 8 N in all, cut by cost."""
        if self._staged_chunks is None:
            stage = unit_stages(self.cfg, self.units)
            owner_of = {}
            for j, ts in enumerate(self.optimiser_shares):
                for t in ts:
                    owner_of[int(t)] = j
            owner = np.array([owner_of[int(t)] for t in self.units[:, 0]], np.int64)
            total = float(self.unit_cost.sum())
            chunks = []
            u = 0
            while u < len(stage):  # runs of units of one stage and one owner
                e = u
                while e < len(stage) and stage[e] == stage[u] and owner[e] == owner[u]:
                    e += 1
                cost = self.unit_cost[u:e]
                n = max(1, min(e - u, round(8 * self.threads * float(cost.sum()) / total)))
                for lo, hi in split_by_cost(cost, n):
                    if hi > lo:
                        chunks.append((u + lo, u + hi, int(stage[u]), int(owner[u])))
                u = e
            chunks.sort(key=lambda c: (c[3], -c[0]))
            self._staged_chunks = np.array(chunks, np.int64)
        return self._staged_chunks

    def loss(self, model, vsa_table, windows: np.ndarray, k: int) -> ValidLosses:
        """The mean loss and plain cross-entropy of windows, forward only (validation)."""
        if self.world is not None:  # MPI: each rank scores its windows
            return self.world.loss(self, model, vsa_table, windows, k)
        B, N = windows.shape[0], self.threads
        losses = np.zeros((B, 2))

        def part(j):
            for i in range(j, B, N):
                losses[i] = self.workers[j].window_loss(model, vsa_table, windows[i], k)

        self._map(part, min(N, B))
        return ValidLosses.of(losses, ordered_mean)


def kernels_cached(speed: int, teams: bool = False) -> bool:
    """Whether Numba's cache holds compiled code for this speed's main kernels (so the
    first step will not compile; teams: with threads beyond the batch);
    precompile.in_cache reads Numba's index."""
    from .optim import adamw_kernel
    from .precompile import in_cache
    sp = SPEEDS[speed]
    kernels = [adamw_kernel, windows_embed, every_block_forward, windows_head,
               windows_loss]
    kernels += ([window_per_position] if sp.loop == PER_POSITION
                else [windows_backward, mean_losses, gradients_from_records]
                + ([team_slot] if teams else []))
    return in_cache(*kernels)


def warm_up(runner: "StepRunner", run) -> None:
    """Run the step's kernels once on throwaway buffers (one window, a two-element
    optimiser), so that compiling or loading them is not counted in step 1. Changes
    nothing in the run: its generator, parameters and moments are not touched."""
    from .optim import warm_up_optimiser
    from .rng import Stream
    cfg, h = run.cfg, run.hyper
    model = run.state.kernel_model()
    # as many windows as the run's threads take at once (at most its batch), so that the
    # kernels loaded are the run's: with threads beyond the batch, the teams' (team_slot).
    # Under MPI every rank takes the same windows (the most any rank's threads take): the
    # gradient's collectives are sized by the batch, and ranks may run different --threads
    n = min(h.batch, runner.threads)
    if runner.world is not None:
        n = runner.world.comm.allreduce(n, op=runner.world.MPI.MAX)
    w = run.corpus.draw_windows(Stream.seeded("warm-up", 0), n, cfg.window)
    runner.warming_up = True
    try:
        runner.gradient(model, run.tables.vsa, w, h.loss_positions, np.zeros(cfg.n_params))
        runner.loss(model, run.tables.vsa, w, h.loss_positions)
    finally:
        runner.warming_up = False
    warm_up_optimiser()
