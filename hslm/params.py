"""The flat parameter vector: seeded initialisation, named views, ternary quantisation."""
from __future__ import annotations

import numpy as np
from numba import njit

from .config import Config
from .ops import Model
from .tables import Tables


def init_params(cfg: Config, seed: int) -> np.ndarray:
    """Spec section 2: one generator, tensors drawn in parameter order."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
    parts = []
    for name, shape, kind in cfg.tensors():
        n = int(np.prod(shape))
        if kind == "ternary":
            parts.append(rng.uniform(-1.0, 1.0, n) / np.sqrt(shape[0]))
        elif kind == "embed":
            parts.append(rng.uniform(-1.0, 1.0, n) / np.sqrt(cfg.width))
        elif kind == "gain":
            parts.append(np.ones(n))
        else:
            parts.append(np.zeros(n))
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float64)


def named_views(cfg: Config, flat: np.ndarray) -> dict:
    """{name: view of flat with the tensor's shape}, in parameter order."""
    offs = cfg.offsets()
    return {name: flat[offs[t]:offs[t + 1]].reshape(shape)
            for t, (name, shape, _) in enumerate(cfg.tensors())}


def ternary_mask(cfg: Config) -> np.ndarray:
    return np.array([kind == "ternary" for _, _, kind in cfg.tensors()])


@njit(cache=True, nogil=True)
def quantize_into(theta, offs, rows, cols, is_ternary, Tf, Tb, alpha, t0, t1):
    """alpha = mean|W| (1 if <= 1e-6); T = sign(W) where |W| > alpha/2 (spec section 3).

    Writes T input-major into Tf and output-major into Tb, at the tensor's offsets,
    for tensors t0..t1-1."""
    for t in range(t0, t1):
        if not is_ternary[t]:
            alpha[t] = 1.0
            continue
        o = offs[t]
        m, n = rows[t], cols[t]
        s = 0.0
        for e in range(m * n):
            s += abs(theta[o + e])
        a = s / (m * n)
        if a <= 1e-6:
            a = 1.0
        alpha[t] = a
        half = a / 2.0
        for e in range(m * n):
            w = theta[o + e]
            Tf[o + e] = 1.0 if w > half else (-1.0 if w < -half else 0.0)
        for i0 in range(0, m, 16):  # the transpose in blocks of 16 rows, cache-friendly
            i1 = min(i0 + 16, m)
            for j in range(n):
                for i in range(i0, i1):
                    Tb[o + j * m + i] = Tf[o + i * n + j]


class ModelState:
    """Parameters plus what every step derives from them: T in two layouts and alpha."""

    def __init__(self, cfg: Config, theta: np.ndarray, tables: Tables):
        self.cfg = cfg
        self.theta = theta
        self.tables = tables
        self.offs = cfg.offsets()
        shapes = [s for _, s, _ in cfg.tensors()]
        self.rows = np.array([s[0] for s in shapes], np.int64)
        self.cols = np.array([s[1] if len(s) > 1 else 1 for s in shapes], np.int64)
        self.is_ternary = ternary_mask(cfg)
        self.Tf = np.zeros_like(theta)
        self.Tb = np.zeros_like(theta)
        self.alpha = np.ones(len(shapes))
        self.requantize()

    def requantize(self, t0=0, t1=None):
        t1 = len(self.rows) if t1 is None else t1
        quantize_into(self.theta, self.offs, self.rows, self.cols, self.is_ternary,
                      self.Tf, self.Tb, self.alpha, t0, t1)

    def kernel_model(self) -> Model:
        c, tb = self.cfg, self.tables
        return Model(self.theta, self.offs, self.Tf, self.Tb, self.alpha, tb.pos, tb.cos,
                     tb.sin, c.attn_scale, c.head_scale, c.dims())
