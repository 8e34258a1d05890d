"""Fast matrix kernels with the exact summation order of hslm.ops.

Speed comes from loop structure only (see ../shared/NUMBA_NOTES.md): the
independent outputs j sit in the innermost, contiguous loop; the input index i
stays sequential for each output, unrolled by 4 as (((y + a0 w0) + a1 w1) +
a2 w2) + a3 w3; and one loaded matrix row serves 4 rows (positions) per pass.
No fastmath, no BLAS, no np.sum: each output is the same chain of additions
as the plain dot product in hslm.ops.matvec_ref.
"""
from __future__ import annotations

import numpy as np
from numba import njit

COL_TILE = 256  # columns per tile: a pass's 4 matrix-row slices (8 KB) stay in L1


@njit(cache=True, nogil=True)
def matmul_rows(X, T, alpha, Y):
    """Y [n, b] = alpha * (X [n, a] . T [a, b]); each Y[r, j] sums i = 0, 1, ... from 0.0."""
    n, a = X.shape
    b = T.shape[1]
    for j0 in range(0, b, COL_TILE):
        j1 = min(j0 + COL_TILE, b)
        w = j1 - j0
        r = 0
        while r + 4 <= n:
            y0 = Y[r, j0:j1]
            y1 = Y[r + 1, j0:j1]
            y2 = Y[r + 2, j0:j1]
            y3 = Y[r + 3, j0:j1]
            for j in range(w):
                y0[j] = 0.0
                y1[j] = 0.0
                y2[j] = 0.0
                y3[j] = 0.0
            i = 0
            while i + 4 <= a:
                w0 = T[i, j0:j1]
                w1 = T[i + 1, j0:j1]
                w2 = T[i + 2, j0:j1]
                w3 = T[i + 3, j0:j1]
                a00, a01, a02, a03 = X[r, i], X[r, i + 1], X[r, i + 2], X[r, i + 3]
                a10, a11, a12, a13 = X[r + 1, i], X[r + 1, i + 1], X[r + 1, i + 2], X[r + 1, i + 3]
                a20, a21, a22, a23 = X[r + 2, i], X[r + 2, i + 1], X[r + 2, i + 2], X[r + 2, i + 3]
                a30, a31, a32, a33 = X[r + 3, i], X[r + 3, i + 1], X[r + 3, i + 2], X[r + 3, i + 3]
                for j in range(w):
                    y0[j] = (((y0[j] + a00 * w0[j]) + a01 * w1[j]) + a02 * w2[j]) + a03 * w3[j]
                    y1[j] = (((y1[j] + a10 * w0[j]) + a11 * w1[j]) + a12 * w2[j]) + a13 * w3[j]
                    y2[j] = (((y2[j] + a20 * w0[j]) + a21 * w1[j]) + a22 * w2[j]) + a23 * w3[j]
                    y3[j] = (((y3[j] + a30 * w0[j]) + a31 * w1[j]) + a32 * w2[j]) + a33 * w3[j]
                i += 4
            while i < a:
                w0 = T[i, j0:j1]
                a00, a10, a20, a30 = X[r, i], X[r + 1, i], X[r + 2, i], X[r + 3, i]
                for j in range(w):
                    y0[j] = y0[j] + a00 * w0[j]
                    y1[j] = y1[j] + a10 * w0[j]
                    y2[j] = y2[j] + a20 * w0[j]
                    y3[j] = y3[j] + a30 * w0[j]
                i += 1
            for j in range(w):
                y0[j] = alpha * y0[j]
                y1[j] = alpha * y1[j]
                y2[j] = alpha * y2[j]
                y3[j] = alpha * y3[j]
            r += 4
        while r < n:
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
            r += 1


@njit(cache=True, nogil=True, fastmath={"contract"})
def ternary_matmul_rows(X, T, alpha, Y):
    """matmul_rows for a ternary T (entries -1, 0, +1): the forward (T input-major)
    and the input gradient (T output-major) of every ternary matrix.

    The same source as matmul_rows, compiled with FMA contraction allowed: each
    product a * w with w in {-1, 0, +1} is exact, so fma(a, w, y) rounds once,
    exactly like y + a * w, and the bits do not change (on machines with or
    without FMA). Never call it with a non-ternary T."""
    n, a = X.shape
    b = T.shape[1]
    for j0 in range(0, b, COL_TILE):
        j1 = min(j0 + COL_TILE, b)
        w = j1 - j0
        r = 0
        while r + 4 <= n:
            y0 = Y[r, j0:j1]
            y1 = Y[r + 1, j0:j1]
            y2 = Y[r + 2, j0:j1]
            y3 = Y[r + 3, j0:j1]
            for j in range(w):
                y0[j] = 0.0
                y1[j] = 0.0
                y2[j] = 0.0
                y3[j] = 0.0
            i = 0
            while i + 4 <= a:
                w0 = T[i, j0:j1]
                w1 = T[i + 1, j0:j1]
                w2 = T[i + 2, j0:j1]
                w3 = T[i + 3, j0:j1]
                a00, a01, a02, a03 = X[r, i], X[r, i + 1], X[r, i + 2], X[r, i + 3]
                a10, a11, a12, a13 = X[r + 1, i], X[r + 1, i + 1], X[r + 1, i + 2], X[r + 1, i + 3]
                a20, a21, a22, a23 = X[r + 2, i], X[r + 2, i + 1], X[r + 2, i + 2], X[r + 2, i + 3]
                a30, a31, a32, a33 = X[r + 3, i], X[r + 3, i + 1], X[r + 3, i + 2], X[r + 3, i + 3]
                for j in range(w):
                    y0[j] = (((y0[j] + a00 * w0[j]) + a01 * w1[j]) + a02 * w2[j]) + a03 * w3[j]
                    y1[j] = (((y1[j] + a10 * w0[j]) + a11 * w1[j]) + a12 * w2[j]) + a13 * w3[j]
                    y2[j] = (((y2[j] + a20 * w0[j]) + a21 * w1[j]) + a22 * w2[j]) + a23 * w3[j]
                    y3[j] = (((y3[j] + a30 * w0[j]) + a31 * w1[j]) + a32 * w2[j]) + a33 * w3[j]
                i += 4
            while i < a:
                w0 = T[i, j0:j1]
                a00, a10, a20, a30 = X[r, i], X[r + 1, i], X[r + 2, i], X[r + 3, i]
                for j in range(w):
                    y0[j] = y0[j] + a00 * w0[j]
                    y1[j] = y1[j] + a10 * w0[j]
                    y2[j] = y2[j] + a20 * w0[j]
                    y3[j] = y3[j] + a30 * w0[j]
                i += 1
            for j in range(w):
                y0[j] = alpha * y0[j]
                y1[j] = alpha * y1[j]
                y2[j] = alpha * y2[j]
                y3[j] = alpha * y3[j]
            r += 4
        while r < n:
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
            r += 1


WGRAD_ROW_BLOCK = 32  # gradient rows computed per pass (a [32, b] block stays in L2)


@njit(cache=True, nogil=True)
def weight_grad_rows(X, i0, i1, DY, G, XT, tmp):
    """G[i0:i1] += (X^T . DY)[i0:i1]: G [a, b], X [n, a], DY [n, b]; each element
    summed over the rows r = 0, 1, ... in increasing order from 0.0.

    This is matmul_rows with X transposed: a block of gradient rows is held
    while every position adds to it (in position order, 4 positions per pass),
    then added into G; so each element is the same chain of additions as the
    per-position outer_add, and G gets the window's sum added once.
    XT (>= (i1 - i0) n) and tmp (>= WGRAD_ROW_BLOCK b) are flat scratch, shaped
    here so that every array the inner loops touch is C-contiguous."""
    n = X.shape[0]
    b = DY.shape[1]
    m = i1 - i0
    xt = XT[:m * n].reshape((m, n))
    for r in range(n):
        for i in range(m):
            xt[i, r] = X[r, i0 + i]
    for q0 in range(0, m, WGRAD_ROW_BLOCK):
        q1 = min(q0 + WGRAD_ROW_BLOCK, m)
        blk = tmp[:(q1 - q0) * b].reshape((q1 - q0, b))
        matmul_rows(xt[q0:q1], DY, 1.0, blk)
        for q in range(q1 - q0):
            g = G[i0 + q0 + q]
            t = blk[q]
            for j in range(b):
                g[j] += t[j]


@njit(cache=True, nogil=True)
def column_sum_rows(DY, g):
    """g [b] += sum_r DY[r, j] (bias gradients), r increasing from 0.0."""
    n, b = DY.shape
    for j in range(b):
        acc = 0.0
        for r in range(n):
            acc += DY[r, j]
        g[j] += acc
