"""The model's math: each layer once, as a forward/backward pair over a range of rows.

Every speed calls these same functions. A speed differs only in its loop order
(hslm/windows.py: one position at a time against the cache, or all positions of
a window layer by layer) and in the matrix kernel it passes in (`kernel`: the
plain dot products, the fast row kernel, or the register-tiled panels).

Rows. The forward of a window writes activation rows p0..p1-1 (positions) of
the window's buffers. The backward runs over the scored positions s..L-1
(s = L - k) and writes gradient rows r0..r1-1 of the window's record, row r
holding position s + r. The per-position speeds pass one row at a time, the
layerwise speed all of them.

Every sum has one order, and every speed reproduces it exactly (docs/model.md,
section 9):

* a matrix product sums over the input index in increasing order from 0.0, and
  the ternary scale multiplies the finished sum: y_j = alpha * sum_i x_i T[i, j];
* the input gradient of a ternary matrix sums over the output index in
  increasing order: dx_i = alpha * sum_j T[i, j] dy_j;
* softmax, attention and the loss sum over positions / ids in increasing order;
* a window's gradient element is the sum of its scored positions'
  contributions in increasing position order, from 0.0 (each position
  contributes exactly one product per element): weight_grad_operands says
  which activation rows pair with which gradient rows, once for every speed.

Buffers are batched: A (activations), R (records) hold [window, ...] and every
function takes the window's index w.
"""
from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from .config import (BDOWN, BUP, GAMMA, TENSORS_PER_BLOCK, WDOWN, WK, WO, WQ, WUP, WV, Dims)
from .jit import kernel_entry, kernel_inner, kernel_part
from .kernels import (PREFETCH_TO_L2, ternary_matmul_rows, ternary_panels,
                      ternary_panels_skipping_zeros)
from .mathfn import exp, log
from .micro import ACTIVE_LANES, WGRAD_PANEL, wide_vectors
from .panel_kernels import WGRAD_WINDOWS
from .vector_tiles import make_cycle_counter, make_tile
from .speeds import KERNEL_ROWS

RMS_EPS = 1e-6
LABEL_SMOOTH = 0.1  # epsilon of the K-position objective

CYCLES = make_cycle_counter()  # (hslm bench's profile: Model.clock)

# Model.clock's slots: cycles hslm bench's profile counts (one thread) where the clock
# has CLOCK_SLOTS elements (a run's has 2, never written), every part through
# part_starts / part_ends
CLOCK_FWD_PRODUCTS, CLOCK_BWD_PRODUCTS, CLOCK_RELU_MATRICES, CLOCK_OPERANDS = 0, 1, 2, 3
CLOCK_FWD_ATTENTION = 4  # rotary, the cache's panels, scores, softmax, outputs
CLOCK_FWD_NORMS = 5      # the blocks' norms and gains, the head's norm
CLOCK_BWD_ATTENTION = 6  # the backward's panels, attention's gradient, rotary's
CLOCK_BWD_NORMS = 7      # through the blocks' norms and gains, and the head's norm
CLOCK_LOSS = 8           # the loss and its gradient (softmax cross-entropy)
CLOCK_SLOTS = 9
# each slot's short name (tools/ab_steps.py prints them)
CLOCK_NAMES = ("forward-products", "backward-products", "Wup-Wdown", "dense-operands",
               "forward-attention", "forward-norms", "backward-attention", "backward-norms",
               "loss")


@kernel_inner
def part_starts(model):
    """The cycle counter where the profile times a step's parts (else 0)."""
    return CYCLES() if model.clock.shape[0] >= CLOCK_SLOTS else 0


@kernel_inner
def part_ends(model, slot, c0):
    """Adds the cycles since part_starts's c0 to clock[slot] where the profile times the
    parts (a hint of time: no value changes)."""
    if model.clock.shape[0] >= CLOCK_SLOTS:
        model.clock[slot] += CYCLES() - c0

# The parts of a block and of the head (and of the weight gradients, hslm/windows.py),
# each called from one place in each kernel that uses it (the forward or backward over
# a thread's windows, a position's column, a team member's rows): Numba inlines them
# into that caller instead of compiling each as a function of its own. Compiled apart,
# each part is optimised and made into machine code alone, and again inside every
# function above it, as Numba links a callee's code into its caller's: a first run's
# jobs took 78 s on a 2-core Zen 5 apart, 50 s inlined (docs/performance-history.md).
# The kernels called from many places (the matrix products, attention's rows) stay
# functions: inlined, each call would be typed again.

# Attention's rows: one row (a query, or a row of probabilities) times a panel of
# ATTN_PANEL columns (keys, or value components), summed in order in vector registers
# (hslm/vector_tiles.py, products rounded then added, as the plain loops).
ATTN_LANES = 8 if wide_vectors() else 4
ATTN_PANEL = 3 * ATTN_LANES
ATTN_ROW = make_tile(1, 3, ATTN_LANES, ternary=False)
# The scores of ATTN_GROUP query rows at once (one tile of ATTN_GROUP x ATTN_PANEL): a
# score is a chain of dh dependent adds, so one row's panel of them waits on the adds'
# latency, while three rows' chains fill the pipes.
ATTN_GROUP = 3
ATTN_ROWS = make_tile(ATTN_GROUP, 3, ATTN_LANES, ternary=False)


def _panels(n):
    return (n + ATTN_PANEL - 1) // ATTN_PANEL


# ------------------------------------------------------------- buffers
# One field list per buffer kind, from which the allocator builds it; shapes
# are per window, in terms of the named dimensions (nb blocks, L positions).
ACT_FIELDS = (
    ("x", lambda D: (D.blocks, D.window, D.width)),        # block inputs x_b (x_0: embedding)
    ("rms", lambda D: (D.blocks, D.window)),               # RMSNorm factor 1/rms(x_b)
    ("x_normed", lambda D: (D.blocks, D.window, D.width)),  # x_b * rms
    ("n", lambda D: (D.blocks, D.window, D.width)),        # x_normed * gamma
    ("q", lambda D: (D.blocks, D.window, D.width)),        # rotated queries
    ("k", lambda D: (D.blocks, D.window, D.width)),        # rotated keys (the KV cache)
    ("v", lambda D: (D.blocks, D.window, D.width)),        # values (the KV cache)
    # the cache again, in the panels the forward's attention reads (cache_panels): by
    # column, a panel holds P positions [b, h, q, e, c] = k[q P + c, h dh + e] (the
    # scores); by row, P components [b, h, q, j, c] = v[j, h dh + q P + c] (o)
    ("k_cols", lambda D: (D.blocks, D.heads, _panels(D.window), D.head_width, ATTN_PANEL)),
    ("v_rows", lambda D: (D.blocks, D.heads, _panels(D.head_width), D.window, ATTN_PANEL)),
    ("attn", lambda D: (D.blocks, D.window, D.heads, D.window)),  # probabilities [b, p, h, j]
    ("attn_out", lambda D: (D.blocks, D.window, D.width)),  # o = sum_j a_j v_j
    ("h", lambda D: (D.blocks, D.window, D.width)),        # x + o Wo
    # max(u, 0) of u = h Wup + bup (u itself is not kept: u > 0 exactly where relu > 0)
    ("relu", lambda D: (D.blocks, D.window, D.mlp)),
    ("x_final", lambda D: (D.window, D.width)),            # the last block's output
    ("rms_final", lambda D: (D.window,)),
    ("x_final_normed", lambda D: (D.window, D.width)),
    ("logits", lambda D: (D.window, D.vocab)),             # z = c (x_final_normed Wout) + bout
)
# The backward of the scored rows (row r = position s + r): each layer's output
# gradient, the DY of its weight gradient (the X are activations).
RECORD_FIELDS = (
    ("d_logits", lambda D: (D.window, D.vocab)),           # dloss/dz (scaled)
    ("d_head", lambda D: (D.window, D.vocab)),             # c dz: Wout's DY
    ("d_block_out", lambda D: (D.blocks, D.window, D.width)),  # dloss/dx_{b+1}: Wdown's DY
    ("d_u", lambda D: (D.blocks, D.window, D.mlp)),        # dloss/du (ReLU applied): Wup's DY
    ("d_h", lambda D: (D.blocks, D.window, D.width)),      # dloss/dh: Wo's DY
    ("d_q", lambda D: (D.blocks, D.window, D.width)),      # Wq's DY (before rotary)
    ("d_k", lambda D: (D.blocks, D.window, D.width)),      # Wk's DY
    ("d_v", lambda D: (D.blocks, D.window, D.width)),      # Wv's DY
    ("d_gain", lambda D: (D.blocks, D.window, D.width)),   # dn * x_normed: gamma's rows
    ("d_x0", lambda D: (D.window, D.width)),               # dloss/dx_0: the embedding's rows
)
# One thread's scratch: rows overwritten by every window it runs.
SCRATCH_FIELDS = (
    ("d_attn_out", lambda D: (D.window, D.width)),
    ("d_n", lambda D: (D.window, D.width)),
    ("d_x_final_normed", lambda D: (D.window, D.width)),
    ("tmp1", lambda D: (D.window, D.width)),
    ("tmp2", lambda D: (D.window, D.width)),
    ("loss_grad", lambda D: (D.window, D.vocab)),          # dz of forward-only evaluation
    # the backward's panels of each block's cache (backward_panels), as k_cols and v_rows
    # are of k and v: v by column (da), k by row (dq)
    ("v_cols", lambda D: (D.blocks, D.heads, _panels(D.window), D.head_width, ATTN_PANEL)),
    ("k_rows", lambda D: (D.blocks, D.heads, _panels(D.head_width), D.window, ATTN_PANEL)),
    # weight-gradient scratch: a layer input transposed, output gradients in panels
    # (one row per window of a group, panel_kernels.WGRAD_WINDOWS)
    ("xt", lambda D: (WGRAD_WINDOWS, max(D.vocab, D.mlp, D.width) * D.window)),
    # (each window's row whole cache lines long, so that every row starts on one)
    ("dy_panels", lambda D: (WGRAD_WINDOWS,
                             whole_lines((max(D.vocab, D.mlp, D.width) + WGRAD_PANEL) * D.window))),
)
# The fields weight_grad_operands reads: all a weight gradient needs of a window (MPI
# sends them between ranks, hslm/distributed.py).
WEIGHT_GRAD_ACTS = ("n", "attn_out", "h", "relu", "x_final_normed")
WEIGHT_GRAD_RECORDS = ("d_logits", "d_head", "d_block_out", "d_u", "d_h", "d_q", "d_k", "d_v",
                       "d_gain", "d_x0")
Acts = namedtuple("Acts", [f for f, _ in ACT_FIELDS])
Record = namedtuple("Record", [f for f, _ in RECORD_FIELDS])
Scratch = namedtuple("Scratch", [f for f, _ in SCRATCH_FIELDS])


def whole_lines(n: int) -> int:
    """n float64 rounded up to whole 64-byte cache lines."""
    return -(-n // 8) * 8


def zeros_on_64(shape):
    """np.zeros(shape) starting on 64 bytes (numpy promises 16): the kernels' vector
    loads from a buffer's rows then cross no cache line where its rows are a whole
    number of 64 bytes long (a 512-bit load across two lines costs two)."""
    n = math.prod(shape)
    raw = np.zeros(n + 8)
    first = (-raw.ctypes.data) % 64 // 8
    return raw[first:first + n].reshape(shape)


def _alloc(kind, fields, dims: Dims, batch):
    pre = () if batch is None else (batch,)
    return kind(*[zeros_on_64(pre + shape(dims)) for _, shape in fields])


def alloc_acts(dims: Dims, batch: int):
    """Activations of `batch` windows: every field [batch, ...]."""
    return _alloc(Acts, ACT_FIELDS, dims, batch)


def alloc_record(dims: Dims, batch: int):
    return _alloc(Record, RECORD_FIELDS, dims, batch)


def alloc_scratch(dims: Dims):
    return _alloc(Scratch, SCRATCH_FIELDS, dims, None)


# ------------------------------------------------------------------ views
@kernel_inner
def tensor_index(dims, b, which):
    """Index of tensor `which` (config.GAMMA ... BDOWN) of block b in the flat layout;
    which = -1 with b = blocks is Wout, which = -2 is bout, b = -1 is E."""
    if b < 0:
        return 0
    if b == dims.blocks:
        return 1 + dims.blocks * TENSORS_PER_BLOCK + (0 if which == -1 else 1)
    return 1 + b * TENSORS_PER_BLOCK + which


@kernel_entry
def wout_index(dims):
    return tensor_index(dims, dims.blocks, -1)


@kernel_part
def view1(a, offs, t):
    return a[offs[t]:offs[t + 1]]


@kernel_part
def view2(a, offs, t, rows, cols):
    return a[offs[t]:offs[t] + rows * cols].reshape((rows, cols))


# ---------------------------------------------------------- ternary matmuls
@kernel_inner
def matvec_dot(x, T, alpha, y):
    """y [n] = alpha * (x [m] . T [m, n]): dot-product form, the definition."""
    m, n = T.shape
    for j in range(n):
        acc = 0.0
        for i in range(m):
            acc += x[i] * T[i, j]
        y[j] = alpha * acc


@kernel_inner
def matvec_t_dot(dy, T, alpha, dx):
    """dx [m] = alpha * (T [m, n] . dy [n]): the input gradient, the definition."""
    m, n = T.shape
    for i in range(m):
        acc = 0.0
        for j in range(n):
            acc += T[i, j] * dy[j]
        dx[i] = alpha * acc


@kernel_inner
def ternary_forward(model, t, m, n, X, Y, kernel):
    """Y [rows, n] = X [rows, m] . (alpha_t T_t), T_t [m, n] ternary.

    kernel: a speed's matrix kernel (hslm/speeds.py); None is KERNEL_PANELS, and Numba
    compiles only that branch for it, or only the others for a number."""
    if kernel is None:
        c0 = part_starts(model)  # (hslm bench's profile: the product's cycles too)
        ternary_panels(model.Pf, model.pf_offs, model.alpha, t, m, n, X, Y)
        part_ends(model, CLOCK_FWD_PRODUCTS, c0)
    elif kernel == KERNEL_ROWS:
        ternary_matmul_rows(X, view2(model.Tf, model.offs, t, m, n), model.alpha[t], Y)
    else:
        T = view2(model.Tf, model.offs, t, m, n)
        for r in range(X.shape[0]):
            matvec_dot(X[r], T, model.alpha[t], Y[r])


@kernel_inner
def ternary_input_grad(model, t, m, n, DY, DX, kernel):
    """DX [rows, m] = DY [rows, n] . (alpha_t T_t)^T (kernel: as ternary_forward's)."""
    if kernel is None:
        c0 = part_starts(model)
        ternary_panels(model.Pb, model.pb_offs, model.alpha, t, n, m, DY, DX)
        part_ends(model, CLOCK_BWD_PRODUCTS, c0)
    elif kernel == KERNEL_ROWS:
        ternary_matmul_rows(DY, view2(model.Tb, model.offs, t, n, m), model.alpha[t], DX)
    else:
        T = view2(model.Tf, model.offs, t, m, n)
        for r in range(DY.shape[0]):
            matvec_t_dot(DY[r], T, model.alpha[t], DX[r])


@kernel_inner
def panels_skipping_zeros(model, clock, P, poffs, t, a, b, X, Y):
    """Speed 3's Y = X . (alpha_t T_t) from T_t's panels P for an X of the ReLU's (its
    output, or its gradient: most entries 0.0), which may skip X's zeros
    (kernels.ternary_panels_skipping_zeros, the same bits); its cycles go to
    model.clock[clock] where hslm bench's profile times the products."""
    c0 = part_starts(model)
    ternary_panels_skipping_zeros(P, poffs, model.alpha, t, a, b, X, Y)
    part_ends(model, clock, c0)


@kernel_inner
def ternary_forward_relu(model, t, m, n, X, Y, kernel):
    """ternary_forward for an X of the ReLU's (panels_skipping_zeros at speed 3)."""
    if kernel is None:
        panels_skipping_zeros(model, CLOCK_FWD_PRODUCTS, model.Pf, model.pf_offs, t, m, n, X, Y)
    else:
        ternary_forward(model, t, m, n, X, Y, kernel)


@kernel_inner
def ternary_input_grad_relu(model, t, m, n, DY, DX, kernel):
    """ternary_input_grad for a DY of the ReLU's (zero where its unit is not active)."""
    if kernel is None:
        panels_skipping_zeros(model, CLOCK_BWD_PRODUCTS, model.Pb, model.pb_offs, t, n, m, DY, DX)
    else:
        ternary_input_grad(model, t, m, n, DY, DX, kernel)


# --------------------------------------------------------------- embedding
@kernel_inner
def embed_forward(model, A, w, tokens, p0, p1):
    """x_0[p] = E[t_p] + P[p] for p in p0..p1-1.   E [V, d], P [L, d] -> x[w, 0] [L, d]."""
    D = model.dims
    E = view2(model.theta, model.offs, 0, D.vocab, D.width)
    X = A.x[w, 0]
    for p in range(p0, p1):
        t = tokens[p]
        for i in range(D.width):
            X[p, i] = E[t, i] + model.pos[p, i]
# The embedding's backward is its weight gradient: E[t_p] += dloss/dx_0[p]
# (weight_grad_operands, EMBED_ROWS).


# ----------------------------------------------------- RMSNorm and the gain
@kernel_inner
def rms_forward(x, xr, ss):
    """xr = x / sqrt(mean(x^2) + 1e-6), given ss = sum_i x_i^2 (in order from 0.0);
    returns the factor r."""
    r = 1.0 / math.sqrt(ss / x.shape[0] + RMS_EPS)
    for i in range(x.shape[0]):
        xr[i] = x[i] * r
    return r


@kernel_inner
def rms_rows(X, XR, rms):
    """rms_forward of each row of X [rows, n] into XR, its factor into rms [rows]. Each
    row's sum of squares is a chain of n dependent adds: four rows' chains run in one
    loop, side by side (one row's alone waited on the adds' latency)."""
    rows, n = X.shape
    r = 0
    while r + 4 <= rows:
        x0, x1, x2, x3 = X[r], X[r + 1], X[r + 2], X[r + 3]
        s0 = s1 = s2 = s3 = 0.0
        for i in range(n):
            s0 += x0[i] * x0[i]
            s1 += x1[i] * x1[i]
            s2 += x2[i] * x2[i]
            s3 += x3[i] * x3[i]
        rms[r] = rms_forward(x0, XR[r], s0)
        rms[r + 1] = rms_forward(x1, XR[r + 1], s1)
        rms[r + 2] = rms_forward(x2, XR[r + 2], s2)
        rms[r + 3] = rms_forward(x3, XR[r + 3], s3)
        r += 4
    for r in range(r, rows):
        ss = 0.0
        for i in range(n):
            ss += X[r, i] * X[r, i]
        rms[r] = rms_forward(X[r], XR[r], ss)


@kernel_inner
def rms_backward(x, r, dxr, dx, dot):
    """dx = dxr * r - x * (sum_i dxr_i x_i) r^3 / n, given dot = sum_i dxr_i x_i (in
    order from 0.0)."""
    n = x.shape[0]
    coef = dot * (r * r * r) / n
    for i in range(n):
        dx[i] = dxr[i] * r - x[i] * coef


@kernel_inner
def rms_backward_rows(X, rms, DXR, DX):
    """rms_backward of each row (X [rows, n], rms [rows], DXR -> DX), four rows' dot
    products side by side (as rms_rows)."""
    rows, n = X.shape
    r = 0
    while r + 4 <= rows:
        s0 = s1 = s2 = s3 = 0.0
        for i in range(n):
            s0 += DXR[r, i] * X[r, i]
            s1 += DXR[r + 1, i] * X[r + 1, i]
            s2 += DXR[r + 2, i] * X[r + 2, i]
            s3 += DXR[r + 3, i] * X[r + 3, i]
        rms_backward(X[r], rms[r], DXR[r], DX[r], s0)
        rms_backward(X[r + 1], rms[r + 1], DXR[r + 1], DX[r + 1], s1)
        rms_backward(X[r + 2], rms[r + 2], DXR[r + 2], DX[r + 2], s2)
        rms_backward(X[r + 3], rms[r + 3], DXR[r + 3], DX[r + 3], s3)
        r += 4
    for r in range(r, rows):
        dot = 0.0
        for i in range(n):
            dot += DXR[r, i] * X[r, i]
        rms_backward(X[r], rms[r], DXR[r], DX[r], dot)


@kernel_part
def norm_gain_forward(model, A, w, b, p0, p1):
    """n = rms(x_b) * gamma_b for rows p0..p1-1.   x [L, d] -> rms [L], x_normed, n [L, d]."""
    D = model.dims
    gamma = view1(model.theta, model.offs, tensor_index(D, b, GAMMA))
    c0 = part_starts(model)
    rms_rows(A.x[w, b, p0:p1], A.x_normed[w, b, p0:p1], A.rms[w, b, p0:p1])
    for p in range(p0, p1):
        xr = A.x_normed[w, b, p]
        n = A.n[w, b, p]
        for i in range(D.width):
            n[i] = xr[i] * gamma[i]
    part_ends(model, CLOCK_FWD_NORMS, c0)


@kernel_part
def norm_gain_backward(model, A, R, w, b, s, r0, r1, DQ, DK, DV, DX):
    """dn = ((dq Wq^T) + dk Wk^T) + dv Wv^T [rows, d] (given as DQ, DK, DV) -> the gain's
    rows d_gain = dn * x_normed, and DX = dloss/dx_b through the norm (rows r0..r1-1).
    DV is overwritten with dn * gamma; DX may be DK (every row is read before any is written)."""
    D = model.dims
    gamma = view1(model.theta, model.offs, tensor_index(D, b, GAMMA))
    c0 = part_starts(model)
    for r in range(r0, r1):
        xr = A.x_normed[w, b, s + r]
        dn = DV[r]  # reused: dv Wv^T becomes dn * gamma
        for i in range(D.width):
            g = (DQ[r, i] + DK[r, i]) + dn[i]
            R.d_gain[w, b, r, i] = g * xr[i]
            dn[i] = g * gamma[i]
    rms_backward_rows(A.x[w, b, s + r0:s + r1], A.rms[w, b, s + r0:s + r1], DV[r0:r1],
                      DX[r0:r1])
    part_ends(model, CLOCK_BWD_NORMS, c0)


# ------------------------------------------------------------------ rotary
@kernel_inner
def rotary_forward(v, cos, sin, p, H, dh):
    """Rotate pairs (c, c + dh//2) of each head by p * phi^(-2c/dh), in place. [d]
    (Each loop indexes slices from 0, as the two rotary loops here: an index Numba
    cannot prove non-negative, h * dh + c, is checked each time and the loop then does
    not vectorise: 0.152 against 0.069 ms for a step's 1,296 rows here, on Zen 5.)"""
    half = dh // 2
    cs, sn = cos[p, :half], sin[p, :half]
    for h in range(H):
        lo, hi = v[h * dh:h * dh + half], v[h * dh + half:h * dh + 2 * half]
        for c in range(half):
            a = lo[c]
            b = hi[c]
            lo[c] = a * cs[c] - b * sn[c]
            hi[c] = a * sn[c] + b * cs[c]


@kernel_inner
def rotary_backward(dv, cos, sin, p, H, dh):
    """Gradient through rotary_forward, in place. [d]"""
    half = dh // 2
    cs, sn = cos[p, :half], sin[p, :half]
    for h in range(H):
        lo, hi = dv[h * dh:h * dh + half], dv[h * dh + half:h * dh + 2 * half]
        for c in range(half):
            da = lo[c]
            db = hi[c]
            lo[c] = da * cs[c] + db * sn[c]
            hi[c] = db * cs[c] - da * sn[c]


# ------------------------------------------------------ causal attention
@kernel_inner
def cache_panels(A, w, b, p0, p1, H, dh):
    """Rows p0..p1-1's keys and values into the forward's panels of the cache (A.k_cols,
    A.v_rows)."""
    panels_of(A.k[w, b], A.v[w, b], p0, p1, H, dh, A.k_cols[w, b], A.v_rows[w, b])


@kernel_inner
def backward_panels(A, w, b, p0, p1, H, dh, VC, KR):
    """The backward's panels of rows p0..p1-1 of the cache, into a thread's scratch: v by
    column (VC), k by row (KR). Made from k and v where a block's backward starts, as the
    forward's from its rows (kept for every window and block, these two had been half of
    a step's panel writes and reads: 9 MB)."""
    panels_of(A.v[w, b], A.k[w, b], p0, p1, H, dh, VC, KR)


@kernel_inner
def panels_of(C, R, p0, p1, H, dh, CC, RR):
    """Rows p0..p1-1 of C and R [L, d] into panels: positions as columns of each head's
    panels of C (CC [H, q, e, c] = C[q P + c, h dh + e]), and as rows of its component
    panels of R (RR [H, q, j, c] = R[j, h dh + q P + c]). By component, then position,
    so that each panel row is written in one run (position by position, each wrote a
    column across all of a head's panel rows: 0.46 ms a step here). Slices indexed from
    0 (rotary_forward): the step's 48 calls took 0.67 ms on Zen 5, since 0.18."""
    P = ATTN_PANEL
    for h in range(H):
        c0 = h * dh
        Ch = C[:, c0:c0 + dh]
        for q in range(p0 // P, (p1 - 1) // P + 1):  # the panels rows p0..p1-1 fall in
            a, z = max(p0, q * P), min(p1, q * P + P)
            panel = CC[h, q]
            for e in range(dh):
                dst, src = panel[e, a - q * P:z - q * P], Ch[a:z, e]
                for c in range(z - a):
                    dst[c] = src[c]
        for p in range(p0, p1):
            row = R[p, c0:c0 + dh]
            for q in range((dh + P - 1) // P):
                n = min(P, dh - q * P)
                dst, src = RR[h, q, p, :n], row[q * P:q * P + n]
                for c in range(n):
                    dst[c] = src[c]


@kernel_inner(allocates=True)
def attention_rows(Q, KC, VR, p0, p1, H, dh, scale, AP, O):
    """Causal attention of positions p0..p1-1, each over rows 0..p.
    Q [L, d] (queries), the cache in panels (cache_panels) -> AP [L, H, >= p+1]
    (probabilities), O [L, d].

    Each score s_j = (sum_e q_e k_je) * scale and each o_e = sum_j a_j v_je, summed in
    order from 0.0, a panel of them at once in vector registers, ATTN_GROUP rows in one
    tile (ATTN_ROWS; fewer rows at the end, ATTN_ROW each): the scores (a panel's
    columns past p, keys not yet causal, are summed too and never read), and the
    outputs over the group's keys (group_over_keys). The forward's attention took 0.85
    ms a step here with each row's scores alone, 0.49 of them waiting on the scores'
    chains; with each row's outputs alone 17.9 us a window and block on Zen 5, 16.0
    in groups (the backward's dq likewise: 26.4 -> 19.6 us)."""
    P = ATTN_PANEL
    sums = np.empty(ATTN_GROUP * P)
    S = sums.ctypes.data
    p = p0
    while p < p1:
        g = min(ATTN_GROUP, p1 - p)  # this group's rows: p .. p + g - 1
        for h in range(H):
            c0 = h * dh
            for qq in range((p + g - 1) // P + 1):  # scores of keys qq P .. qq P + P - 1
                group_against_panel(Q, p, g, c0, KC[h, qq], dh, S)
                for i in range(g):
                    n = min(P, p + i + 1 - qq * P)
                    if n > 0:
                        dst, src = AP[p + i, h, qq * P:qq * P + n], sums[i * P:i * P + n]
                        for c in range(n):
                            dst[c] = src[c] * scale
            for i in range(g):
                attention_softmax(AP[p + i, h], p + i)
            group_over_keys(AP, p, g, h, p, VR[h], sums, O, p, c0, dh)  # o = sum_j a_j v_j
        p += g


@kernel_inner
def group_against_panel(X, r, n, c0, panel, dh, S):
    """Rows r..r+n-1 of X, from column c0 (dh of them), times a panel [dh, ATTN_PANEL]
    into sums [n, ATTN_PANEL] at address S, each sum over e in order from 0.0:
    n = ATTN_GROUP rows in one tile (ATTN_ROWS), fewer one by one (ATTN_ROW)."""
    if n == ATTN_GROUP:
        ATTN_ROWS(X[r].ctypes.data + 8 * c0, X.strides[0] // 8, panel.ctypes.data, dh, S)
    else:
        for i in range(n):
            ATTN_ROW(X[r + i].ctypes.data + 8 * c0, 0, panel.ctypes.data, dh,
                     S + 8 * ATTN_PANEL * i)


@kernel_inner
def group_over_keys(X, r, n, h, p, panels, sums, Y, y0, c0, dh):
    """Rows r..r+n-1 of head h of X [rows, H, >= p + n] (probabilities of positions
    p, p + 1, ..., or the scores' gradients with H = 1) times a head's panels [q,
    >= p + n, ATTN_PANEL] (keys as rows: its value or key panels) into Y[y0 + i, c0 ..
    c0 + dh - 1] (sums: scratch [ATTN_GROUP * ATTN_PANEL]), row i's each over the keys
    j = 0 .. p + i in order from 0.0: ATTN_GROUP rows in one tile over keys 0 .. p + n
    - 1, a row's entries of X past its own position set to 0.0 first (products +-0.0,
    which change no bit of a sum from 0.0), fewer rows one by one. One row's panel of
    sums waits on its chains' latency (3 vectors); three rows' fill the pipes."""
    P = ATTN_PANEL
    S = sums.ctypes.data
    if n == ATTN_GROUP:
        for i in range(n):
            for j in range(p + i + 1, p + n):
                X[r + i, h, j] = 0.0
    for qq in range(panels.shape[0]):  # components qq P .. qq P + P - 1
        panel = panels[qq].ctypes.data
        if n == ATTN_GROUP:
            ATTN_ROWS(X[r, h].ctypes.data, X.strides[0] // 8, panel, p + n, S)
        else:
            for i in range(n):
                ATTN_ROW(X[r + i, h].ctypes.data, 0, panel, p + i + 1, S + 8 * P * i)
        m = min(P, dh - qq * P)
        for i in range(n):
            dst, src = Y[y0 + i, c0 + qq * P:c0 + qq * P + m], sums[i * P:i * P + m]
            for c in range(m):
                dst[c] = src[c]


@kernel_inner
def attention_softmax(a, p):
    """One head of row p: its scores a[0..p] -> probabilities, in place."""
    m = -np.inf
    for j in range(p + 1):
        if a[j] > m:
            m = a[j]
    for j in range(p + 1):  # apart from the sum, so that exp vectorises
        a[j] = exp(a[j] - m)
    z = 0.0
    for j in range(p + 1):
        z += a[j]
    for j in range(p + 1):
        a[j] = a[j] / z


@kernel_inner(allocates=True)
def attention_rows_backward(Q, VC, KR, AP, s, r0, r1, H, dh, scale, DO, DQ, DK, DV):
    """Gradient of the attention of record rows r0..r1-1 (positions p = s + r) through
    each row's own q, k_p and v_p only: earlier keys and values are constants of
    position p's backward (docs/model.md, 7). Q [L, d] and AP [L, H, L] by position,
    DO (d_attn_out) -> DQ, DK, DV [k, d] by record row. The cache in panels
    (backward_panels: VC, KR): da_j = do . v_j and dq_e = sum_j g_j k_je, each summed in order from
    0.0, a panel of them at once, ATTN_GROUP rows in one tile (ATTN_ROWS), as the
    forward's scores and outputs."""
    P = ATTN_PANEL
    sums = np.empty(ATTN_GROUP * P)
    S = sums.ctypes.data
    g = np.empty((ATTN_GROUP, AP.shape[2]))  # per row: da_j, then the scores' gradients g_j
    g3 = g.reshape((ATTN_GROUP, 1, AP.shape[2]))
    r = r0
    while r < r1:
        n = min(ATTN_GROUP, r1 - r)  # this group's rows: r .. r + n - 1
        for h in range(H):
            c0 = h * dh
            for qq in range((s + r + n - 1) // P + 1):
                group_against_panel(DO, r, n, c0, VC[h, qq], dh, S)
                for i in range(n):
                    m = min(P, s + r + i + 1 - qq * P)
                    if m > 0:
                        dst, src = g[i, qq * P:qq * P + m], sums[i * P:i * P + m]
                        for c in range(m):
                            dst[c] = src[c]
            for i in range(n):
                p = s + r + i
                attention_grad_tail(AP[p, h], g[i], p, c0, dh, scale, Q[p], DO[r + i],
                                    DK[r + i], DV[r + i])
            group_over_keys(g3, 0, n, 0, s + r, KR[h], sums, DQ, r, c0, dh)  # dq = sum_j g_j k_j
        r += n


@kernel_inner
def attention_grad_tail(a, g, p, c0, dh, scale, q, do, dk, dv):
    """One head (components c0..c0+dh-1) of row p's attention gradient, given its
    probabilities a[0..p] and da in g[0..p]: the scores' gradients g (in place), dk and
    dv (dq, over the key panels, is the caller's: a group of rows at once)."""
    sum_ad = 0.0  # sum_j a_j da_j
    for j in range(p + 1):
        sum_ad += a[j] * g[j]
    for j in range(p + 1):
        g[j] = (a[j] * (g[j] - sum_ad)) * scale
    gp, ap = g[p], a[p]
    qh, doh, dkh, dvh = q[c0:c0 + dh], do[c0:c0 + dh], dk[c0:c0 + dh], dv[c0:c0 + dh]
    for e in range(dh):  # (slices from 0: rotary_forward; 0.25 -> 0.07 ms a step here)
        dkh[e] = gp * qh[e]
        dvh[e] = ap * doh[e]


# The attention forward in two parts, keys and values (they join the cache) then queries
# and attention, since a row's attention needs the cache of every row before it.
# n [L, d] -> q, k, v, attn_out [L, d], attn [L, H, L].
@kernel_part
def keys_values_forward(model, A, w, b, p0, p1, kernel):
    """k = rot(n Wk), v = n Wv for rows p0..p1-1, into the cache and its panels."""
    D = model.dims
    d, H, dh = D.width, D.heads, D.head_width
    N = A.n[w, b]
    ternary_forward(model, tensor_index(D, b, WK), d, d, N[p0:p1], A.k[w, b, p0:p1], kernel)
    ternary_forward(model, tensor_index(D, b, WV), d, d, N[p0:p1], A.v[w, b, p0:p1], kernel)
    c0 = part_starts(model)
    for p in range(p0, p1):
        rotary_forward(A.k[w, b, p], model.cos, model.sin, p, H, dh)
    cache_panels(A, w, b, p0, p1, H, dh)
    part_ends(model, CLOCK_FWD_ATTENTION, c0)


@kernel_part
def queries_attention_forward(model, A, w, b, q0, p1, kernel):
    """q = rot(n Wq) and o = attention over the cache, for rows q0..p1-1 (every row up to
    p1 - 1 has its key and value in the cache)."""
    D = model.dims
    d, H, dh = D.width, D.heads, D.head_width
    ternary_forward(model, tensor_index(D, b, WQ), d, d, A.n[w, b, q0:p1], A.q[w, b, q0:p1],
                    kernel)
    c0 = part_starts(model)
    for p in range(q0, p1):
        rotary_forward(A.q[w, b, p], model.cos, model.sin, p, H, dh)
    attention_rows(A.q[w, b], A.k_cols[w, b], A.v_rows[w, b], q0, p1, H, dh, model.attn_scale,
                   A.attn[w, b], A.attn_out[w, b])
    part_ends(model, CLOCK_FWD_ATTENTION, c0)


@kernel_inner
def to_l2(X):
    """Asks for X's cache lines (X contiguous) to come into L2 (a hint: no value changes)."""
    if X.size > 0:
        PREFETCH_TO_L2(X.ctypes.data, X.size * 8)


@kernel_part
def qkv_attention_backward(model, A, R, S, w, b, s, r0, r1, cached, kernel):
    """d_h [rows, d] -> do = d_h Wo^T -> dq, dk, dv (recorded, rotary undone) ->
    dn's three parts in S.tmp1, S.tmp2 and S.d_n (rows r0..r1-1). The cache's rows
    0..cached-1 are in S's backward panels of block b already (the per-position speeds
    go back through a window's rows in order, one a call); the rest up to the last row's
    position are added."""
    D = model.dims
    d, H, dh = D.width, D.heads, D.head_width
    dO = S.d_attn_out
    # the attention's records, on their way to L2 while W_o's product runs: 1.16-1.23 ->
    # 0.90-0.96 ms a step for the attention backward on Zen 5 (into L1 as well, they
    # slowed the product)
    to_l2(A.q[w, b, s + r0:s + r1])
    to_l2(A.attn[w, b, s + r0:s + r1])
    to_l2(A.k[w, b, cached:s + r1])  # (backward_panels' rows)
    to_l2(A.v[w, b, cached:s + r1])
    to_l2(R.d_q[w, b, r0:r1])
    to_l2(R.d_k[w, b, r0:r1])
    to_l2(R.d_v[w, b, r0:r1])
    ternary_input_grad(model, tensor_index(D, b, WO), d, d, R.d_h[w, b, r0:r1], dO[r0:r1],
                       kernel)
    c0 = part_starts(model)
    backward_panels(A, w, b, cached, s + r1, H, dh, S.v_cols[b], S.k_rows[b])
    attention_rows_backward(A.q[w, b], S.v_cols[b], S.k_rows[b], A.attn[w, b], s, r0, r1, H, dh,
                            model.attn_scale, dO, R.d_q[w, b], R.d_k[w, b], R.d_v[w, b])
    for r in range(r0, r1):
        p = s + r
        rotary_backward(R.d_q[w, b, r], model.cos, model.sin, p, H, dh)
        rotary_backward(R.d_k[w, b, r], model.cos, model.sin, p, H, dh)
    part_ends(model, CLOCK_BWD_ATTENTION, c0)
    ternary_input_grad(model, tensor_index(D, b, WQ), d, d, R.d_q[w, b, r0:r1], S.tmp1[r0:r1],
                       kernel)
    ternary_input_grad(model, tensor_index(D, b, WK), d, d, R.d_k[w, b, r0:r1], S.tmp2[r0:r1],
                       kernel)
    ternary_input_grad(model, tensor_index(D, b, WV), d, d, R.d_v[w, b, r0:r1], S.d_n[r0:r1],
                       kernel)


# ------------------------------------------ output projection and residual
@kernel_part
def attn_residual_forward(model, A, w, b, p0, p1, kernel):
    """h = x + o Wo for rows p0..p1-1.   attn_out [L, d] -> h [L, d]."""
    D = model.dims
    d = D.width
    H = A.h[w, b]
    ternary_forward(model, tensor_index(D, b, WO), d, d, A.attn_out[w, b, p0:p1], H[p0:p1],
                    kernel)
    X = A.x[w, b]
    for p in range(p0, p1):
        for i in range(d):
            H[p, i] = X[p, i] + H[p, i]
# Its backward: dh = dx' + du Wup^T (mlp_backward); do = dh Wo^T (qkv_attention_backward).


# ------------------------------------------------------------------- MLP
@kernel_part
def mlp_forward(model, A, w, b, vsa, p0, p1, kernel):
    """u = h Wup + bup, relu = max(u, 0), x' = (h + (relu Wdown + bdown)) + vsa_b
    for rows p0..p1-1.   h [L, d] -> relu [L, F] (u made in place) -> x_{b+1} (or
    x_final) [L, d]."""
    D = model.dims
    d, F = D.width, D.mlp
    U = A.relu[w, b]
    ternary_forward(model, tensor_index(D, b, WUP), d, F, A.h[w, b, p0:p1], U[p0:p1], kernel)
    bup = view1(model.theta, model.offs, tensor_index(D, b, BUP))
    for p in range(p0, p1):
        u = U[p]
        for j in range(F):
            uj = u[j] + bup[j]
            u[j] = uj if uj > 0.0 else 0.0
    XO = A.x[w, b + 1] if b + 1 < D.blocks else A.x_final[w]
    ternary_forward_relu(model, tensor_index(D, b, WDOWN), F, d, A.relu[w, b, p0:p1],
                         XO[p0:p1], kernel)
    bdown = view1(model.theta, model.offs, tensor_index(D, b, BDOWN))
    for p in range(p0, p1):
        xo = XO[p]
        h = A.h[w, b, p]
        for i in range(d):
            xo[i] = (h[i] + (xo[i] + bdown[i])) + vsa[b, p, i]


@kernel_part
def mlp_backward(model, A, R, S, w, b, s, r0, r1, kernel):
    """d_block_out [rows, d] -> d_u = (dx' Wdown^T) * (u > 0) [rows, F] ->
    d_h = dx' + d_u Wup^T [rows, d] (rows r0..r1-1)."""
    D = model.dims
    d, F = D.width, D.mlp
    dXo = R.d_block_out[w, b]
    dU = R.d_u[w, b]
    ternary_input_grad(model, tensor_index(D, b, WDOWN), F, d, dXo[r0:r1], dU[r0:r1], kernel)
    for r in range(r0, r1):
        relu = A.relu[w, b, s + r]
        for j in range(F):
            if not relu[j] > 0.0:  # u > 0 exactly where relu > 0 (a NaN u gives relu 0)
                dU[r, j] = 0.0
    T = S.tmp1
    ternary_input_grad_relu(model, tensor_index(D, b, WUP), d, F, dU[r0:r1], T[r0:r1], kernel)
    for r in range(r0, r1):
        for i in range(d):
            R.d_h[w, b, r, i] = dXo[r, i] + T[r, i]


# ------------------------------------------------------------------ blocks
@kernel_part
def block_forward(model, A, w, vsa, b, p0, p1, s, kernel):
    """Block b for rows p0..p1-1: x_b [L, d] -> x_{b+1} (or x_final) [L, d].
    Rows below s make only their keys and values (later rows attend to them)."""
    block_keys_values(model, A, w, b, p0, p1, kernel)
    block_queries(model, A, w, vsa, b, max(p0, s), p1, kernel)


@kernel_part
def block_keys_values(model, A, w, b, p0, p1, kernel):
    """Block b's first part for rows p0..p1-1: the norm, then the keys and values (into
    the cache). A team of threads waits between the two parts (windows.py)."""
    norm_gain_forward(model, A, w, b, p0, p1)
    keys_values_forward(model, A, w, b, p0, p1, kernel)


@kernel_part
def block_queries(model, A, w, vsa, b, q0, p1, kernel):
    """Block b's second part for rows q0..p1-1 (every row before p1 in the cache): the
    queries and attention, the residual and the MLP."""
    if q0 < p1:
        queries_attention_forward(model, A, w, b, q0, p1, kernel)
        attn_residual_forward(model, A, w, b, q0, p1, kernel)
        mlp_forward(model, A, w, b, vsa, q0, p1, kernel)


@kernel_part
def blocks_forward(model, A, vsa, b, first, step, B, p0, p1, s, kernel):
    """block_forward of windows first, first + step, ... < B (vsa [B, nb, L, d]), each layer
    for all of them before the next, so that a layer's matrix and code stay in cache
    (a window's block whole, then the next: the forward 1-2.5% slower here). Windows
    are independent: the same bits as block_forward window by window."""
    for w in range(first, B, step):
        block_keys_values(model, A, w, b, p0, p1, kernel)
    q0 = max(p0, s)
    if q0 < p1:
        for w in range(first, B, step):
            queries_attention_forward(model, A, w, b, q0, p1, kernel)
        for w in range(first, B, step):
            attn_residual_forward(model, A, w, b, q0, p1, kernel)
        for w in range(first, B, step):
            mlp_forward(model, A, w, b, vsa[w], q0, p1, kernel)


@kernel_part
def block_backward(model, A, R, S, w, b, s, r0, r1, cached, kernel):
    """Block b's backward for record rows r0..r1-1: d_block_out[b] -> d_block_out[b - 1]
    (or d_x0 for block 0), recording each layer's output gradient on the way (cached:
    qkv_attention_backward's)."""
    mlp_backward(model, A, R, S, w, b, s, r0, r1, kernel)
    attention_norm_backward(model, A, R, S, w, b, s, r0, r1, cached, kernel)


@kernel_part
def blocks_backward(model, A, R, S, b, first, step, B, s, r0, r1, kernel):
    """block_backward of windows first, first + step, ... < B: the MLP's for all of them,
    then the rest of the block's for each (its parts pass through the thread's scratch S,
    so they go window by window). The same bits; the backward 2.5-4% faster here."""
    for w in range(first, B, step):
        mlp_backward(model, A, R, S, w, b, s, r0, r1, kernel)
    for w in range(first, B, step):
        attention_norm_backward(model, A, R, S, w, b, s, r0, r1, 0, kernel)


@kernel_part
def attention_norm_backward(model, A, R, S, w, b, s, r0, r1, cached, kernel):
    """Block b's backward below the MLP (rows r0..r1-1): d_h -> attention, the norm and
    the residual -> d_block_out[b - 1] (or d_x0 for block 0) (cached:
    qkv_attention_backward's)."""
    qkv_attention_backward(model, A, R, S, w, b, s, r0, r1, cached, kernel)
    # through the norm into tmp2 (its dk Wk^T part is read before it is overwritten)
    norm_gain_backward(model, A, R, w, b, s, r0, r1, S.tmp1, S.tmp2, S.d_n, S.tmp2)
    # x_b feeds the block twice: the norm, and the residual h = x + o Wo
    dX = R.d_block_out[w, b - 1] if b > 0 else R.d_x0[w]
    for r in range(r0, r1):
        for i in range(model.dims.width):
            dX[r, i] = R.d_h[w, b, r, i] + S.tmp2[r, i]


# -------------------------------------------------------------------- head
@kernel_part
def head_forward(model, A, w, p0, p1, kernel):
    """z = c (rms(x_final) Wout) + bout for rows p0..p1-1.   x_final [L, d] -> logits [L, V]."""
    D = model.dims
    c0 = part_starts(model)
    rms_rows(A.x_final[w, p0:p1], A.x_final_normed[w, p0:p1], A.rms_final[w, p0:p1])
    part_ends(model, CLOCK_FWD_NORMS, c0)
    t = wout_index(D)
    Z = A.logits[w]
    ternary_forward(model, t, D.width, D.vocab, A.x_final_normed[w, p0:p1], Z[p0:p1], kernel)
    bout = view1(model.theta, model.offs, t + 1)
    c = model.head_scale
    for p in range(p0, p1):
        z = Z[p]
        for j in range(D.vocab):
            z[j] = c * z[j] + bout[j]


@kernel_part
def head_backward(model, A, R, S, w, s, r0, r1, kernel):
    """d_logits [rows, V] -> d_head = c dz -> dloss/dx_final = rms'(d_head Wout^T)
    into d_block_out[nb - 1] [rows, d] (rows r0..r1-1)."""
    D = model.dims
    c = model.head_scale
    dY = R.d_head[w]
    for r in range(r0, r1):
        for j in range(D.vocab):
            dY[r, j] = c * R.d_logits[w, r, j]
    dXR = S.d_x_final_normed
    ternary_input_grad(model, wout_index(D), D.width, D.vocab, dY[r0:r1], dXR[r0:r1], kernel)
    c0 = part_starts(model)
    rms_backward_rows(A.x_final[w, s + r0:s + r1], A.rms_final[w, s + r0:s + r1], dXR[r0:r1],
                      R.d_block_out[w, D.blocks - 1, r0:r1])
    part_ends(model, CLOCK_BWD_NORMS, c0)


# -------------------------------------------------------------------- loss
@kernel_inner(allocates=True)
def loss_rows(Z, targets, scale, DZ, losses, cross_entropies):
    """Label-smoothed cross-entropy of scored positions: Z [rows, V] (their logits) and
    targets [rows] -> losses [rows]; DZ [rows, V] = dloss/dz * scale; and, unless
    cross_entropies is None (then Numba compiles without it), the plain cross-entropy
    -log p(target) into cross_entropies [rows] (evaluation's, for its perplexity).

    A row's max, and its sums of exp(z - max) and of z, each run over j in order; each
    sum is a chain of V dependent adds, so four rows' chains run side by side in one
    loop (row by row the loss waited on the adds' latency), the rows left over alone."""
    V = Z.shape[1]
    mx, se, zs = np.empty(4), np.empty(4), np.empty(4)
    r = 0
    while r < Z.shape[0]:
        n = min(4, Z.shape[0] - r)
        if n == 4:
            z0, z1, z2, z3 = Z[r], Z[r + 1], Z[r + 2], Z[r + 3]
            m0 = m1 = m2 = m3 = -np.inf
            for j in range(V):
                if z0[j] > m0:
                    m0 = z0[j]
                if z1[j] > m1:
                    m1 = z1[j]
                if z2[j] > m2:
                    m2 = z2[j]
                if z3[j] > m3:
                    m3 = z3[j]
            mx[0], mx[1], mx[2], mx[3] = m0, m1, m2, m3
        else:
            for i in range(n):
                m = -np.inf
                for j in range(V):
                    if Z[r + i, j] > m:
                        m = Z[r + i, j]
                mx[i] = m
        for i in range(n):  # kept, so exp runs once per id; apart from the sums: it vectorises
            z, dz, m = Z[r + i], DZ[r + i], mx[i]
            for j in range(V):
                dz[j] = exp(z[j] - m)
        if n == 4:
            d0, d1, d2, d3 = DZ[r], DZ[r + 1], DZ[r + 2], DZ[r + 3]
            e0 = e1 = e2 = e3 = 0.0
            s0 = s1 = s2 = s3 = 0.0
            for j in range(V):
                e0 += d0[j]
                s0 += z0[j]
                e1 += d1[j]
                s1 += z1[j]
                e2 += d2[j]
                s2 += z2[j]
                e3 += d3[j]
                s3 += z3[j]
            se[0], se[1], se[2], se[3] = e0, e1, e2, e3
            zs[0], zs[1], zs[2], zs[3] = s0, s1, s2, s3
        else:
            for i in range(n):
                e = 0.0
                t = 0.0
                for j in range(V):
                    e += DZ[r + i, j]
                    t += Z[r + i, j]
                se[i], zs[i] = e, t
        for i in range(n):
            loss, nll = loss_finish(Z[r + i], targets[r + i], scale, DZ[r + i], mx[i], se[i],
                                    zs[i])
            losses[r + i] = loss
            if cross_entropies is not None:
                cross_entropies[r + i] = nll
        r += n


@kernel_inner
def loss_finish(z, target, scale, dz, m, se, zs):
    """One row's (loss, plain cross-entropy) from its max m, se = sum_j exp(z_j - m) (dz
    holds the exp terms) and zs = sum_j z_j; dz becomes dloss/dz * scale."""
    V = z.shape[0]
    eps = LABEL_SMOOTH
    log_se = log(se)
    lse = m + log_se
    loss = (1.0 - eps) * (lse - z[target]) + eps * (lse - zs / V)
    # -log p(target) as torch's log_softmax has it: m - z_t first, exact for nearby
    # logits, where lse - z_t loses log(se) beside an m of 1e300
    nll = (m - z[target]) + log_se
    for j in range(V):
        g = dz[j] / se - eps / V
        if j == target:
            g = g - (1.0 - eps)
        dz[j] = g * scale
    return loss, nll


@kernel_inner
def window_loss_rows(A, R, w, tokens, s, r0, r1, scale, losses):
    """Window w's scored rows r0..r1-1 (positions s + r): their losses into
    losses[r0..r1-1] and their d_logits."""
    loss_rows(A.logits[w, s + r0:s + r1], tokens[s + r0 + 1:s + r1 + 1], scale,
              R.d_logits[w, r0:r1], losses[r0:r1], None)


# -------------------------------------------------- weight-gradient operands
MATRIX = 0       # G_t += X^T . DY over the rows
COLUMN_SUM = 1   # g_t += sum of DY's rows (biases, the gain)
EMBED_ROWS = 2   # E[t_p] += DY row of position p (the embedding)
RELU_INPUT = 1   # relu_side: Wdown, whose input is the ReLU's output (G's rows are its units)
RELU_OUTPUT = 2  # Wup, whose output gradient is zero where the ReLU is (G's columns)


@kernel_entry
def relu_side(dims, t):
    """Whether tensor t's weight gradient has a factor that is 0.0 wherever the MLP's
    ReLU unit is inactive: RELU_INPUT (Wdown), RELU_OUTPUT (Wup), else 0. Those sums
    need only the active positions (windows.relu_weight_grads, whose tiles want rows of
    at least ACTIVE_LANES columns: 0 for a narrower model). The one place that decides
    it, for the gradient's units (step.gradient_units) and their sums."""
    if t == 0 or t >= wout_index(dims) or dims.width < ACTIVE_LANES:
        return 0
    which = (t - 1) % TENSORS_PER_BLOCK
    return RELU_INPUT if which == WDOWN else RELU_OUTPUT if which == WUP else 0


@kernel_inner(allocates=True)
def weight_grad_operands(model, A, R, w, t, s, k):
    """What tensor t's gradient is made of, for window w's k scored rows:
    (kind, X [k, m], DY [k, n], m, n). The one place that pairs each activation with
    its output gradient; every speed's weight gradients read it."""
    D = model.dims
    d, F, V = D.width, D.mlp, D.vocab
    t_out = wout_index(D)
    if t == 0:
        return EMBED_ROWS, R.d_x0[w, :k], R.d_x0[w, :k], V, d
    if t == t_out:
        return MATRIX, A.x_final_normed[w, s:], R.d_head[w, :k], d, V
    if t == t_out + 1:
        return COLUMN_SUM, R.d_logits[w, :k], R.d_logits[w, :k], 1, V
    b = (t - 1) // TENSORS_PER_BLOCK
    which = (t - 1) % TENSORS_PER_BLOCK
    if which == GAMMA:
        return COLUMN_SUM, R.d_gain[w, b, :k], R.d_gain[w, b, :k], 1, d
    if which == WQ:
        return MATRIX, A.n[w, b, s:], R.d_q[w, b, :k], d, d
    if which == WK:
        return MATRIX, A.n[w, b, s:], R.d_k[w, b, :k], d, d
    if which == WV:
        return MATRIX, A.n[w, b, s:], R.d_v[w, b, :k], d, d
    if which == WO:
        return MATRIX, A.attn_out[w, b, s:], R.d_h[w, b, :k], d, d
    if which == WUP:
        return MATRIX, A.h[w, b, s:], R.d_u[w, b, :k], d, F
    if which == BUP:
        return COLUMN_SUM, R.d_u[w, b, :k], R.d_u[w, b, :k], 1, F
    if which == WDOWN:
        return MATRIX, A.relu[w, b, s:], R.d_block_out[w, b, :k], F, d
    return COLUMN_SUM, R.d_block_out[w, b, :k], R.d_block_out[w, b, :k], 1, d  # BDOWN
