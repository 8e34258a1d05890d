"""AdamW with per-tensor clipping and the warm-up + cosine schedule (spec section 8)."""
from __future__ import annotations

import math

from numba import njit

BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-8
CLIP_NORM = 1.0


def learning_rate(step: int, peak: float, warmup: int, decay_steps: int) -> float:
    """Step counts from 1: linear warm-up from 0 over `warmup` steps, then cosine
    decay to 10% of the peak at `decay_steps`, and 10% after that."""
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    span = max(decay_steps - warmup, 1)
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@njit(cache=True, nogil=True)
def adamw_step(theta, grad, m, v, offs, decay, step, lr, weight_decay, norms, t0, t1):
    """One AdamW update in place, tensor by tensor.

    Each tensor's gradient is clipped to L2 norm 1 on its own (g * (1 / norm)
    when norm > 1); its pre-clip norm goes to norms[t]. Weight decay is
    decoupled and applies where decay[t]. The update follows torch.optim.AdamW:
    w *= 1 - lr wd; w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    Updates tensors t0..t1-1: tensors are independent, so threads may split them."""
    bc1 = 1.0 - BETA1 ** step
    bc2 = 1.0 - BETA2 ** step
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
        for e in range(a, b):
            g = grad[e] * clip
            m[e] = BETA1 * m[e] + (1.0 - BETA1) * g
            v[e] = BETA2 * v[e] + (1.0 - BETA2) * (g * g)
            w = theta[e] * wd
            theta[e] = w - step_size * (m[e] / (math.sqrt(v[e]) / sbc2 + ADAM_EPS))
