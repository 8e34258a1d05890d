"""Fast matrix kernels with the exact summation order of hslm.layers.

Speed comes from loop structure only; no BLAS,
no np.sum, no reassociation: each output is the same chain of additions as the
plain dot product in hslm.layers.matvec_dot.

* ternary_matmul_rows (speed 2, one position at a time): the outputs j in the
  innermost, contiguous loop; the input index i sequential for each output,
  unrolled by 4 as (((y + a0 w0) + a1 w1) + a2 w2) + a3 w3.
* ternary_panels (speed 3, all positions of a window) and the weight gradient's
  panel_matmul_add (speed 3's weight-gradient phase, hslm.windows; weight_grad_rows
  is its one-window form, which the tests compare with the plain sums): the
  register-tiled kernels of hslm.panel_kernels over matrices stored in column
  panels, each tile's loop in LLVM IR (hslm.vector_tiles).

Only one contraction is allowed, in the ternary kernels, where it is exact.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .jit import kernel_entry, kernel_inner
from .micro import (ACTIVE_LANES, ACTIVE_VECS, MICRO_KERNELS, SPARSE_MOST, TERNARY_PANEL,
                    WGRAD_PANEL, compile_micro, panel_matmul_add, ternary_panel_matmul,
                    ternary_sparse_matmul)
from .vector_tiles import make_active_rows_tile, make_prefetch_to_l2

COL_TILE = 256  # columns per tile: a pass's 4 matrix-row slices (8 KB) stay in L1


@njit(cache=True, nogil=True, fastmath={"contract"})
def ternary_matmul_rows(X, T, alpha, Y):
    """Y [n, b] = alpha * (X [n, a] . T [a, b]) for a ternary T (entries -1, 0, +1);
    each Y[r, j] sums i = 0, 1, ... from 0.0. The per-position speed's forward (T
    input-major) and input gradient (T output-major).

    FMA contraction is allowed: each product a * w with w in {-1, 0, +1} is exact,
    so fma(a, w, y) rounds once, exactly like y + a * w, and the bits do not change
    (on machines with or without FMA). Never call it with a non-ternary T."""
    n, a = X.shape
    b = T.shape[1]
    for j0 in range(0, b, COL_TILE):
        j1 = min(j0 + COL_TILE, b)
        w = j1 - j0
        for r in range(n):  # one row per pass (the per-position speed calls one row)
            y0 = Y[r, j0:j1]
            for j in range(w):
                y0[j] = 0.0
            i = 0
            while i + 4 <= a:
                w0 = T[i, j0:j1]
                w1 = T[i + 1, j0:j1]
                w2 = T[i + 2, j0:j1]
                w3 = T[i + 3, j0:j1]
                a00, a01, a02, a03 = X[r, i], X[r, i + 1], X[r, i + 2], X[r, i + 3]
                for j in range(w):
                    y0[j] = (((y0[j] + a00 * w0[j]) + a01 * w1[j]) + a02 * w2[j]) + a03 * w3[j]
                i += 4
            while i < a:
                w0 = T[i, j0:j1]
                a00 = X[r, i]
                for j in range(w):
                    y0[j] = y0[j] + a00 * w0[j]
                i += 1
            for j in range(w):
                y0[j] = alpha * y0[j]


WGRAD_ROW_BLOCK = 36  # gradient rows per unit of the weight-gradient phase (a multiple of 3 rows)


for _name in MICRO_KERNELS:  # before any caller compiles (hslm/micro.py)
    compile_micro(_name)


@kernel_inner
def ternary_panels(P, poffs, alpha, t, a, b, X, Y):
    """Y [n, b] = alpha[t] * (X [n, a] . T_t), T_t read from its column panels in P."""
    npan = (b + TERNARY_PANEL - 1) // TERNARY_PANEL
    ternary_panel_matmul(X, P[poffs[t]:poffs[t + 1]].reshape((npan, a, TERNARY_PANEL)), b,
                         alpha[t], Y)


@kernel_inner
def no_sparse_matmul(X, P, b, alpha, Y, most):
    """ternary_sparse_matmul where this machine has none: never done, so the dense kernel
    runs (and the sparse one is not compiled)."""
    return False


# (a module constant: the callers compile with this machine's choice in them)
SPARSE_MATMUL = no_sparse_matmul if ternary_sparse_matmul is None else ternary_sparse_matmul


@kernel_inner
def ternary_panels_skipping_zeros(P, poffs, alpha, t, a, b, X, Y):
    """ternary_panels for an X that is mostly zeros (the ReLU's output or its gradient):
    over X's nonzero entries only, where this machine skips them (micro.skips_relu_zeros)
    and no more than SPARSE_MOST of X is nonzero; else the dense kernel. The same bits
    either way."""
    npan = (b + TERNARY_PANEL - 1) // TERNARY_PANEL
    panels = P[poffs[t]:poffs[t + 1]].reshape((npan, a, TERNARY_PANEL))
    if not SPARSE_MATMUL(X, panels, b, alpha[t], Y, SPARSE_MOST):
        ternary_panel_matmul(X, panels, b, alpha[t], Y)


@kernel_inner(allocates=True)
def output_grad_panels(DY, PD):
    """DY [n, b] (an output gradient) in column panels of WGRAD_PANEL, zero past
    column b, into the flat scratch PD (>= n b + WGRAD_PANEL n); returns the
    [npan, n, WGRAD_PANEL] view. Made once per window and matrix, shared by every
    unit of gradient rows of that matrix."""
    n, b = DY.shape
    P = WGRAD_PANEL
    npan = (b + P - 1) // P
    full = b // P
    pd = PD[:npan * n * P].reshape((npan, n, P))
    for r in range(n):  # DY row by row, as it lies in memory (it comes from far caches)
        for q in range(full):
            for c in range(P):
                pd[q, r, c] = DY[r, q * P + c]
        if full < npan:  # the last panel, zero past column b
            for c in range(P):
                pd[full, r, c] = DY[r, full * P + c] if full * P + c < b else 0.0
    return pd


@kernel_inner(allocates=True)
def input_columns(X, i0, i1, XT):
    """X[:, i0:i1] transposed into the flat scratch XT (>= (i1 - i0) n), X [n, a]: a layer
    input's columns as rows of the weight gradient's tile; returns the [i1 - i0, n] view.
    X is read row by row, as it lies in memory."""
    n = X.shape[0]
    m = i1 - i0
    xt = XT[:m * n].reshape((m, n))
    for r in range(n):
        for i in range(m):
            xt[i, r] = X[r, i0 + i]
    return xt


@kernel_entry(allocates=True)
def weight_grad_rows(X, i0, i1, pd, b, G, XT, fresh):
    """G[i0:i1] += (X^T . DY)[i0:i1]: G [a, b], X [n, a], DY [n, b] given in panels
    (pd, output_grad_panels); each element summed over the positions r = 0, 1, ...
    in increasing order from 0.0. fresh: G[i0:i1] = 0.0 + that sum instead.

    A tile of gradient rows is held in registers while every position adds to
    it, then added into G: each element is the same chain of additions as the
    per-position streaming (windows.stream_weight_grads), and G gets the window's
    sum added once. XT (>= (i1 - i0) n) is flat scratch for X's columns transposed."""
    panel_matmul_add(input_columns(X, i0, i1, XT), pd, b, G[i0:i1], fresh)


@kernel_inner
def column_sum_rows(DY, g, acc):
    """g [b] += sum_r DY[r, j] (bias gradients), r increasing from 0.0; acc [>= b] scratch.
    Each column's sum is its own chain in row order, and the chains run side by side, a
    row at a time in vectors: summed a column at a time, each a chain of k dependent
    additions, the step's bias gradients took 0.46 ms here (AMD Zen 4, built for AVX2)."""
    n, b = DY.shape
    if acc.shape[0] < b or g.shape[0] < b:
        raise ValueError("column_sum_rows: the operands' shapes do not agree")  # no bound checks
    a = acc[:b]
    for j in range(b):
        a[j] = 0.0
    for r in range(n):
        row = DY[r]
        for j in range(b):
            a[j] += row[j]
    for j in range(b):
        g[j] += a[j]


# ------------------------------------------------- the MLP's weight gradients, active rows
# Tiles of ACTIVE_VECS and ACTIVE_VECS - 1 vectors (a row of 243 columns: 16 + 15 vectors
# of 8, or 13 + 4 x 12 of 4), and, for narrower rows, a slower one of up to ACTIVE_VECS.
ACTIVE_ROW = make_active_rows_tile(ACTIVE_VECS, ACTIVE_LANES)
ACTIVE_ROW_LESS = make_active_rows_tile(ACTIVE_VECS - 1, ACTIVE_LANES)
ACTIVE_ROW_ANY = make_active_rows_tile(ACTIVE_VECS, ACTIVE_LANES, exact=False)
PREFETCH_TO_L2 = make_prefetch_to_l2()
# Rows ahead that active_masks and copy_rows ask into L2 as they read a step's records
# (last written in the forward or the backward, fetched from far caches): the hardware's
# prefetch, within a 4 KB page, left these reads at about 8 GB/s here. (The dense
# matrices' operand copies, output_grad_panels and input_columns, ran 0.88x with it, but
# their tiles after them as much slower: left without.)
ROWS_AHEAD = 4


@kernel_inner
def columns_to_l2(S, j0, j1):
    """The cache lines of S[t, j0:j1] for every row t asked into L2 (a hint: no value
    changes): a block of units' sparse factor for active_rows_grad, a call ahead."""
    for t in range(S.shape[0]):
        PREFETCH_TO_L2(S.ctypes.data + t * S.strides[0] + j0 * 8, (j1 - j0) * 8)


@kernel_inner
def active_masks(X, j0, j1, M):
    """M[w, j] for j0 <= j < j1: bit t % 64 of word w = t // 64 set where X[t, j] > 0.0
    (X [k, F]: the ReLU's outputs at the scored positions; a NaN is not active).
    Indexed from 0 within slices: with j from j0 Numba cannot rule out a negative index,
    and the check on each one kept LLVM from vectorising the loop (13.0 against 1.9 us a
    call of 27 x 729 here, on Zen 5). Asks for the row ROWS_AHEAD on while it reads each."""
    n = j1 - j0
    for w in range(M.shape[0]):
        m = M[w, j0:j1]
        for j in range(n):
            m[j] = 0
    for t in range(X.shape[0]):
        if t + ROWS_AHEAD < X.shape[0]:  # a later row's lines, on their way meanwhile
            PREFETCH_TO_L2(X[t + ROWS_AHEAD, j0:j1].ctypes.data, (j1 - j0) * 8)
        bit = t & 63
        x = X[t, j0:j1]
        m = M[t >> 6, j0:j1]
        for j in range(n):
            m[j] |= np.int64(x[j] > 0.0) << bit


@kernel_entry
def active_tiles(n):
    """How many register tiles active_rows_grad cuts a row of n columns into."""
    nv = (n + ACTIVE_LANES - 1) // ACTIVE_LANES
    return (nv + ACTIVE_VECS - 1) // ACTIVE_VECS


@kernel_entry
def active_span(n, q):
    """Columns (c0, c1) of tile q of active_tiles(n): the row's vectors shared out as
    evenly as the tiles allow, so no tile runs mostly empty."""
    T = active_tiles(n)
    nv = (n + ACTIVE_LANES - 1) // ACTIVE_LANES
    base, extra = nv // T, nv % T
    v0 = q * base + min(q, extra)
    v1 = v0 + base + (1 if q < extra else 0)
    return v0 * ACTIVE_LANES, min(n, v1 * ACTIVE_LANES)


@kernel_inner
def active_rows_grad(M, S, D, c0, c1, j0, j1, O, fresh):
    """O[j - j0, c - c0] = base + sum_t S[t, j] D[t, c] for j0 <= j < j1, c0 <= c < c1 (at
    least ACTIVE_LANES columns), base what O held or, where fresh, 0.0: one window's
    weight-gradient rows of a matrix beside the ReLU, summed over the positions t where
    unit j is active (M, active_masks) in increasing order from 0.0, the product
    rounded and then added. The positions left out add S[t, j] D[t, c] = +-0.0, which
    changes no bit of such a sum (vector_tiles.make_active_rows_tile), so these are
    the dense sums' bits. S [k, F] (its column j: unit j's factor), D [k, >= c1] rows
    contiguous, O [>= j1 - j0, >= c1 - c0] rows contiguous (rows starting on 64 bytes
    where they can: a vector split across two cache lines costs 10-20% of the tile's
    time here).

    Tiles of up to ACTIVE_VECS vectors; for each, every row j (D's columns of the tile,
    27 x 128 doubles, stay in L1 while the rows pass). S's column j is a load from each
    of its k rows, k cache lines that serve 8 units each and come from far caches (a
    step's records): the first tile asks for the next 8 units' lines every 8 units
    (on AMD Zen 4, W_up and W_down 13.0 -> 9.6 ms a step, the medians of five runs:
    docs/performance-history.md)."""
    words, F = M.shape
    n = c1 - c0
    if (n < ACTIVE_LANES or D.shape[1] < c1 or O.shape[1] < n or O.shape[0] < j1 - j0
            or j0 < 0 or j1 > F
            or S.shape[1] != F or words * 64 < S.shape[0] or D.shape[0] < S.shape[0]
            or (D.size > 0 and D.strides[1] != 8) or (O.size > 0 and O.strides[1] != 8)
            or (S.size > 0 and S.strides[1] != 8)):
        raise ValueError("active_rows_grad: the operands' shapes do not agree")  # raw addresses
    xs, ds, os = S.strides[0] // 8, D.strides[0] // 8, O.strides[0] // 8
    m, x, rows, k = M.ctypes.data + j0 * 8, S.ctypes.data + j0 * 8, j1 - j0, S.shape[0]
    for q in range(active_tiles(n)):
        a, b = active_span(n, q)
        d = D.ctypes.data + (c0 + a) * 8
        o = O.ctypes.data + a * 8
        vecs = (b - a + ACTIVE_LANES - 1) // ACTIVE_LANES
        last, first = b - a - ACTIVE_LANES, 1 if fresh else 0
        ahead = F - 8 - j0 if q == 0 else 0  # the first tile asks for the next x lines
        if vecs == ACTIVE_VECS:
            ACTIVE_ROW(m, F, words, x, xs, d, ds, last, o, os, rows, ahead, k, first)
        elif vecs == ACTIVE_VECS - 1:
            ACTIVE_ROW_LESS(m, F, words, x, xs, d, ds, last, o, os, rows, ahead, k, first)
        else:
            ACTIVE_ROW_ANY(m, F, words, x, xs, d, ds, last, o, os, rows, ahead, k, first)


@kernel_inner(allocates=True)
def aligned_view(flat, start, k, n):
    """The [k, n] view of flat that aligned_rows(X [k, n], flat, start) fills: from element
    `start` on, each row starting on 64 bytes, rows a multiple of 8 elements apart and not
    of 64 (so that rows do not share L1 sets). Takes at most k * (n + 15) + 7 elements."""
    stride = (n + 7) // 8 * 8
    if stride % 64 == 0:
        stride += 8
    a = start + (-(flat.ctypes.data // 8 + start)) % 8
    return flat[a:a + k * stride].reshape((k, stride))[:, :n]


@kernel_inner
def copy_rows(X, Y):
    """Y[:] = X, both [k, n] with rows contiguous. Asks for X's row ROWS_AHEAD on while it
    copies each (X is often a step's records, or G, from far caches)."""
    k, n = X.shape
    for r in range(k):
        if r + ROWS_AHEAD < k:  # a later row's lines, on their way meanwhile
            PREFETCH_TO_L2(X[r + ROWS_AHEAD].ctypes.data, n * 8)
        for c in range(n):
            Y[r, c] = X[r, c]


@kernel_inner(allocates=True)
def aligned_rows(X, flat, start):
    """X [k, n] copied into flat's aligned_view(flat, start, k, n), which it returns. The
    tile's vector loads from records' rows (243 doubles apart) split cache lines: 1.24
    against 0.99-1.03 ms for Wdown's gradient."""
    k, n = X.shape
    out = aligned_view(flat, start, k, n)
    copy_rows(X, out)
    return out


@kernel_inner
def transpose_rows(T, G):
    """G [w, F] = T^T, T [F, w]: W_up's transposed sums into G, and G's rows into them
    where a sum goes on. In blocks of 8 x 8, which LLVM transposes in vector registers
    (8 loads, shuffles, 8 stores of 64 bytes), eight of G's rows at a time; G's lines
    come from memory (the optimiser last touched them). Element by element, eight of T's
    rows at a time, it took 1.22 ms a step here, against 0.53. The next eight rows of the
    output are asked into L2 while these are done: for W_up's sums written into G, lines
    last touched by the optimiser (W_up + W_down 0.972x and the weight gradients 0.992x in
    steps taken in turns on the 2-core Xeon, batch 8); into the scratch T, a hint that
    costs little."""
    F, w = T.shape
    for i0 in range(0, w - 7, 8):
        if i0 + 8 < w:  # the next eight rows of G, on their way meanwhile
            PREFETCH_TO_L2(G[i0 + 8].ctypes.data, (min(i0 + 16, w) - i0 - 8) * G.strides[0])
        for j0 in range(0, F - 7, 8):
            for i in range(8):
                for j in range(8):
                    G[i0 + i, j0 + j] = T[j0 + j, i0 + i]
        for j in range(F - F % 8, F):
            for i in range(8):
                G[i0 + i, j] = T[j, i0 + i]
    for i in range(w - w % 8, w):
        for j in range(F):
            G[i, j] = T[j, i]
