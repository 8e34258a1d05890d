"""The flat parameter vector: seeded initialisation, named views, ternary quantisation."""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .config import Config
from .jit import kernel_entry
from .micro import TERNARY_PANEL, wide_vectors
from .rng import Stream
from .tables import Tables
from .vector_tiles import make_copy_bytes, make_transpose_bytes, make_trits


# The model as the kernels see it: flat parameters, their offsets, the ternary
# matrices in both layouts (input-major Tf, output-major Tb) with one scale per
# tensor, the fixed tables, the named dimensions, and Tf and Tb again in column
# panels (Pf, Pb, at their own offsets) for the register-tiled kernels; and clock, cycles
# counted for hslm bench's profile (one thread; a run's has 2 elements, never written)
# where it has layers.CLOCK_SLOTS: the matrix products, the weight gradients' two parts
# and the forward's and the backward's other parts (layers.CLOCK_*).
Model = namedtuple("Model", "theta offs Tf Tb alpha pos cos sin attn_scale head_scale dims "
                            "Pf pf_offs Pb pb_offs clock")
# What requantisation writes, and the shapes it needs (ModelState.trits): per tensor
# rows, cols, whether ternary, alpha and the count of zero trits; the trits in the
# panels (Pf, Pb) and, with plain, as float64 (Tf, Tb).
Trits = namedtuple("Trits", "rows cols is_ternary alpha plain Tf Tb pf_offs Pf pb_offs Pb zeros")


def init_params(cfg: Config, seed: int) -> np.ndarray:
    """Spec section 2: one stream ("init", hslm.rng), tensors drawn in parameter order;
    uniform(-1, 1) is 2u - 1 (exact), divided by the correctly rounded sqrt(fan_in)."""
    rng = Stream.seeded("init", seed)
    parts = []
    for name, shape, kind in cfg.tensors():
        n = int(np.prod(shape))
        if kind == "ternary":
            parts.append((2.0 * rng.uniform(n) - 1.0) / np.sqrt(float(shape[0])))
        elif kind == "embed":
            parts.append((2.0 * rng.uniform(n) - 1.0) / np.sqrt(float(cfg.width)))
        elif kind == "gain":
            parts.append(np.ones(n))
        else:
            parts.append(np.zeros(n))
    return np.ascontiguousarray(np.concatenate(parts), dtype=np.float64)


# requantisation's byte moves for the panels' width (16 on AVX-512, 12 on AVX2)
COPY_PANEL_ROW = make_copy_bytes(TERNARY_PANEL)
TRANSPOSE_TO_PANEL = make_transpose_bytes(TERNARY_PANEL)
TRITS_LANES = 8 if wide_vectors() else 16
TRITS = make_trits(TRITS_LANES)


def ternary_mask(cfg: Config) -> np.ndarray:
    return np.array([kind == "ternary" for _, _, kind in cfg.tensors()])


@kernel_entry(allocates=True)
def quantize_into(theta, offs, Q, abs_sums, sums_given, t0, t1):
    """alpha = mean|W| (1 if <= 1e-6); T = sign(W) where |W| > alpha/2 (spec section 3),
    for tensors t0..t1-1, written in the layouts the kernels read (Q, a Trits). With
    sums_given, abs_sums[t] already holds sum |W| in element order (adamw_step makes it).
    Q.zeros[t] gets the tensor's count of zero trits (the run's metrics report the share).

    * always the column panels of T (Pf) and of its transpose (Pb), for the
      register-tiled kernels: P[q, i, c] = M[i, q * panel + c], zero past the last column;
    * with `plain`, also T input-major (Tf) and output-major (Tb) at the tensor's
      offsets, for the per-position speeds."""
    rows, cols, is_ternary, alpha, plain = Q.rows, Q.cols, Q.is_ternary, Q.alpha, Q.plain
    Tf, Tb, pf_offs, Pf, pb_offs, Pb, zeros = Q.Tf, Q.Tb, Q.pf_offs, Q.Pf, Q.pb_offs, Q.Pb, Q.zeros
    for t in range(t0, t1):
        if not is_ternary[t]:
            alpha[t] = 1.0
            continue
        o = offs[t]
        m, n = rows[t], cols[t]
        if sums_given:
            s = abs_sums[t]
        else:
            s = 0.0
            for e in range(m * n):
                s += abs(theta[o + e])
        a = s / (m * n)
        if a <= 1e-6:
            a = 1.0
        alpha[t] = a
        half = a / 2.0
        if plain:
            for e in range(m * n):
                w = theta[o + e]
                Tf[o + e] = 1.0 if w > half else (-1.0 if w < -half else 0.0)
            for i0 in range(0, m, 16):  # the transpose in blocks of 16 rows, cache-friendly
                i1 = min(i0 + 16, m)
                for j in range(n):
                    for i in range(i0, i1):
                        Tb[o + j * m + i] = Tf[o + i * n + j]
        # Pf[q, i, c] = T[i, q P + c] and Pb[q, j, c] = T[q P + c, j] (P = TERNARY_PANEL,
        # a compile-time constant <= 16), both from one pass over theta, P rows at a time:
        # their trits are made row by row into `block` (TRITS, vectors), each row copied into
        # its Pf panels (a P-byte vector each), then the block is written out as one Pb
        # panel, 16 columns at a time transposed in registers (hslm.vector_tiles), P trits
        # per column in a contiguous run. With P = 16, requantisation took 2.1 ms alone with
        # theta in cache, 1.0 ms since, the same bytes. Built for AVX2 (P = 12), with byte
        # loops for P != 16 and Numba's trits loop, the model's took 4.1-4.3 ms here (2.1
        # built for AVX-512), now 2.8-3.1. The zero padding past the last column is never
        # written; the last block's padding rows are written as the zeros they are.
        P = TERNARY_PANEL
        pf, pb = pf_offs[t], pb_offs[t]
        block = np.empty((16, n), np.int8)  # rows P..15 (P < 16) are read, never stored
        nz = 0
        for i0 in range(0, m, P):
            rows_here = min(P, m - i0)
            for c in range(rows_here):
                i = i0 + c
                src, row = theta[o + i * n:o + (i + 1) * n], block[c]
                j0 = n - n % TRITS_LANES
                nz += TRITS(src.ctypes.data, n, half, row.ctypes.data)  # row[:j0]
                for j in range(j0, n):
                    w = src[j]
                    row[j] = 1 if w > half else (-1 if w < -half else 0)
                    nz += 1 if row[j] == 0 else 0
                for q in range(n // P):
                    COPY_PANEL_ROW(row.ctypes.data + q * P, Pf.ctypes.data + pf + (q * m + i) * P)
                j0 = n - n % P  # the last panel's real columns
                dst = pf + (n // P * m + i) * P
                for cc in range(n - j0):
                    Pf[dst + cc] = row[j0 + cc]
            dst = pb + (i0 // P) * n * P
            block[rows_here:P] = 0  # Pb's padding rows hold zeros
            pb_addr = Pb.ctypes.data + dst
            j = 0
            while j + 16 <= n:
                TRANSPOSE_TO_PANEL(block.ctypes.data + j, n, pb_addr + j * P)
                j += 16
            for j in range(j, n):
                for c in range(rows_here):
                    Pb[dst + j * P + c] = block[c, j]
        zeros[t] = nz


def panel_offsets(rows, cols, is_ternary, panel):
    """Offsets of each tensor's panels (0-sized for non-ternary tensors), plus the total."""
    sizes = [(-(-c // panel)) * panel * r if t else 0 for r, c, t in zip(rows, cols, is_ternary)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


class ModelState:
    """Parameters plus what every step derives from them: T in two layouts and alpha."""

    def __init__(self, cfg: Config, theta: np.ndarray, tables: Tables, plain: bool = True):
        self.cfg = cfg
        self.theta = theta
        self.tables = tables
        self.offs = cfg.offsets()
        shapes = [s for _, s, _ in cfg.tensors()]
        self.rows = np.array([s[0] for s in shapes], np.int64)
        self.cols = np.array([s[1] if len(s) > 1 else 1 for s in shapes], np.int64)
        self.is_ternary = ternary_mask(cfg)
        self.plain = plain  # keep Tf and Tb (speeds 0-2); speed 3 reads only the panels
        self.Tf = np.zeros_like(theta) if plain else np.zeros(0)
        self.Tb = np.zeros_like(theta) if plain else np.zeros(0)
        self.alpha = np.ones(len(shapes))
        self.zeros = np.zeros(len(shapes), np.int64)  # zero trits per ternary tensor
        # speed 3's layouts: Tf and Tb again, in column panels (hslm.panel_kernels)
        self.pf_offs = panel_offsets(self.rows, self.cols, self.is_ternary, TERNARY_PANEL)
        self.pb_offs = panel_offsets(self.cols, self.rows, self.is_ternary, TERNARY_PANEL)
        # int8 holds -1, 0, +1 exactly, in a quarter of float32's bytes: the kernels
        # stream the panels of every layer each window, and requantisation writes them
        self.Pf = np.zeros(self.pf_offs[-1], np.int8)
        self.clock = np.zeros(2)  # (Model.clock)
        self.Pb = np.zeros(self.pb_offs[-1], np.int8)
        self.requantize()

    def requantize(self, t0=0, t1=None, abs_sums=None):
        """Remake alpha and the trits of tensors t0..t1-1 from theta; abs_sums, when given,
        holds each tensor's sum |W| (adamw_step's by-product)."""
        t1 = len(self.rows) if t1 is None else t1
        quantize_into(self.theta, self.offs, self.trits(),
                      self.alpha if abs_sums is None else abs_sums, abs_sums is not None, t0, t1)

    def trits(self) -> Trits:
        """What requantisation writes (quantize_into), as the kernels take it."""
        return Trits(self.rows, self.cols, self.is_ternary, self.alpha, self.plain, self.Tf,
                     self.Tb, self.pf_offs, self.Pf, self.pb_offs, self.Pb, self.zeros)

    def kernel_model(self) -> Model:
        c, tb = self.cfg, self.tables
        return Model(self.theta, self.offs, self.Tf, self.Tb, self.alpha, tb.pos, tb.cos,
                     tb.sin, c.attn_scale, c.head_scale, c.dims(), self.Pf, self.pf_offs,
                     self.Pb, self.pb_offs, self.clock)
