"""The speed table: each speed is one entry, and the rest of the program asks the table.

A speed is a loop order (hslm/windows.py) plus the matrix kernel it passes to the
layers (hslm/layers.py); every speed computes the same bits. Adding a speed is
one entry here and, if it needs one, one loop order in windows.py: the CLI, the
benchmark and the tests pick it up from SPEEDS. (No Numba here: the CLI reads
this table before it imports any kernel.)
"""
from __future__ import annotations

from dataclasses import dataclass

# Matrix kernels a loop order passes to the layers (all give the same bits):
KERNEL_DOT = 0        # plain dot products per row over T input-major (the definition)
KERNEL_ROWS = 1       # hslm.kernels.ternary_matmul_rows over T input-major / output-major
KERNEL_PANELS = None  # the register-tiled micro-kernels over column panels (hslm.panel_kernels)
# (None, not a number: Numba prunes a branch on whether an argument is None, which is its
# type, and not on its value; so the layer-by-layer kernels, given None, are compiled without
# the per-position products, and the per-position ones without the panels: 5% of a first
# run's compile. hslm/layers.py, ternary_forward.)

PER_POSITION = "per-position"
LAYERWISE = "layerwise"


@dataclass(frozen=True)
class Speed:
    """One entry of the speed table: everything the rest of the program asks of a speed."""

    number: int
    name: str
    loop: str              # PER_POSITION or LAYERWISE (hslm/windows.py)
    kernel: int            # the matrix kernel passed to the layers (hslm/layers.py)
    plain_layouts: bool    # reads T input-major and output-major (else only the panels)
    reduction: str         # how a step's gradient is summed across threads
    recompute_prefix: bool = False   # per position: the whole prefix again for each scored p
    kv_only_unscored: bool = False   # per position: unscored rows make only k, v in the last block
    summary: str = ""


SPEEDS = {s.number: s for s in (
    Speed(0, "reference", PER_POSITION, KERNEL_DOT, True, "window buffers", recompute_prefix=True,
          summary="for each scored position, the whole prefix again; plain loops (the oracle)"),
    Speed(1, "cached", PER_POSITION, KERNEL_DOT, True, "window buffers",
          summary="each position once against the KV cache; plain loops"),
    Speed(2, "fast", PER_POSITION, KERNEL_ROWS, True, "window buffers", kv_only_unscored=True,
          summary="speed 1 with the fast row kernels"),
    Speed(3, "layerwise", LAYERWISE, KERNEL_PANELS, False, "gradient units",
          summary="each layer over all positions of all of a thread's windows; register-tiled "
                  "panels; weight gradients once per step from the windows' records"),
)}
DEFAULT_SPEED = 3
SPEED_NAMES = {n: s.name for n, s in SPEEDS.items()}


def speed_help() -> str:
    return "; ".join(f"{n} {s.name}" for n, s in SPEEDS.items()) + ": all give the same bytes"
