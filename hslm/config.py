"""One config object for the model, and the flat parameter layout it implies.

The parameter order is part of the checkpoint format (spec section 2):
E, then per block (gamma, Wq, Wk, Wv, Wo, Wup, bup, Wdown, bdown), then Wout, bout.
"""
from __future__ import annotations

import json
import math
from collections import namedtuple
from dataclasses import asdict, dataclass, fields

import numpy as np

from .precise import inverse_power_scale


def canonical_json(obj) -> str:
    """The one JSON form of what a checkpoint stores as text (its header, the config,
    the hyper-parameters, the random streams' state): keys sorted, no spaces. The
    golden digests pin the bytes it makes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))

PHI = (1.0 + math.sqrt(5.0)) / 2.0  # basic operations only: the same bits everywhere

# Index of each tensor inside a block, in checkpoint order.
BLOCK_TENSORS = ("gamma", "Wq", "Wk", "Wv", "Wo", "Wup", "bup", "Wdown", "bdown")
GAMMA, WQ, WK, WV, WO, WUP, BUP, WDOWN, BDOWN = range(9)
TENSORS_PER_BLOCK = len(BLOCK_TENSORS)


MAX_WINDOW = 81  # docs/model.md section 1: the definition bounds the window
# Bounds far beyond any model this trainer is for; they keep sizes (and int32 index
# arithmetic in the kernels) sane before anything is allocated.
LIMITS = {"vocab": 1 << 20, "width": 1 << 14, "mlp": 1 << 16, "blocks": 1 << 10,
          "vsa_dim": 1 << 16}


# The integer dimensions by name, the form the kernels take (a Numba named tuple).
Dims = namedtuple("Dims", "vocab width heads head_width mlp blocks window")


def _as_json(v) -> str:
    """A config field's value as its JSON file has it (true, null, "8"), where it can be
    written as JSON (a Config made in Python may hold anything): Python's repr had said
    True, None, '8'."""
    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(v)


@dataclass(frozen=True)
class Config:
    """Model dimensions. Written into every checkpoint."""

    vocab: int = 729      # V
    width: int = 243      # d
    heads: int = 3        # H
    head_width: int = 81  # dh, H * dh == d
    mlp: int = 729        # F
    blocks: int = 3       # nb
    window: int = 27      # L, positions per training window
    vsa_dim: int = 1024   # D_vsa, >= 4 d

    def _heads_fix(self) -> str:
        """A change that satisfies every rule on the heads (heads * head_width = width,
        head_width >= 2, vsa_dim >= 4 * width): the first of head_width, width, heads,
        or one head. (Setting head_width to width // heads had been suggested where
        it came to 1, which the next rule refused.)"""
        w, h, hw = self.width, self.heads, self.head_width
        tries = [{"head_width": w // h}, {"width": h * hw}, {"heads": w // hw},
                 {"heads": 1, "head_width": w}]
        # one that keeps vsa_dim's rule first; else one right on the heads alone (the
        # vsa_dim rule then says its own fix)
        for vsa_too in (True, False):
            for change in tries:
                c = {"width": w, "heads": h, "head_width": hw, **change}
                if (c["heads"] * c["head_width"] == c["width"]
                        and c["head_width"] >= 2
                        and (self.vsa_dim >= 4 * c["width"] or not vsa_too)):
                    return "set " + " and ".join(f"{k} to {v}" for k, v in change.items())
        return "width must be at least 2, for a head_width of at least 2"

    def __post_init__(self):
        """Each rule says what is wrong and what would fix it (a ValueError, one line)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"config {f.name} must be a positive integer, got "
                                 f"{_as_json(v)}")
        if self.heads * self.head_width != self.width:
            raise ValueError(f"config: heads * head_width must equal width ({self.heads} * "
                             f"{self.head_width} = {self.heads * self.head_width}, width "
                             f"{self.width}): {self._heads_fix()}")
        if self.head_width < 2:
            raise ValueError(f"config: head_width must be at least 2 (rotary turns pairs), "
                             f"got {self.head_width}: use fewer heads")
        if self.vsa_dim < 4 * self.width:
            raise ValueError(f"config: vsa_dim must be at least 4 * width = {4 * self.width} "
                             f"(each model coordinate reads 4 trits), got {self.vsa_dim}")
        if self.window > MAX_WINDOW:
            raise ValueError(f"config: window must be at most {MAX_WINDOW} (the model "
                             f"definition's bound), got {self.window}")
        for name, top in LIMITS.items():
            if getattr(self, name) > top:
                raise ValueError(f"config: {name} must be at most {top:,}, got "
                                 f"{getattr(self, name):,}")

    # -- fixed scales (docs/model.md, section 4)
    # computed at high precision and rounded once (hslm.precise): no C pow() decides a bit
    @property
    def attn_scale(self) -> float:
        """dh^(-phi^-3)."""
        return inverse_power_scale(self.head_width)

    @property
    def head_scale(self) -> float:
        """d^(-phi^-3)."""
        return inverse_power_scale(self.width)

    # -- layout
    def tensors(self):
        """[(name, shape, kind)] in checkpoint order; kind in embed/gain/ternary/bias."""
        V, d, F = self.vocab, self.width, self.mlp
        out = [("E", (V, d), "embed")]
        for b in range(self.blocks):
            p = f"blocks.{b}."
            out += [
                (p + "gamma", (d,), "gain"),
                (p + "Wq", (d, d), "ternary"),
                (p + "Wk", (d, d), "ternary"),
                (p + "Wv", (d, d), "ternary"),
                (p + "Wo", (d, d), "ternary"),
                (p + "Wup", (d, F), "ternary"),
                (p + "bup", (F,), "bias"),
                (p + "Wdown", (F, d), "ternary"),
                (p + "bdown", (d,), "bias"),
            ]
        out += [("Wout", (d, V), "ternary"), ("bout", (V,), "bias")]
        return out

    def offsets(self) -> np.ndarray:
        """Start offset of every tensor in the flat vector, plus the total at the end."""
        sizes = [int(np.prod(s)) for _, s, _ in self.tensors()]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def n_params(self) -> int:
        return int(self.offsets()[-1])

    def dims(self) -> Dims:
        return Dims(self.vocab, self.width, self.heads, self.head_width, self.mlp, self.blocks,
                    self.window)

    def to_json(self) -> str:
        return canonical_json(asdict(self))

    @classmethod
    def from_dict(cls, obj) -> "Config":
        """A config from a JSON object with exactly the config's fields (ValueError if not)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(obj, dict):
            raise ValueError("a model config must be a JSON object with the fields "
                             + ", ".join(names))
        missing = [n for n in names if n not in obj]
        unknown = sorted(set(obj) - set(names))
        if missing or unknown:
            raise ValueError("; ".join(
                ([f"missing {', '.join(missing)}"] if missing else [])
                + ([f"unknown {', '.join(unknown)}"] if unknown else []))
                + f" (the fields are {', '.join(names)})")
        return cls(**{n: obj[n] for n in names})

    def flops_per_token(self, scored_share: float = 1.0) -> float:
        """Matrix FLOPs (2 per multiply-add) per token: forward, input gradient, weight gradient.

        The input and weight gradients run at the scored positions (scored_share of them);
        the forward at every position, less what an unscored one skips (unscored_skip: it
        had been counted, 15% too many FLOPs at k = 9 of 27)."""
        L = self.window
        k = scored_share * L
        return (2.0 * self.forward_macs(L, k) + 4.0 * k * self.matrix_macs_per_position()) / L

    def forward_macs(self, positions, scored) -> float:
        """Multiply-adds of the ternary matrices in the forward over `positions`, of which
        `scored` are scored (the others skip unscored_skip)."""
        return self.matrix_macs_per_position() * positions - self.unscored_skip() * (
            positions - scored)

    def unscored_skip(self) -> int:
        """Multiply-adds of a position's forward that an unscored position skips: it needs
        only the last block's keys and values (for the later positions), not its queries,
        attention output and MLP (two d x d, two d x F), nor the head (d x V)."""
        d, F, V = self.width, self.mlp, self.vocab
        return 2 * d * d + 2 * d * F + d * V

    def matrix_macs_per_position(self) -> int:
        """Multiply-adds of the ternary matrices in one position's forward: four d x d
        and two d x F a block, and the head's d x V."""
        d, F, V, nb = self.width, self.mlp, self.vocab, self.blocks
        return nb * (4 * d * d + 2 * d * F) + d * V


PRESETS = {
    # The default model: 2,130,138 parameters.
    "hslm-3": Config(),
    # The same family, one dimension grown (hslm info lists their parameter counts):
    "hslm-3-deep": Config(blocks=6),                                     # 3,905,253
    "hslm-3-wide": Config(width=486, heads=6, mlp=1458, vsa_dim=2048),  # 7,802,487
    "hslm-3-long": Config(window=81),                                    # 2,130,138
    # Kernel tests: the spec's small configuration of the same shape (oracles in ms).
    "hslm-test": Config(vocab=27, width=9, heads=3, head_width=3, mlp=27, blocks=2,
                        window=9, vsa_dim=64),
    # Training and CLI tests: a real byte-level tokenizer needs vocab >= 260.
    "hslm-tiny": Config(vocab=300, width=27, heads=3, head_width=9, mlp=81, blocks=2,
                        window=9, vsa_dim=128),
}
