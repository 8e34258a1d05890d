"""One training window at each speed: the loop orders, and nothing else.

Every function here computes, for one window of L+1 tokens with its last k
positions scored, the same bits (spec section 9): the window's loss, the logits
of the scored positions, dloss/dx_0 at the scored positions, and the window's
gradient S_w, which it adds into `out` (out += S_w). The math lives in
hslm.ops (one position) and hslm.kernels (the fast matrix loops).

    speed 0  window_grad_reference  for each scored p: the forward of the whole
                                    prefix 0..p from the embeddings, then p's backward
    speed 1  window_grad_cached     each position's forward once (KV cache), then
                                    its backward; plain loops
    speed 2  window_grad_fast       speed 1 with the fast kernels, k/v only in the
                                    last block at unscored positions
    speed 3  window_grad_layerwise  layer by layer over all positions: each ternary
                                    matrix and each gradient row read once per window

Speeds 0-2 build S_w in scratch.S (per position, streaming the whole gradient)
and add it to `out` at the end; speed 3 holds one gradient row while every
scored position adds to it, then adds the row to `out`. Both give
out + ((0.0 + c_0) + c_1 + ...) per element, c_p being position p's product.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .config import BDOWN, BUP, GAMMA, TENSORS_PER_BLOCK, WDOWN, WK, WO, WQ, WUP, WV
from .kernels import column_sum_rows, ternary_matmul_rows, weight_grad_rows
from .ops import (attention_backward, attention_forward, embed, loss_forward_backward,
                  position_backward, position_forward, rms_backward, rms_forward,
                  rotary_backward, rotary_forward, tidx, view1, view2)


@njit(cache=True, nogil=True)
def _finish_per_position(model, acts, scr, k, out, logits, dx0, loss_sum):
    V, d, H, hw, F, nb, L = model.dims
    for p in range(L - k, L):
        logits[p] = acts.Z[p]
        dx0[p] = scr.dX[p]
    S = scr.S
    for i in range(S.shape[0]):
        out[i] += S[i]
    return loss_sum / k


# ----------------------------------------------------------------- speed 0
@njit(cache=True, nogil=True)
def window_grad_reference(model, tokens, vsa, k, scale, acts, scr, out, logits, dx0):
    """Speed 0, the oracle: recompute the prefix for every scored position."""
    L = model.dims[6]
    scr.S[:] = 0.0
    loss_sum = 0.0
    for p in range(L - k, L):
        for j in range(p + 1):
            position_forward(model, acts, tokens, vsa, j, False, j == p, False)
        loss_sum += position_backward(model, acts, scr, tokens, p, scale, False)
    return _finish_per_position(model, acts, scr, k, out, logits, dx0, loss_sum)


# ----------------------------------------------------------------- speed 1
@njit(cache=True, nogil=True)
def window_grad_cached(model, tokens, vsa, k, scale, acts, scr, out, logits, dx0):
    """Speed 1: each position's forward once against the KV cache, then its backward."""
    L = model.dims[6]
    scr.S[:] = 0.0
    loss_sum = 0.0
    for p in range(L):
        scored = p >= L - k
        position_forward(model, acts, tokens, vsa, p, False, scored, False)
        if scored:
            loss_sum += position_backward(model, acts, scr, tokens, p, scale, False)
    return _finish_per_position(model, acts, scr, k, out, logits, dx0, loss_sum)


# ----------------------------------------------------------------- speed 2
@njit(cache=True, nogil=True)
def window_grad_fast(model, tokens, vsa, k, scale, acts, scr, out, logits, dx0):
    """Speed 2: speed 1 with the fast kernels; unscored positions make only k, v
    in the last block and skip the head."""
    L = model.dims[6]
    scr.S[:] = 0.0
    loss_sum = 0.0
    for p in range(L):
        scored = p >= L - k
        position_forward(model, acts, tokens, vsa, p, not scored, scored, True)
        if scored:
            loss_sum += position_backward(model, acts, scr, tokens, p, scale, True)
    return _finish_per_position(model, acts, scr, k, out, logits, dx0, loss_sum)


# ----------------------------------------------------------------- speed 3
@njit(cache=True, nogil=True)
def window_forward_layerwise(model, tokens, vsa, k, acts, scr):
    """Forward of a whole window, one layer at a time over all positions.

    In the last block only the scored rows L-k..L-1 go past their keys and
    values, and only they reach the head (their logits land in acts.Z)."""
    V, d, H, hw, F, nb, L = model.dims
    th, offs = model.theta, model.offs
    for p in range(L):
        embed(model, tokens, p, acts.XIN[0, p])
    for b in range(nb):
        s = L - k if b == nb - 1 else 0  # first row that needs more than k, v
        X = acts.XIN[b]
        gamma = view1(th, offs, tidx(b, GAMMA))
        for p in range(L):
            xr = acts.XR1[b, p]
            n = acts.NN[b, p]
            acts.R1[b, p] = rms_forward(X[p], xr)
            for i in range(d):
                n[i] = xr[i] * gamma[i]
        # x [L, d] . Wk, Wv [d, d] -> K, V [L, d]; x[s:] . Wq -> Q[s:]
        t = tidx(b, WK)
        ternary_matmul_rows(acts.NN[b], view2(model.Tf, offs, t, d, d), model.alpha[t], acts.K[b])
        t = tidx(b, WV)
        ternary_matmul_rows(acts.NN[b], view2(model.Tf, offs, t, d, d), model.alpha[t], acts.VV[b])
        t = tidx(b, WQ)
        ternary_matmul_rows(acts.NN[b, s:], view2(model.Tf, offs, t, d, d), model.alpha[t], acts.Q[b, s:])
        for p in range(L):
            rotary_forward(acts.K[b, p], model.cos, model.sin, p, H, hw)
        for p in range(s, L):
            rotary_forward(acts.Q[b, p], model.cos, model.sin, p, H, hw)
            attention_forward(acts.Q[b, p], acts.K[b], acts.VV[b], p, H, hw, model.attn_scale,
                              acts.A[b, p], acts.O[b, p])
        # o [n, d] . Wo [d, d] -> h = x + o Wo
        t = tidx(b, WO)
        ternary_matmul_rows(acts.O[b, s:], view2(model.Tf, offs, t, d, d), model.alpha[t], acts.HH[b, s:])
        for p in range(s, L):
            h = acts.HH[b, p]
            for i in range(d):
                h[i] = X[p, i] + h[i]
        # h [n, d] . Wup [d, F] + bup -> u, r = relu(u)
        t = tidx(b, WUP)
        ternary_matmul_rows(acts.HH[b, s:], view2(model.Tf, offs, t, d, F), model.alpha[t], acts.U[b, s:])
        bup = view1(th, offs, tidx(b, BUP))
        for p in range(s, L):
            u = acts.U[b, p]
            r = acts.RR[b, p]
            for j in range(F):
                u[j] = u[j] + bup[j]
                r[j] = u[j] if u[j] > 0.0 else 0.0
        # r [n, F] . Wdown [F, d] + bdown -> x' = h + mlp + vsa
        XO = acts.XIN[b + 1] if b + 1 < nb else acts.XF
        t = tidx(b, WDOWN)
        ternary_matmul_rows(acts.RR[b, s:], view2(model.Tf, offs, t, F, d), model.alpha[t], XO[s:])
        bdown = view1(th, offs, tidx(b, BDOWN))
        for p in range(s, L):
            xo = XO[p]
            h = acts.HH[b, p]
            for i in range(d):
                xo[i] = (h[i] + (xo[i] + bdown[i])) + vsa[b, p, i]
    # head on the scored rows: z = c * (rms(x) . Wout) + bout
    s = L - k
    for p in range(s, L):
        acts.RF[p] = rms_forward(acts.XF[p], acts.XRF[p])
    t = 1 + nb * TENSORS_PER_BLOCK
    ternary_matmul_rows(acts.XRF[s:], view2(model.Tf, offs, t, d, V), model.alpha[t], acts.Z[s:])
    bout = view1(th, offs, t + 1)
    c = model.head_scale
    for p in range(s, L):
        z = acts.Z[p]
        for j in range(V):
            z[j] = c * z[j] + bout[j]


@njit(cache=True, nogil=True)
def window_grad_layerwise(model, tokens, vsa, k, scale, acts, scr, out, logits, dx0):
    """Speed 3: forward layer by layer, then the backward of all scored rows at once."""
    V, d, H, hw, F, nb, L = model.dims
    th, offs = model.theta, model.offs
    window_forward_layerwise(model, tokens, vsa, k, acts, scr)
    s = L - k
    tmp = scr.t1  # [L, F] >= [4, max(d, F)]: the held gradient rows
    loss_sum = 0.0
    for r in range(k):
        p = s + r
        loss_sum += loss_forward_backward(acts.Z[p], tokens[p + 1], scale, scr.dZ[r])
        logits[p] = acts.Z[p]
    dZ = scr.dZ[:k]
    dY = scr.dY[:k]
    c = model.head_scale
    for r in range(k):
        for j in range(V):
            dY[r, j] = c * dZ[r, j]
    t = 1 + nb * TENSORS_PER_BLOCK
    column_sum_rows(dZ, view1(out, offs, t + 1))
    weight_grad_rows(acts.XRF[s:], dY, view2(out, offs, t, d, V), scr.XT, scr.WG)
    dXR = scr.dXR[:k]
    ternary_matmul_rows(dY, view2(model.Tb, offs, t, V, d), model.alpha[t], dXR)
    dX = scr.dX[:k]
    for r in range(k):
        rms_backward(acts.XF[s + r], acts.RF[s + r], dXR[r], dX[r])
    dH, dR, dO = scr.dH[:k], scr.dR[:k], scr.dO[:k]
    dQ, dK, dV, dN = scr.dQ[:k], scr.dK[:k], scr.dV[:k], scr.dN[:k]
    T1, T2, T3 = scr.t1[:k, :d], scr.t2[:k], scr.t3[:k]
    for b in range(nb - 1, -1, -1):
        # x' = h + (r . Wdown + bdown) + vsa
        column_sum_rows(dX, view1(out, offs, tidx(b, BDOWN)))
        t = tidx(b, WDOWN)
        weight_grad_rows(acts.RR[b, s:], dX, view2(out, offs, t, F, d), scr.XT, scr.WG)
        ternary_matmul_rows(dX, view2(model.Tb, offs, t, d, F), model.alpha[t], dR)
        for r in range(k):
            u = acts.U[b, s + r]
            for j in range(F):
                if not u[j] > 0.0:
                    dR[r, j] = 0.0
        # u = h . Wup + bup
        column_sum_rows(dR, view1(out, offs, tidx(b, BUP)))
        t = tidx(b, WUP)
        weight_grad_rows(acts.HH[b, s:], dR, view2(out, offs, t, d, F), scr.XT, scr.WG)
        ternary_matmul_rows(dR, view2(model.Tb, offs, t, F, d), model.alpha[t], T1)
        for r in range(k):
            for i in range(d):
                dH[r, i] = dX[r, i] + T1[r, i]
        # h = x + o . Wo
        t = tidx(b, WO)
        weight_grad_rows(acts.O[b, s:], dH, view2(out, offs, t, d, d), scr.XT, scr.WG)
        ternary_matmul_rows(dH, view2(model.Tb, offs, t, d, d), model.alpha[t], dO)
        for r in range(k):
            p = s + r
            attention_backward(acts.Q[b, p], acts.K[b], acts.VV[b], acts.A[b, p], p, H, hw,
                               model.attn_scale, dO[r], dQ[r], dK[r], dV[r])
            rotary_backward(dQ[r], model.cos, model.sin, p, H, hw)
            rotary_backward(dK[r], model.cos, model.sin, p, H, hw)
        NN = acts.NN[b, s:]
        t = tidx(b, WQ)
        weight_grad_rows(NN, dQ, view2(out, offs, t, d, d), scr.XT, scr.WG)
        ternary_matmul_rows(dQ, view2(model.Tb, offs, t, d, d), model.alpha[t], T1)
        t = tidx(b, WK)
        weight_grad_rows(NN, dK, view2(out, offs, t, d, d), scr.XT, scr.WG)
        ternary_matmul_rows(dK, view2(model.Tb, offs, t, d, d), model.alpha[t], T2)
        t = tidx(b, WV)
        weight_grad_rows(NN, dV, view2(out, offs, t, d, d), scr.XT, scr.WG)
        ternary_matmul_rows(dV, view2(model.Tb, offs, t, d, d), model.alpha[t], T3)
        # n = rms(x) * gamma
        gamma = view1(th, offs, tidx(b, GAMMA))
        for r in range(k):
            xr = acts.XR1[b, s + r]
            for i in range(d):
                dN[r, i] = (T1[r, i] + T2[r, i]) + T3[r, i]
                T3[r, i] = dN[r, i] * xr[i]  # the gain's contribution
                dN[r, i] = dN[r, i] * gamma[i]
        column_sum_rows(T3, view1(out, offs, tidx(b, GAMMA)))
        for r in range(k):
            rms_backward(acts.XIN[b, s + r], acts.R1[b, s + r], dN[r], T2[r])
            for i in range(d):
                dX[r, i] = dH[r, i] + T2[r, i]
    # E[t_p] gets the scored positions' dx_0 in position order, one token row at a time
    E = view2(out, offs, 0, V, d)
    row = scr.WG[:d]
    for r in range(k):
        dx0[s + r] = dX[r]
        tok = tokens[s + r]
        seen = False
        for r2 in range(r):
            if tokens[s + r2] == tok:
                seen = True
        if seen:
            continue
        for i in range(d):
            row[i] = 0.0
        for r2 in range(r, k):
            if tokens[s + r2] == tok:
                for i in range(d):
                    row[i] += dX[r2, i]
        for i in range(d):
            E[tok, i] += row[i]
    return loss_sum / k


@njit(cache=True, nogil=True)
def window_loss_layerwise(model, tokens, vsa, k, acts, scr):
    """Forward only (evaluation): the window's mean loss over its last k positions."""
    L = model.dims[6]
    window_forward_layerwise(model, tokens, vsa, k, acts, scr)
    loss_sum = 0.0
    for p in range(L - k, L):
        loss_sum += loss_forward_backward(acts.Z[p], tokens[p + 1], 1.0, scr.dZ[p - L + k])
    return loss_sum / k
