"""AdamW with per-tensor clipping and the warm-up + cosine schedule (spec section 8).

The schedule's cosine and the bias corrections 1 - beta^t are computed at high
precision and rounded once (hslm.precise), so no C library decides a bit."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import precise

BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-8
CLIP_NORM = 1.0
BLOCK = 512  # elements updated (vectorised) before their sums are taken (in order)


def learning_rate(step: int, peak: float, warmup: int, decay_steps: int) -> float:
    """Step counts from 1: linear warm-up from 0 over `warmup` steps, then cosine
    decay to 10% of the peak at `decay_steps`, and 10% after that."""
    ctx, D = precise.CTX, precise.D
    if warmup > 0 and step <= warmup:
        return precise.to_f64(ctx.divide(ctx.multiply(D(peak), D(step)), D(warmup)))
    span = max(decay_steps - warmup, 1)
    progress = min(max(ctx.divide(D(step - warmup), D(span)), D(0)), D(1))
    cos = precise.cos(ctx.multiply(precise.PI, progress))
    share = ctx.add(D("0.1"), ctx.multiply(D("0.45"), ctx.add(D(1), cos)))
    return precise.to_f64(ctx.multiply(D(peak), share))


def bias_corrections(step: int):
    """(1 - beta1^t, 1 - beta2^t) for step t >= 1, correctly rounded."""
    ctx, D = precise.CTX, precise.D
    return tuple(precise.to_f64(ctx.subtract(D(1), ctx.power(D(beta), step)))
                 for beta in (BETA1, BETA2))


@njit(cache=True, nogil=True, error_model="numpy")
def adamw_step(theta, grad, m, v, offs, decay, bc1, bc2, lr, weight_decay, norms, abs_sums,
               moment_sums, t0, t1):
    """One AdamW update in place, tensor by tensor.

    Each tensor's gradient is clipped to L2 norm 1 on its own (g * (1 / norm)
    when norm > 1); its pre-clip norm goes to norms[t]. Weight decay is
    decoupled and applies where decay[t]. The update follows torch.optim.AdamW:
    w *= 1 - lr wd; w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    bc1, bc2 are the bias corrections 1 - beta^t (bias_corrections).
    abs_sums[t] gets sum |w| of the updated tensor in element order, the sum that
    requantisation's alpha = mean|W| needs (fused here: one pass less over theta), and
    moment_sums[t] = sum |m| + sum v: with norms and abs_sums, finite exactly when every
    gradient, parameter and moment of the tensor is (or, rarely, when a sum of finite
    values overflows), so the run's finiteness check needs no pass of its own.
    Updates tensors t0..t1-1: tensors are independent, so threads may split them.
    error_model="numpy" (as on every float kernel of the step): a division is a plain
    IEEE division, with no Python zero check in the loop, so the update vectorises
    (same bits)."""
    step_size = lr / bc1
    sbc2 = math.sqrt(bc2)
    for t in range(t0, t1):
        a, b = offs[t], offs[t + 1]
        ss = 0.0
        for e in range(a, b):
            ss += grad[e] * grad[e]
        norm = math.sqrt(ss)
        norms[t] = norm
        clip = 1.0 / norm if norm > CLIP_NORM else 1.0
        wd = 1.0 - lr * weight_decay if decay[t] else 1.0
        s = 0.0
        sm = 0.0
        for e0 in range(a, b, BLOCK):
            n = min(BLOCK, b - e0)
            gb, mb, vb, wb = grad[e0:e0 + n], m[e0:e0 + n], v[e0:e0 + n], theta[e0:e0 + n]
            for i in range(n):  # elementwise over slice views: this loop vectorises
                g = gb[i] * clip
                me = BETA1 * mb[i] + (1.0 - BETA1) * g
                ve = BETA2 * vb[i] + (1.0 - BETA2) * (g * g)
                mb[i] = me
                vb[i] = ve
                w = wb[i] * wd
                wb[i] = w - step_size * (me / (math.sqrt(ve) / sbc2 + ADAM_EPS))
            for i in range(n):  # the sums in element order, on the block while it is in L1
                s += abs(wb[i])
                sm += abs(mb[i]) + vb[i]
        abs_sums[t] = s
        moment_sums[t] = sm


def warm_up_optimiser() -> None:
    """AdamW once on a two-element throwaway model (compiled, or loaded from the cache)."""
    z = np.zeros(2)
    adamw_step(z, z.copy(), z.copy(), z.copy(), np.array([0, 2]), np.array([True]), 0.1, 0.001,
               0.0, 0.0, np.zeros(1), np.zeros(1), np.zeros(1), 0, 1)
