"""A machine's first run: compile the kernels in several processes at once.

Numba compiles one function at a time, under one lock per process, and a first
run has about 50 s of compiling to do (2-core Zen 5; it was 78 s before the blocks'
parts were inlined into their callers, hslm/layers.py's kernel_part). The kernels fall
into jobs with few dependencies (JOBS): a job may start once the kernels it
calls are in Numba's cache, or it would compile them again. Up to cores - 1
helpers (`python -m hslm.precompile DIR`) start while `hslm train` reads and
tokenizes its text (which compiles the tokenizer here); then this process joins
them. Each takes the first job in JOBS order whose dependencies are done,
compiles it into the cache by running it once on a tiny model of the same
types, and marks it done; the run then loads every kernel from the cache. The
bits cannot change: each kernel is compiled from the same source for the same
argument types, whoever compiles it. A test checks that a run after the jobs
compiles nothing (tests/test_precompile.py).

Coordination is by files in a fresh folder: a job is claimed by creating
`<job>.claim` exclusively (with the claimer's pid) and finished by `<job>.done`.
Numba's own cache index is rewritten by every save (read, add, replace), so two
processes saving entries of one function at once could lose one or, worse,
point two entries at one data file; every save here takes the run's own lock and
this user's (_locked_cache_saves: the board's, then CACHE_LOCK where usable). A
helper that fails or dies only costs time: the jobs waiting on its unfinished one go
ahead (Board.settled) and compile what it left where they need it. The helpers get
this process's Numba target and cache folder (helper_environment), and end, removing
the folder, if the run's process disappears.

One parallel compile a kernel cache at a time (CompileLock): a second run started
while another compiles the same cache's kernels waits for them, then loads them
(two cold first runs at once had each compiled everything: 88 s, not 16-25 s, on a
2-core Xeon), and compiles itself only what the first left out.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .userlock import UserLock, lock_path, own_file

# name: the jobs it needs done first. Order is priority: the ternary tile starts the
# longest chain (tile -> forward or backward), the tokenizer fills a core meanwhile.
# "model" is the kernels that make a model's state (every other job makes a tiny one
# first); the optimiser is a job apart, after the long ones, so that they need not
# wait for it. The forward's blocks (about 70% of its compile) are a job of their own,
# so that with two processes the three long jobs (forward blocks, backward, weight
# gradients, each 8-11 s on a 2-core Zen 5) and the short rest share the two evenly.
# The weight gradients, the longest, go before the backward: with two processes one
# then takes the forward's blocks and the backward, the other the weight gradients and
# the forward (AMD Zen 4: the jobs ended at 15.9 s, not 16.7 s, where the one process
# that took the weight gradients last had left the other waiting 3.9 s).
JOBS = {
    "ternary tile": (),
    "weight-gradient tile": (),
    "model": (),
    "forward blocks": ("ternary tile", "weight-gradient tile", "model"),
    "weight gradients": ("ternary tile", "weight-gradient tile", "model"),
    "backward": ("ternary tile", "weight-gradient tile", "model"),
    "per position": ("ternary tile", "weight-gradient tile", "model"),
    "optimiser": ("model",),
    "forward": ("forward blocks",),
    "tokenizer": (),
    "team": ("backward", "weight gradients"),
    "evaluation": ("forward", "backward"),
}
MAX_PROCESSES = 4  # the chains allow no more than about this many at once
# the folder that holds this hslm package: the helpers import it from there (and no other)
PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])


def _cache_lock_path():
    """One lock for every parallel compile of this user's (two first runs at once
    included), in the temporary folder; None when no temporary folder is usable (then
    nothing compiles in parallel: a run needs none of its own)."""
    return lock_path("hslm-numba-cache")


CACHE_LOCK = _cache_lock_path()


class CompileLock(UserLock):
    """Which process compiles a kernel cache's missing kernels now, across processes: a
    UserLock on a file in the temporary folder named after the cache's folder. The file
    also holds the reason of the compile under way (note), cleared when its jobs are
    done: found there by a later run whose lock is free, that compile was interrupted,
    and its reason still holds (a first run stopped in its compile is followed by a first
    run, not by "new kernels"). take() is True without the lock where the file is
    unusable: the run compiles on its own, as before the lock."""

    @classmethod
    def for_cache(cls) -> "CompileLock | None":
        """The lock of the cache hslm's kernels compile into (None without a temporary
        folder: nothing compiles in parallel then)."""
        if CACHE_LOCK is None:
            return None
        try:
            from .micro import ternary_panel_matmul
            where = str(ternary_panel_matmul._cache._cache_path)  # (Numba's, private)
        except Exception:  # noqa: BLE001 (then one lock for all of this user's caches)
            where = ""
        key = hashlib.sha256(where.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return cls(CACHE_LOCK.with_name(f"{CACHE_LOCK.stem}-compile-{key}.lock"))


def jobs_for(speeds, teams: bool = False) -> list[str]:
    """The jobs a run at these speeds needs, in priority order (teams: with threads beyond
    the batch; their kernel is long to compile, 16-22 s on a 2-core Zen 5, and most runs
    never use it). With teams, the backward and the weight gradients, which the teams'
    kernel waits for, go before the forward's blocks: on that machine a first run then
    compiled in 42 s, not 49 (the teams' job had started last, after both)."""
    from .speeds import PER_POSITION, SPEEDS
    loops = {SPEEDS[s].loop for s in speeds}
    skip = set()
    if PER_POSITION not in loops:
        skip.add("per position")
    if loops == {PER_POSITION}:
        skip |= {"backward", "team", "weight gradients"}
    # (the per-position loop's forward is its own; evaluation is layer by layer at every
    # speed, through the forward's blocks)
    if not teams:
        skip.add("team")
    order = list(JOBS)
    if teams:
        for job in ("weight gradients", "backward"):
            order.remove(job)
            order.insert(order.index("forward blocks"), job)
    return [j for j in order if j not in skip]


# ------------------------------------------------------------------ the jobs
def _tiny():
    """A tiny model with the default model's types, and one window of it."""
    from .config import PRESETS
    from .params import ModelState, init_params
    from .tables import Tables
    cfg = PRESETS["hslm-tiny"]
    tables = Tables(cfg)
    state = ModelState(cfg, init_params(cfg, 0), tables, plain=True)
    windows = (np.arange(cfg.window + 1, dtype=np.int64) % cfg.vocab).reshape(1, -1)
    return cfg, state.kernel_model(), tables.vsa, windows


def _layerwise_buffers(cfg):
    from .layers import alloc_acts, alloc_record, alloc_scratch
    dims = cfg.dims()
    vsa = np.zeros((1, cfg.blocks, cfg.window, cfg.width))
    return alloc_acts(dims, 1), alloc_record(dims, 1), alloc_scratch(dims), vsa


def _run_job(name: str, vocab: int) -> None:
    """Compile (or load) the kernels of one job, in this process."""
    if name in ("ternary tile", "weight-gradient tile"):
        from .micro import compile_micro
        compile_micro(name)
        return
    if name == "tokenizer":
        _tokenizer_job(vocab)
        return
    if name == "model":  # a model's state: its ternary matrices, scales and panels
        _tiny()
        return
    if name == "optimiser":  # AdamW, alone and requantising as it goes, as warm_up calls it
        from .optim import warm_up_optimiser
        from .slots import compile_waits
        warm_up_optimiser()
        compile_waits()  # (and the thread slots' waits: small, and every run's)
        return
    from .speeds import KERNEL_PANELS, PER_POSITION, SPEEDS
    cfg, model, vsa_table, windows = _tiny()
    k = cfg.window
    if name == "per position":  # a window, and the threads' buffers summed in order
        from .step import Worker, add_in_order
        speed = next(s for s, sp in SPEEDS.items() if sp.loop == PER_POSITION)
        Worker(cfg, speed).window(model, vsa_table, windows[0], k, 1.0, np.zeros(cfg.n_params))
        add_in_order(np.zeros(2), np.zeros((1, 2)), 1, 0, 2)
        return
    if name == "evaluation":  # every speed evaluates layer by layer
        from .step import Worker
        Worker(cfg, 3).window_loss(model, vsa_table, windows[0], k)
        return
    from .slots import NO_GATE
    from .windows import (gradients_from_records, mean_losses, team_counters, team_slot,
                          windows_backward, windows_forward)
    A, R, S, vsa = _layerwise_buffers(cfg)
    if name == "forward blocks":  # with the argument types windows_forward gives it
        from .windows import every_block_forward
        every_block_forward(model, A, vsa, 0, 1, windows.shape[0], cfg.window, 0,
                            KERNEL_PANELS)
    elif name == "forward":
        windows_forward(model, vsa_table, windows, vsa, k, A, 0, 1, KERNEL_PANELS)
    elif name == "backward":
        row_losses = np.zeros((1, k))
        windows_backward(model, windows, k, 1.0, A, R, S, 0, 1, 0, k, row_losses,
                         KERNEL_PANELS, True, cfg.blocks, 0)
        mean_losses(row_losses, k, 0, 1, np.zeros(1))
    elif name == "team":  # threads beyond the batch: one slot's share, alone in its team
        from .step import gradient_units
        units, _ = gradient_units(cfg)
        team_slot(model, vsa_table, windows, k, 1.0, A, R, S, vsa[0], 0, 0, cfg.window,
                  np.zeros((1, k)), team_counters(1, cfg.blocks), units,
                  np.array([[0, len(units), 0, 0]], np.int64), np.zeros(cfg.n_params),
                  KERNEL_PANELS)
    elif name == "weight gradients":
        from .step import gradient_units
        units, _ = gradient_units(cfg)
        gradients_from_records(model, A, R, windows, k, units, 0, len(units),
                               np.zeros(cfg.n_params), S.xt, S.dy_panels, True, NO_GATE, 0)
    else:
        raise ValueError(f"unknown compile job {name!r}")


def _tokenizer_job(vocab: int) -> None:
    """Learn, cache and read back a tokenizer and tokens of a few bytes, in a folder of
    its own: the kernels of a real corpus's first run, for its token type."""
    from .data import corpus_tokens, text_sha256
    from .textsource import TextSource
    # printable noise: few merges, so tokens enough for the checksum's 64-byte blocks
    text = "".join(map(chr, np.random.default_rng(0).integers(32, 127, 4096)))
    with tempfile.TemporaryDirectory() as d:
        for _ in range(2):  # learned and written, then read back from the cache
            corpus_tokens(TextSource(text=text, label="compile"), text_sha256(text), vocab,
                          cache_dir=Path(d))


# ------------------------------------------------------------ the scheduler
@contextlib.contextmanager
def _locked_cache_saves(*lock_paths):
    """Numba's cache saves under file locks (see the module's docstring): each of
    lock_paths that is this user's own file (own_file), taken in that order: the run's
    private one first (every process of the run takes it, whatever the shared one does),
    then the one shared by this user's runs, where it is usable. Numba's
    IndexDataCacheFile is a private class: if it is not there, saves are left as they
    are (the jobs' functions then rarely share a callee's index anyway)."""
    import fcntl

    from numba.core import caching
    cls = getattr(caching, "IndexDataCacheFile", None)
    fds = [fd for fd in map(own_file, filter(None, lock_paths)) if fd is not None]
    if cls is None or not hasattr(cls, "save") or not fds:
        for fd in fds:
            os.close(fd)
        yield
        return
    original = cls.save

    def save(self, key, data):
        held = []
        try:
            for fd in fds:  # (Numba saves under its compiler lock: one thread at a time)
                with contextlib.suppress(OSError):  # (no flock there: saved all the same)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    held.append(fd)
            original(self, key, data)
        finally:
            for fd in reversed(held):
                fcntl.flock(fd, fcntl.LOCK_UN)

    cls.save = save
    try:
        yield
    finally:
        if cls.save is save:
            cls.save = original
        for fd in fds:
            os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Board:
    """The claim and done markers of one parallel compile, in a folder."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        spec = json.loads((self.folder / "jobs.json").read_text())
        self.jobs, self.vocab = spec["jobs"], spec["vocab"]

    def done(self, job) -> bool:
        return (self.folder / f"{job}.done").exists()

    def claimed(self, job) -> bool:
        return (self.folder / f"{job}.claim").exists()

    def claim(self, job) -> bool:
        """Claim a job for this process (its pid in the claim file); False if taken."""
        try:
            fd = os.open(self.folder / f"{job}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True

    def settled(self, job) -> bool:
        """Done, or claimed by a process that is gone without finishing it (its kernels
        are then compiled where they are next needed)."""
        if self.done(job):
            return True
        try:
            pid = int((self.folder / f"{job}.claim").read_text())
        except (OSError, ValueError):  # not claimed, or the claim is being written
            return False
        return not _alive(pid) and not self.done(job)

    def finish(self, job, ok: bool, began: float):
        (self.folder / f"{job}.done").write_text(
            f"{'ok' if ok else 'failed'} {os.getpid()} {began:.3f} {time.time():.3f}")

    def ready(self, job) -> bool:
        return all(self.settled(d) for d in JOBS[job] if d in self.jobs)

    def unsaved(self) -> str | None:
        """Why a process of this compile could not save a kernel in Numba's cache (a full
        disk), or None. From then on the jobs are pointless: a job compiles again each
        callee that is not in the cache, and the run compiles every kernel anyway."""
        try:
            return (self.folder / "cache unsaved").read_text() or "?"
        except OSError:
            return None

    def note_unsaved(self, why: str):
        """Written whole, then renamed: a reader never sees it empty."""
        part = self.folder / f"cache unsaved.{os.getpid()}"
        with contextlib.suppress(OSError):  # (a temporary folder as full: the jobs go on)
            part.write_text(why)
            os.replace(part, self.folder / "cache unsaved")

    def work(self, give_up=lambda: False):
        """Take and run jobs until every job is claimed, or until a save in Numba's cache
        fails here or in another process (unsaved). A job whose dependencies' owners
        died unfinished runs anyway (settled), as does any job once give_up() says so:
        it then compiles what they left itself."""
        from . import kernel_cache_failure
        with _locked_cache_saves(self.folder / "saves.lock", CACHE_LOCK):
            while True:
                failed = kernel_cache_failure()  # (in this process)
                if failed is not None:
                    self.note_unsaved(failed)
                if self.unsaved() is not None:
                    return
                free = [j for j in self.jobs if not self.claimed(j)]
                if not free:
                    return
                ready = [j for j in free if self.ready(j)] or (free if give_up() else [])
                if not ready:
                    time.sleep(0.02)
                    continue
                job = ready[0]
                if not self.claim(job):
                    continue
                ok, began = False, time.time()
                try:
                    _run_job(job, self.vocab)
                    ok = True
                finally:
                    self.finish(job, ok, began)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or a batch
    job's share, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def processes_to_use(n_jobs: int) -> int:
    return max(1, min(available_cores(), n_jobs, MAX_PROCESSES))


class ParallelCompile:
    """Helpers compiling a run's kernels in the background from entry; finish() says so,
    takes jobs here too and waits for all; leaving early (an error, Ctrl-C) stops the
    helpers silently. Kernels already in the cache just load, so this is harmless on
    a warm machine, only needless: see needed()."""

    def __init__(self, speeds, vocab: int, echo=None, jobs=None, processes=None,
                 reason="first run on this machine", lock: CompileLock | None = None,
                 on_stop=None):
        self.jobs = jobs_for(speeds) if jobs is None else jobs
        self.on_stop = on_stop  # tidies the caller's work up when a signal ends the process
        self.reason = reason
        self.n = processes or processes_to_use(len(self.jobs))
        self.vocab, self.echo = int(vocab), echo
        self.helpers, self.t0 = [], None
        self.lock = lock  # held (CompileLock.take) until every job is done, or this ends
        self._jobs_over = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._dir = tempfile.TemporaryDirectory(prefix="hslm-compile-")
        self.folder = Path(self._dir.name)
        (self.folder / "jobs.json").write_text(json.dumps({"jobs": self.jobs, "vocab": self.vocab}))
        self.board = Board(self.folder)
        if self.lock is not None:
            # another run waiting on this cache goes on once the jobs are done, not once
            # this run has read its text (finish())
            self.lock.note(self.reason)
            self._watcher = threading.Thread(target=self._release_when_done, daemon=True)
            self._watcher.start()
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (or SIGHUP) while compiling: stop the helpers and remove the folder,
            # then end of the signal as before (the run installs its own handler later)
            from .errors import TERMINATING
            for sig in TERMINATING:
                previous = signal.getsignal(sig)
                if previous is not signal.SIG_IGN:
                    self._previous[sig] = signal.SIG_DFL if previous is None else previous
                    signal.signal(sig, self._terminated)
        try:
            env = helper_environment()
            for _ in range(self.n - 1):
                with open(self.folder / "helpers.log", "ab") as log:
                    # run from the folder that holds this hslm: `python -m` puts the working
                    # folder first on the path, and a source tree there (a clone, after
                    # `pip install .`) had the helpers compile its hslm into its cache, not
                    # this one's (the quick start's first run compiled twice, 33 s)
                    self.helpers.append(subprocess.Popen(
                        [sys.executable, "-m", "hslm.precompile", str(self.folder)],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                        cwd=PACKAGE_PARENT if os.path.isdir(PACKAGE_PARENT) else None))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _release_when_done(self):
        while True:
            over = self._jobs_over.wait(0.05)  # (this run ends: its note stays if unfinished)
            if all(self.board.done(j) for j in self.jobs):
                self.lock.note("")
                break
            if over:
                break
        self.lock.release()

    def helpers_ended(self) -> bool:
        return all(h.poll() is not None for h in self.helpers)

    def finish(self):
        """Say so, take the jobs left, and wait until every job is done (here, or by a
        helper; a helper that ended leaves its unfinished jobs to be compiled on use).
        Where this process could not save a kernel already (the tokenizer's, compiled as
        the text was read), the helpers are stopped without a word of compiling."""
        from . import kernel_cache_failure
        failed = kernel_cache_failure()
        if failed is not None:
            self.board.note_unsaved(failed)
        if self.echo and self.board.unsaved() is None:
            n = self.n
            self.echo(f"compiling kernels in {n} process{'es' if n > 1 else ''} ({self.reason}) "
                      "...")
        try:
            self.board.work(give_up=self.helpers_ended)
        except Exception:  # noqa: BLE001 (a job that fails here fails again where the
            pass           # run needs it, and is reported there as usual)
        while (not all(self.board.settled(j) for j in self.jobs) and not self.helpers_ended()
               and self.board.unsaved() is None):
            time.sleep(0.02)
        unsaved = self.board.unsaved()
        if unsaved is not None:  # the helpers' work would be lost: stopped
            for h in self.helpers:
                if h.poll() is None:
                    h.terminate()
        if os.environ.get("HSLM_COMPILE_LOG"):  # measuring: each job's process, start, end
            with open(os.environ["HSLM_COMPILE_LOG"], "a") as f:
                for j in self.jobs:
                    done = self.folder / f"{j}.done"
                    f.write(f"{j}: {done.read_text() if done.exists() else '-'}\n")
        if self.echo and unsaved is not None:
            self.echo(f"stopped compiling in {self.n} processes after "
                      f"{time.perf_counter() - self.t0:.0f} s: Numba's cache cannot be written "
                      f"({unsaved}), so the run compiles its kernels as it goes")
        elif self.echo:
            self.echo(f"compiled in {time.perf_counter() - self.t0:.0f} s")

    def _terminated(self, signum, frame):
        """SIGTERM or SIGHUP while compiling: stop the helpers, tidy up (on_stop: a run
        removes the folder it made, which had been left with its lock) and say so, then
        end of the signal."""
        self.__exit__(None, None, None)
        if self.on_stop is not None:
            self.on_stop()
        from .errors import stop_word
        with contextlib.suppress(OSError):  # (a hung-up terminal's stderr may be gone)
            os.write(2, f"error: {stop_word(signum)}\n".encode())
        if callable(signal.getsignal(signum)):
            # a Python handler would raise here, inside whatever this process was compiling
            # (Numba may hold its cache's lock): end of the signal instead, as before
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        for h in self.helpers:  # normally ended already; on Ctrl-C or an error, stopped here
            if h.poll() is None:
                h.terminate()
            try:
                h.wait(timeout=10)
            except subprocess.TimeoutExpired:
                h.kill()
                h.wait()
        if self.lock is not None:  # (its note left as it is: an interrupted compile)
            self._jobs_over.set()
            self._watcher.join()
        self._dir.cleanup()
        return False


def helper_environment() -> dict:
    """The helpers' environment: this one, plus what makes them compile for the same
    target into the same cache as this process, whatever hslm/__init__.py could or
    could not set here (Numba imported first, say), and this hslm on their path."""
    from numba.core import config
    env = dict(os.environ)
    if config.CPU_FEATURES is not None:
        env["NUMBA_CPU_FEATURES"] = config.CPU_FEATURES
    else:  # Numba's own default features here: the helpers must not widen the vectors
        env.pop("NUMBA_CPU_FEATURES", None)
        env["HSLM_VECTOR_WIDTH"] = "256"
    if config.CACHE_DIR:
        env["NUMBA_CACHE_DIR"] = config.CACHE_DIR
    env["HSLM_QUIET_CACHE_WARNINGS"] = "1"  # the run's own process says it, once
    env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_PARENT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def needed(speeds, teams: bool = False) -> str:
    """Why a run at these speeds would compile kernels ("" if it would not): a
    machine's first run (no compiled micro-kernel in Numba's cache), or kernels
    changed since the last run (an upgrade)."""
    from .micro import ternary_panel_matmul
    if not in_cache(ternary_panel_matmul):
        return "first run on this machine"
    from .step import kernels_cached  # (loads the micro-kernels: cached, so quick)
    return ("" if all(kernels_cached(s, teams) for s in speeds)
            else "new kernels since the last run")


class _Nothing:
    """session() when nothing is to be compiled in parallel."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def finish(self):
        pass


class _AfterAnother(_Nothing):
    """session() while another process compiles this cache's kernels: finish() waits for
    its jobs (the text is read meanwhile), then compiles in parallel what is still
    missing (the other run's speeds may not have been these), as session() would."""

    def __init__(self, lock, speeds, vocab, echo, tokenizing_here, teams, reason, on_stop):
        self.lock, self.speeds, self.vocab, self.echo = lock, speeds, vocab, echo
        self.tokenizing_here, self.teams, self.reason = tokenizing_here, teams, reason
        self.on_stop = on_stop

    def finish(self):
        t0 = time.perf_counter()
        if self.echo:
            self.echo(f"waiting for the kernels another hslm process is compiling ({self.reason})"
                      " ...")
        self.lock.wait()
        try:
            if self.echo:
                self.echo(f"waited {time.perf_counter() - t0:.0f} s")
            if needed(self.speeds, self.teams):  # (not an upgrade: what the other left)
                with _parallel_compile(self.lock, "kernels the other process did not compile",
                                       self.speeds, self.vocab, self.echo,
                                       self.tokenizing_here, self.teams,
                                       self.on_stop) as compiling:
                    compiling.finish()
        finally:
            self.lock.release()  # (after a ParallelCompile, released there already)


def session(speeds, vocab: int, echo=None, tokenizing_here=False, teams=False, on_stop=None):
    """The one decision for every command: a ParallelCompile when a run at these
    speeds would compile (needed()), else a context that does nothing. With
    tokenizing_here the caller tokenizes meanwhile (which compiles the tokenizer in
    this process), so the tokenizer is not a job and one more process helps. Under
    MPI each rank compiles as it goes, as before; on a first run rank 0 says so.
    on_stop: what to tidy up if SIGTERM or SIGHUP ends the process while compiling
    (ParallelCompile._terminated)."""
    from . import distributed, kernel_cache_failure
    from .micro import ternary_panel_matmul
    if kernel_cache_failure() is not None:  # (helpers would compile what cannot be saved)
        return _Nothing()
    if distributed.launched_by_mpi():
        if echo and distributed.is_writer() and not in_cache(ternary_panel_matmul):
            echo("compiling kernels (first run on this machine: under a minute) ...")
        return _Nothing()
    reason = needed(speeds, teams)
    if reason and not _cache_takes_a_kernel(ternary_panel_matmul):  # (compiled as it goes)
        return _Nothing()
    lock = CompileLock.for_cache() if reason else None
    if lock is None:  # (warm; or no temporary folder: compiled as the run goes)
        return _Nothing()
    if not lock.take():
        return _AfterAnother(lock, speeds, vocab, echo, tokenizing_here, teams,
                             lock.noted() or reason, on_stop)
    if lock.no_flock:  # (the saves' lock cannot be held there either: compiled as the run goes)
        return _Nothing()
    return _parallel_compile(lock, reason, speeds, vocab, echo, tokenizing_here, teams, on_stop)


ROOM_PROBE_BYTES = 1 << 20  # about the largest kernel's cache file (1.2 MB, hslm-3's team)


def _cache_takes_a_kernel(kernel) -> bool:
    """Whether Numba's cache folder for hslm's kernels takes a file of a large kernel's size,
    written and removed; where it does not (a full disk, a file-size limit) that is the
    cache's first failure to save (hslm.kernel_cache_failure), said once, and the helpers
    would compile what cannot be saved. True where the folder cannot be told."""
    from . import note_kernel_cache_failure
    try:
        folder = kernel._cache._cache_path  # (Numba's private API)
    except AttributeError:
        return True
    if not os.path.isdir(folder):
        return True
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hslm-room-") as f:
            f.write(bytes(ROOM_PROBE_BYTES))
            f.flush()
    except OSError as e:
        note_kernel_cache_failure(e.strerror or str(e))
        return False
    return True


def _parallel_compile(lock, reason, speeds, vocab, echo, tokenizing_here, teams, on_stop=None):
    """session()'s ParallelCompile, the lock held (a compile of this cache's that was
    interrupted gives its reason)."""
    jobs = [j for j in jobs_for(speeds, teams) if not (tokenizing_here and j == "tokenizer")]
    return ParallelCompile(speeds, vocab, echo, jobs,
                           processes_to_use(len(jobs) + tokenizing_here),
                           lock.noted() or reason, lock, on_stop)


def compile_first(speeds, vocab: int, echo=None, teams=False) -> None:
    """Before a run that would compile (needed()), compile every kernel it needs in one
    process per core (at most MAX_PROCESSES: processes_to_use), saying so through echo
    (None: quietly)."""
    with session(speeds, vocab, echo, teams=teams) as compiling:
        compiling.finish()


def in_cache(*kernels) -> bool:
    """Whether Numba's cache holds compiled code for each of these dispatchers, for this
    machine, read from its cache index (a private API) without compiling: an entry's key
    holds the target it was compiled for (codegen's magic tuple: the triple, the CPU's
    name and features), and a cache filled on another CPU model (a checkout shared by a
    cluster's nodes, a cache baked into an image) had counted as warm, so the run compiled
    every kernel in one process, silently. When it cannot tell: True (no parallel compile
    and no message, rather than a wrong one)."""
    try:
        target = kernels[0].targetctx.codegen().magic_tuple() if kernels else None
        return all(any(key[1] == target for key in k._cache._cache_file._load_index())
                   for k in kernels)
    except Exception:  # noqa: BLE001 (any failure of the private API: assume cached)
        return True


def main(argv=None):
    """A helper: `python -m hslm.precompile FOLDER` (started by ParallelCompile). It ends
    with the run: when the run's process is gone, at once (Numba writes each cache
    file whole, by a rename, so nothing is left half-written)."""
    args = sys.argv[1:] if argv is None else argv
    board = Board(Path(args[0]))
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        shutil.rmtree(board.folder, ignore_errors=True)  # (the run could not remove it)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    board.work()


if __name__ == "__main__":
    main()
