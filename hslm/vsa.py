"""The VSA stream (spec section 6): parameter-free, integer, once per window.

Its output vsa[b, p, :d] enters block b's residual stream as a constant.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .config import PHI

GATE = 1.0 / PHI  # 0.6180339887...


@njit(cache=True, nogil=True, error_model="numpy")
def vsa_window(table, tokens, n_blocks, width, out):
    """table [V, D] int8, tokens [>= L] -> out [nb, L, d] f64 (L = out.shape[1])."""
    L = out.shape[1]
    D = table.shape[1]
    # trits in int32: the dot products (|.| <= D) vectorise 8 lanes wide
    tau = np.zeros((L, D), np.int32)
    nxt = np.zeros((L, D), np.int32)
    for p in range(L):  # tau^0_p: table row of t_p rotated right by p (two plain copies:
        row = table[tokens[p]]  # an integer division per element cost 40 us a window)
        r = p % D
        for i in range(D - r):
            tau[p, i + r] = row[i]
        for i in range(D - r, D):
            tau[p, i + r - D] = row[i]
    g = np.zeros(L, np.int64)
    nrm = np.zeros(L, np.int64)
    acc = np.zeros(D, np.int32)
    for b in range(n_blocks):
        for p in range(L):
            for j in range(p + 1):
                s = np.int32(0)
                for i in range(D):
                    s += tau[p, i] * tau[j, i]
                g[j] = s
            nrm[p] = g[p]  # tau_p . tau_p; the earlier rows' norms are their own g[p]
            # gate: the largest similarity to an earlier position (at p = 0: sim_0)
            gate = -2.0
            for j in range(p + 1):
                if j == p and p > 0:
                    break
                nn = nrm[p] * nrm[j]
                sim = g[j] / math.sqrt(nn) if nn != 0 else 0.0
                if sim > gate:
                    gate = sim
            # context = sign(sum of w_j tau_j over j <= p with g_j > 0), w_j exact in integers
            for i in range(D):
                acc[i] = 0
            for j in range(p + 1):
                if g[j] > 0:
                    nn = nrm[p] * nrm[j]
                    w = np.int32(1)
                    for c in range(2, 11):
                        if c * c * nn <= 100 * g[j] * g[j]:
                            w = np.int32(c)
                    for i in range(D):
                        acc[i] += w * tau[j, i]
            for i in range(D):
                nxt[p, i] = 1 if acc[i] > 0 else (-1 if acc[i] < 0 else 0)
            if gate >= GATE:
                for i in range(width):
                    s = nxt[p, 4 * i] + nxt[p, 4 * i + 1] + nxt[p, 4 * i + 2] + nxt[p, 4 * i + 3]
                    out[b, p, i] = 0.1 * (s / 4.0)
            else:
                for i in range(width):
                    out[b, p, i] = 0.0
        for p in range(L):
            for i in range(D):
                tau[p, i] = nxt[p, i]
    return out


def vsa_terms(table: np.ndarray, tokens: np.ndarray, n_blocks: int, width: int, L: int):
    out = np.empty((n_blocks, L, width), np.float64)
    return vsa_window(table, np.ascontiguousarray(tokens, dtype=np.int64), n_blocks, width, out)
