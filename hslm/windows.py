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
    speed 3  window_backward_layerwise + gradients_from_records
                                    layer by layer over all positions: each ternary
                                    matrix read once per window, and each gradient
                                    row once per step

Speeds 0-2 build S_w in scratch.S (per position, streaming the whole gradient)
and add it to `out` at the end. Speed 3 records each layer's output gradients
for the window; after all windows of a step, it holds one block of gradient
rows while every scored position of window 0 adds to it, adds the block to
`out`, then does the same for window 1, and so on. Both give
out + ((0.0 + c_0) + c_1 + ...) per element and window, c_p being position
p's product.
"""
from __future__ import annotations

from numba import njit

from .config import BDOWN, BUP, GAMMA, TENSORS_PER_BLOCK, WDOWN, WK, WO, WQ, WUP, WV
from .kernels import column_sum_rows, ternary_panels, weight_grad_rows
from .vsa import vsa_window
from .ops import (Acts, Record, attention_backward, attention_forward, embed, loss_forward_backward,
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
# A window's forward and backward are cut into layers (the embedding, each
# block, the head), so that a thread can run one layer for all of its windows
# before the next: the layer's matrices are then read from cache, not memory.
# The per-window functions below run the same layers in window order.

@njit(cache=True, nogil=True)
def layerwise_embed(model, tokens, acts):
    """x_p = E[t_p] + P[p] for all positions."""
    for p in range(model.dims[6]):
        embed(model, tokens, p, acts.XIN[0, p])


@njit(cache=True, nogil=True)
def layerwise_block_forward(model, acts, vsa, b, k):
    """Block b over all positions: XIN[b] [L, d] -> XIN[b + 1] (or XF) [L, d].

    In the last block only the scored rows L-k..L-1 go past their keys and values."""
    V, d, H, hw, F, nb, L = model.dims
    th, offs = model.theta, model.offs
    s = L - k if b == nb - 1 else 0  # first row that needs more than k, v
    X = acts.XIN[b]
    gamma = view1(th, offs, tidx(b, GAMMA))
    for p in range(L):
        xr = acts.XR1[b, p]
        n = acts.NN[b, p]
        acts.R1[b, p] = rms_forward(X[p], xr)
        for i in range(d):
            n[i] = xr[i] * gamma[i]
    # n [L, d] . Wk, Wv [d, d] -> K, V [L, d]; n[s:] . Wq -> Q[s:]
    t = tidx(b, WK)
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, d, d, acts.NN[b], acts.K[b])
    t = tidx(b, WV)
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, d, d, acts.NN[b], acts.VV[b])
    t = tidx(b, WQ)
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, d, d, acts.NN[b, s:], acts.Q[b, s:])
    for p in range(L):
        rotary_forward(acts.K[b, p], model.cos, model.sin, p, H, hw)
    for p in range(s, L):
        rotary_forward(acts.Q[b, p], model.cos, model.sin, p, H, hw)
        attention_forward(acts.Q[b, p], acts.K[b], acts.VV[b], p, H, hw, model.attn_scale,
                          acts.A[b, p], acts.O[b, p])
    # o [n, d] . Wo [d, d] -> h = x + o Wo
    t = tidx(b, WO)
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, d, d, acts.O[b, s:], acts.HH[b, s:])
    for p in range(s, L):
        h = acts.HH[b, p]
        for i in range(d):
            h[i] = X[p, i] + h[i]
    # h [n, d] . Wup [d, F] + bup -> u, r = relu(u)
    t = tidx(b, WUP)
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, d, F, acts.HH[b, s:], acts.U[b, s:])
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
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, F, d, acts.RR[b, s:], XO[s:])
    bdown = view1(th, offs, tidx(b, BDOWN))
    for p in range(s, L):
        xo = XO[p]
        h = acts.HH[b, p]
        for i in range(d):
            xo[i] = (h[i] + (xo[i] + bdown[i])) + vsa[b, p, i]


@njit(cache=True, nogil=True)
def layerwise_head_forward(model, acts, k):
    """The scored rows: z = c * (rms(x) . Wout) + bout -> acts.Z[L-k:] [k, V]."""
    V, d, H, hw, F, nb, L = model.dims
    s = L - k
    for p in range(s, L):
        acts.RF[p] = rms_forward(acts.XF[p], acts.XRF[p])
    t = 1 + nb * TENSORS_PER_BLOCK
    ternary_panels(model.Pf, model.pf_offs, model.alpha, t, d, V, acts.XRF[s:], acts.Z[s:])
    bout = view1(model.theta, model.offs, t + 1)
    c = model.head_scale
    for p in range(s, L):
        z = acts.Z[p]
        for j in range(V):
            z[j] = c * z[j] + bout[j]


@njit(cache=True, nogil=True)
def window_forward_layerwise(model, tokens, vsa, k, acts, scr):
    """Forward of a whole window, one layer at a time over all positions; the
    scored rows' logits land in acts.Z."""
    layerwise_embed(model, tokens, acts)
    for b in range(model.dims[5]):
        layerwise_block_forward(model, acts, vsa, b, k)
    layerwise_head_forward(model, acts, k)


@njit(cache=True, nogil=True)
def layerwise_head_backward(model, tokens, k, scale, acts, rec, scr):
    """Loss of the k scored rows, and the gradient down to the last block's output:
    rec.dZ, rec.dY [k, V] and rec.dXo[nb - 1] [k, d]. Returns the summed loss."""
    V, d, H, hw, F, nb, L = model.dims
    s = L - k
    loss_sum = 0.0
    dZ = rec.dZ[:k]
    for r in range(k):
        loss_sum += loss_forward_backward(acts.Z[s + r], tokens[s + r + 1], scale, dZ[r])
    # z = c y + bout, y = rms(x) . Wout: dy = c dz [k, V]
    dY = rec.dY[:k]
    c = model.head_scale
    for r in range(k):
        for j in range(V):
            dY[r, j] = c * dZ[r, j]
    t = 1 + nb * TENSORS_PER_BLOCK
    dXR = scr.dXR[:k]
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, V, d, dY, dXR)
    dX = rec.dXo[nb - 1, :k]
    for r in range(k):
        rms_backward(acts.XF[s + r], acts.RF[s + r], dXR[r], dX[r])
    return loss_sum


@njit(cache=True, nogil=True)
def layerwise_block_backward(model, acts, rec, scr, b, k):
    """Block b's backward for the k scored rows: from rec.dXo[b] (the gradient at
    its output) to rec.dXo[b - 1] (or rec.dX0 for block 0), recording on the way
    each of its layers' output gradients: dR, dH, dQ, dK, dV and the gain's dG."""
    V, d, H, hw, F, nb, L = model.dims
    th, offs = model.theta, model.offs
    s = L - k
    T1, T2 = scr.t3[:k], scr.t2[:k]
    dXo, dR, dH = rec.dXo[b, :k], rec.dR[b, :k], rec.dH[b, :k]
    dQ, dK, dV, dG = rec.dQ[b, :k], rec.dK[b, :k], rec.dV[b, :k], rec.dG[b, :k]
    dO, dN = scr.dO[:k], scr.dN[:k]
    dX = rec.dXo[b - 1, :k] if b > 0 else rec.dX0[:k]
    # x' = h + (r . Wdown + bdown) + vsa: dx' [k, d] -> dr [k, F]
    t = tidx(b, WDOWN)
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, d, F, dXo, dR)
    for r in range(k):
        u = acts.U[b, s + r]
        for j in range(F):
            if not u[j] > 0.0:
                dR[r, j] = 0.0
    # u = h . Wup + bup: du [k, F] -> dh = dx' + du . Wup^T [k, d]
    t = tidx(b, WUP)
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, F, d, dR, T1)
    for r in range(k):
        for i in range(d):
            dH[r, i] = dXo[r, i] + T1[r, i]
    # h = x + o . Wo: dh [k, d] -> do [k, d]
    t = tidx(b, WO)
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, d, d, dH, dO)
    for r in range(k):
        p = s + r
        attention_backward(acts.Q[b, p], acts.K[b], acts.VV[b], acts.A[b, p], p, H, hw,
                           model.attn_scale, dO[r], dQ[r], dK[r], dV[r])
        rotary_backward(dQ[r], model.cos, model.sin, p, H, hw)
        rotary_backward(dK[r], model.cos, model.sin, p, H, hw)
    # q, k, v = n . Wq, Wk, Wv: dn = ((dq Wq^T) + dk Wk^T) + dv Wv^T [k, d]
    t = tidx(b, WQ)
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, d, d, dQ, T1)
    t = tidx(b, WK)
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, d, d, dK, T2)
    t = tidx(b, WV)
    ternary_panels(model.Pb, model.pb_offs, model.alpha, t, d, d, dV, dN)
    # n = rms(x) * gamma
    gamma = view1(th, offs, tidx(b, GAMMA))
    for r in range(k):
        xr = acts.XR1[b, s + r]
        for i in range(d):
            g = (T1[r, i] + T2[r, i]) + dN[r, i]
            dG[r, i] = g * xr[i]  # the gain's contribution
            dN[r, i] = g * gamma[i]
    for r in range(k):
        rms_backward(acts.XIN[b, s + r], acts.R1[b, s + r], dN[r], T2[r])
        for i in range(d):
            dX[r, i] = dH[r, i] + T2[r, i]


@njit(cache=True, nogil=True)
def window_backward_layerwise(model, tokens, vsa, k, scale, acts, rec, scr, logits, dx0):
    """Speed 3, one window: forward layer by layer, then the backward of all k
    scored rows at once, through every layer's input gradient.

    Each layer's output gradients (the DY of its weight gradient) go to the
    window's record `rec`, row r for the r-th scored position; its inputs (the
    X) stay in `acts`. gradients_from_records then turns them into weight
    gradients, one held block of gradient rows at a time. Returns the loss."""
    L, nb = model.dims[6], model.dims[5]
    window_forward_layerwise(model, tokens, vsa, k, acts, scr)
    loss_sum = layerwise_head_backward(model, tokens, k, scale, acts, rec, scr)
    for b in range(nb - 1, -1, -1):
        layerwise_block_backward(model, acts, rec, scr, b, k)
    for r in range(k):
        logits[L - k + r] = acts.Z[L - k + r]
        dx0[L - k + r] = rec.dX0[r]
    return loss_sum / k


@njit(cache=True, nogil=True)
def acts_of(A, w):
    """Window w's Acts from batched Acts."""
    return Acts(A.XIN[w], A.R1[w], A.XR1[w], A.NN[w], A.Q[w], A.K[w], A.VV[w], A.A[w], A.O[w],
                A.HH[w], A.U[w], A.RR[w], A.XF[w], A.RF[w], A.XRF[w], A.Z[w])


@njit(cache=True, nogil=True)
def record_of(R, w):
    """Window w's Record from a batched Record."""
    return Record(R.dZ[w], R.dY[w], R.dXo[w], R.dR[w], R.dH[w], R.dQ[w], R.dK[w], R.dV[w],
                  R.dG[w], R.dX0[w])


@njit(cache=True, nogil=True)
def windows_backward_layerwise(model, vsa_table, windows, vsa, k, scale, acts, rec, scr,
                               first, step, losses):
    """Speed 3 for windows first, first + step, ... of a batch (one thread's share):
    each layer runs for all of them before the next layer, so a layer's matrices
    are read once from memory and then from cache. Each window computes exactly
    what window_backward_layerwise computes; losses[w] gets its mean loss."""
    V, d, H, hw, F, nb, L = model.dims
    B = windows.shape[0]
    for w in range(first, B, step):
        vsa_window(vsa_table, windows[w], nb, d, vsa[w])
        layerwise_embed(model, windows[w], acts_of(acts, w))
    for b in range(nb):
        for w in range(first, B, step):
            layerwise_block_forward(model, acts_of(acts, w), vsa[w], b, k)
    for w in range(first, B, step):
        aw = acts_of(acts, w)
        layerwise_head_forward(model, aw, k)
        losses[w] = layerwise_head_backward(model, windows[w], k, scale, aw, record_of(rec, w),
                                            scr) / k
    for b in range(nb - 1, -1, -1):
        for w in range(first, B, step):
            layerwise_block_backward(model, acts_of(acts, w), record_of(rec, w), scr, b, k)


@njit(cache=True, nogil=True)
def gradients_from_records(model, acts, rec, tokens, k, units, u0, u1, out, XT, WG):
    """Speed 3's weight-gradient phase for a batch of windows.

    acts, rec and tokens hold every window of the batch ([window, ...]). For
    each unit u0..u1-1 (tensor t, rows r0..r1), adds into `out` each window's
    sum in window order; a window's sum over its scored positions runs in
    position order from 0.0 (for a ternary matrix: a held block of gradient
    rows, X^T . DY). Units write disjoint parts of `out`, so threads may take
    any units: the bits do not depend on who computes what."""
    V, d, H, hw, F, nb, L = model.dims
    offs = model.offs
    s = L - k
    B = tokens.shape[0]
    t_out = 1 + nb * TENSORS_PER_BLOCK
    for u in range(u0, u1):
        t, r0, r1 = units[u, 0], units[u, 1], units[u, 2]
        if t == 0:  # E[t_p] += dx_0 of the scored positions, one token row at a time
            E = view2(out, offs, 0, V, d)
            row = WG[:d]
            for w in range(B):
                tok = tokens[w]
                for r in range(k):
                    seen = False
                    for r2 in range(r):
                        if tok[s + r2] == tok[s + r]:
                            seen = True
                    if seen:
                        continue
                    for i in range(d):
                        row[i] = 0.0
                    for r2 in range(r, k):
                        if tok[s + r2] == tok[s + r]:
                            for i in range(d):
                                row[i] += rec.dX0[w, r2, i]
                    for i in range(d):
                        E[tok[s + r], i] += row[i]
            continue
        if t == t_out:
            for w in range(B):
                weight_grad_rows(acts.XRF[w, s:], r0, r1, rec.dY[w, :k], view2(out, offs, t, d, V),
                                 XT, WG)
            continue
        if t == t_out + 1:
            for w in range(B):
                column_sum_rows(rec.dZ[w, :k], view1(out, offs, t))
            continue
        b = (t - 1) // TENSORS_PER_BLOCK
        which = (t - 1) % TENSORS_PER_BLOCK
        for w in range(B):
            if which == GAMMA:
                column_sum_rows(rec.dG[w, b, :k], view1(out, offs, t))
            elif which == WQ:
                weight_grad_rows(acts.NN[w, b, s:], r0, r1, rec.dQ[w, b, :k],
                                 view2(out, offs, t, d, d), XT, WG)
            elif which == WK:
                weight_grad_rows(acts.NN[w, b, s:], r0, r1, rec.dK[w, b, :k],
                                 view2(out, offs, t, d, d), XT, WG)
            elif which == WV:
                weight_grad_rows(acts.NN[w, b, s:], r0, r1, rec.dV[w, b, :k],
                                 view2(out, offs, t, d, d), XT, WG)
            elif which == WO:
                weight_grad_rows(acts.O[w, b, s:], r0, r1, rec.dH[w, b, :k],
                                 view2(out, offs, t, d, d), XT, WG)
            elif which == WUP:
                weight_grad_rows(acts.HH[w, b, s:], r0, r1, rec.dR[w, b, :k],
                                 view2(out, offs, t, d, F), XT, WG)
            elif which == BUP:
                column_sum_rows(rec.dR[w, b, :k], view1(out, offs, t))
            elif which == WDOWN:
                weight_grad_rows(acts.RR[w, b, s:], r0, r1, rec.dXo[w, b, :k],
                                 view2(out, offs, t, F, d), XT, WG)
            else:  # BDOWN
                column_sum_rows(rec.dXo[w, b, :k], view1(out, offs, t))


@njit(cache=True, nogil=True)
def window_loss_layerwise(model, tokens, vsa, k, acts, scr):
    """Forward only (evaluation): the window's mean loss over its last k positions."""
    L = model.dims[6]
    window_forward_layerwise(model, tokens, vsa, k, acts, scr)
    loss_sum = 0.0
    for p in range(L - k, L):
        loss_sum += loss_forward_backward(acts.Z[p], tokens[p + 1], 1.0, scr.dZ[p - L + k])
    return loss_sum / k
