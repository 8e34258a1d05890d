"""AdamW with per-tensor clipping and the warm-up + cosine schedule (spec section 8).

The schedule's cosine and the bias corrections 1 - beta^t are computed at high
precision and rounded once (hslm.precise), so no C library decides a bit."""
from __future__ import annotations

import math

import numpy as np

from . import precise
from .adam_loop import (B1, B2, CLIP, DECAY, EPS, N_PARAMS, ONE_MINUS_B1, ONE_MINUS_B2, SQRT_BC2,
                        STEP_SIZE, make_adam_loop)
from .jit import kernel_entry
from .micro import adam_lanes
from .params import Trits, quantize_into
from .slots import NO_GATE
from .spin import gate_opens

BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-8
CLIP_NORM = 1.0
ADAM_LOOP = make_adam_loop(adam_lanes())  # 4 or 8 doubles a vector, for this core


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

    The elementwise work and the three serial sums (the norm's sum of squares, sum |w|,
    sum |m| + v, each in element order) run in one loop (hslm/adam_loop.py). A tensor's
    norm must be whole before its update starts, so the norm's sum runs ahead: while
    tensor t is updated, the loop sums the squares of the gradient that follows, as many
    elements as it updates (a cursor, across tensors); only the first tensor's norm is
    summed alone. Before (a pass for the norm, then the update and its sums in blocks)
    the same update took 10.0 ms here, now 6.0, with the same bits."""
    adamw_tensors(theta, grad, m, v, offs, decay, bc1, bc2, lr, weight_decay, norms, abs_sums,
                  moment_sums, np.arange(t0, t1, dtype=np.int64))


@kernel_entry(allocates=True)
def adamw_kernel(theta, grad, m, v, offs, decay, bc1, bc2, lr, weight_decay, norms, abs_sums,
                 moment_sums, tensors, trits, requantise, gate, target):
    """adamw_tensors' work, requantising each tensor (into trits) when requantise: one
    compiled kernel for both (trits=None had made a second one, 3 s of a first run).
    False, having done nothing, where its gate does not open (spin.gate_opens)."""
    if not gate_opens(gate, target):
        return False
    params = np.empty(N_PARAMS)
    params[STEP_SIZE] = lr / bc1
    params[SQRT_BC2] = math.sqrt(bc2)
    params[B1] = BETA1
    params[ONE_MINUS_B1] = 1.0 - BETA1
    params[B2] = BETA2
    params[ONE_MINUS_B2] = 1.0 - BETA2
    params[EPS] = ADAM_EPS
    sums = np.zeros(3)  # sum |w|, sum |m| + v of tensor t; the cursor's sum of squares
    G, M, V, W = grad.ctypes.data, m.ctypes.data, v.ctypes.data, theta.ctypes.data
    nt = tensors.shape[0]
    if nt == 0:
        return True
    ci = 0  # the norm cursor: at element c of tensor tensors[ci]
    c = offs[tensors[0]]
    for ti in range(nt):
        t = tensors[ti]
        while ci <= ti:  # a norm the cursor has not finished (the first one), alone
            ss = sums[2]
            for e in range(c, offs[tensors[ci] + 1]):
                ss += grad[e] * grad[e]
            norms[tensors[ci]] = math.sqrt(ss)
            sums[2] = 0.0
            ci += 1
            if ci < nt:
                c = offs[tensors[ci]]
        norm = norms[t]
        params[CLIP] = 1.0 / norm if norm > CLIP_NORM else 1.0
        params[DECAY] = 1.0 - lr * weight_decay if decay[t] else 1.0
        sums[0] = 0.0
        sums[1] = 0.0
        e = offs[t]
        while e < offs[t + 1]:  # in runs that end where the cursor's tensor ends
            while ci < nt and c == offs[tensors[ci] + 1]:  # its tensor summed (or empty)
                norms[tensors[ci]] = math.sqrt(sums[2])
                sums[2] = 0.0
                ci += 1
                if ci < nt:
                    c = offs[tensors[ci]]
            k = offs[t + 1] - e
            h = e  # past the last norm, the third sum runs on this gradient, unused
            if ci < nt:
                k = min(k, offs[tensors[ci] + 1] - c)
                h = c
            ADAM_LOOP(G + 8 * e, M + 8 * e, V + 8 * e, W + 8 * e, k, params.ctypes.data,
                      sums.ctypes.data, G + 8 * h)
            e += k
            if ci < nt:
                c += k
        abs_sums[t] = sums[0]
        moment_sums[t] = sums[1]
        if requantise:
            quantize_into(theta, offs, trits, abs_sums, True, t, t + 1)
    return True


def adamw_tensors(theta, grad, m, v, offs, decay, bc1, bc2, lr, weight_decay, norms, abs_sums,
                  moment_sums, tensors, trits=None, gate=NO_GATE, target=0) -> bool:
    """adamw_step for the tensors listed (increasing, not necessarily contiguous: a
    thread's share, hslm.step.optimiser_shares); the norm cursor runs along the list.
    With trits (a Trits), each tensor is requantised (params.quantize_into) as soon as
    it is updated: its parameters are then still in a near cache. Requantising them all
    afterwards took 2.1-2.2 ms a step here, theta (17 MB) coming back from memory: the
    optimiser 8.16 to 7.68 ms. (Calling the optimiser tensor by tensor to that end had
    broken the norm cursor: 8.0 to 8.5-11 ms.) gate, target: a barrier the kernel
    waits for first (spin.gate_opens); False where it did not open (nothing done)."""
    return adamw_kernel(theta, grad, m, v, offs, decay, bc1, bc2, lr, weight_decay, norms,
                        abs_sums, moment_sums, tensors, _NO_TRITS if trits is None else trits,
                        trits is not None, gate, target)


def _unquantised_trits(n: int) -> Trits:
    """Trits of n tensors of 1 x 2 that are not ternary (requantising one only records
    its sum), of the types of ModelState.trits(): other types would compile another
    copy of adamw_kernel."""
    return Trits(np.ones(n, np.int64), np.full(n, 2, np.int64), np.zeros(n, np.bool_),
                 np.ones(n), False, np.zeros(0), np.zeros(0), np.zeros(n + 1, np.int64),
                 np.zeros(0, np.int8), np.zeros(n + 1, np.int64), np.zeros(0, np.int8),
                 np.zeros(n, np.int64))


_NO_TRITS = _unquantised_trits(0)  # what adamw_kernel is given when it does not requantise


def warm_up_optimiser() -> None:
    """AdamW once on a two-element throwaway model, requantising as it goes (the one
    compiled kernel of adamw_step and adamw_tensors: compiled, or loaded from the cache)."""
    z = np.zeros(2)
    adamw_tensors(z, z.copy(), z.copy(), z.copy(), np.array([0, 2]), np.array([True]), 0.1,
                  0.001, 0.0, 0.0, np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1, np.int64),
                  _unquantised_trits(1))
