"""A training step's gradient: windows to workers, accumulators added in window order.

Each worker (one per thread) owns its scratch, allocated once per run:
activations and KV cache (Acts), gradient rows (Scratch), and at speeds 0-2 the
window accumulator S. The step's gradient is

    G = ((0 + S_w0) + S_w1) + ...      (each S_w in position order, spec section 9)

whatever the thread count. With one thread the windows add into G directly,
in order. With N threads, the windows run in groups of N, each into its own
zeroed buffer (a buffer is chosen by the window's place in its group, never by
thread id), and the group's buffers are then added into G in window order, the
flat vector split into N ranges. Threads are plain Python threads running
nogil Numba kernels: no Numba threading layer is involved, so forking and
Ctrl-C behave as in any Python program.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from .ops import alloc_acts, alloc_scratch
from .vsa import vsa_window
from .windows import (window_grad_cached, window_grad_fast, window_grad_layerwise,
                      window_grad_reference, window_loss_layerwise)

WINDOW_KERNELS = {
    0: window_grad_reference,
    1: window_grad_cached,
    2: window_grad_fast,
    3: window_grad_layerwise,
}
SPEED_NAMES = {0: "reference", 1: "cached", 2: "fast", 3: "layerwise"}
SPEEDS = tuple(WINDOW_KERNELS)


class Worker:
    """Scratch for one thread: everything a window writes besides the step's gradient."""

    def __init__(self, cfg, speed: int):
        dims = cfg.dims()
        self.speed = speed
        self.acts = alloc_acts(dims)
        # Speeds 0-2 build the window's gradient in scr.S before adding it to the output.
        self.scr = alloc_scratch(dims, cfg.n_params, with_accumulator=speed < 3)
        self.vsa = np.zeros((cfg.blocks, cfg.window, cfg.width))
        self.logits = np.zeros((cfg.window, cfg.vocab))
        self.dx0 = np.zeros((cfg.window, cfg.width))

    def window(self, model, vsa_table, tokens, k, scale, out):
        """Add one window's gradient into out; return the window's mean loss."""
        vsa_window(vsa_table, tokens, model.dims[5], model.dims[1], self.vsa)
        return WINDOW_KERNELS[self.speed](model, tokens, self.vsa, k, scale, self.acts,
                                          self.scr, out, self.logits, self.dx0)

    def window_loss(self, model, vsa_table, tokens, k):
        """Forward only: the window's mean loss over its last k positions."""
        vsa_window(vsa_table, tokens, model.dims[5], model.dims[1], self.vsa)
        return window_loss_layerwise(model, tokens, self.vsa, k, self.acts, self.scr)


@njit(cache=True, nogil=True)
def add_in_order(G, bufs, n, lo, hi):
    """G[lo:hi] += bufs[0], then bufs[1], ... bufs[n-1]: window order."""
    for w in range(n):
        B = bufs[w]
        for e in range(lo, hi):
            G[e] += B[e]


class StepRunner:
    """Computes the gradient of a batch of windows at one speed on N threads."""

    def __init__(self, cfg, speed: int, threads: int = 1):
        self.cfg = cfg
        self.speed = speed
        self.threads = max(1, int(threads))
        self.workers = [Worker(cfg, speed) for _ in range(self.threads)]
        self.bufs = (np.zeros((self.threads, cfg.n_params)) if self.threads > 1 else None)
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def gradient(self, model, vsa_table, windows: np.ndarray, k: int, G: np.ndarray) -> float:
        """G = the batch's gradient (scaled by 1/(k B)); returns the step's mean loss."""
        B = windows.shape[0]
        scale = 1.0 / (k * B)
        G[:] = 0.0
        losses = np.zeros(B)
        if self.threads == 1:
            w = self.workers[0]
            for i in range(B):
                losses[i] = w.window(model, vsa_table, windows[i], k, scale, G)
        else:
            N = self.threads
            for g0 in range(0, B, N):
                n = min(N, B - g0)

                def one(j):
                    buf = self.bufs[j]
                    buf[:] = 0.0
                    return self.workers[j].window(model, vsa_table, windows[g0 + j], k, scale, buf)

                losses[g0:g0 + n] = list(self.pool.map(one, range(n)))
                P = self.cfg.n_params
                cuts = [P * r // N for r in range(N + 1)]
                list(self.pool.map(lambda r: add_in_order(G, self.bufs, n, cuts[r], cuts[r + 1]),
                                   range(N)))
        total = 0.0
        for i in range(B):
            total += losses[i]
        return total / B

    def loss(self, model, vsa_table, windows: np.ndarray, k: int) -> float:
        """Mean loss of windows, forward only (validation)."""
        B = windows.shape[0]
        losses = np.zeros(B)
        if self.threads == 1:
            for i in range(B):
                losses[i] = self.workers[0].window_loss(model, vsa_table, windows[i], k)
        else:
            N = self.threads

            def part(j):
                for i in range(j, B, N):
                    losses[i] = self.workers[j].window_loss(model, vsa_table, windows[i], k)

            list(self.pool.map(part, range(N)))
        total = 0.0
        for i in range(B):
            total += losses[i]
        return total / B
