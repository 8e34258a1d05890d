"""The training run: data, model, steps, checkpoints, resume, validation."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from .config import PRESETS, Config
from .data import Corpus, Tokenizer
from .errors import HslmError
from .optim import adamw_step, learning_rate
from .params import ModelState, init_params, ternary_mask
from .step import StepRunner
from .tables import Tables


@dataclass
class Hyper:
    """Everything besides the config that decides a run's bytes (stored in .state)."""

    batch: int = 8
    loss_positions: int = 27
    lr: float = 1e-3
    warmup: int = 100
    decay_steps: int = 10000
    weight_decay: float = 0.01
    seed: int = 0
    eval_windows: int = 64

    def to_json(self):
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def check_hyper(cfg: Config, h: Hyper):
    if not 1 <= h.loss_positions <= cfg.window:
        raise HslmError(f"--loss-positions must be between 1 and the window ({cfg.window}), "
                        f"got {h.loss_positions}")
    if h.batch < 1:
        raise HslmError(f"--batch must be at least 1, got {h.batch}")
    if not h.lr > 0:
        raise HslmError(f"--lr must be positive, got {h.lr}")
    if h.warmup < 0 or h.decay_steps < 1:
        raise HslmError("--warmup must be >= 0 and --decay-steps >= 1")
    if h.eval_windows < 1:
        raise HslmError(f"--eval-windows must be at least 1, got {h.eval_windows}")


def prepare_out_dir(out: Path):
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".hslm-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise HslmError(f"output folder {out} cannot be written: {e.strerror or e}") from None
    remove_torn_writes(out)


def remove_torn_writes(out: Path):
    """Delete temporary files left by a writer that was killed mid-write
    (checkpoint.write_atomic's `.<name>.tmp<pid>`), when that process is gone."""
    for p in out.glob(".*.tmp*"):
        pid = p.name.rsplit(".tmp", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                p.unlink()
            except OSError:
                pass
        except OSError:  # exists but not ours to signal: leave it
            pass


def rng_state_json(rng: np.random.Generator) -> str:
    return json.dumps(rng.bit_generator.state, sort_keys=True, separators=(",", ":"))


def rng_from_json(s: str) -> np.random.Generator:
    bg = np.random.PCG64()
    bg.state = json.loads(s)
    return np.random.Generator(bg)


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

    @classmethod
    def fresh(cls, cfg: Config, hyper: Hyper, corpus: Corpus, plain=True) -> "Run":
        theta = init_params(cfg, hyper.seed)
        # Windows come from their own stream, so the data order does not depend on the model.
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([hyper.seed, 1])))
        z = np.zeros(cfg.n_params)
        return cls(cfg, hyper, corpus, theta, z, z.copy(), 0, rng, plain)

    @classmethod
    def resume(cls, state_path: Path, corpus_for, plain=True) -> "Run":
        st = ckpt.read(state_path, expect_kind="state")
        bin_path = state_path.with_suffix(".bin")
        pb = ckpt.read(bin_path, expect_kind="params")
        if pb.data_sha256 != st.meta.get("params_sha256"):
            raise HslmError(f"{bin_path} does not belong to {state_path} (parameter checksum "
                            "differs)")
        if pb.step != st.step or pb.config != st.config:
            raise HslmError(f"{bin_path} and {state_path} disagree on step or config")
        hyper = Hyper(**json.loads(st.meta["hyper"]))
        tok = saved_tokenizer(state_path.parent, st.meta.get("tokenizer"))
        corpus = corpus_for(st.config, hyper, st.meta.get("text_sha256"), tok)
        if corpus.tokenizer.identity != st.meta.get("tokenizer"):
            raise HslmError("the tokenizer differs from the checkpoint's")
        return cls(st.config, hyper, corpus, pb.flat(), st.tensor("adam.m").copy(),
                   st.tensor("adam.v").copy(), st.step, rng_from_json(st.meta["rng"]), plain)

    # ------------------------------------------------------------- stepping
    def lr_at(self, step):
        h = self.hyper
        return learning_rate(step, h.lr, h.warmup, h.decay_steps)

    def train_step(self, runner: StepRunner) -> float:
        h = self.hyper
        windows = self.corpus.draw_windows(self.rng, h.batch, self.cfg.window)
        model = self.state.kernel_model()
        loss = runner.gradient(model, self.tables.vsa, windows, h.loss_positions, self.grad)
        self.step += 1
        lr = self.lr_at(self.step)

        def update(part):  # tensors are independent: threads take contiguous runs of them
            t0, t1 = part
            adamw_step(self.state.theta, self.grad, self.m, self.v, self.state.offs, self.decay,
                       self.step, lr, h.weight_decay, self.norms, t0, t1)
            self.state.requantize(t0, t1)

        runner.map_parts(update, tensor_parts(self.cfg, runner.threads))
        return loss

    def validation_loss(self, runner: StepRunner) -> float:
        h = self.hyper
        windows = self.corpus.validation_windows(h.eval_windows, self.cfg.window)
        return runner.loss(self.state.kernel_model(), self.tables.vsa, windows, h.loss_positions)

    # ---------------------------------------------------------- checkpoints
    def save(self, out: Path):
        pblob = ckpt.params_blob(self.cfg, self.state.theta, self.step)
        extra = {
            "rng": rng_state_json(self.rng),
            "hyper": self.hyper.to_json(),
            "tokenizer": self.corpus.tokenizer.identity,
            "text_sha256": self.corpus.text_sha256,
            "data_source": self.corpus.source,
        }
        sblob = ckpt.state_blob(self.cfg, self.m, self.v, self.step,
                                ckpt.params_sha256_of(pblob), extra)
        base = out / f"ckpt_{self.step}"
        ckpt.write_atomic(base.with_suffix(".bin"), pblob)
        ckpt.write_atomic(base.with_suffix(".state"), sblob)
        return base.with_suffix(".bin"), base.with_suffix(".state")

    def ternary_zero_share(self) -> float:
        """Share of zeros over all ternary matrices (|W| <= alpha / 2)."""
        offs = self.state.offs
        zeros = total = 0
        for t in np.flatnonzero(self.state.is_ternary):
            seg = self.state.theta[offs[t]:offs[t + 1]]
            half = self.state.alpha[t] / 2.0
            zeros += int(np.count_nonzero(np.abs(seg) <= half))
            total += seg.size
        return zeros / total


def tensor_parts(cfg: Config, n: int):
    """n contiguous runs of tensors with about equal sizes."""
    from .step import split_by_cost
    return split_by_cost(np.diff(cfg.offsets()).astype(np.float64), n)


def load_corpus(data, cfg: Config, expect_sha256=None, tokenizer=None, cache_dir=None) -> Corpus:
    return Corpus.load(data, cfg.vocab, cfg.window, expect_sha256, tokenizer, cache_dir)


def saved_tokenizer(folder: Path, identity):
    """The run's tokenizer.json when it is the one the checkpoint names, else None
    (the tokenizer is then learned again from the text: the same merges)."""
    p = Path(folder) / "tokenizer.json"
    if not p.exists():
        return None
    try:
        tok = Tokenizer.from_json(p.read_text(encoding="utf-8"))
    except (HslmError, OSError, UnicodeDecodeError):
        return None
    return tok if tok.identity == identity else None


def save_tokenizer(out: Path, tok: Tokenizer):
    ckpt.write_atomic(out / "tokenizer.json", tok.to_json().encode("utf-8"))


def load_for_inference(path, data=None):
    """(config, ModelState, tokenizer or None, Hyper or None) from a .bin (or the .bin
    beside a .state). The tokenizer comes from tokenizer.json beside the checkpoint;
    the hyper-parameters from the .state beside it, when there."""
    path = Path(path)
    if path.suffix == ".state":
        path = path.with_suffix(".bin")
    ck = ckpt.read(path, expect_kind="params")
    cfg = ck.config
    state = ModelState(cfg, ck.flat(), Tables(cfg), plain=False)
    tok = None
    tok_path = path.parent / "tokenizer.json"
    if tok_path.exists():
        tok = Tokenizer.from_json(tok_path.read_text(encoding="utf-8"))
        if tok.vocab != cfg.vocab:
            raise HslmError(f"{tok_path} has a vocabulary of {tok.vocab}, the model {cfg.vocab}")
    hyper = None
    st = path.with_suffix(".state")
    if st.exists():
        hyper = Hyper(**json.loads(ckpt.read(st, expect_kind="state").meta["hyper"]))
    return cfg, state, tok, hyper


def resolve_config(model: str) -> Config:
    if model not in PRESETS:
        raise HslmError(f"unknown --model {model!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[model]
