"""Fixed tables (spec section 4): positional encoding, rotary angles, VSA token table.

None of these are parameters; they are made once per run from the config alone.
"""
from __future__ import annotations

import numpy as np

from .config import PHI, Config

# The VSA table's seed is fixed ("HSLM"): it does not depend on --seed.
VSA_SEED = 0x48534C4D


def positional_table(cfg: Config) -> np.ndarray:
    """P[p, i], shape [L, d]: sin(p f_i) at even i, cos(p f_i) at odd i."""
    d, L = cfg.width, cfg.window
    i = np.arange(d)
    f = PHI ** (-2.0 * (i // 2) / d) * 3.0 / np.pi
    ang = np.arange(L)[:, None] * f[None, :]
    return np.where(i % 2 == 0, np.sin(ang), np.cos(ang)).astype(np.float64)


def rotary_tables(cfg: Config):
    """cos and sin of theta = p * phi^(-2c/dh), shape [L, dh // 2] each.

    Pair c of each head is (c, c + dh // 2); an odd head width leaves its last
    element as it is."""
    half = cfg.head_width // 2
    c = np.arange(half)
    theta = np.arange(cfg.window)[:, None] * PHI ** (-2.0 * c / cfg.head_width)[None, :]
    return np.ascontiguousarray(np.cos(theta)), np.ascontiguousarray(np.sin(theta))


def vsa_table(cfg: Config, structured: bool = False) -> np.ndarray:
    """Ternary [V, D_vsa] int8 table, uniform over {-1, 0, +1} from a fixed seed.

    structured=True gives rows that are constant vectors (row t is all
    (t % 3) - 1), which rotation leaves unchanged, so the gate fires at p > 0
    and tests reach every branch of the VSA stream."""
    if structured:
        row = (np.arange(cfg.vocab) % 3 - 1).astype(np.int8)
        return np.ascontiguousarray(np.repeat(row[:, None], cfg.vsa_dim, axis=1))
    rng = np.random.Generator(np.random.PCG64(VSA_SEED))
    return rng.integers(-1, 2, size=(cfg.vocab, cfg.vsa_dim)).astype(np.int8)


class Tables:
    """Everything fixed that a window kernel reads besides the parameters."""

    def __init__(self, cfg: Config, structured_vsa: bool = False):
        self.cfg = cfg
        self.pos = positional_table(cfg)
        self.cos, self.sin = rotary_tables(cfg)
        self.vsa = vsa_table(cfg, structured_vsa)
