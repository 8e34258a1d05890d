"""A training step's gradient: windows to workers, accumulators added in window order.

Each worker owns its scratch (activations, KV cache, gradient rows, the
per-window accumulator), allocated once per run. The step's gradient is
G = ((0 + S_w0) + S_w1) + ... in window order, whatever the thread count:
with one thread the windows add into G directly, in order; with N threads,
each window of a group of N adds into its own zeroed buffer and the buffers
are then added into G in window order, split over ranges of G.
"""
from __future__ import annotations

import numpy as np

from .ops import alloc_acts, alloc_scratch
from .vsa import vsa_window
from .windows import (window_grad_cached, window_grad_fast, window_grad_layerwise,
                      window_grad_reference)

WINDOW_KERNELS = {
    0: window_grad_reference,
    1: window_grad_cached,
    2: window_grad_fast,
    3: window_grad_layerwise,
}
SPEED_NAMES = {0: "reference", 1: "cached", 2: "fast", 3: "layerwise"}


class Worker:
    """Scratch for one thread: everything a window writes besides the gradient."""

    def __init__(self, cfg, speed: int):
        dims = cfg.dims()
        self.speed = speed
        self.acts = alloc_acts(dims)
        # Speeds 0-2 build the window's gradient in S before adding it to the output.
        self.scr = alloc_scratch(dims, cfg.n_params, with_accumulator=speed < 3)
        self.vsa = np.zeros((cfg.blocks, cfg.window, cfg.width))
        self.logits = np.zeros((cfg.window, cfg.vocab))
        self.dx0 = np.zeros((cfg.window, cfg.width))

    def window(self, model, vsa_table, tokens, k, scale, out):
        """Add one window's gradient into out; return the window's mean loss."""
        nb = model.dims[5]
        d = model.dims[1]
        vsa_window(vsa_table, tokens, nb, d, self.vsa)
        kernel = WINDOW_KERNELS[self.speed]
        return kernel(model, tokens, self.vsa, k, scale, self.acts, self.scr, out,
                      self.logits, self.dx0)
