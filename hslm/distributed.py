"""Data-parallel training over MPI, byte-identical to one process.

`mpiexec -n P hslm train ...` (or `srun hslm train ...`) runs P copies of the same
command. Every rank reads the same data and draws the same windows (the window
stream is seeded identically); window w of a step belongs to rank floor(w P / B),
so each rank holds a contiguous run of windows (a rank may hold none).

The step's gradient must be the one of a single process, to the bit:
G = ((0 + S_w0) + S_w1) + ... per element, in window order. MPI's Allreduce does
not promise an order of addition, so it is not used for G. Instead the running
sum travels from rank to rank in window order, in chunks (a pipeline):

    rank 0 adds its windows' sums into G (from zeros), chunk by chunk, and sends
    each chunk to rank 1; rank r receives a chunk, adds its windows' sums into
    it in window order, sends it on; the last rank holds the finished G.

Each element thus sees exactly the additions of one process, in its order.
Speed 3 adds the windows' sums straight from their records
(`gradients_from_records` over the chunk's gradient units and the rank's windows),
so nothing per window is kept; speeds 0-2 keep each of the rank's windows' sums
S_w in its own zeroed buffer (0 + S_w == S_w: a sum from +0.0 is never -0.0) and
add them in window order when the chunk arrives. Window losses are allgathered
and averaged in window order.

For small batches at speed 3 a second way moves fewer bytes (records_pay
decides; both give the same bits): each rank runs its windows, the ranks allgather
what the weight gradients read of every window (layers.WEIGHT_GRAD_ACTS and
WEIGHT_GRAD_RECORDS), and each rank adds every window, in window order, into the
gradient units of the tensors it owns. No pipeline to wait on, and the weight
gradients keep the whole batch's inner loop.

The optimiser step is split, not repeated: rank r owns a run of tensors (about
1/P of the parameters, or of the weight-gradient and AdamW work when records
move). With running sums, the last rank sends each finished chunk's pieces
straight to their owners as the pipeline goes. Each rank takes the AdamW step of its own
tensors (per element, so the bytes are one process's), the ranks allgather the
updated parameters and the per-tensor sums (norms, sum |W|, moment sums), and every
rank requantises the whole model itself (cheaper than moving the trits). Adam's
moments stay with their owners; rank 0 gathers them only to write a `.state`.

The ranks of a node share memory (MPI-3 Win.Allocate_shared; HSLM_MPI_SHARED=0
forbids it, and so does a node whose /dev/shm cannot hold it; ranks placed on the
nodes in turn are renumbered, so that each node's are consecutive): they hold
one copy of the model (theta, its trits, alpha, zero counts: share_state) and of
the windows' records. Each rank writes its windows'
records; a node barrier; with several nodes, each node's first rank allgathers
the node's records with the other nodes' first ranks, and a barrier; each rank
adds every window into its own units, takes the AdamW step of its own tensors and
requantises them in place; a barrier (with several nodes, the first ranks then
allgather the updated parameters, and the node's ranks requantise the other
nodes' tensors between them, between barriers). On one node nothing moves but
the losses and the per-tensor sums, and speed 3 always takes the records.

No rank writes what another still reads: each rank writes only its own windows'
records and its own tensors; records are read only between the barrier after the
windows and the next step's windows; the model is read by the windows (and by
validation and saves, before the next step's windows), never by the weight
gradients, and written only after a barrier that every rank reaches once its
windows are done (with records, the barrier after the windows; with running
sums, one at the optimiser's start). One digest per copy is compared (on one
node there is one copy). Each rank still holds its own G, m and v (24n bytes).

Communication per step, n = n_params: with running sums every rank but the
last sends 8n bytes (point to point) and the last rank 8n (P-1)/P (the finished
pieces); with records each rank sends its windows' records to every other rank;
then the allgather moves each rank's 8n/P parameters to every other one; plus a
few bytes (losses, per-tensor sums, a stop flag).

Rank 0 alone writes (checkpoints, tokenizer.json, the token cache, metrics) and
prints. The ranks agree after every step whether to stop (SIGINT/SIGTERM on any
rank: one checkpoint, then every rank stops) and compare a sha256 of their
parameters every CHECK_EVERY steps and at every save. An error on one rank ends
the whole run (comm.Abort); errors before the first step (bad flags) are
reported once.

Nothing here imports mpi4py unless the process was launched by MPI.
"""
from __future__ import annotations

import hashlib
import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

from . import (MPI_LAUNCH_VARIABLES, MPI_RANK_VARIABLES, MPI_SIZE_VARIABLES, launch_value,
               launched_by_mpi)
from .errors import (HslmError, machine_error_line, stop_word, stopped_by,
                     take_dropped_interrupt)

# Environment variables that MPI launchers set (MPICH/Hydra and Intel MPI, Open MPI,
# PMIx under Slurm, MVAPICH). HSLM_MPI=1 forces MPI, HSLM_MPI=0 ignores it.
LAUNCH_VARIABLES = MPI_LAUNCH_VARIABLES
CHECK_EVERY = 16            # steps between parameter digest comparisons (and at every save)
CHUNK_ELEMENTS = 1 << 17    # about 1 MB of gradient per message of the pipeline
TAG = 13
REDUCTIONS = ("records", "running sums")

_world = None


class AllRanksError(HslmError):
    """An error every rank raises at the same point: rank 0 reports it, all exit."""


def init():
    """The World when launched by MPI with more than one rank, else None (and then
    mpi4py is never imported)."""
    global _world
    try:
        check_mpi_variables()
    except HslmError as e:
        if launched_by_mpi():  # (a rank's own environment: it may be the only one)
            _die_before_joining(f"error: {e}")
        raise
    if _world is not None or not launched_by_mpi():
        return _world
    if launch_value(MPI_SIZE_VARIABLES) == "1" and os.environ.get("HSLM_MPI") != "1":
        return None
    with default_signals(), start_watch(start_notice_seconds()):
        try:
            from mpi4py import MPI  # (MPI_Init: it waits in C for every rank to start)
        except ImportError:
            _die_before_joining("error: launched by MPI, but mpi4py is not installed: pip "
                                "install mpi4py mpich (or set HSLM_MPI=0 to run each copy as "
                                "one process)")
            raise HslmError("launched by MPI, but mpi4py is not installed") from None
    if MPI.COMM_WORLD.Get_size() == 1:
        return None
    _world = World(MPI.COMM_WORLD, MPI)
    return _world


# Seconds that this rank waits in MPI's start before it says what it waits for
# (HSLM_MPI_START_NOTICE sets them; 0: never).
START_NOTICE_SECONDS = 60.0


def start_notice_seconds() -> float:
    """HSLM_MPI_START_NOTICE's seconds (0: no notice), 60 where it is unset or empty; any
    other value than a finite number of seconds, 0 or more, is one error line."""
    notice = os.environ.get("HSLM_MPI_START_NOTICE", "")
    if not notice:
        return START_NOTICE_SECONDS
    try:
        seconds = float(notice)
    except ValueError:
        seconds = float("nan")
    if not 0.0 <= seconds < float("inf"):  # (NaN is neither)
        raise HslmError(f"HSLM_MPI_START_NOTICE must be a finite number of seconds, 0 or "
                        f"more (0: no notice), got {notice!r}")
    return seconds


def _die_before_joining(line: str):
    """A rank that will not join MPI: its line, then death by SIGTERM. Had it exited with
    a status, the other ranks would wait in MPI's start for it for ever; killed by a
    signal, the launcher ends them."""
    os.write(2, line.encode("utf-8", "backslashreplace") + b"\n")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def check_mpi_variables():
    """The user's MPI switches as documented, or one error line before anything starts
    (every command, launched by MPI or not: a value a user set has a meaning either
    way). Under a launcher every rank has the same environment and stops alike, so none
    is left waiting in MPI's start (and one that is gets its notice)."""
    forced = os.environ.get("HSLM_MPI", "")
    if forced not in ("", "0", "1"):
        raise HslmError(f"HSLM_MPI must be 1 (run under MPI) or 0 (one process, even under "
                        f"an MPI launcher), got {forced!r}")
    shared = os.environ.get("HSLM_MPI_SHARED", "")
    if shared not in ("", "0", "1"):
        raise HslmError(f"HSLM_MPI_SHARED must be 1 (a node's ranks share its memory) or 0 "
                        f"(every rank its own copy), got {shared!r}")
    start_notice_seconds()  # (judged here too, for every command)


def start_notice(seconds: float) -> str:
    rank = launch_value(MPI_RANK_VARIABLES, "?")
    size = launch_value(MPI_SIZE_VARIABLES, "?")
    return (f"hslm: rank {rank} of {size} has waited {seconds:g} s in MPI's start for the "
            "other ranks; a rank that ended before it started MPI (a wrapper script that "
            "exits with a status where hslm died) leaves the others waiting here: Ctrl-C "
            "or SIGTERM ends the run\n")


@contextmanager
def start_watch(seconds: float):
    """MPI's start waits in C, holding the GIL, for every rank to start, so no thread of
    this process runs meanwhile, and a rank that never starts MPI leaves the others
    waiting without a word for good (a launcher ends them when a rank dies by a signal,
    not always when one exits with a status). So a child process watches the start: if it
    has not returned after `seconds`, the child writes one line saying what this rank waits
    for and how to end it. The child ends when the start returns (its pipe's write end
    closed) or when this process dies (the same), and does nothing else."""
    if seconds <= 0 or not hasattr(os, "fork"):
        yield
        return
    notice = start_notice(seconds).encode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then _exit (no handler, no atexit)
        try:
            os.close(w)
            ready, _, _ = select.select([r], [], [], seconds)
            if not ready:
                os.write(2, notice)
                os.read(r, 1)  # until the start returns or the rank dies
        finally:
            os._exit(0)
    os.close(r)
    try:
        yield
    finally:
        os.close(w)
        os.waitpid(pid, 0)


@contextmanager
def default_signals():
    """Ctrl-C and SIGTERM at their defaults, where the main thread waits in C code that
    runs no Python handler (MPI's start: a rank waiting there for another that never
    came could then be ended by SIGKILL alone); the handlers before, afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:  # (None: a handler not set from Python, left as is)
                signal.signal(s, handler)


def current():
    return _world


def relaunch_words() -> str:
    """What starts this run's ranks again, before the command: `mpiexec -n P ` (the MPI
    standard's launcher; under Slurm, srun's own words do as well), "" in one process."""
    return "" if _world is None else f"mpiexec -n {_world.size} "


def is_writer() -> bool:
    """True in one process and on rank 0: the one that writes files and prints."""
    return _world is None or _world.rank == 0


def on_writers_machine() -> bool:
    """True in one process and on the ranks of rank 0's node (machine): where a text's
    tokens are missing from the cache, these wait for rank 0 to write them and read them
    from there (hslm.data.corpus_tokens); the ranks of other machines make their own."""
    return _world is None or _world.beside_rank_0


class _NoLock:
    dir_fd = None

    def check(self):
        return None

    def release(self):
        pass


NO_LOCK = _NoLock()


def ranges(B: int, P: int):
    """[(lo, hi)] of each rank: window w goes to rank floor(w P / B)."""
    return [((r * B + P - 1) // P, ((r + 1) * B + P - 1) // P) for r in range(P)]


def unit_chunks(cfg, units, target=CHUNK_ELEMENTS):
    """[(e0, e1, u0, u1)]: consecutive gradient units grouped into chunks of about
    `target` elements; their element ranges cover the flat gradient in order."""
    from .step import unit_spans
    spans = unit_spans(cfg, units)
    chunks, u0 = [], 0
    for u in range(len(spans)):
        if spans[u][1] - spans[u0][0] >= target or u == len(spans) - 1:
            chunks.append((spans[u0][0], spans[u][1], u0, u + 1))
            u0 = u + 1
    assert chunks[0][0] == 0 and chunks[-1][1] == cfg.n_params
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), "units not contiguous"
    return chunks


def record_specs(dims, B):
    """[(shape, dtype)] of B windows' Acts and Record fields (hslm.layers), in order."""
    from .layers import ACT_FIELDS, RECORD_FIELDS
    return [((B,) + shape(dims), np.float64) for _, shape in ACT_FIELDS + RECORD_FIELDS]


def _unlike_rank_0(every):
    """(the ranks whose {what: value} differs from rank 0's, the whats that differ)."""
    odd = [r for r, x in enumerate(every) if x != every[0]]
    return odd, [k for k in every[0] if any(every[r].get(k) != every[0][k] for r in odd)]


def _unlike_statuses(codes):
    """The line for ranks whose commands ended with other exit statuses and no error of
    their own (`hslm diff`: identical on rank 0, differing on rank 1, its paths naming
    other files on its node), or None where every rank's is the same. Rank 0 alone
    prints, so its output had stood for every rank's."""
    odd = [r for r, c in enumerate(codes) if c != codes[0]]
    if not odd:
        return None
    others = ", ".join(f"rank {r} with {codes[r]}" for r in odd)
    return (f"error: the ranks' commands ended differently: rank 0 with exit status "
            f"{codes[0]} (the output above is rank 0's alone), {others} (do the paths name "
            "other files on other nodes?)")


def collapsed_line(e) -> str:
    """An error as one line, its whitespace collapsed (MPI's rule; the CLI's escapes
    control characters instead: errors.one_line)."""
    return " ".join(str(e).split()) or type(e).__name__


class World:
    """This rank's place among P ranks, and everything MPI does for a run."""

    def __init__(self, comm, MPI):
        self.comm, self.MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.started = False     # after the first step begins, an error aborts every rank
        self.settled = False     # the ranks agreed (before the first step) that one failed
        self.sent = 0            # bytes this rank sent (its part of every message)
        self.reductions = set()  # the reductions this run's steps took (records, running sums)
        self.last_reduction = None
        self.forced_reduction = os.environ.get("HSLM_MPI_REDUCTION")  # checked in start()
        self.steps = 0           # gradients computed (the warm-up's included: it sends too)
        self.train_steps = 0     # training steps (for the test hook)
        self.batch = -1          # the sizes the buffers below were made for
        self.records_batch = -1
        self._nodes(comm, MPI)
        self._wins = {}          # name -> the MPI window of a block of shared memory
        hook = os.environ.get("HSLM_MPI_TEST_FAIL", "")  # "RANK:STEP" (tests): raise there
        self.fail_at = tuple(int(x) for x in hook.split(":")) if hook else None
        # "RANK:SECONDS" (tests): that rank sleeps before its windows and before its
        # optimiser writes, so that a missing barrier would show as other bytes
        skew = os.environ.get("HSLM_MPI_TEST_SKEW", "")
        who, _, seconds = skew.partition(":")
        self.skew = float(seconds) if skew and int(who) == self.rank else 0.0
        if self.rank != 0:  # rank 0 alone prints: the others' stdout goes nowhere
            sys.stdout = open(os.devnull, "w")

    def _nodes(self, comm, MPI):
        """The ranks that share a node's memory (self.node), the node of every rank and
        its first rank, and a communicator of each node's first rank (self.leaders,
        None elsewhere). The nodes share memory (self.shared) unless HSLM_MPI_SHARED=0.
        A node's windows and tensors must be one run, so its ranks must be consecutive:
        where the launcher placed them in turn (--map-by node, Slurm's cyclic
        distribution), hslm renumbers them (self.comm; world rank 0 stays rank 0, the
        one that writes). HSLM_MPI_TEST_NODE_SIZE=k (tests) pretends that each k
        consecutive ranks are a node, and =rrk that the nodes take ranks in turn (rank
        r on node r mod k)."""
        pretend = os.environ.get("HSLM_MPI_TEST_NODE_SIZE")
        if pretend:
            k = max(1, int(pretend.removeprefix("rr")))
            color = self.rank % k if pretend.startswith("rr") else self.rank // k
            self.node = comm.Split(color, self.rank)
        else:
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.shared = os.environ.get("HSLM_MPI_SHARED", "1") != "0"
        # the switches that decide the ranks' collectives, the same on every rank (a rank's
        # own -env) before any of them: else the ranks had waited on each other for ever
        # in unmatched collectives, where no signal ends them
        settings = {"HSLM_MPI_SHARED": self.shared, "HSLM_MPI_REDUCTION": self.forced_reduction}
        odd, what = _unlike_rank_0(comm.allgather(settings))
        if odd:
            if self.rank == 0:
                print(f"error: the ranks were not given the same MPI settings: rank(s) {odd} "
                      f"differ from rank 0 in {', '.join(what)}; nothing trained",
                      file=sys.stderr, flush=True)
            sys.exit(2)
        every = comm.allgather(self.node.allgather(self.rank))  # per rank: its node's ranks
        self.renumbered = False
        if self.shared and not all(r == list(range(r[0], r[0] + len(r))) for r in every):
            first = every[self.rank][0]  # nodes in the order of their first rank
            self.comm = comm = comm.Split(0, key=first * self.size + self.rank)
            self.rank = comm.Get_rank()
            self.node = comm.Split(first, self.rank)
            every = comm.allgather(self.node.allgather(self.rank))
            self.renumbered = True
        self._copies(every if self.shared else None)
        self.beside_rank_0 = 0 in every[self.rank]  # (on rank 0's node: on_writers_machine)
        is_leader = self.node.Get_rank() == 0
        leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, self.rank)
        self.leaders = leaders if is_leader else None

    def _copies(self, every):
        """Who holds which copy of the model: every[r] = the ranks of rank r's node
        (consecutive), or None for a copy per rank (no shared memory)."""
        if every is None:
            every = [[r] for r in range(self.size)]
        self.node_first = [r[0] for r in every]                 # per rank
        firsts = sorted(set(self.node_first))
        self.node_of = [firsts.index(f) for f in self.node_first]  # per rank
        self.node_ranks = [(f, f + len(every[f])) for f in firsts]  # per copy: [r0, r1)

    def node_span(self, per_rank):
        """Per node, the span [a, b) its ranks' consecutive spans per_rank cover."""
        return [(per_rank[r0][0], per_rank[r1 - 1][1]) for r0, r1 in self.node_ranks]

    # ------------------------------------------------------------ a step
    def gradient(self, runner, model, vsa_table, windows, k, G):
        """runner.gradient over MPI: G = the batch's gradient, summed in window order
        exactly as one process sums it, on the elements this rank owns (the last
        rank of a running-sum pipeline holds all of it); returns the mean loss."""
        from .speeds import PER_POSITION
        self.steps += 1
        if not getattr(runner, "warming_up", False):  # step.warm_up's call is not a step
            self.train_steps += 1
            if self.fail_at == (self.rank, self.train_steps):
                raise HslmError(f"test hook HSLM_MPI_TEST_FAIL: rank {self.rank} fails at step "
                                f"{self.train_steps}")
        B = windows.shape[0]
        lo, hi = ranges(B, self.size)[self.rank]
        mine = np.ascontiguousarray(windows[lo:hi])
        nb = hi - lo
        scale = 1.0 / (k * B)
        losses = np.zeros(nb)
        self.finish_sends()  # the last step's sends read from G
        if self.skew:
            time.sleep(self.skew)
        if runner.speed.loop != PER_POSITION and self.records_pay(runner.cfg, B):
            self._ownership(runner.cfg, self._records_work(runner, B, k))
            self._by_records(runner, model, vsa_table, windows, k, scale, G, lo, hi)
            self._took("records", runner)
            return self.ordered_mean(self.losses[lo:hi])
        self._took("running sums", runner)
        owned = self._ownership(runner.cfg)
        if self.rank == 0:  # the running sums start from zeros; later ranks receive them
            G[:] = 0.0
        if runner.speed.loop == PER_POSITION:
            fold = self._per_position(runner, model, vsa_table, mine, k, scale, G, losses)
            chunks = [(e0, e1, (e0, e1)) for e0, e1, _, _ in self._chunks(runner)]
        else:
            fold = self._layerwise(runner, model, vsa_table, mine, k, scale, G, losses)
            chunks = [(e0, e1, (u0, u1)) for e0, e1, u0, u1 in self._chunks(runner)]
        self.fold_in_order(G, chunks, fold if nb else None, owned)
        return self.ordered_mean(losses)

    def _took(self, reduction, runner):
        self.last_reduction = reduction
        if not getattr(runner, "warming_up", False):  # the summary reports training steps
            self.reductions.add(reduction)

    def _chunks(self, runner):
        if getattr(runner, "_mpi_chunks", None) is None:
            runner._mpi_chunks = unit_chunks(runner.cfg, runner.units)
        return runner._mpi_chunks

    def _per_position(self, runner, model, vsa_table, mine, k, scale, G, losses):
        """Speeds 0-2: each of this rank's windows into its own zeroed buffer."""
        from .step import add_in_order
        nb, N = mine.shape[0], runner.threads
        if self.batch != nb:
            self.bufs = np.zeros((max(nb, 1), runner.cfg.n_params))
            self.batch = nb
        bufs = self.bufs
        for g0 in range(0, nb, N):
            n = min(N, nb - g0)

            def one(j):
                bufs[g0 + j][:] = 0.0
                return runner.workers[j].window(model, vsa_table, mine[g0 + j], k, scale,
                                                bufs[g0 + j])

            losses[g0:g0 + n] = runner._map(one, n)

        def fold(span):
            e0, e1 = span
            cuts = [e0 + (e1 - e0) * r // N for r in range(N + 1)]
            runner._map(lambda r: add_in_order(G, bufs, nb, cuts[r], cuts[r + 1]), N)
        return fold

    def _layerwise(self, runner, model, vsa_table, mine, k, scale, G, losses):
        """Speed 3: the rank's windows' records; the chunk's units add their sums."""
        from .layers import alloc_acts, alloc_record
        from .step import split_by_cost
        from .slots import NO_GATE
        from .windows import gradients_from_records, windows_layerwise
        nb, N = mine.shape[0], runner.threads
        cfg = runner.cfg
        if nb == 0:
            return None
        if self.batch != nb:
            self.acts = alloc_acts(cfg.dims(), nb)
            self.rec = alloc_record(cfg.dims(), nb)
            self.vsa = np.zeros((nb, cfg.blocks, cfg.window, cfg.width))
            self.batch = nb
        kernel = runner.speed.kernel

        def run_windows(j):
            windows_layerwise(model, vsa_table, mine, self.vsa, k, scale, self.acts, self.rec,
                              runner.workers[j].scr, j, N, losses, kernel)

        runner._map(run_windows, min(N, nb))

        def fold(span):
            u0, u1 = span
            parts = [(u0 + a, u0 + b) for a, b in split_by_cost(runner.unit_cost[u0:u1], N)]

            def run_units(j):
                scr = runner.workers[j].scr
                gradients_from_records(model, self.acts, self.rec, mine, k, runner.units,
                                       parts[j][0], parts[j][1], G, scr.xt, scr.dy_panels,
                                       False, NO_GATE, 0)
            runner._map(run_units, N)
        return fold

    def _records_work(self, runner, B, k):
        """Per tensor, a rank's work when records move: the weight gradients of its
        units over every window, and its AdamW step (about 50 multiply-adds' time an
        element updated; with shared memory also its requantising). Made once per
        batch shape."""
        if getattr(self, "_work_for", None) != (B, k):
            work = np.diff(runner.cfg.offsets()) * 50.0
            if self.shared:  # each rank also requantises its own tensors (about half as long)
                from .params import ternary_mask
                work += np.diff(runner.cfg.offsets()) * 25.0 * ternary_mask(runner.cfg)
            np.add.at(work, runner.units[:, 0], runner.unit_cost * B * k)
            self._work, self._work_for = work, (B, k)
        return self._work

    def _ownership(self, cfg, weights=None):
        """[(e0, e1)]: the elements of the tensors each rank updates (self.owned[r] =
        its run of tensors). By default each owns about a P-th of the parameters;
        `weights` (per tensor) balances other work instead. Moments live with their
        owners, so one run keeps one ownership (its batch does not change)."""
        from .step import split_by_cost
        key = (cfg, None if weights is None else tuple(weights))
        if getattr(self, "_owned_for", None) != key:
            offs = cfg.offsets()
            w = np.diff(offs).astype(np.float64) if weights is None else np.asarray(weights)
            self.owned = split_by_cost(w, self.size)
            self.owned_elements = [(int(offs[a]), int(offs[b])) for a, b in self.owned]
            self.owned_counts = [b - a for a, b in self.owned_elements]  # Allgatherv, Gatherv
            self.owned_displs = [a for a, _ in self.owned_elements]
            self._owned_for = key
        return self.owned_elements

    def records_pay(self, cfg, B):
        """Whether to move the windows' records rather than running sums: each rank
        (sharing memory: each node, P nodes) receives (B - B/P) windows' records,
        against about 16 n_params bytes for the running sums and finished pieces (and
        no pipeline to wait on)."""
        from .layers import WEIGHT_GRAD_ACTS, WEIGHT_GRAD_RECORDS, ACT_FIELDS, RECORD_FIELDS
        if self.forced_reduction is not None:  # the tests run both
            return self.forced_reduction == "records"
        if getattr(self, "_record_size_for", None) != cfg:  # doubles one window sends
            shapes = dict(ACT_FIELDS + RECORD_FIELDS)
            self._record_size = sum(int(np.prod(shapes[f](cfg.dims())))
                                    for f in WEIGHT_GRAD_ACTS + WEIGHT_GRAD_RECORDS)
            self._record_size_for = cfg
        # sharing memory, only the other nodes' windows move (none on one node)
        copies = len(self.node_ranks) if self.shared else self.size
        return 8 * self._record_size * (B - B // copies) <= 16 * cfg.n_params

    def _by_records(self, runner, model, vsa_table, windows, k, scale, G, lo, hi):
        """Speed 3 by records: each rank runs its windows, the ranks allgather what the
        weight gradients read of every window (hslm.layers.WEIGHT_GRAD_*), and each
        rank sums every window, in window order, into the gradient units of the
        tensors it owns: G is final there, with no pipeline to wait on."""
        from .layers import Acts, Record, alloc_acts, alloc_record
        from .step import split_by_cost
        from .slots import NO_GATE
        from .windows import gradients_from_records, windows_layerwise
        cfg, N = runner.cfg, runner.threads
        B = windows.shape[0]
        if self.records_batch != B:
            if self.shared:  # one copy per node: each rank writes its windows' records
                self.acts_b, self.rec_b = self._shared_records(cfg.dims(), B)
            else:
                self.acts_b, self.rec_b = alloc_acts(cfg.dims(), B), alloc_record(cfg.dims(), B)
            self.vsa_b = np.zeros((B, cfg.blocks, cfg.window, cfg.width))
            self.losses = np.zeros(B)
            self.records_batch = B
        A, R, nb = self.acts_b, self.rec_b, hi - lo
        mine = (windows[lo:hi], self.vsa_b[lo:hi], Acts(*[f[lo:hi] for f in A]),
                Record(*[f[lo:hi] for f in R]), self.losses[lo:hi])

        def run_windows(j):
            w, vsa, a, r, losses = mine
            windows_layerwise(model, vsa_table, w, vsa, k, scale, a, r, runner.workers[j].scr,
                              j, N, losses, runner.speed.kernel)

        if self.shared:  # no rank writes records while another still reads the last step's
            self.node_sync()
        if nb:
            runner._map(run_windows, min(N, nb))
        spans = ranges(B, self.size)
        if not self.shared:
            self._allgather_records(A, R, self.comm, spans)
        else:  # the node's windows' records are written, and seen by its ranks
            self.node_sync()
            if len(self.node_ranks) > 1:  # the other nodes' windows, into the node's copy
                if self.leaders is not None:
                    self._allgather_records(A, R, self.leaders, self.node_span(spans))
                self.node_sync()
        units, cost = runner.units, runner.unit_cost
        t0, t1 = self.owned[self.rank]
        u0 = int(np.searchsorted(units[:, 0], t0))
        u1 = int(np.searchsorted(units[:, 0], t1))
        parts = [(u0 + a, u0 + b) for a, b in split_by_cost(cost[u0:u1], N)]

        def run_units(j):
            scr = runner.workers[j].scr
            gradients_from_records(model, A, R, windows, k, units, parts[j][0], parts[j][1], G,
                                   scr.xt, scr.dy_panels, True, NO_GATE, 0)

        runner._map(run_units, N)

    def _allgather_records(self, A, R, comm, spans):
        """What the weight gradients read of every window, from the member of comm
        that holds it (spans[i]: the windows of comm's member i) to every other."""
        from .layers import WEIGHT_GRAD_ACTS, WEIGHT_GRAD_RECORDS
        a, b = spans[comm.Get_rank()]
        for f in ([getattr(A, n) for n in WEIGHT_GRAD_ACTS]
                  + [getattr(R, n) for n in WEIGHT_GRAD_RECORDS]):
            per = f[0].size
            comm.Allgatherv(self.MPI.IN_PLACE, [f, [(y - x) * per for x, y in spans],
                                                [x * per for x, _ in spans], self.MPI.DOUBLE])
            self.sent += 8 * (b - a) * per * (comm.Get_size() - 1)

    def fold_in_order(self, G, chunks, fold, owned):
        """The pipeline: for each chunk [e0, e1) in order, receive the running sum from
        the rank before (rank 0 starts from G's zeros), add this rank's windows
        (fold(arg), None when it has none), send it to the next rank. The last rank
        holds the finished sums: it sends each piece straight to the rank that owns
        it (`owned`), chunk by chunk, so G is the batch's gradient on every rank's own
        elements (and the last rank's whole G)."""
        r, P, comm = self.rank, self.size, self.comm
        last = r == P - 1

        def pieces(e0, e1):  # [(owner, a, b)]: the parts of [e0, e1) other ranks own
            return [(o, max(e0, a), min(e1, b)) for o, (a, b) in enumerate(owned[:-1])
                    if max(e0, a) < min(e1, b)]

        pending = []
        for e0, e1, arg in chunks:
            if r > 0:
                comm.Recv(G[e0:e1], source=r - 1, tag=TAG)
            if fold is not None:
                fold(arg)
            if not last:
                pending.append(comm.Isend(G[e0:e1], dest=r + 1, tag=TAG))
                self.sent += 8 * (e1 - e0)
            else:
                for o, a, b in pieces(e0, e1):
                    pending.append(comm.Isend(G[a:b], dest=o, tag=TAG + 1))
                    self.sent += 8 * (b - a)
        if not last:  # the finished sums of this rank's own elements
            # A send from G[a:b] must be complete before G[a:b] receives; the other sends
            # may finish while the optimiser runs (the receiver pulls them: MPICH moves a
            # large message without the sender's help) and are waited for after it.
            a, b = owned[r]
            mine = {i for i, (e0, e1, _) in enumerate(chunks) if e0 < b and a < e1}
            self.MPI.Request.Waitall([pending[i] for i in sorted(mine)])
            self.unfinished = [q for i, q in enumerate(pending) if i not in mine]
            pieces_mine = [(x, y) for e0, e1, _ in chunks for o, x, y in pieces(e0, e1) if o == r]
            self.MPI.Request.Waitall([comm.Irecv(G[x:y], source=P - 1, tag=TAG + 1)
                                      for x, y in pieces_mine])
        else:
            self.unfinished = pending

    def finish_sends(self):
        """Wait for this step's sends from G (before G is written again)."""
        self.MPI.Request.Waitall(getattr(self, "unfinished", []))
        self.unfinished = []

    def optimizer_step(self, run, runner, adam, requantize):
        """The AdamW step split between ranks: each updates the tensors it owns (where
        its G is the batch's gradient). Each element's update is one process's, so
        are the bytes; rank 0 gathers the moments only when it saves.

        With shared memory each rank also requantises its own tensors, in the one
        copy of the model every rank reads. Otherwise every rank gathers the others'
        updated parameters and requantises the whole model itself (cheaper than
        moving the trits). Either way the ranks gather the per-tensor sums."""
        from .step import tensor_parts
        t0, t1 = self.owned[self.rank]
        parts = [p for p in tensor_parts(run.cfg, runner.threads, t0, t1) if p[0] < p[1]]
        if self.skew:
            time.sleep(self.skew)
        if self.shared:
            if self.last_reduction != "records":  # every rank is done reading the model
                self.node_sync()               # (records: since the barrier after the windows)
            runner.map_parts(lambda part: (adam(part), requantize(part)), parts)
        else:
            runner.map_parts(adam, parts)
        self.finish_sends()
        multi = len(self.node_ranks) > 1
        if not self.shared:
            self._allgather_params(run.state.theta, self.comm, self.owned_elements)
        else:  # the node's tensors are updated, and seen by its ranks
            self.node_sync()
            if multi and self.leaders is not None:  # the other nodes' parameters
                self._allgather_params(run.state.theta, self.leaders,
                                       self.node_span(self.owned_elements))
        sums = np.stack([run.norms, run.abs_sums, run.moment_sums])
        for (u0, u1), part in zip(self.owned, self.comm.allgather(sums[:, t0:t1])):
            sums[:, u0:u1] = part
        run.norms[:], run.abs_sums[:], run.moment_sums[:] = sums
        if not self.shared:
            runner.map_parts(requantize, tensor_parts(run.cfg, runner.threads))
        elif multi:  # the node's ranks requantise the other nodes' tensors between them
            self.node_sync()
            n0, n1 = self.node_span(self.owned)[self.node_of[self.rank]]
            i, q = self.node.Get_rank(), self.node.Get_size()
            others = ((0, n0), (n1, len(run.norms)))
            mine = [tensor_parts(run.cfg, q, a, b)[i] for a, b in others]
            runner.map_parts(requantize, [p for a, b in mine
                                          for p in tensor_parts(run.cfg, runner.threads, a, b)
                                          if p[0] < p[1]])
            self.node_sync()

    def _allgather_params(self, theta, comm, spans):
        """The updated parameters, from the member of comm that owns them (spans[i]:
        the elements of comm's member i) to every other."""
        a, b = spans[comm.Get_rank()]
        comm.Allgatherv(self.MPI.IN_PLACE, [theta, [y - x for x, y in spans],
                                            [x for x, _ in spans], self.MPI.DOUBLE])
        self.sent += 8 * (b - a) * (comm.Get_size() - 1)

    def gather_moments(self, m, v):
        """Rank 0 receives every rank's own part of the Adam moments (before a save)."""
        a, b = self.owned_elements[self.rank]
        for arr in (m, v):
            if self.rank == 0:
                self.comm.Gatherv(self.MPI.IN_PLACE, [arr, self.owned_counts, self.owned_displs,
                                                      self.MPI.DOUBLE], root=0)
            else:
                self.comm.Gatherv(arr[a:b], None, root=0)

    def first_findings(self, firsts):
        """Per quantity, the first tensor any rank found (ranks own runs in order)."""
        every = self.comm.allgather(firsts)
        return [min((f[i] for f in every if f[i] is not None), default=None)
                for i in range(len(firsts))]

    def ordered_mean(self, losses):
        from .step import ordered_mean
        every = [v for part in self.comm.allgather([float(v) for v in losses]) for v in part]
        return ordered_mean(every)

    def loss(self, runner, model, vsa_table, windows, k):
        """runner.loss over MPI: each rank scores its run of windows; the means in order."""
        from .step import ValidLosses
        lo, hi = ranges(windows.shape[0], self.size)[self.rank]
        losses = np.zeros((hi - lo, 2))
        N = runner.threads

        def part(j):
            for i in range(j, hi - lo, N):
                losses[i] = runner.workers[j].window_loss(model, vsa_table, windows[lo + i], k)

        runner._map(part, min(N, hi - lo))
        return ValidLosses.of(losses, self.ordered_mean)

    # ------------------------------------------- one node: shared memory
    def shared_arrays(self, name, specs, fill=None):
        """Arrays [(shape, dtype)] in one block of memory that every rank of the node
        maps (MPI-3 shared memory: Win.Allocate_shared), zeroed, then given to
        `fill(arrays)` on the node's first rank; they replace the block made before
        under `name`, freed only after `fill` (which may copy from it). Collective:
        every rank calls it with the same specs."""
        MPI = self.MPI
        old = self._wins.pop(name, None)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
        starts = np.concatenate([[0], np.cumsum([-(-n // 64) * 64 for n in sizes])]).astype(int)
        total = int(starts[-1]) + 64  # each array starts on a cache line
        win = MPI.Win.Allocate_shared(total if self.node.Get_rank() == 0 else 0, 1,
                                      comm=self.node)
        win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for the whole run: Sync fences
        self._wins[name] = win
        raw = np.frombuffer(win.Shared_query(0)[0], np.uint8)
        base = -raw.ctypes.data % 64
        arrays = [raw[base + a:base + a + n].view(dtype).reshape(shape)
                  for (shape, dtype), a, n in zip(specs, starts, sizes)]
        if self.node.Get_rank() == 0:  # MPI does not promise zeroed memory
            raw[:] = 0
            if fill is not None:
                fill(arrays)
        self.node_sync()
        if old is not None:
            old.Unlock_all()
            old.Free()
        return arrays

    def node_sync(self):
        """A barrier of the node's ranks that orders their stores to shared memory:
        what any rank wrote before it, every rank sees after it."""
        for win in self._wins.values():
            win.Sync()
        self.node.Barrier()
        for win in self._wins.values():
            win.Sync()

    def share_state(self, state, batch, echo=None):
        """With shared memory, move the model (theta, its trits in every layout, alpha,
        the zero counts: hslm.params.ModelState) into one copy every rank of the node
        reads and each rank updates in its own tensors. Every rank holds the same
        values (the same init or checkpoint): rank 0's are copied.

        MPICH keeps shared memory in files under /dev/shm, and writing past what that
        holds kills the process (SIGBUS; a container's is 64 MB unless --shm-size says
        more). So each node first checks that the model and `batch` windows' records
        fit; if any node's do not, every rank passes messages instead."""
        if not self.shared:
            return
        names = ("theta", "Tf", "Tb", "alpha", "zeros", "Pf", "Pb")
        records = record_specs(state.cfg.dims(), batch)
        need = (sum(getattr(state, n).nbytes for n in names)
                + sum(8 * int(np.prod(shape)) for shape, _ in records))
        room = shm_room() if self.node.Get_rank() == 0 else None
        short = [(r, x) for r, x in enumerate(self.comm.allgather(room))
                 if x is not None and x < need + (16 << 20)]  # and a margin for MPI itself
        if short:
            self.shared = False
            self._copies(None)
            self._work_for = None
            if echo is not None and self.rank == 0:
                r, x = short[0]
                echo(f"MPI: rank {r}'s node has {x / 2 ** 20:.0f} MiB free in /dev/shm; the "
                     f"shared model and records need {need / 2 ** 20:.0f} MiB: each rank keeps "
                     "its own copy and passes messages (a container: --shm-size)")
            return

        def fill(arrays):  # rank 0's values (they may live in the block being replaced)
            for n, a in zip(names, arrays):
                a[...] = getattr(state, n)

        arrays = self.shared_arrays("model", [(getattr(state, n).shape, getattr(state, n).dtype)
                                              for n in names], fill)
        for n, a in zip(names, arrays):
            setattr(state, n, a)

    def close(self):
        """End the shared-memory epochs and free the windows. Collective: only where
        every rank ends together (a finished run, an agreed stop, an AllRanksError)."""
        wins, self._wins = self._wins, {}
        for win in wins.values():
            win.Unlock_all()
            win.Free()

    def _shared_records(self, dims, B):
        """Acts and Record of B windows (hslm.layers.alloc_acts, alloc_record) in shared
        memory."""
        from .layers import ACT_FIELDS, Acts, Record
        arrays = self.shared_arrays("records", record_specs(dims, B))
        return Acts(*arrays[:len(ACT_FIELDS)]), Record(*arrays[len(ACT_FIELDS):])

    # -------------------------------------------------- agreement between ranks
    def digest_check(self, theta, step):
        """Every copy of the parameters (one per rank, or one per node sharing memory,
        hashed by its first rank) must be the same."""
        d = None
        if not self.shared or self.node.Get_rank() == 0:
            d = hashlib.sha256(np.ascontiguousarray(theta).tobytes()).hexdigest()
        every = self.comm.allgather(d)
        held = [x for x in every if x is not None]
        if len(set(held)) != 1:
            odd = [r for r, x in enumerate(every) if x is not None and x != every[0]]
            raise AllRanksError(f"after step {step} the ranks hold different parameters (rank 0 "
                                f"sha256 {every[0][:16]}..., the copies of rank(s) {odd} "
                                "differ); stopping without saving")

    def after_step(self, run, signum, steps, save_every, failed):
        """Agree whether any rank was asked to stop (the largest signal number wins) or
        failed to write its metrics, and compare the parameters now and then."""
        flags = np.array([int(signum or 0), int(failed)], np.int64)
        self.comm.Allreduce(self.MPI.IN_PLACE, flags, op=self.MPI.MAX)
        agreed = int(flags[0])
        s = run.step
        if (agreed or s % CHECK_EVERY == 0 or s >= steps
                or (save_every and s % save_every == 0)):
            self.digest_check(run.state.theta, s)
        return agreed or None, bool(flags[1])

    def start(self, identity=None):
        """Before the first step: did every rank get ready? If one failed, the
        first failing rank has reported it; the others leave with its exit code. Then
        is every rank's run the same (identity: {what: digest}, train.run_identity)?
        Ranks that read different texts (a path naming other files on another node)
        had trained one model on a mix of them, their parameters agreeing all along;
        ranks given different --steps had waited on each other forever."""
        self._agree(None, 0)
        self.started = True
        if self.forced_reduction not in (None,) + REDUCTIONS:  # every rank: rank 0 reports
            raise AllRanksError(f"HSLM_MPI_REDUCTION must be one of {', '.join(REDUCTIONS)}, "
                                f"got {self.forced_reduction!r}")
        odd, what = _unlike_rank_0(self.comm.allgather(identity or {}))
        if odd:
            raise AllRanksError(f"the ranks were not given the same run: rank(s) {odd} differ "
                                f"from rank 0 in {', '.join(what)}; nothing trained")

    def _agree(self, msg, code):
        """Every rank's verdict before the first step, the one collective every rank makes
        there: (None, 0) from a rank about to train (start), (message, code) from one that
        failed, (ENDED, status) from one whose command ended without training (any command
        but train, `--help`; status: its own, as `diff`'s 1 for "differ"). If any failed,
        the first failing rank reports (naming itself when others did not fail: a path only
        it could not read) and every rank leaves with its exit code. If every rank's command
        ended, with statuses that differ (`diff` of paths naming other files on another
        node), rank 0 says so (it alone printed the output). If some ended and others are
        to train, the first of those reports and every rank leaves with status 2 (had they gone
        on, they would have waited for ever on the ranks that ended). The SystemExit this
        raises on a healthy rank must not agree again (settled): the failed ranks are
        gone."""
        every = self.comm.allgather((msg, code))
        failed = [(r, m, c) for r, (m, c) in enumerate(every) if c and m != ENDED]
        if failed:
            first, m, c = failed[0]
            if first == self.rank and m is not None:
                who = "" if len(failed) == len(every) else f"rank {first} of {self.size}: "
                print(f"error: {who}{m}", file=sys.stderr, flush=True)
            self.settled = True
            sys.exit(c)
        ended = [r for r, (m, _) in enumerate(every) if m == ENDED]
        if ended and len(ended) < len(every):
            training = [r for r in range(self.size) if r not in ended]
            if self.rank == training[0]:
                print(f"error: rank {ended[0]} of {self.size} ran another command than "
                      f"rank {training[0]}'s train (every rank must run the same one); "
                      "nothing trained", file=sys.stderr, flush=True)
            self.settled = True
            sys.exit(2)  # (every rank: launchers combine the ranks' statuses, MPICH by OR)
        line = _unlike_statuses([status for _, status in every]) if ended else None
        if line is not None and self.rank == 0:
            print(line, file=sys.stderr, flush=True)

    def fail(self, msg, code):
        """An error on this rank: before the first step, agree with the others and
        report it once; during the run, report it and abort every rank."""
        if not self.started:
            self._agree(msg, code)
        if self.rank == 0 or not isinstance(msg, _Shared):
            who = "" if isinstance(msg, _Shared) else f"rank {self.rank} of {self.size}: "
            print(f"error: {who}{msg}", file=sys.stderr, flush=True)
        if isinstance(msg, _Shared):
            sys.exit(code)
        sys.stderr.flush()
        # let mpiexec forward the line first: Abort tears down its I/O forwarding too, and
        # once in a CI run (fresh clone, 2 cores) the line was lost
        time.sleep(0.5)
        self.comm.Abort(code)
        os._exit(code)  # Abort may return before the launcher ends this process

    def summary(self, echo):
        """Rank 0 reports what each rank sent per step."""
        every = self.comm.allgather(self.sent / max(self.steps, 1))
        if self.rank == 0:
            per = ", ".join(f"{b / 1e6:.2f}" for b in every)
            how = {"records": "each rank's windows' records to all",
                   "running sums": "running sums to the next rank, finished sums to their owners"}
            ways = "; ".join(how[r] for r in REDUCTIONS if r in self.reductions)
            params = "updated parameters to all"
            if self.shared and len(self.node_ranks) == 1:
                ways = ways.replace("records to all", "records to all through shared memory")
                params = "parameters in shared memory"
            elif self.shared:
                nodes = len(self.node_ranks)
                ways = ways.replace("each rank's windows' records to all",
                                    f"each node's windows' records to the other {nodes - 1}")
                params = (f"updated parameters between the {nodes} nodes; the ranks of a node "
                          "share memory")
            echo(f"MPI: {self.size} ranks; MB sent per step by rank 0..{self.size - 1}: {per} "
                 f"({ways}; {params})")


class _Shared(str):
    """The message of an AllRanksError."""


ENDED = "(the command ended without training)"  # World._agree's word from such a rank


def after_step(run, signum, steps, save_every, failed=False):
    """The step loop's hook: (the signal to stop on or None, whether a rank could not
    write its metrics). In one process, as they are."""
    if _world is None:
        return signum, failed
    return _world.after_step(run, signum, steps, save_every, failed)


def largest(value: int) -> int:
    """The largest of the ranks' values (in one process: value)."""
    return value if _world is None else int(_world.comm.allreduce(int(value), op=_world.MPI.MAX))


def largest_once_all_here(value) -> int:
    """largest(value()), value() read on each rank once every rank has come here: a rank
    waiting for a slower one (rank 0 writing a checkpoint, which the others do not) waits
    where its signal handlers run (a blocking collective holds them off until it
    returns), so that a signal that reached it meanwhile counts now, not a step later."""
    if _world is None:
        return value()
    arrived = _world.comm.Ibarrier()
    while not arrived.Test():
        time.sleep(0.001)
    return largest(value())


def any_rank(flag: bool) -> bool:
    """Whether flag is true on any rank (in one process: flag)."""
    return flag if _world is None else bool(largest(int(flag)))


def share_state(state, batch, echo=None):
    """Under MPI: the model's arrays in each node's shared memory (World.share_state)."""
    if _world is not None:
        _world.share_state(state, batch, echo)


def shm_room():
    """Bytes free in /dev/shm, where MPICH keeps shared memory (None if it has none)."""
    if os.environ.get("HSLM_MPI_TEST_SHM_ROOM"):  # tests: pretend that this much is free
        return int(os.environ["HSLM_MPI_TEST_SHM_ROOM"])
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def close():
    """Free what MPI holds for the run (every rank together)."""
    if _world is not None:
        _world.close()


def start(identity=None):
    if _world is not None:
        _world.start(identity)


def summary(echo):
    if _world is not None:
        _world.summary(echo)


def run_main(cli, argv):
    """The CLI's main() under MPI: the same one-line errors and exit codes, agreed
    between ranks (see World.fail)."""
    import click
    w = _world
    try:
        rv = cli.main(args=argv, prog_name="hslm", standalone_mode=False)
    except SystemExit as e:
        if not w.started and not w.settled:  # nothing to report
            w._agree(*((ENDED, 0) if e.code in (0, None) else (None, e.code)))
        if w.started and e.code in (128 + 1, 128 + 2, 128 + 15):  # an agreed stop: every
            # rank is here (SIGHUP, SIGINT, SIGTERM)
            w.close()
        raise
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        w._agree(ENDED, 0)
        sys.exit(0)
    except click.UsageError as e:  # agreed: a rank given other flags than the rest fails too
        w.fail(e.format_message().replace("\n", " "), 2)
    except click.ClickException as e:
        w.fail(e.format_message(), e.exit_code)
    except (click.Abort, KeyboardInterrupt) as e:  # click makes an Abort of either
        signum = stopped_by(e)
        w.fail(stop_word(signum), 128 + signum)
    except AllRanksError as e:  # raised by every rank at the same point
        w.close()
        w.fail(_Shared(collapsed_line(e)), 2)
    except HslmError as e:
        w.fail(collapsed_line(e), 2)
    except (OSError, ModuleNotFoundError, MemoryError) as e:  # as one process reports them
        line = machine_error_line(e)
        w.fail(f"{type(e).__name__}: {collapsed_line(e)}" if line is None
               else collapsed_line(line), 1 if line is None else 2)
    except Exception as e:  # noqa: BLE001 - one rank's bug must not leave the others waiting
        dropped = take_dropped_interrupt()  # (or what an interrupt inside a compile left)
        if dropped is not None:
            signum = stopped_by(dropped)
            w.fail(stop_word(signum), 128 + signum)
        w.fail(f"{type(e).__name__}: {collapsed_line(e)}", 1)
    code = rv if isinstance(rv, int) else 0  # (a command's own status: diff's 1, "differ")
    if not w.started and not w.settled:  # a command that does not train: agreed all the same
        w._agree(ENDED, code)
    sys.exit(code)
