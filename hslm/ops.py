"""The model's math, one position at a time (spec sections 3, 5 and 7).

Every layer is a forward/backward pair on one row. Every sum here has one
order, and every speed reproduces it exactly:

* a dot product or matrix-vector product sums over the input index in
  increasing order, starting from 0.0, and the ternary scale multiplies the
  finished sum: y_j = alpha * sum_i x_i T[i, j];
* the input gradient of a ternary matrix sums over the output index in
  increasing order: dx_i = alpha * sum_j T[i, j] dy_j;
* softmax, attention and the loss sum over positions / ids in increasing order;
* a window's gradient element is the sum of its scored positions'
  contributions in increasing position order, starting from 0.0
  (each position contributes exactly one product per element).

The plain matrix loops (matvec_ref, matvec_t_ref) are the readable definition;
hslm.kernels has fast loops with the same order. Speeds 0 and 1 use the plain
ones, speeds 2 and 3 the fast ones (the `fast` flag).
"""
from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import njit

from .config import (BDOWN, BUP, GAMMA, TENSORS_PER_BLOCK, WDOWN, WK, WO, WQ, WUP, WV)
from .kernels import ternary_matmul_rows
from .mathfn import exp, log
from .panel_kernels import PANEL

RMS_EPS = 1e-6
LABEL_SMOOTH = 0.1  # epsilon of the K-position objective

# The model as the kernels see it: flat parameters, their offsets, the ternary
# matrices in both layouts (input-major Tf, output-major Tb) with one scale per
# tensor, the fixed tables, and Tf and Tb again in column panels (Pf, Pb, at
# their own offsets) for the register-tiled kernels of speed 3.
Model = namedtuple("Model", "theta offs Tf Tb alpha pos cos sin attn_scale head_scale dims "
                             "Pf pf_offs Pb pb_offs")

# Activations of one window, [block, position, ...]. The K and V rows are the KV cache.
Acts = namedtuple("Acts", "XIN R1 XR1 NN Q K VV A O HH U RR XF RF XRF Z")

# Gradient-side rows of one window (row r = r-th scored position at speed 3,
# row p = position p at the per-position speeds), the weight-gradient scratch
# (XT: a layer input transposed, WG: an output gradient in column panels) and the
# window accumulator S of the per-position speeds.
Scratch = namedtuple("Scratch", "dX dH dR dO dQ dK dV dN dXR dZ dY t1 t2 t3 XT WG S")


# Speed 3's record of one window's backward: each layer's output gradient for
# the r-th scored position (the DY of its weight gradient; the X are in Acts).
Record = namedtuple("Record", "dZ dY dXo dR dH dQ dK dV dG dX0")


def alloc_acts(dims, batch=None):
    """Activations of one window, or with batch=B of B windows ([B, ...] each)."""
    V, d, H, dh, F, nb, L = dims
    pre = () if batch is None else (batch,)
    f = lambda *s: np.zeros(pre + s)
    return Acts(f(nb, L, d), f(nb, L), f(nb, L, d), f(nb, L, d), f(nb, L, d),
                f(nb, L, d), f(nb, L, d), f(nb, L, H, L), f(nb, L, d),
                f(nb, L, d), f(nb, L, F), f(nb, L, F), f(L, d), f(L), f(L, d),
                f(L, V))


def alloc_record(dims, batch=None):
    V, d, H, dh, F, nb, L = dims
    pre = () if batch is None else (batch,)
    f = lambda *s: np.zeros(pre + s)
    return Record(f(L, V), f(L, V), f(nb, L, d), f(nb, L, F), f(nb, L, d), f(nb, L, d),
                  f(nb, L, d), f(nb, L, d), f(nb, L, d), f(L, d))


def window_view(batched, w):
    """The namedtuple of window w's slices of a batched Acts or Record."""
    return type(batched)(*[a[w] for a in batched])


def alloc_scratch(dims, n_params, with_accumulator=True):
    V, d, H, dh, F, nb, L = dims
    f = np.zeros
    S = f(n_params if with_accumulator else 0)
    return Scratch(f((L, d)), f((L, d)), f((L, F)), f((L, d)), f((L, d)), f((L, d)),
                   f((L, d)), f((L, d)), f((L, d)), f((L, V)), f((L, V)), f((L, F)),
                   f((L, d)), f((L, d)), f(max(V, F, d) * L),
                   f((max(V, F, d) + PANEL) * L), S)


# ----------------------------------------------------------------- views
@njit(cache=True)
def tidx(b, which):
    """Index of tensor `which` of block b in the flat layout."""
    return 1 + b * TENSORS_PER_BLOCK + which


@njit(cache=True)
def view1(a, offs, t):
    return a[offs[t]:offs[t + 1]]


@njit(cache=True)
def view2(a, offs, t, rows, cols):
    return a[offs[t]:offs[t] + rows * cols].reshape((rows, cols))



# ----------------------------------------------------------- ternary matvec
@njit(cache=True)
def matvec_ref(x, T, alpha, y):
    """y [n] = alpha * (x [m] . T [m, n]): dot-product form, the definition."""
    m, n = T.shape
    for j in range(n):
        acc = 0.0
        for i in range(m):
            acc += x[i] * T[i, j]
        y[j] = alpha * acc


@njit(cache=True)
def matvec_t_ref(dy, T, alpha, dx):
    """dx [m] = alpha * (T [m, n] . dy [n]): the input gradient, the definition."""
    m, n = T.shape
    for i in range(m):
        acc = 0.0
        for j in range(n):
            acc += T[i, j] * dy[j]
        dx[i] = alpha * acc


@njit(cache=True)
def ternary_forward(model, t, rows, cols, x, y, fast):
    """y = x . (alpha T) for tensor t ([rows, cols] input-major)."""
    a = model.alpha[t]
    if fast:
        ternary_matmul_rows(x.reshape((1, rows)), view2(model.Tf, model.offs, t, rows, cols), a,
                    y.reshape((1, cols)))
    else:
        matvec_ref(x, view2(model.Tf, model.offs, t, rows, cols), a, y)


@njit(cache=True)
def ternary_input_grad(model, t, rows, cols, dy, dx, fast):
    """dx = alpha T . dy for tensor t; fast reads the output-major copy Tb."""
    a = model.alpha[t]
    if fast:
        ternary_matmul_rows(dy.reshape((1, cols)), view2(model.Tb, model.offs, t, cols, rows), a,
                    dx.reshape((1, rows)))
    else:
        matvec_t_ref(dy, view2(model.Tf, model.offs, t, rows, cols), a, dx)


@njit(cache=True)
def outer_add(x, dy, G):
    """G [m, n] += x [m] (x) dy [n]: one position's weight-gradient contribution."""
    m, n = G.shape
    for i in range(m):
        xi = x[i]
        g = G[i]
        for j in range(n):
            g[j] += xi * dy[j]


# ------------------------------------------------------------------ norms
@njit(cache=True)
def rms_forward(x, xr):
    """xr = x / sqrt(mean(x^2) + 1e-6); returns the factor r."""
    n = x.shape[0]
    ss = 0.0
    for i in range(n):
        ss += x[i] * x[i]
    r = 1.0 / math.sqrt(ss / n + RMS_EPS)
    for i in range(n):
        xr[i] = x[i] * r
    return r


@njit(cache=True)
def rms_backward(x, r, dxr, dx):
    """dx = dxr * r - x * (sum_i dxr_i x_i) r^3 / n."""
    n = x.shape[0]
    dot = 0.0
    for i in range(n):
        dot += dxr[i] * x[i]
    coef = dot * (r * r * r) / n
    for i in range(n):
        dx[i] = dxr[i] * r - x[i] * coef


# ----------------------------------------------------------------- rotary
@njit(cache=True)
def rotary_forward(v, cos, sin, p, H, dh):
    """Rotate pairs (c, c + dh//2) of each head by p * phi^(-2c/dh), in place."""
    half = dh // 2
    for h in range(H):
        for c in range(half):
            i0 = h * dh + c
            i1 = i0 + half
            a = v[i0]
            b = v[i1]
            cs = cos[p, c]
            sn = sin[p, c]
            v[i0] = a * cs - b * sn
            v[i1] = a * sn + b * cs


@njit(cache=True)
def rotary_backward(dv, cos, sin, p, H, dh):
    """Gradient through rotary_forward, in place."""
    half = dh // 2
    for h in range(H):
        for c in range(half):
            i0 = h * dh + c
            i1 = i0 + half
            da = dv[i0]
            db = dv[i1]
            cs = cos[p, c]
            sn = sin[p, c]
            dv[i0] = da * cs + db * sn
            dv[i1] = db * cs - da * sn


# -------------------------------------------------------------- attention
@njit(cache=True)
def attention_forward(q, K, Vc, p, H, dh, scale, A, o):
    """Causal attention of position p over cache rows 0..p.

    q [d], K/Vc [>= p+1, d] -> A [H, >= p+1] (probabilities), o [d]."""
    for h in range(H):
        c0 = h * dh
        m = -np.inf
        for j in range(p + 1):
            s = 0.0
            for e in range(dh):
                s += q[c0 + e] * K[j, c0 + e]
            s = s * scale
            A[h, j] = s
            if s > m:
                m = s
        z = 0.0
        for j in range(p + 1):
            ex = exp(A[h, j] - m)
            A[h, j] = ex
            z += ex
        for j in range(p + 1):
            A[h, j] = A[h, j] / z
        for e in range(dh):
            acc = 0.0
            for j in range(p + 1):
                acc += A[h, j] * Vc[j, c0 + e]
            o[c0 + e] = acc


@njit(cache=True)
def attention_backward(q, K, Vc, A, p, H, dh, scale, do, dq, dk, dv):
    """Gradient of position p's attention through its own q, k_p and v_p only.

    Earlier keys and values are constants of position p's backward (spec 7)."""
    for h in range(H):
        c0 = h * dh
        # da_j = do . v_j ; sum_ad = sum_j a_j da_j
        sum_ad = 0.0
        for j in range(p + 1):
            da = 0.0
            for e in range(dh):
                da += do[c0 + e] * Vc[j, c0 + e]
            sum_ad += A[h, j] * da
        for e in range(dh):
            dq[c0 + e] = 0.0
        gp = 0.0
        for j in range(p + 1):
            da = 0.0
            for e in range(dh):
                da += do[c0 + e] * Vc[j, c0 + e]
            g = (A[h, j] * (da - sum_ad)) * scale
            for e in range(dh):
                dq[c0 + e] += g * K[j, c0 + e]
            gp = g
        for e in range(dh):
            dk[c0 + e] = gp * q[c0 + e]
            dv[c0 + e] = A[h, p] * do[c0 + e]


# ------------------------------------------------------------------ loss
@njit(cache=True)
def loss_forward_backward(z, target, scale, dz):
    """Label-smoothed cross-entropy of one scored position; dz = dloss/dz * scale."""
    V = z.shape[0]
    eps = LABEL_SMOOTH
    m = -np.inf
    for j in range(V):
        if z[j] > m:
            m = z[j]
    se = 0.0
    zs = 0.0
    for j in range(V):
        ex = exp(z[j] - m)
        dz[j] = ex  # kept, so exp runs once per id
        se += ex
        zs += z[j]
    lse = m + log(se)
    loss = (1.0 - eps) * (lse - z[target]) + eps * (lse - zs / V)
    for j in range(V):
        g = dz[j] / se - eps / V
        if j == target:
            g = g - (1.0 - eps)
        dz[j] = g * scale
    return loss


# -------------------------------------------------------- one position
@njit(cache=True)
def embed(model, tokens, p, x):
    """x = E[t_p] + P[p]."""
    d = x.shape[0]
    E = view2(model.theta, model.offs, 0, model.dims[0], d)
    t = tokens[p]
    for i in range(d):
        x[i] = E[t, i] + model.pos[p, i]


@njit(cache=True)
def block_forward_position(model, acts, vsa, b, p, kv_only, fast):
    """Block b at position p: x -> n -> q,k,v -> attention -> h -> MLP -> x'.

    Reads XIN[b, p] and the cache rows K[b, :p], VV[b, :p]; writes K[b, p],
    VV[b, p] and (unless kv_only) everything else, and the next block's input."""
    V, d, H, dh, F, nb, L = model.dims
    th, offs = model.theta, model.offs
    x = acts.XIN[b, p]
    xr = acts.XR1[b, p]
    n = acts.NN[b, p]
    acts.R1[b, p] = rms_forward(x, xr)
    gamma = view1(th, offs, tidx(b, GAMMA))
    for i in range(d):
        n[i] = xr[i] * gamma[i]
    k = acts.K[b, p]
    v = acts.VV[b, p]
    ternary_forward(model, tidx(b, WK), d, d, n, k, fast)
    ternary_forward(model, tidx(b, WV), d, d, n, v, fast)
    rotary_forward(k, model.cos, model.sin, p, H, dh)
    if kv_only:
        return
    q = acts.Q[b, p]
    ternary_forward(model, tidx(b, WQ), d, d, n, q, fast)
    rotary_forward(q, model.cos, model.sin, p, H, dh)
    o = acts.O[b, p]
    attention_forward(q, acts.K[b], acts.VV[b], p, H, dh, model.attn_scale, acts.A[b, p], o)
    h = acts.HH[b, p]
    ternary_forward(model, tidx(b, WO), d, d, o, h, fast)
    for i in range(d):
        h[i] = x[i] + h[i]
    u = acts.U[b, p]
    r = acts.RR[b, p]
    ternary_forward(model, tidx(b, WUP), d, F, h, u, fast)
    bup = view1(th, offs, tidx(b, BUP))
    for j in range(F):
        u[j] = u[j] + bup[j]
        r[j] = u[j] if u[j] > 0.0 else 0.0
    xo = acts.XIN[b + 1, p] if b + 1 < nb else acts.XF[p]
    ternary_forward(model, tidx(b, WDOWN), F, d, r, xo, fast)
    bdown = view1(th, offs, tidx(b, BDOWN))
    for i in range(d):
        xo[i] = (h[i] + (xo[i] + bdown[i])) + vsa[b, p, i]


@njit(cache=True)
def head_forward_position(model, acts, p, fast):
    """z_p = c * (rms(x_p) . Wout) + bout."""
    V, d, H, dh, F, nb, L = model.dims
    acts.RF[p] = rms_forward(acts.XF[p], acts.XRF[p])
    t = 2 + nb * TENSORS_PER_BLOCK - 1  # Wout
    z = acts.Z[p]
    ternary_forward(model, t, d, V, acts.XRF[p], z, fast)
    bout = view1(model.theta, model.offs, t + 1)
    c = model.head_scale
    for j in range(V):
        z[j] = c * z[j] + bout[j]


@njit(cache=True)
def position_forward(model, acts, tokens, vsa, p, kv_only_last, head, fast):
    """The whole column of position p (its keys and values join the cache)."""
    nb = model.dims[5]
    embed(model, tokens, p, acts.XIN[0, p])
    for b in range(nb):
        block_forward_position(model, acts, vsa, b, p, kv_only_last and b == nb - 1, fast)
    if head:
        head_forward_position(model, acts, p, fast)


@njit(cache=True)
def position_backward(model, acts, scr, tokens, p, scale, fast):
    """Backward of loss_p through position p's column; adds into scr.S.

    Returns loss_p. Leaves dloss/dx_0 (the input embedding's gradient) in scr.dX[p]."""
    V, d, H, hw, F, nb, L = model.dims
    th, offs, S = model.theta, model.offs, scr.S
    dz = scr.dZ[p]
    loss = loss_forward_backward(acts.Z[p], tokens[p + 1], scale, dz)
    t_out = 1 + nb * TENSORS_PER_BLOCK
    view1(S, offs, t_out + 1)[:] += dz  # bout
    dy = scr.dY[p]
    c = model.head_scale
    for j in range(V):
        dy[j] = c * dz[j]
    outer_add(acts.XRF[p], dy, view2(S, offs, t_out, d, V))
    dxr = scr.dXR[p]
    ternary_input_grad(model, t_out, d, V, dy, dxr, fast)
    dx = scr.dX[p]
    rms_backward(acts.XF[p], acts.RF[p], dxr, dx)
    dhid, dr, do = scr.dH[p], scr.dR[p], scr.dO[p]
    dq, dk, dv, dn = scr.dQ[p], scr.dK[p], scr.dV[p], scr.dN[p]
    t1, t2, t3 = scr.t1[p], scr.t2[p], scr.t3[p]
    for b in range(nb - 1, -1, -1):
        # x' = h + (r . Wdown + bdown) + vsa
        view1(S, offs, tidx(b, BDOWN))[:] += dx
        outer_add(acts.RR[b, p], dx, view2(S, offs, tidx(b, WDOWN), F, d))
        ternary_input_grad(model, tidx(b, WDOWN), F, d, dx, dr, fast)
        u = acts.U[b, p]
        for j in range(F):
            if not u[j] > 0.0:
                dr[j] = 0.0
        view1(S, offs, tidx(b, BUP))[:] += dr
        outer_add(acts.HH[b, p], dr, view2(S, offs, tidx(b, WUP), d, F))
        ternary_input_grad(model, tidx(b, WUP), d, F, dr, t1[:d], fast)
        for i in range(d):
            dhid[i] = dx[i] + t1[i]
        # h = x + o . Wo
        outer_add(acts.O[b, p], dhid, view2(S, offs, tidx(b, WO), d, d))
        ternary_input_grad(model, tidx(b, WO), d, d, dhid, do, fast)
        attention_backward(acts.Q[b, p], acts.K[b], acts.VV[b], acts.A[b, p], p, H, hw,
                           model.attn_scale, do, dq, dk, dv)
        rotary_backward(dq, model.cos, model.sin, p, H, hw)
        rotary_backward(dk, model.cos, model.sin, p, H, hw)
        n = acts.NN[b, p]
        outer_add(n, dq, view2(S, offs, tidx(b, WQ), d, d))
        outer_add(n, dk, view2(S, offs, tidx(b, WK), d, d))
        outer_add(n, dv, view2(S, offs, tidx(b, WV), d, d))
        ternary_input_grad(model, tidx(b, WQ), d, d, dq, t1[:d], fast)
        ternary_input_grad(model, tidx(b, WK), d, d, dk, t2, fast)
        ternary_input_grad(model, tidx(b, WV), d, d, dv, t3, fast)
        # n = rms(x) * gamma
        gamma = view1(th, offs, tidx(b, GAMMA))
        sg = view1(S, offs, tidx(b, GAMMA))
        xr = acts.XR1[b, p]
        for i in range(d):
            dn[i] = (t1[i] + t2[i]) + t3[i]
            sg[i] += dn[i] * xr[i]
            dn[i] = dn[i] * gamma[i]
        rms_backward(acts.XIN[b, p], acts.R1[b, p], dn, t2)
        for i in range(d):
            dx[i] = dhid[i] + t2[i]
    E = view2(S, offs, 0, V, d)
    E[tokens[p]] += dx
    return loss

