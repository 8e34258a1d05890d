"""The VSA stream (spec section 6): parameter-free, integer, once per window.

Its output vsa[b, p, :d] enters block b's residual stream as a constant.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .config import PHI
from .jit import kernel_entry
from .vector_tiles import CountedLoop, declare, splat

GATE = 1.0 / PHI  # 0.6180339887...


LANES = 32  # int16 lanes of the trit loops' vectors (one AVX-512 or two AVX2 registers)


def _trit_loop(dot: bool):
    """An IR loop over rows of n int16 (n a multiple of LANES), as a Numba intrinsic:
    dot: trit_dot(a_addr, b_addr, n) -> int64, sum_i a[i] b[i];
    else: add_scaled(w, a_addr, acc_addr, n): acc[i] += w a[i] (w an int64 in int16).
    Integer sums are exact in any order, so the lanes add in parallel. Each lane of a
    dot adds n / LANES products of trits (|.| <= 2048 for vsa_dim <= 65536), and the
    lanes are added in int32."""

    def codegen(context, builder, signature, args):
        i16, i32 = ir.IntType(16), ir.IntType(32)
        vt = ir.VectorType(i16, LANES)
        a_addr, b_addr, n = args if dot else args[1:]
        a = builder.inttoptr(a_addr, i16.as_pointer())
        b = builder.inttoptr(b_addr, i16.as_pointer())
        zero = ir.Constant(vt, [0] * LANES)
        if not dot:
            wv = splat(builder, builder.trunc(args[0], i16), vt)
        with CountedLoop(builder, n, LANES, "trits") as loop:
            acc = builder.phi(vt) if dot else None  # (phis first in the block)
            pa = builder.bitcast(builder.gep(a, [loop.i]), vt.as_pointer())
            pb = builder.bitcast(builder.gep(b, [loop.i]), vt.as_pointer())
            if dot:
                new = builder.add(acc, builder.mul(builder.load(pa, align=2),
                                                   builder.load(pb, align=2)))
            else:
                builder.store(builder.add(builder.load(pb, align=2),
                                          builder.mul(wv, builder.load(pa, align=2))), pb,
                              align=2)
        if not dot:
            return context.get_dummy_value()
        acc.add_incoming(zero, loop.entry)
        acc.add_incoming(new, loop.latch)
        total = builder.phi(vt)  # after the loop: 0 when n <= 0
        total.add_incoming(zero, loop.entry)
        total.add_incoming(new, loop.latch)
        wide = builder.sext(total, ir.VectorType(i32, LANES))
        reduce = declare(builder, f"llvm.vector.reduce.add.v{LANES}i32", i32,
                         [ir.VectorType(i32, LANES)])
        return builder.sext(builder.call(reduce, [wide]), ir.IntType(64))

    if dot:
        def trit_dot(typingctx, a_addr, b_addr, n):
            return types.int64(types.intp, types.intp, types.intp), codegen
        return intrinsic(trit_dot)

    def add_scaled(typingctx, w, a_addr, acc_addr, n):
        return types.void(types.int64, types.intp, types.intp, types.intp), codegen
    return intrinsic(add_scaled)


trit_dot = _trit_loop(True)
add_scaled = _trit_loop(False)


@kernel_entry(allocates=True)
def vsa_window(table, tokens, n_blocks, width, out):
    """table [V, D] int8, tokens [>= L] -> out [nb, L, d] f64 (L = out.shape[1])."""
    L = out.shape[1]
    D = table.shape[1]
    Dp = (D + LANES - 1) // LANES * LANES  # rows padded with zeros to whole vectors
    # trits in int16, summed by the vector loops above (trit_dot, add_scaled)
    tau = np.zeros((L, Dp), np.int16)
    nxt = np.zeros((L, Dp), np.int16)
    for p in range(L):  # tau^0_p: table row of t_p rotated right by p (two plain copies:
        row = table[tokens[p]]  # an integer division per element cost 40 us a window;
        r = p % D  # slices indexed from 0 vectorise, layers.rotary_forward)
        head, tail = tau[p, r:D], tau[p, 0:r]
        src_head, src_tail = row[0:D - r], row[D - r:D]
        for i in range(D - r):
            head[i] = src_head[i]
        for i in range(r):
            tail[i] = src_tail[i]
    g = np.zeros(L, np.int64)
    nrm = np.zeros(L, np.int64)
    acc = np.zeros(Dp, np.int16)  # |acc| <= 10 L <= 810
    for b in range(n_blocks):
        for p in range(L):
            for j in range(p + 1):
                g[j] = trit_dot(tau[p].ctypes.data, tau[j].ctypes.data, Dp)
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
            acc[:] = 0
            for j in range(p + 1):
                if g[j] > 0:
                    nn = nrm[p] * nrm[j]
                    w = 1
                    for c in range(2, 11):
                        if c * c * nn <= 100 * g[j] * g[j]:
                            w = c
                    add_scaled(w, tau[j].ctypes.data, acc.ctypes.data, Dp)
            for i in range(Dp):
                nxt[p, i] = 1 if acc[i] > 0 else (-1 if acc[i] < 0 else 0)
            if gate >= GATE:
                for i in range(width):
                    s = nxt[p, 4 * i] + nxt[p, 4 * i + 1] + nxt[p, 4 * i + 2] + nxt[p, 4 * i + 3]
                    out[b, p, i] = 0.1 * (s / 4.0)
            else:
                for i in range(width):
                    out[b, p, i] = 0.0
        tau, nxt = nxt, tau


def vsa_terms(table: np.ndarray, tokens: np.ndarray, n_blocks: int, width: int, L: int):
    out = np.empty((n_blocks, L, width), np.float64)
    vsa_window(table, np.ascontiguousarray(tokens, dtype=np.int64), n_blocks, width, out)
    return out
