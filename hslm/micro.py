"""This machine's matrix micro-kernels (hslm/panel_kernels.py), chosen and compiled.

Importing this module compiles nothing; hslm.kernels compiles both micro-kernels
when it loads (compile_micro), and a first run's compile jobs (hslm/precompile.py)
may compile each on its own, in another process, beforehand.
"""
from __future__ import annotations

import os

from . import panel_kernels


def wide_vectors(features=None) -> bool:
    """Whether Numba compiles for 512-bit vectors (AVX-512 with 256-bit not preferred,
    as hslm/__init__.py sets up): 32 registers of 8 doubles."""
    f = os.environ.get("NUMBA_CPU_FEATURES", "") if features is None else features
    return "+avx512f" in f.split(",") and "-prefer-256-bit" in f.split(",")


# The ternary kernels' tile, for this machine's registers (tools/gen_panel_kernels.py);
# the tile never changes a bit, only speed. TERNARY_PANEL is the panel width of the
# ternary matrices' layouts (hslm.params).
TERNARY_ROWS, TERNARY_PANEL = panel_kernels.TERNARY_TILES[0 if wide_vectors() else 1]
ternary_panel_matmul = getattr(panel_kernels,
                               f"ternary_panel_matmul_{TERNARY_ROWS}x{TERNARY_PANEL}")
# The weight gradient's tile, likewise; WGRAD_PANEL is the panel width of the output
# gradients' scratch layout (hslm.kernels.output_grad_panels).
WGRAD_ROWS, WGRAD_PANEL = panel_kernels.WGRAD_TILES[0 if wide_vectors() else 1]
panel_matmul_add = getattr(panel_kernels, f"panel_matmul_add_{WGRAD_ROWS}x{WGRAD_PANEL}")
# two windows a call (a pair tile where the registers hold two tiles' sums)
panel_matmul_add2 = getattr(panel_kernels, f"panel_matmul_add2_{WGRAD_ROWS}x{WGRAD_PANEL}")
# The MLP's weight gradients over the ReLU's active positions only (hslm.kernels.
# active_rows_grad): a row of up to ACTIVE_VECS vectors of ACTIVE_LANES doubles in
# registers (with the broadcast and a product: 18 of 32 registers, 15 of 16).
ACTIVE_VECS, ACTIVE_LANES = (16, 8) if wide_vectors() else (13, 4)

# name: [(kernel, the one signature it is compiled for)]. Ternary panels are int8
# (exact for -1, 0, +1; an eighth of float64's memory traffic).
_X, _P, _G = "float64[:, ::1]", "float64[:, :, ::1]", "float64[:, ::1]"
MICRO_KERNELS = {
    "ternary tile": [(ternary_panel_matmul,
                      f"({_X}, int8[:, :, ::1], int64, float64, {_G})")],
    "weight-gradient tile": [(panel_matmul_add, f"({_X}, {_P}, int64, {_G}, boolean)"),
                             (panel_matmul_add2,
                              f"({_X}, {_X}, {_P}, {_P}, int64, {_G}, boolean)")],
}


def compile_micro(name: str) -> None:
    """Compile a register-tiled kernel (with cache=True a cached build loads instead).
    Other signatures are then refused, so a wrong-typed call fails loudly instead of
    building a slow copy."""
    for kernel, signature in MICRO_KERNELS[name]:
        if not kernel._can_compile:  # done already in this process
            continue
        kernel.compile(signature)
        kernel.disable_compile()
