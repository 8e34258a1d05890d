"""This machine's matrix micro-kernels (hslm/panel_kernels.py), chosen and compiled, and
the facts about its core they are chosen by (cpu_info).

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


def cpu_info() -> dict:
    """The first core's /proc/cpuinfo fields (empty where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep:
                    if info:
                        break  # the first core's block ends at its blank line
                    continue
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def amd_family(info) -> int:
    """The core's family if it is AMD's (0x19 Zen 3 and 4, 0x1A Zen 5), else 0."""
    try:
        family = int(info.get("cpu family", 0))
    except ValueError:
        return 0
    return family if info.get("vendor_id") == "AuthenticAMD" else 0


def half_width_avx512(info) -> bool:
    """Whether the core (its cpu_info) runs AVX-512 on 256-bit pipes, a 512-bit operation
    as two halves (AMD Zen 4, family 19h): 512-bit vectors there hold twice the lanes but
    give no more flops a cycle than 256-bit ones (hslm.peak measures the same peak at
    either width)."""
    return amd_family(info) == 0x19


def half_width_avx2(info) -> bool:
    """Whether the core (its cpu_info) runs AVX2 on 128-bit pipes, a 256-bit operation as
    two halves: AMD's first Zen cores (family 17h below model 30h: Zen and Zen+; Zen 2,
    from model 30h, has 256-bit pipes). 4-lane vectors there give 8 f64 flops a cycle
    from the two FMA pipes, not 16 (hslm.peak measured 20-22 GFLOP/s on a 2.0 GHz Zen
    core that boosts to about 2.7-3.0)."""
    try:
        model = int(info.get("model", 0))
    except ValueError:
        return False
    return amd_family(info) == 0x17 and model < 0x30


def adam_lanes(info=None, wide=None) -> int:
    """Doubles a vector in AdamW's loop (hslm/adam_loop.py), for this core (its cpu_info,
    and whether Numba builds 512-bit vectors): 8 where Numba builds 512-bit vectors on
    AMD (Zen 5, family 1Ah, full-width pipes: the optimiser 3.7-4.0 ms a step at 4,
    3.1-3.3 at 8, four alternations; Zen 4, family 19h, which runs a 512-bit operation
    as two halves but holds more of the loop's iterations in flight while they wait on
    the divider: 6.28 against 7.19 ms at 4, steps taken in turns, 2026-12-04 in
    docs/performance-history.md); 4 elsewhere (on the AVX-512 Xeon of the README 8 ran
    15% slower, 6.9 against 6.0 ms, before the loop's sums were vectors; 8 built for
    AVX2, as two 4-lane halves, timed the same as 4 on the Zen 4).
    The bits do not depend on it: each element is updated on its own and the sums take
    the elements one at a time, in order (tests/test_optim.py)."""
    info = cpu_info() if info is None else info
    wide = wide_vectors() if wide is None else wide
    return 8 if wide and amd_family(info) >= 0x19 else 4


def single_widened(info=None, panel=None) -> bool:
    """Whether the ternary kernel widens its panels' chunks to float32 rather than float64
    (panel_kernels.SINGLE_WIDENED; the tiles convert each vector to float64 as they load
    it): on AMD cores (Zen and later, family 17h on) built for 4-lane vectors, where the
    conversion runs beside the two FMA pipes and the widening's stores are what the 4 x 12
    tile loses most to. On an AMD Zen 4 built for AVX2, the kernel alone ran 2-4% faster
    hot, 1-5% with its panels and rows in far caches (docs/performance-history.md,
    2026-12-05). Not on Intel's cores, where by the published port tables the conversion
    takes one of the two FMA ports (on the 2-core Xeon of the README, built for AVX2, the
    products ran 1.09x slower so: steps in turns, 2026-12-05), nor with 512-bit vectors,
    whose 9 x 16 tile ran 5-9% slower so. The bits do not depend on it: -1, 0 and +1 are
    exact in either."""
    info = cpu_info() if info is None else info
    panel = TERNARY_PANEL if panel is None else panel  # (this build's, set below)
    return panel in panel_kernels.SINGLE_WIDENED and amd_family(info) >= 0x17


def skips_relu_zeros(info=None) -> bool:
    """Whether speed 3's products whose inputs are the ReLU's output or its gradient (half
    of them 0.0) skip the zero inputs (panel_kernels.ternary_sparse_matmul_*; the same
    bits): on AMD's family 19h (Zen 3 and Zen 4), where it was measured, built for either
    width: on a Zen 4 such a product took 0.71-0.73 of the dense kernel's time with half
    its inputs zero, and broke even at 75% nonzero (SPARSE_MOST stops short of that).
    On the 2-core Xeon of the README (2026-12-05) the windows phase ran 1.035x slower with
    it as built and 1.055x built for AVX2 (steps in turns): dense there. Zen 5's
    full-width AVX-512 and the first Zen: not measured, dense."""
    info = cpu_info() if info is None else info
    return amd_family(info) == 0x19


SPARSE_MOST = 0.7  # the share of nonzero inputs above which the dense kernel is used


# The ternary kernels' tile, for this machine's registers (tools/gen_panel_kernels.py);
# the tile never changes a bit, only speed. TERNARY_PANEL is the panel width of the
# ternary matrices' layouts (hslm.params).
TERNARY_ROWS, TERNARY_PANEL = panel_kernels.TERNARY_TILES[0 if wide_vectors() else 1]
ternary_panel_matmul = getattr(panel_kernels, "ternary_panel_matmul_%dx%d%s" % (
    TERNARY_ROWS, TERNARY_PANEL, "_f32" if single_widened() else ""))
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

# The product that skips its inputs' zeros (None where skips_relu_zeros says no): the
# 12-column panels' kernel widens to float32, the 16-column panels' to float64.
ternary_sparse_matmul = (getattr(panel_kernels, "ternary_sparse_matmul_%d%s" % (
    TERNARY_PANEL, "_f32" if panel_kernels.SPARSE_SINGLE_WIDENED.get(TERNARY_PANEL) else ""))
    if skips_relu_zeros() else None)

# name: [(kernel, the one signature it is compiled for)]. Ternary panels are int8
# (exact for -1, 0, +1; an eighth of float64's memory traffic).
_X, _P, _G = "float64[:, ::1]", "float64[:, :, ::1]", "float64[:, ::1]"
MICRO_KERNELS = {
    "ternary tile": [(ternary_panel_matmul,
                      f"({_X}, int8[:, :, ::1], int64, float64, {_G})")] + (
        [(ternary_sparse_matmul, f"({_X}, int8[:, :, ::1], int64, float64, {_G}, float64)")]
        if ternary_sparse_matmul is not None else []),
    "weight-gradient tile": [(panel_matmul_add, f"({_X}, {_P}, int64, {_G}, boolean)"),
                             (panel_matmul_add2,
                              f"({_X}, {_X}, {_P}, {_P}, int64, {_G}, boolean)")],
}


def compile_micro(name: str) -> None:
    """Compile a register-tiled kernel (with cache=True a cached build loads instead).
    Other signatures are then refused, so a wrong-typed call fails loudly instead of
    building a slow copy."""
    from numba import config

    from .errors import HslmError
    if config.DISABLE_JIT:  # (the tiles are LLVM IR, never Python: a traceback had followed)
        raise HslmError("hslm's kernels need Numba's compiler: unset NUMBA_DISABLE_JIT")
    for kernel, signature in MICRO_KERNELS[name]:
        if not kernel._can_compile:  # done already in this process
            continue
        kernel.compile(signature)
        kernel.disable_compile()
