"""Fixed tables (spec section 4): positional encoding, rotary angles, VSA token table.

None of these are parameters; they are made once per run from the config alone.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import precise
from .config import Config
from .rng import Stream

# The VSA table's seed is fixed ("HSLM"): it does not depend on --seed.
VSA_SEED = 0x48534C4D


@lru_cache(maxsize=16)
def _positional(d: int, L: int) -> np.ndarray:
    # frequencies f_i = phi^(-2 floor(i/2) / d) 3 / pi, the angles p f_i, their sin or cos:
    # at 50 and 60 digits (hslm.precise), rounded once, so no C library decides a bit
    ctx = precise.CTX
    out = np.empty((L, d), np.float64)
    three_over_pi = ctx.divide(precise.D(3), precise.PI)
    for i in range(0, d, 2):  # columns i and i + 1 share a frequency: one sin and cos for both
        f = ctx.multiply(precise.power(precise.PHI, ctx.divide(precise.D(-i), precise.D(d))),
                         three_over_pi)
        for p, (s, c) in enumerate(precise.sin_cos_multiples(f, L)):
            out[p, i] = precise.to_f64(s)
            if i + 1 < d:
                out[p, i + 1] = precise.to_f64(c)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=16)
def _rotary(dh: int, L: int):
    ctx = precise.CTX
    half = dh // 2
    cos = np.empty((L, half), np.float64)
    sin = np.empty((L, half), np.float64)
    for c in range(half):
        rate = precise.power(precise.PHI, ctx.divide(precise.D(-2 * c), precise.D(dh)))
        for p, (s, co) in enumerate(precise.sin_cos_multiples(rate, L)):
            cos[p, c], sin[p, c] = precise.to_f64(co), precise.to_f64(s)
    cos.setflags(write=False)
    sin.setflags(write=False)
    return cos, sin


def positional_table(cfg: Config) -> np.ndarray:
    """P[p, i], shape [L, d]: sin(p f_i) at even i, cos(p f_i) at odd i,
    f_i = phi^(-2 floor(i/2) / d) * 3 / pi."""
    return _positional(cfg.width, cfg.window).copy()


def rotary_tables(cfg: Config):
    """cos and sin of theta = p * phi^(-2c/dh), shape [L, dh // 2] each.

    Pair c of each head is (c, c + dh // 2); an odd head width leaves its last
    element as it is."""
    cos, sin = _rotary(cfg.head_width, cfg.window)
    return cos.copy(), sin.copy()


def vsa_table(cfg: Config, structured: bool = False) -> np.ndarray:
    """Ternary [V, D_vsa] int8 table, uniform over {-1, 0, +1}, row by row from the
    fixed-seed "vsa" stream (hslm.rng).

    structured=True gives rows that are constant vectors (row t is all
    (t % 3) - 1), which rotation leaves unchanged, so the gate fires at p > 0
    and tests reach every branch of the VSA stream."""
    if structured:
        row = (np.arange(cfg.vocab) % 3 - 1).astype(np.int8)
        return np.ascontiguousarray(np.repeat(row[:, None], cfg.vsa_dim, axis=1))
    trits = Stream.seeded("vsa", VSA_SEED).integers(cfg.vocab * cfg.vsa_dim, 3, np.int8)
    trits -= 1
    return trits.reshape(cfg.vocab, cfg.vsa_dim)


class Tables:
    """Everything fixed that a window kernel reads besides the parameters."""

    def __init__(self, cfg: Config, structured_vsa: bool = False):
        self.cfg = cfg
        self.pos = positional_table(cfg)
        self.cos, self.sin = rotary_tables(cfg)
        self.vsa = vsa_table(cfg, structured_vsa)
