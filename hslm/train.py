"""The training run: data, model, steps, checkpoints, resume, validation."""
from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np

from . import checkpoint as ckpt
from . import _the_hslm_command, distributed, errors, kernel_cache_failure, precise
from .config import PRESETS, Config
from .data import (BUILTIN_SHA256, BUILTIN_SOURCE, Corpus, Tokenizer, check_apart_from_text,
                   check_cache_apart, same_file)
from .errors import (HANGUP, TERMINATING, HslmError, Terminated, open_regular, warn,
                     raise_dropped_interrupt, raise_terminated, read_bytes, refuse_unless_file,
                     stop_word)
from .hyper import HYPER_NAMES, Hyper
from .lock import LOCK_NAME
from .optim import adamw_step, adamw_tensors, bias_corrections, learning_rate
from .params import ModelState, init_params, ternary_mask
from .rng import Stream
from .slots import NO_GATE
from .speeds import SPEEDS
from .tables import Tables
from .token_cache import TEXT_SHA_MEMO
from .validate import (MAX_INT, check_file_not_named_as_folder, check_fits, check_hyper,
                       memory_estimate, unique_keys)

if TYPE_CHECKING:  # (the step's module loads the kernels: only once the flags are judged)
    from .step import StepRunner, ValidLosses


# What a run that diverged says after naming what is not finite.
DIVERGED = ("stopping without saving this step (checkpoints already written are left as "
            "they are); a smaller --lr or --weight-decay may help")


def perplexity(nats: float) -> float:
    """exp(nats), a cross-entropy's perplexity, correctly rounded (hslm.precise: math.exp
    is the C library's, whose FMA and non-FMA variants differ in the last bit for about
    one value in 1,400, and the metrics file keeps all 17 digits); inf past the largest
    double (a diverged run's cross-entropy above 709.78), NaN for NaN."""
    if math.isnan(nats):
        return nats
    if nats > 710.0:  # (decimal's exp of a huge value would trap on its exponent range)
        return math.inf
    if nats < -746.0:
        return 0.0
    return precise.to_f64(precise.CTX.exp(precise.D(nats)))


def short_figure(x: float, places: int) -> str:
    """x with `places` decimals, or in 5 significant digits from 1e6 up (a diverged or
    crafted model's perplexity of 300 digits, a loss of 1e300)."""
    return f"{x:.{places}f}" if abs(x) < 1e6 else f"{x:.4e}"


def threads_note(threads: int) -> str:
    """" (on 2 cores: ...)" where --threads asks for more threads than the process has
    cores: allowed (the bytes never depend on it), but the threads then take turns."""
    from .precompile import available_cores
    cores = available_cores()
    return (f" (on {cores} core{'s' if cores > 1 else ''}: they take turns, no faster)"
            if threads > cores else "")


def check_out_dir(out: Path):
    """Judge an output folder without creating anything: it, or the nearest folder
    above it that exists, must be a writable folder."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise HslmError(f"output folder {out} cannot be written: it is not a folder")
    probe = p
    while not probe.exists():
        if probe.is_symlink():  # (a folder cannot be made at its name: "File exists")
            raise HslmError(f"output folder {out} cannot be written: {probe} is a link to "
                            f"nothing ({os.readlink(probe)}); make what it names, or remove it")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise HslmError(f"output folder {out} cannot be written: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise HslmError(f"output folder {out} cannot be written: {probe} is not writable")


def check_metrics_path(metrics, out: Path):
    """--metrics must name a file we can append to, in a folder that exists (or the
    output folder, made when the run starts); judged before anything is created."""
    if metrics is None:
        return
    m = Path(metrics)
    if refuse_unless_file(m, "--metrics") is not None:
        try:  # opened to append, as the run will (os.access says yes to root, always)
            open(m, "ab").close()
        except OSError as e:
            raise HslmError(f"--metrics {m} is not writable: {e.strerror or e}") from None
        from .progress import partial_record
        partial_record(m)  # a file that is not a metrics file cut short is refused here
        return
    # a new name, or a link to none: the run appends through the link (O_CREAT), so what
    # must exist and be writable is the folder of the name it leads to
    parent = Path(os.path.realpath(m)).parent if os.path.islink(m) else m.parent
    if os.path.realpath(parent) == os.path.realpath(out):
        return
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise HslmError(f"--metrics {m}: {parent} {what}")
    try:
        ckpt.probe_new_file(parent, f".hslm-write-test-{os.getpid()}")
    except OSError as e:
        raise HslmError(f"--metrics {m}: the folder {parent} is not writable "
                        f"({e.strerror or e})") from None


# The names a run writes in its output folder (and its token cache folder): a metrics
# file of such a name was cut short or replaced by the run's own file. Hidden names are
# hslm's too (the folder's lock, write_atomic's temporary files, the write probe).
WRITTEN_NAMES = (r"tokenizer\.json|ckpt_\d+\.(?:bin|state)|bpe-.*\.json|tokens-.*\.tok|"
                 + re.escape(TEXT_SHA_MEMO))
RUN_FILE_NAMES = re.compile(WRITTEN_NAMES + r"|\..*", re.DOTALL)
# write_atomic's temporary file of one of them: `.<name>.tmp<pid>`
TORN_WRITE = re.compile(r"\.(?:" + WRITTEN_NAMES + r")\.tmp(?P<pid>[0-9]{1,10})", re.DOTALL)


def written_by_the_run(path: Path, folders) -> str | None:
    """The folder, as "output folder DIR", in which the run writes a file of path's name
    (RUN_FILE_NAMES), path's own or, for a link, its target's; else None. folders: [(DIR or
    None, what)]."""
    target = Path(os.path.realpath(path))
    names = ((str(target.parent), target.name),  # (a link's target, and the link itself:
             (os.path.realpath(path.parent), path.name))  # write_atomic replaces it)
    for folder, what in folders:
        if folder is not None and any(place == os.path.realpath(folder)
                                      and RUN_FILE_NAMES.fullmatch(name)
                                      for place, name in names):
            return f"{what} {folder}"
    return None


def check_paths_apart(o: TrainOptions, out: Path):
    """Judged before anything is created: neither the output folder nor the token cache
    folder is a --data folder, no --data file or --model config has a name the run writes
    in those folders (RUN_FILE_NAMES: the run replaced it, and its own checkpoint could not
    be resumed with it), and --metrics names none of the run's own files: not its text (a
    --data file, or a file in a --data folder: appended to, the text changes, and no
    checkpoint of the run could be resumed with it), not the checkpoint it resumes, and no
    name the run writes; and it can be written (check_metrics_path: a metrics file or a
    new name; a --model config is not one)."""
    from .token_cache import cache_dir as token_cache_dir

    check_apart_from_text(o.data, out, "output folder", "--out")
    cache = token_cache_dir(o.cache_dir, out)
    check_cache_apart(o.data, cache)
    folders = ((out, "output folder"), (cache, "token cache folder"))
    written = "(tokenizer.json, ckpt_N.bin and .state, token caches, hidden files)"
    model = Path(o.model) if o.model not in PRESETS and Path(o.model).is_file() else None
    inputs = [(f"--data {d}", Path(d)) for d in o.data if not Path(d).is_dir()]
    for flag, path in inputs + ([(f"--model {model}", model)] if model else []):
        where = written_by_the_run(path, folders)
        if where is not None:
            raise HslmError(f"{flag} has a name this run writes in its {where} {written}, "
                            f"which would replace it; move it, or give another --out")
    if o.metrics is None:
        return
    m = Path(o.metrics)
    target = Path(os.path.realpath(m))
    for folder, what in folders:  # a folder the run makes, or one above it: not there yet
        made = Path(os.path.realpath(folder)) if folder is not None else None
        if made is not None and (target == made or target in made.parents):
            where = (f"the run's {what}" if target == made else
                     f"a folder above the run's {what} {folder}")
            raise HslmError(f"--metrics {m} is {where}; give the metrics file another name")
    where = written_by_the_run(m, folders)
    if where is not None:
        shown = f"{m} (a link to {target})" if os.path.islink(m) else str(m)
        raise HslmError(f"--metrics {shown} is a name this run writes in its {where} "
                        f"{written}; give the metrics file another name")
    for d in o.data:  # (where the run's appends go: through a link, its target's folder;
        # a hard link to a file of a --data folder is that file)
        if same_file(m, d) or (Path(d).is_dir() and (
                str(target.parent) == os.path.realpath(d)
                or any(same_file(m, Path(d) / n) for n in os.listdir(d)))):
            raise HslmError(f"--metrics {m} is in the training text (--data {d}), which "
                            "it would change; give a path outside it")
    if o.resume is not None and any(same_file(m, o.resume.with_suffix(ext))
                                    for ext in (".bin", ".state")):
        raise HslmError(f"--metrics {m} is the checkpoint this run resumes; give the metrics "
                        "file another name")
    check_metrics_path(m, out)  # (after these: a run's own file is named as such)


def check_steps(steps: int):
    if not 1 <= steps <= MAX_INT:
        raise HslmError(f"--steps must be from 1 to 2^63 - 1, got {steps}")


def prepare_out_dir(out: Path):
    """Create the output folder, take its lock (one writer per folder) and tidy what
    killed writers left; returns the held lock (kept until the process ends)."""
    from .lock import FolderLock
    check_out_dir(out)
    try:
        ckpt.make_writable_folder(out)
    except OSError as e:
        raise HslmError(f"output folder {out} cannot be written: {e.strerror or e}") from None
    lock = FolderLock(out).acquire()
    remove_torn_writes(out)
    return lock


def tidy_cache_dir(cache, out: Path | None = None):
    """remove_torn_writes in a token cache folder apart from the output folder (--cache-dir,
    $HSLM_CACHE_DIR; for eval and bench, out None): a run killed while caching a large
    text's tokens leaves its temporary file there, as big as the cache it was writing.
    Never in a run's output folder (it holds a run's lock file), which only its run tidies,
    holding the lock: a writer in another PID namespace (a container sharing the folder)
    looks gone to os.kill, and eval, tidying the checkpoint's folder, had removed a live
    run's checkpoint on its way in, and the run failed."""
    if cache is None or not distributed.is_writer():
        return
    try:
        there = Path(cache).is_dir() and not os.path.lexists(Path(cache) / LOCK_NAME)
    except OSError:  # a name too long, say: the cache is then a warning (corpus_tokens)
        return
    if there and (out is None or os.path.abspath(cache) != os.path.abspath(out)):
        remove_torn_writes(Path(cache))


def remove_torn_writes(out: Path):
    """Delete temporary files left by a writer that was killed mid-write
    (checkpoint.write_atomic's `.<name>.tmp<pid>`, of a name a run writes: a --cache-dir
    may be a folder of the user's, whose `.notes.tmp12` is not hslm's), when that process
    is gone."""
    for p in out.glob(".*.tmp*"):
        torn = TORN_WRITE.fullmatch(p.name)
        if torn is None or not 0 < int(torn["pid"]) < 2 ** 31:
            continue  # (not a name write_atomic makes: os.kill would refuse such a pid)
        pid = torn["pid"]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                p.unlink()
            except OSError:
                pass
        except OSError:  # exists but not ours to signal: leave it
            pass


class Run:
    """A model, its optimiser state and its data, ready to take steps."""

    def __init__(self, cfg: Config, hyper: Hyper, corpus: Corpus, theta, m, v, step, rng,
                 plain=True):
        self.cfg, self.hyper, self.corpus = cfg, hyper, corpus
        self.tables = Tables(cfg)
        # plain: keep the layouts of the per-position speeds too (speed 3 needs only panels)
        self.state = ModelState(cfg, theta, self.tables, plain=plain)
        self.m, self.v = m, v
        self.step = step
        self.rng = rng
        self.grad = np.zeros(cfg.n_params)
        self.decay = ternary_mask(cfg)
        self.norms = np.zeros(len(cfg.tensors()))
        self.abs_sums = np.zeros(len(cfg.tensors()))  # sum |W| per tensor, for alpha
        self.moment_sums = np.zeros(len(cfg.tensors()))  # sum |m| + v: the finiteness check
        # MPI: the world of the runner that took the steps (None in one process, and in
        # a bench, whose runners have none): where each rank owns part of the state
        self.world = None
        self.folder_lock = None  # hslm train's lock of the output folder, checked at each save
        self.last_saved = None  # the .state this run last saved (or resumed from): named when
        # a save fails

    @classmethod
    def fresh(cls, cfg: Config, hyper: Hyper, corpus: Corpus, plain=True) -> "Run":
        theta = init_params(cfg, hyper.seed)
        # Windows come from their own stream, so the data order does not depend on the model.
        rng = Stream.seeded("windows", hyper.seed)
        z = np.zeros(cfg.n_params)
        return cls(cfg, hyper, corpus, theta, z, z.copy(), 0, rng, plain)

    @classmethod
    def resume(cls, state_path: Path, corpus_for, plain=True, threads=1, speed=3) -> "Run":
        st = ckpt.read(state_path, expect_kind="state")
        bin_path = state_path.with_suffix(".bin")
        pb = ckpt.read(bin_path, expect_kind="params")
        if pb.data_sha256 != st.meta["params_sha256"]:
            raise HslmError(f"{bin_path} does not belong to {state_path} (parameter checksum "
                            "differs)")
        if pb.step != st.step or pb.config != st.config:
            raise HslmError(f"{bin_path} and {state_path} disagree on step or config")
        hyper = st.hyper
        tok = pb.tokenizer()  # the run's own tokenizer travels in its .bin
        if tok.identity != st.meta["tokenizer"]:
            raise HslmError(f"{bin_path} carries another tokenizer than {state_path} records")
        pb.check_finite()
        st.check_finite()
        held = 3 * 8 * st.config.n_params  # theta, m and v: read already, the run's own
        check_fits(memory_estimate(st.config, hyper.batch, threads, speed) - held,
                   f"resuming {state_path} (batch {hyper.batch}, {threads} thread(s))")
        corpus = corpus_for(st.config, hyper, st.meta["text_sha256"], tok, st.step)
        # the arrays read are the run's own: no second copy of the parameters or moments
        return cls(st.config, hyper, corpus, pb.flat(), st.tensor("adam.m"), st.tensor("adam.v"),
                   st.step, Stream.from_state_json(st.meta["rng"]), plain)

    def check_finite(self, loss):
        """An error naming the step and the first non-finite quantity: the loss, a
        gradient, a parameter or an Adam moment (nothing is saved after one). Under MPI
        every rank reaches the same verdict (the sums are gathered), rank 0 reports."""
        where = f"step {self.step}"
        if not np.isfinite(loss):
            raise distributed.AllRanksError(f"{where}: the training loss is {loss}; {DIVERGED}")
        if (np.isfinite(self.norms).all() and np.isfinite(self.abs_sums).all()
                and np.isfinite(self.moment_sums).all()):
            return  # the optimiser's per-tensor sums are finite: so is every element
        # A sum is not: find the first quantity and tensor holding a non-finite element
        # (or find that a finite sum overflowed). Under MPI each rank looks at the
        # tensors it updated (there its gradient and moments are the run's) and the
        # ranks agree on the first finding.
        world = self.world
        t0, t1 = (0, len(self.norms)) if world is None else world.owned[world.rank]
        offs = self.state.offs
        quantities = (("gradient", self.grad), ("parameter", self.state.theta),
                      ("Adam first moment", self.m), ("Adam second moment", self.v))
        firsts = [next((t for t in range(t0, t1)
                        if not np.isfinite(arr[offs[t]:offs[t + 1]]).all()), None)
                  for _, arr in quantities]
        if world is not None:
            firsts = world.first_findings(firsts)
        for (what, _), t in zip(quantities, firsts):
            if t is not None:
                name = self.cfg.tensors()[t][0]
                raise distributed.AllRanksError(
                    f"{where}: the {what} of tensor {name} is not finite (NaN or infinite); "
                    f"{DIVERGED}")

    # ------------------------------------------------------------- stepping
    def lr_at(self, step):
        h = self.hyper
        return learning_rate(step, h.lr, h.warmup, h.decay_steps)

    def train_step(self, runner: StepRunner) -> float:
        h = self.hyper
        windows = self.corpus.draw_windows(self.rng, h.batch, self.cfg.window)
        model = self.state.kernel_model()
        step = self.step + 1
        lr = self.lr_at(step)
        bc1, bc2 = bias_corrections(step)

        def adam(part):  # MPI: a rank's contiguous run of tensors (they are independent)
            adamw_step(self.state.theta, self.grad, self.m, self.v, self.state.offs, self.decay,
                       bc1, bc2, lr, h.weight_decay, self.norms, self.abs_sums,
                       self.moment_sums, part[0], part[1])

        trits = self.state.trits()

        def optimise_share(share, gate=NO_GATE, target=0):
            """A thread's tensors (hslm.step.optimiser_shares), requantised as it goes,
            once its gate opens (StepRunner._gated); False where it did not open."""
            return adamw_tensors(self.state.theta, self.grad, self.m, self.v, self.state.offs,
                                 self.decay, bc1, bc2, lr, h.weight_decay, self.norms,
                                 self.abs_sums, self.moment_sums, share, trits, gate, target)

        def requantize(part):  # alpha from the update's sums
            self.state.requantize(part[0], part[1], self.abs_sums)

        self.world = world = runner.world
        # in one process each thread slot updates its share once the gradient is whole
        loss = runner.gradient(model, self.tables.vsa, windows, h.loss_positions, self.grad,
                               then=optimise_share if world is None else None)
        self.step = step
        if world is not None:  # MPI: each rank updates its own tensors, then all gather them
            t0 = time.perf_counter()
            world.optimizer_step(self, runner, adam, requantize)
            runner.add_timing("optimiser", time.perf_counter() - t0)
        return loss

    def validation_loss(self, runner: StepRunner) -> ValidLosses:
        h = self.hyper
        windows = self.corpus.validation_windows(h.eval_windows, self.cfg.window)
        return runner.loss(self.state.kernel_model(), self.tables.vsa, windows, h.loss_positions)

    # ---------------------------------------------------------- checkpoints
    def save(self, out: Path):
        base = out / f"ckpt_{self.step}"
        paths = base.with_suffix(".bin"), base.with_suffix(".state")
        if self.world is not None:  # MPI: every rank calls save; rank 0 alone writes
            self.world.gather_moments(self.m, self.v)  # it needs every rank's moments
        if not distributed.is_writer():
            return paths
        lock = self.folder_lock
        problem = lock.check() if lock is not None else None
        if problem == "unlocked":  # another run may hold the folder now: write nothing there
            raise HslmError(f"the lock file {lock.path} was removed during the run, so another "
                            f"run may hold {out}; step {self.step} not saved")
        pblob = ckpt.params_parts(self.cfg, self.state.theta, self.step, self.corpus.tokenizer)
        extra = {
            "rng": self.rng.state_json(),
            "hyper": self.hyper.to_json(),
            "tokenizer": self.corpus.tokenizer.identity,
            "text_sha256": self.corpus.text_sha256,
            # what the text is, by its sha256: never how it was given (a --data file named
            # as the built-in text is labelled, or a copy of that text: the bytes of a run
            # resumed with its text given the other way must not change)
            "data_source": (BUILTIN_SOURCE if self.corpus.text_sha256 == BUILTIN_SHA256
                            else "--data text"),
        }
        sblob = ckpt.state_parts(self.cfg, self.m, self.v, self.step,
                                ckpt.params_sha256_of(pblob), extra)
        # through the folder locked, whatever its name now
        locked_dir_fd = lock.dir_fd if lock is not None else None
        # both written before either is renamed: a failed save leaves the old pair whole
        try:
            ckpt.write_atomic_files([(paths[0], pblob), (paths[1], sblob)],
                                    dir_fd=locked_dir_fd)
        except HslmError as e:
            raise HslmError(f"{e}; step {self.step} not saved, " + (
                f"the last checkpoint saved is {self.last_saved}" if self.last_saved else
                "no checkpoint of this run is saved")) from None
        self.last_saved = paths[1]
        if problem == "moved":
            raise HslmError(f"{out} is no longer the folder this run locked (moved or replaced "
                            f"during the run): step {self.step} is saved in the folder it "
                            "locked, under its new name, and the run stops")
        return paths

    def grad_norm(self) -> float:
        """The whole gradient's L2 norm (before clipping), from the tensors' norms: their
        squares added in tensor order (numpy's sum adds pairwise, in an order its version
        chooses)."""
        total = 0.0
        for norm in self.norms:
            total += float(norm) * float(norm)
        return math.sqrt(total)

    def ternary_zero_share(self) -> float:
        """Share of zeros over all ternary matrices (|W| <= alpha / 2), counted when
        they were requantised."""
        st = self.state
        return int(st.zeros[st.is_ternary].sum()) / int((st.rows * st.cols)[st.is_ternary].sum())


def load_corpus(data, cfg: Config, expect_sha256=None, tokenizer=None, cache_dir=None) -> Corpus:
    return Corpus.load(data, cfg.vocab, cfg.window, expect_sha256, tokenizer, cache_dir)


def load_corpus_compiling(o: TrainOptions, cfg: Config, load, batch: int, held):
    """load() (the run's corpus), while on a machine's first run (or after an upgrade)
    helper processes compile the step's kernels (hslm/precompile.py); then say so, and
    compile what is left here and in the helpers. The tokenizer's kernels compile here
    as the text is tokenized. A bad text's error comes alone: the helpers are stopped
    silently. With more threads than the batch has windows, the teams' kernel too.
    A SIGTERM or SIGHUP while compiling ends the process by the signal: the folders
    held (HeldFolder) are given up first, as for an error."""
    from . import precompile
    echo = None if o.quiet or not distributed.is_writer() else (lambda m: click.echo(m, err=True))
    with precompile.session([o.speed], cfg.vocab, echo, tokenizing_here=True,
                            teams=o.threads > batch, on_stop=lambda: give_up(held)) as compiling:
        corpus = load()
        compiling.finish()
    return corpus


def save_tokenizer(out: Path, tok: Tokenizer, dir_fd=None):
    """tokenizer.json beside the checkpoints, for people and other tools; hslm itself
    reads the copy inside each .bin. dir_fd: the run's locked folder, written there
    whatever its name now (a folder moved while the text was tokenized: the name may
    be another run's folder, whose tokenizer.json this one had replaced)."""
    ckpt.write_atomic(out / "tokenizer.json", tok.to_json().encode("utf-8"), what="tokenizer",
                      dir_fd=dir_fd)


def load_for_inference(path, threads=1, warn=None, trained_on=None):
    """(config, ModelState, tokenizer, Hyper or None) from a .bin (or the .bin beside a
    .state). The tokenizer is the one the .bin carries; a tokenizer.json beside it that
    differs is ignored (with a warning); the hyper-parameters come from the .state
    beside it, when there and when it belongs to this .bin. A .state named by the user
    that is damaged or belongs to other parameters is an error (the file named would
    be the one ignored); one found beside a named .bin is set aside with a warning."""
    # (MPI: every rank reads the same files; rank 0 alone warns)
    warn = warn or errors.warn  # (MPI: rank 0's alone)
    path = Path(path)
    named_state = path.suffix == ".state"
    if named_state:
        # a named .state that is not there is an error, as a damaged one is: its .bin alone
        # had been used, scored with the window's k, not the run's
        if not path.exists():
            raise HslmError(f"checkpoint not found: {path}")
        path = path.with_suffix(".bin")
        if not path.exists():
            raise HslmError(f"checkpoint not found: {path} (the parameters of "
                            f"{path.with_suffix('.state')})")
    ck = ckpt.read(path, expect_kind="params")
    cfg = ck.config
    ck.check_finite()
    tok = ck.tokenizer()
    tok_path = path.parent / "tokenizer.json"
    if tok_path.is_file():
        try:
            # (one larger than twice this tokenizer's JSON is not it: not read whole)
            other = Tokenizer.from_json(read_bytes(tok_path, "tokenizer", limit=2 * len(
                tok.to_json()) + 4096)).identity
        except (HslmError, OSError):
            other = None
        if other != tok.identity:
            warn(f"ignoring {tok_path}: it is not the tokenizer of {path} (which carries "
                 "its own)")
    hyper = None
    st = path.with_suffix(".state")
    if st.exists():  # only for its default k: a damaged or foreign .state is set aside
        try:
            sck = ckpt.read(st, expect_kind="state", keep_data=False, expect_config=cfg)
            foreign = sck.meta["params_sha256"] != ck.data_sha256
        except ckpt.OtherModel:  # (known from its header: its parameters are not these)
            foreign = True
        except HslmError as e:
            if named_state:
                raise
            warn(f"ignoring {st}: {e}")
            foreign = None
        if foreign and named_state:
            raise HslmError(f"{st} belongs to other parameters than {path} (not the "
                            "same checkpoint's pair); name the .bin to use it alone")
        if foreign:
            warn(f"ignoring {st}: it belongs to other parameters than {path}")
        elif foreign is False:
            hyper = sck.hyper
            if trained_on is not None:  # the run's text: its sha256 and where it came from
                trained_on.update(sha256=sck.meta.get("text_sha256"),
                                  source=sck.meta.get("data_source"))
    held = 8 * cfg.n_params  # theta: the data read, already held
    check_fits(memory_estimate(cfg, threads=threads, training=False) - held,
               f"evaluating {path} ({cfg.n_params:,} parameters)")
    state = ModelState(cfg, ck.flat(), Tables(cfg), plain=False)
    return cfg, state, tok, hyper


def resolve_config(model: str) -> Config:
    """A preset name, or the path of a JSON file with the config's fields."""
    if model in PRESETS:
        return PRESETS[model]
    check_file_not_named_as_folder(model, "--model ")
    path = Path(model)
    if not (model.endswith(".json") or path.exists()):
        raise HslmError(f"unknown --model {model!r}: give a preset ({', '.join(PRESETS)}) "
                        "or a JSON file of config fields")
    f, _ = open_regular(path, "model config")
    with f:
        head = f.read(16)
    if ckpt.starts_as_checkpoint(head):
        raise HslmError(f"--model {path} is an hslm checkpoint, not a model config (a preset or "
                        "a JSON file of config fields); to go on training from it: --resume "
                        f"{path.with_suffix('.state')}")
    raw = read_bytes(path, "model config", limit=65536)  # (a config is a small JSON object)
    if not raw.removeprefix(codecs.BOM_UTF8).strip():
        raise HslmError(f"model config {path} is empty")
    try:  # (a byte order mark first, as some editors save JSON: read past, as info does)
        return Config.from_dict(json.loads(raw.decode("utf-8-sig"),
                                           object_pairs_hook=unique_keys))
    except json.JSONDecodeError as e:
        raise HslmError(f"model config {path} is not JSON: {e}") from None
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        # (Python's advice on a number of thousands of digits is not the user's to follow)
        msg = msg.split("; use sys.set_int_max_str_digits")[0]
        raise HslmError(f"model config {path}: {msg}") from None


# ------------------------------------------------------------------ the run loop
@dataclass
class TrainOptions:
    """What `hslm train` was asked (the CLI parses, this module runs)."""

    model: str
    data: tuple
    cache_dir: Path | None
    steps: int
    hyper: dict          # HYPER_NAMES -> value given or default (loss_positions may be None)
    given: set           # option names given on the command line
    speed: int
    threads: int
    out: Path | None
    save_every: int
    resume: Path | None
    eval_every: int
    metrics: Path | None
    log_every: int
    quiet: bool

    def resume_command(self, state_path) -> str:
        """The command that continues this run from state_path, to run verbatim (started
        as this process was: `hslm`, `python -m hslm` or `python cli.py`; under MPI by
        `mpiexec -n P`, P the run's ranks, though any P gives the same bytes)."""
        import shlex
        cmd = (f"{distributed.relaunch_words()}{this_program()} train --resume "
               f"{shlex.quote(str(state_path))} --steps {self.steps}")
        for d in self.data:
            cmd += f" --data {shlex.quote(str(d))}"
        if self.cache_dir is not None:
            cmd += f" --cache-dir {shlex.quote(str(self.cache_dir))}"
        if self.metrics is not None:
            cmd += f" --metrics {shlex.quote(str(self.metrics))}"
        # the run's cadence and machine flags as given (the bytes never depend on them, but
        # a resumed long run must keep saving and evaluating as the user asked)
        for name in ("save_every", "eval_every", "log_every", "speed", "threads"):
            if name in self.given:
                cmd += f" --{name.replace('_', '-')} {getattr(self, name)}"
        if self.quiet:
            cmd += " -q"
        return cmd


def this_program() -> str:
    """How to start hslm as this process was started (hslm.launch), for a command to give
    back: `hslm`, `python -m hslm` or `python cli.py` (the path it was given). A program
    or interpreter is named as the PATH finds it where that name finds the one running
    (in the same folder: a venv's python is a link to another's), else by its path."""
    import shlex
    import shutil

    from . import launch

    def found_as(name, path):
        found = shutil.which(name)
        return found is not None and os.path.realpath(os.path.dirname(found)) == (
            os.path.realpath(os.path.dirname(os.path.abspath(path))))
    how = launch()
    if how == "script":
        return "hslm" if found_as("hslm", sys.argv[0]) else shlex.quote(
            os.path.abspath(sys.argv[0]))
    if how is None:  # (a program calling hslm.cli.main: the command it stands for)
        return "hslm"
    python = os.path.basename(sys.executable)
    if not found_as(python, sys.executable):
        python = sys.executable
    return f"{shlex.quote(python)} " + ("-m hslm" if how == "module" else
                                        shlex.quote(sys.argv[0]))


def open_run(o: TrainOptions):
    """Judge every flag and path, take the output folder (hold_out_dir), then make the
    run or load the one to resume. Nothing is created before all flags are judged, and
    a run that fails while its text is read removes the folder it made. Returns (run,
    output folder, HeldFolder)."""
    from .token_cache import cache_dir as token_cache_dir

    if o.resume is not None:
        out = o.out or o.resume.parent
        check_steps(o.steps)
        check_out_dir(out)
        check_paths_apart(o, out)
        cfg_flag = resolve_config(o.model) if "model" in o.given else None

        def corpus_for(cfg, hyper, text_sha256, tokenizer, step):
            if o.steps <= step:
                raise HslmError(f"{o.resume} is already at step {step}; pass --steps above it")
            named = re.fullmatch(r"ckpt_(\d+)\.state", o.resume.name)
            if named and int(named.group(1)) != step:  # (it had gone on without a word)
                warn(f"{o.resume} holds step {step}, not {int(named.group(1))} (a file "
                     f"renamed?); going on from step {step}")
            check_checkpoint_names(out, step, o.steps, o.save_every)
            if cfg_flag is not None and cfg_flag != cfg:
                mine, theirs = asdict(cfg_flag), asdict(cfg)
                diff = ", ".join(f"{k} {mine[k]} against {theirs[k]}" for k in mine
                                 if mine[k] != theirs[k])
                raise HslmError(f"config mismatch: --model {o.model} differs from the "
                                f"checkpoint's configuration ({diff})")
            for n in HYPER_NAMES:  # flags that decide the bytes must agree with the run's
                if n in o.given and o.hyper[n] != getattr(hyper, n):
                    raise HslmError(f"config mismatch: --{n.replace('_', '-')} {o.hyper[n]} "
                                    f"differs from the checkpoint's {getattr(hyper, n)}")
            held.append(hold_out_dir(out))  # every flag judged: take the folder
            tidy_cache_dir(token_cache_dir(o.cache_dir, out), out)
            return load_corpus_compiling(o, cfg, lambda: load_corpus(
                o.data, cfg, text_sha256, tokenizer, token_cache_dir(o.cache_dir, out)),
                hyper.batch, held)

        held = []
        with releasing_on_error(held):
            run = Run.resume(o.resume, corpus_for, plain=SPEEDS[o.speed].plain_layouts,
                             threads=o.threads, speed=o.speed)
            run.last_saved = o.resume
        return run, out, held[0]
    cfg = resolve_config(o.model)
    values = dict(o.hyper)
    if values["loss_positions"] is None:
        values["loss_positions"] = cfg.window
    hyper = Hyper(**values)
    check_hyper(cfg, hyper)
    check_steps(o.steps)
    out = o.out or Path("ckpt")
    check_out_dir(out)
    check_paths_apart(o, out)
    check_checkpoint_names(out, 0, o.steps, o.save_every)
    check_fits(memory_estimate(cfg, hyper.batch, o.threads, o.speed),
               f"--model {o.model} with --batch {hyper.batch} on {o.threads} thread(s)")
    held = [hold_out_dir(out)]
    with releasing_on_error(held):
        tidy_cache_dir(token_cache_dir(o.cache_dir, out), out)
        corpus = load_corpus_compiling(o, cfg, lambda: load_corpus(
            o.data, cfg, cache_dir=token_cache_dir(o.cache_dir, out)), hyper.batch, held)
        run = Run.fresh(cfg, hyper, corpus, plain=SPEEDS[o.speed].plain_layouts)
    return run, out, held[0]


class HeldFolder:
    """The output folder's lock (MPI: rank 0's; the other ranks hold none) and the
    topmost folder this run created for it (None if it was there), removed again if
    the run fails before it starts."""

    def __init__(self, lock, created):
        self.lock, self.created = lock, created

    def release(self):
        self.lock.release()

    def remove_created(self):
        """Remove the folders this run made: the output folder (it holds only this run's
        caches), if its name still leads to the folder locked, then each folder made
        above it that is now empty. Never by name alone: under a parent this run made,
        another run may have made its own --out since (or taken the name of a folder
        moved away), and removing the parent whole had removed that run's checkpoints."""
        if self.created is None:
            return
        out = self.lock.path.parent
        if self.lock.holds(out):
            shutil.rmtree(out, ignore_errors=True)
        if out != self.created:
            ckpt.remove_empty_folders(out.parent, self.created)


def hold_out_dir(out: Path) -> HeldFolder:
    """Take the output folder once every flag is judged and before the text is read:
    a busy folder is refused before minutes of tokenizing, and the caches written
    into it are written under its lock."""
    if not distributed.is_writer():
        return HeldFolder(distributed.NO_LOCK, None)
    top = ckpt.first_missing_folder(out)
    try:
        lock = prepare_out_dir(out)
    except BaseException:  # (its lock file could not be written, say: a full disk; the
        # lock removed its file then). Only empty folders: another run may have made and
        # locked this one since top was judged, and be refused to us here
        if top is not None:
            ckpt.remove_empty_folders(Path(out), top)
        raise
    return HeldFolder(lock, top)


@contextmanager
def releasing_on_error(held):
    """On any error (a bad text, Ctrl-C while tokenizing) release the folder held, and
    remove it if this run created it: it holds only this run's caches. A Ctrl-C or
    SIGTERM that C code dropped meanwhile (hslm.errors) stops it here, as it would have."""
    try:
        yield
        raise_dropped_interrupt()
    except BaseException:
        give_up(held)
        raise


def give_up(held):
    """Remove the folders a run that failed before it started made, and release them
    (removed while still held: another run may take them once released)."""
    for h in held:
        h.remove_created()
        h.release()


def checkpoints_saved_over(out: Path, step: int, steps: int, save_every: int):
    """{n: [paths]} of the ckpt_n.bin / .state already in `out` at the steps a run from
    `step` to `steps` saves on its own (every save_every-th, and the last)."""
    import re
    found = {}
    if not out.is_dir():
        return found
    for p in out.glob("ckpt_*.*"):
        m = re.fullmatch(r"ckpt_(\d+)\.(bin|state)", p.name)
        if m:
            n = int(m.group(1))
            if step < n <= steps and (n == steps or (save_every and n % save_every == 0)):
                found.setdefault(n, []).append(p)
    return found


def check_checkpoint_names(out: Path, step: int, steps: int, save_every: int):
    """Refuse, before the run, a folder standing where it will save a checkpoint or its
    tokenizer.json (the rename onto it would fail after the work that made the file)."""
    if (out / "tokenizer.json").is_dir():
        raise HslmError(f"{out / 'tokenizer.json'} is a folder, where this run saves its "
                        "tokenizer; move it or give another --out")
    for n, paths in sorted(checkpoints_saved_over(out, step, steps, save_every).items()):
        for p in sorted(paths):
            if p.is_dir():
                raise HslmError(f"{p} is a folder, where this run saves its step-{n} "
                                "checkpoint; move it or give another --out")


def warn_of_replaced_checkpoints(out: Path, step: int, steps: int, save_every: int):
    """One line on stderr when `out` holds checkpoints this run replaces (at the steps it
    saves, after its start): another run's, or an earlier branch of this one."""
    found = sorted(checkpoints_saved_over(out, step, steps, save_every))
    if found:
        shown = ", ".join(f"ckpt_{n}" for n in found[:3]) + (", ..." if len(found) > 3 else "")
        warn(f"{out} already holds checkpoints at steps this run saves ({shown}); they are "
             "replaced")


def warn_of_another_runs_metrics(metrics, step: int):
    """One line on stderr when a new run (step 0) appends to a metrics file that already
    holds records: another run's, which hslm plot refuses to join to this one's where
    their values at a step differ."""
    if metrics is None or step != 0:
        return
    def whole_line(chunk):  # a record whole (its newline there), not a blank line's
        return chunk[:chunk.rfind(b"\n") + 1].strip() != b""
    try:  # (its first and last 64 KB; a torn last record is cut off, with its own warning)
        with open(metrics, "rb") as f:
            held = whole_line(f.read(1 << 16))
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))
            held = held or whole_line(f.read())
    except OSError:
        held = False
    if held:
        warn(f"--metrics {metrics} already holds records (another run's?); this run's are "
             "added after them, and hslm plot refuses a file of two runs' records")


def train_run(o: TrainOptions, echo=None):
    """`hslm train`: open the run, hold its folder, step until o.steps with progress,
    metrics, evaluations and checkpoints. Returns (first loss, last loss, validation loss)."""
    echo = echo or click.echo
    if not distributed.is_writer():  # MPI: rank 0 alone prints and writes
        o = replace(o, quiet=True, metrics=None)
    # A signal ignored when hslm started stays ignored (a job started in the background by
    # a shell without job control ignores Ctrl-C, nohup SIGHUP; hslm/__init__.py leaves
    # them so too).
    ignored = {s for s in STOP_SIGNALS if signal.getsignal(s) is signal.SIG_IGN}
    # SIGTERM and SIGHUP as Ctrl-C until below (a closed terminal had left the folder the
    # run made, with its lock, as a kill does)
    originals = {s: signal.getsignal(s) for s in TERMINATING}
    for s in originals.keys() - ignored:
        signal.signal(s, raise_terminated)
    try:
        run, out, held = open_run(o)
    except BaseException:
        for s, handler in originals.items():
            # (the hslm command, once a SIGHUP came, ignores more: errors.raise_terminated)
            if not (s == HANGUP and signal.getsignal(s) is signal.SIG_IGN):
                signal.signal(s, handler)
        raise
    # From here on SIGINT/SIGTERM/SIGHUP finish the current step and save (before, while
    # the text is read and tokenized, Ctrl-C stops at once and open_run tidies up):
    # installed before the run's own files (tokenizer.json, checkpoints) are written,
    # so a signal that sees them always gets a checkpoint.
    stop = StopRequest(echo)
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS if s not in ignored}
    previous.update(originals)
    # one writer per folder, held (open_run took it) until the run ends
    lock = held.lock
    run.folder_lock = lock
    try:
        cfg, h = run.cfg, run.hyper
        if distributed.is_writer():
            warn_of_replaced_checkpoints(out, run.step, o.steps, o.save_every)
            warn_of_another_runs_metrics(o.metrics, run.step)
            save_tokenizer(out, run.corpus.tokenizer, lock.dir_fd)
        try:
            if not o.quiet:
                need = memory_estimate(cfg, h.batch, o.threads, o.speed)
                echo(f"model {cfg.n_params:,} parameters, about {need / 2 ** 20:,.0f} MiB for "
                     f"parameters, optimiser, scratch and activations | data "
                     f"{run.corpus.source}: {len(run.corpus.train):,} train / "
                     f"{len(run.corpus.valid):,} valid tokens | speed {o.speed} "
                     f"({SPEEDS[o.speed].name}) | threads {o.threads}"
                     f"{threads_note(o.threads)} | batch {h.batch} x {cfg.window} | "
                     f"k {h.loss_positions}")
            # MPI: every rank is ready (else the first error is reported once), on one run
            distributed.start(run_identity(run, o))
        except BaseException:  # the output failing (a full disk), or another rank before
            held.remove_created()  # the first step: as a failed text
            raise
        try:
            return run_loop(run, out, o, stop, echo)
        except StoppedBeforeTraining as e:  # as a stop while the text was read
            held.remove_created()
            if distributed.current() is None:
                raise KeyboardInterrupt() if e.signum == signal.SIGINT else Terminated(e.signum)
            if distributed.is_writer():  # MPI: an agreed stop, every rank here
                echo(f"error: {stop_word(e.signum)}", err=True)
            sys.exit(128 + e.signum)
    finally:
        lock.release()
        for sig, handler in previous.items():
            # after a hangup, later ones (a closed terminal sends two) find the command
            # ending; a program calling hslm gets its own handler back
            signal.signal(sig, signal.SIG_IGN if sig == stop.hung_up and _the_hslm_command()
                          else handler)


def run_identity(run, o: "TrainOptions") -> dict:
    """What every MPI rank's run must share, each as a short digest: the text, the
    tokenizer, the model, the hyper-parameters, the step and stream it starts from, and
    the flags that decide what the ranks do together."""
    def digest(x) -> str:
        return hashlib.sha256(str(x).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return {"text": run.corpus.text_sha256, "tokenizer": run.corpus.tokenizer.identity[:16],
            "model": digest(run.cfg.to_json()), "hyper-parameters": digest(run.hyper.to_json()),
            "step": str(run.step), "data stream": digest(run.rng.state_json()),
            "--steps": str(o.steps), "--speed": str(o.speed),
            "--save-every": str(o.save_every), "--eval-every": str(o.eval_every)}


class StoppedBeforeTraining(Exception):
    """A stop asked while the step's kernels compiled, before step 1 (under MPI, agreed
    by the ranks): nothing is trained or saved, as for a stop while the text was read
    (train_run)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


# The signals that stop a run once its step is done, with a checkpoint. SIGHUP is a
# closed terminal (an ssh session dropped): it had ended the run at once, unsaved. A
# SIGHUP ignored at the start (nohup) stays ignored, as the others do.
STOP_SIGNALS = (signal.SIGINT,) + TERMINATING


class StopRequest:
    """Signal handler: the first SIGINT/SIGTERM/SIGHUP asks the loop to stop after the
    current step (with a checkpoint), or, while the step's kernels compile before step 1
    (training False), once they are compiled, with nothing trained; a second SIGINT or
    SIGTERM stops at once. A SIGHUP then is ignored: a closed terminal sends two (the
    shell passes its own on, and the kernel sends one as the shell ends), and the first
    stop's save goes on. The run's output then goes nowhere (cli.ReaderGone)."""

    def __init__(self, echo):
        self.signum = None     # the stop to act on (under MPI: the one the ranks agreed on)
        self.received = False  # whether this process got a signal itself
        self.echo = echo
        self.progress = None   # run_loop's Progress: a bar on screen needs a line break first
        self.training = True   # False while run_loop compiles the step's kernels
        self.hung_up = None    # SIGHUP, once one came (train_run then ignores more)

    # how long a second signal waits for the run to end of it before ending the process
    AT_ONCE_GRACE = 1.0

    def __call__(self, signum, frame):
        # Only this process's own second signal stops at once: under MPI the ranks may
        # agree on a stop (another rank's signal) before this rank's own one arrives.
        hangup = signum == HANGUP
        if hangup:
            self.hung_up = signum
        if self.received:
            if hangup:  # the terminal closed on a stop under way: its save goes on
                return
            raise KeyboardInterrupt
        self.received = True
        self.signum = self.signum or signum
        if distributed.is_writer():  # MPI: rank 0 alone prints
            bar = self.progress is not None and self.progress.bar_shown
            lead = "\n" if bar else ""  # end the bar's line, and print no blank line otherwise
            self.echo(f"{lead}{signal.Signals(signum).name}: " + (
                "finishing the current step, then saving" if self.training else
                "stopping once the step's kernels are compiled, with nothing trained")
                + ("" if hangup else " (again to stop at once)"), err=True)


@contextmanager
def second_signal_at_once(stop: StopRequest):
    """From the warm-up before step 1 on (one process): a second SIGINT or SIGTERM stops at once
    even while a kernel holds the main thread. Python runs a handler only between two of
    the main thread's bytecodes, and keeps one pending flag a signal: two Ctrl-C during
    one kernel call ran the handler once (the second was lost, and the run went on to
    save), and one after it waited for the kernel (a step of a large model takes
    seconds). Python's C handler writes each signal's number to the wakeup fd as it comes:
    a thread reading it counts them, and at the second one gives the main thread
    AT_ONCE_GRACE to end of it (its handler raises when it can), then ends the process
    with the line the handler's KeyboardInterrupt gives. A torn checkpoint write leaves
    only its hidden temporary file, as with kill -9."""
    if (distributed.current() is not None
            or threading.current_thread() is not threading.main_thread()):
        yield  # (MPI: the ranks end together through the handler's path)
        return
    # a signal taken while the kernels loaded counts; read before the wakeup fd is set
    # (after it, a signal arriving meanwhile had been counted twice: by its byte too)
    earlier = int(stop.received)
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        yield
        return
    over = threading.Event()

    def watch():
        seen = earlier
        while True:
            try:
                got = os.read(r, 64)
            except OSError:
                return
            if not got:
                return
            for b in got:  # a SIGHUP counts as a first signal only, as in the handler
                seen += b in (signal.SIGINT, signal.SIGTERM) or (b == HANGUP and not seen)
            if seen >= 2 and not over.wait(stop.AT_ONCE_GRACE):
                bar = stop.progress is not None and stop.progress.bar_shown
                with contextlib.suppress(OSError):  # (a bar on screen ends its line first)
                    os.write(2, b"\nerror: interrupted\n" if bar else b"error: interrupted\n")
                os._exit(130)

    watcher = threading.Thread(target=watch, daemon=True, name="hslm-second-signal")
    watcher.start()
    try:
        yield
    finally:
        over.set()
        signal.set_wakeup_fd(previous)
        os.close(w)  # (the watcher reads the end, and returns)
        watcher.join(5)
        os.close(r)


def run_loop(run, out, o: TrainOptions, stop, echo=None):
    """The step loop: progress, metrics, checkpoints, and a clean stop on SIGINT/SIGTERM.

    Nothing non-finite is ever saved: a NaN or infinite loss, gradient or parameter
    stops the run with an error before the next checkpoint."""
    import sys
    import time

    from .progress import Metrics, MetricsError, Progress

    echo = echo or click.echo
    cfg, h = run.cfg, run.hyper
    metrics = Metrics(o.metrics)
    progress = Progress(run.step, o.steps, quiet=o.quiet, log_every=o.log_every)
    stop.progress = progress
    from .step import StepRunner, kernels_cached, warm_up
    runner = StepRunner(cfg, o.speed, o.threads, world=distributed.current())
    distributed.share_state(run.state, h.batch, progress.message)  # MPI: a copy per node
    first = last = None
    metrics_error = None

    def write_metrics(**record):
        """Rank 0 writes (MPI); a failure stops the run after the ranks agree on it."""
        nonlocal metrics_error
        try:
            metrics.write(**record)
        except MetricsError as e:
            metrics_error = metrics_error or e

    def stop_for_metrics(saved):
        resume = (f" (resume with: {o.resume_command(saved)})" if run.step < o.steps else
                  "")  # (at --steps a resume would be refused)
        raise distributed.AllRanksError(
            f"{metrics_error or 'rank 0 could not write --metrics'}; stopped after step "
            f"{run.step} and saved {saved}{resume}")

    def evaluate(saved=None):
        v = run.validation_loss(runner)
        if not math.isfinite(v.loss):
            raise distributed.AllRanksError(
                f"step {run.step}: the validation loss is {v.loss} (the parameters are finite "
                "but the model overflows; is --lr too high?); " + (
                    "not saved" if saved is None else f"saved before it was evaluated: {saved}"))
        write_metrics(kind="eval", step=run.step, valid_loss=v.loss,
                      cross_entropy=v.cross_entropy, perplexity=perplexity(v.cross_entropy))
        return v

    def say_valid(v):
        progress.message(f"step {run.step}: valid {short_figure(v.loss, 4)} (cross-entropy "
                         f"{short_figure(v.cross_entropy, 4)}, perplexity "
                         f"{short_figure(perplexity(v.cross_entropy), 1)})")

    def stop_after_step(signum, saved=None, evaluated=False):
        """A stop after a step before the last: saved first (a scheduler's SIGKILL may
        follow its SIGTERM soon) and said (a second signal during the evaluation must
        not hide that it was), then the evaluation this step is due (the resumed run
        starts past it: its record had been lost for good)."""
        b, s = saved or run.save(out)
        progress.message(f"{signal.Signals(signum).name}: stopped after step {run.step}; "
                         f"saved {b} and {s}", needed=True)
        progress.message(f"resume with: {o.resume_command(s)}", needed=True)
        if not evaluated and o.eval_every and run.step % o.eval_every == 0:
            v = evaluate(saved=s)
            if distributed.any_rank(metrics_error is not None):
                stop_for_metrics(s)
            say_valid(v)
        sys.exit(128 + signum)

    watching = contextlib.ExitStack()  # (second_signal_at_once)
    saved_first = False  # a stop asked in the last step: saved before its evaluation
    try:
        # from the warm-up on: two signals during one long kernel call there (a compile)
        # had run the handler once, and the run went on to train step 1 and save
        watching.enter_context(second_signal_at_once(stop))
        # compile (first run only) or load the kernels before step 1, so its figure is the
        # step's
        compiling = not kernels_cached(o.speed, teams=o.threads > h.batch)
        unsaved = kernel_cache_failure()  # (then every run compiles: "first run" is untrue)
        if compiling:
            progress.message("compiling the step's kernels (" + (
                "first run only" if unsaved is None else
                f"every run while Numba's cache cannot be written: {unsaved}") + ") ...")
            stop.training = False
        t0 = time.perf_counter()
        warm_up(runner, run)
        if compiling:
            progress.message(f"compiled in {time.perf_counter() - t0:.0f} s")
        progress.start()  # (the time left had counted the warm-up once a step to come)
        # a stop asked while the kernels compiled (under MPI a first run compiles them
        # here, for half a minute): nothing trained, as before the text was read; the ranks
        # agree on it (a signal may reach one; a rank may have had them cached). One asked
        # while cached kernels loaded (a second) finishes step 1 and saves, as in the steps
        signum = distributed.largest((stop.signum or 0) if compiling else 0)
        if signum:
            raise StoppedBeforeTraining(signum)
        stop.training = True
        while run.step < o.steps:
            t0 = time.perf_counter()
            loss = run.train_step(runner)
            dt = time.perf_counter() - t0
            run.check_finite(loss)
            first = loss if first is None else first
            last = loss
            tok_s = h.batch * cfg.window / dt
            progress.step(run.step, loss, run.lr_at(run.step), tok_s)
            if metrics.fd is not None:
                write_metrics(kind="train", step=run.step, loss=loss, lr=run.lr_at(run.step),
                              grad_norm=run.grad_norm(), tok_s=tok_s,
                              ternary_zero_share=run.ternary_zero_share())
            # MPI: the ranks agree on a stop and compare parameters (hslm/distributed.py).
            # The decision is the agreed value, never stop.signum read again: a signal
            # arriving just after the agreement must wait for the next step on every rank.
            agreed, failed = distributed.after_step(run, stop.signum, o.steps, o.save_every,
                                                    metrics_error is not None)
            if failed:  # the run itself is fine: keep it, then stop
                stop_for_metrics(run.save(out)[1])
            if agreed is not None:
                stop.signum = agreed
                if run.step >= o.steps:
                    saved_first = True
                    break  # the last step: its save and evaluation below, said as a stop
                stop_after_step(agreed)
            saved, evaluated = None, False
            if o.eval_every and run.step % o.eval_every == 0 and run.step < o.steps:
                v = evaluate()
                if distributed.any_rank(metrics_error is not None):  # stop at this step
                    stop_for_metrics(run.save(out)[1])
                say_valid(v)
                evaluated = True
            if o.save_every and run.step % o.save_every == 0 and run.step < o.steps:
                saved = run.save(out)
            # a stop asked during this step's evaluation or save stops here, the step done
            # (it had trained one more step, and saved again). MPI: agreed once every rank
            # is done, where the ranks evaluated or saved (the same steps on every rank)
            if run.step < o.steps and (evaluated or saved or distributed.current() is None):
                signum = distributed.largest_once_all_here(lambda: stop.signum or 0)
                if signum:
                    stop.signum = signum
                    stop_after_step(signum, saved, evaluated=True)
        progress.close()
        # evaluate before saving: a model whose validation loss is not finite is not saved;
        # but a stop asked in the last step saves first, as a stop in the steps does (a
        # scheduler's SIGKILL may follow its SIGTERM: the run's last step would be lost),
        # and a loss not finite then says it was saved
        if saved_first:
            b, s = run.save(out)
            valid = evaluate(saved=s)
            say_valid(valid)
        else:
            valid = evaluate()
            b, s = run.save(out)
        if distributed.any_rank(metrics_error is not None):
            stop_for_metrics(s)
        # asked in the last step, its evaluation or save: done anyway (nothing is left to
        # resume), but said as a stop is, and ended as one (a caller's `&&` must not go on).
        # MPI: agreed, as in the steps (one rank's stop had ended the run unsaid)
        stopped = distributed.largest(stop.signum or 0)
        if stopped and not saved_first:  # (asked during the last evaluation: its loss is
            say_valid(valid)              # said, as the summary line it skips would)
        if stopped:
            progress.message(f"{signal.Signals(stopped).name}: stopped after step "
                             f"{run.step}, the last; saved {b} and {s}", needed=True)
        elif not o.quiet:
            echo(f"saved {b} and {s}")
        distributed.summary(echo)  # MPI: bytes sent per rank per step
        distributed.close()
        if stopped:
            sys.exit(128 + stopped)
    finally:
        try:
            progress.close()
            runner.close()  # (waits for the threads' kernels: a second signal still ends it)
            metrics.close()
        finally:
            watching.close()
    return first, last, valid.loss
