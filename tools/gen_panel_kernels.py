"""Writes hslm/panel_kernels.py: the register-tiled matrix micro-kernels.

Each kernel holds a tile of ROWS x PANEL outputs in vector registers for the whole
sum over the input index, which runs in increasing order from 0.0: an LLVM IR loop
(hslm/vector_tiles.py) per tile shape, and a Numba driver that walks the panels and
rows and stores the tiles. Generated, because each tile shape has its remainder
tiles; run `python tools/gen_panel_kernels.py` after changing this file (a test
checks that the committed file is current).
"""
from math import gcd
from pathlib import Path

# Tiles (rows, panel width): rows are positions (or gradient rows) per tile, the panel
# its columns. A tile's ROWS x PANEL sums live in vector registers, so the best tile
# depends on the register file (hslm/micro.py picks one when it loads):
# * 32 registers of 8 doubles (AVX-512): 9 x 16 uses 18 accumulators (27 rows =
#   3 tiles). 14 x 16 (27 = 14 + 13) ran 5-10% faster on hot caches and 2-3% in the
#   forward here, but its 28 accumulators leave LLVM short of registers (it spilled
#   some to the stack), which other AVX-512 cores may take worse: not used;
# * 16 registers of 4 doubles (AVX2) or fewer: 4 x 12, its 12 accumulators, 3 panel
#   vectors and the broadcast filling the 16 registers without a spill (27 rows = 6
#   tiles + 3). Compiled for Haswell on an AVX-512 Xeon it ran 53-55 GFLOP/s hot against
#   3 x 12's 49-50 (6 x 8: 49-50, 9 x 8: 36), and the step's forward and backward 6-7%
#   faster.
# The tiles' inner loops are written in LLVM IR with explicit vectors
# (hslm/vector_tiles.py; VECTOR_LANES doubles per vector). They were named scalars for
# LLVM's SLP vectoriser to pack: it packed the 9 x 16 ternary tile imperfectly (20 FMAs,
# 4 conversions and 3 inserts per input index for 18 FMAs and 2 conversions), and the
# weight gradient's 3 x 24 cleanly but slowly: 5.5-6 s to compile, 0.9 s in IR, at the
# same speed (38-44 GFLOP/s alone, hot, alternating) and with the same bits.
# The weight gradient (no contraction: a multiply and an add per term): 3 x 24 (9
# accumulators) with 32 registers; with 16 registers 3 x 24 needs 18, so it spilled:
# 3 x 12 ran 1.6x as fast compiled for Haswell and 3.2x for Zen 3 (timed on an Intel
# core), while on AVX-512 3 x 24 is as fast as any other (2 x 24, 3 x 32, 4 x 16 ...).
TERNARY_TILES = ((9, 16), (4, 12))
VECTOR_LANES = {24: 8, 16: 8, 12: 4}  # panel width: doubles per vector of a tile
WGRAD_TILES = ((3, 24), (3, 12))
WGRAD_WINDOWS = 8
# The weight gradient takes windows two at a time (panel_matmul_add2_*): with 32
# registers one loop sums a 3 x 24 tile of both (18 accumulators), the tile of G loaded,
# added to and stored once for the two: the phase 2% faster here (21.4 to 21.0 ms hot,
# alternating), the pair tile alone 2-8%. With 16 registers the 3 x 12 pair spilled (29
# to 34-36 ms): there the pair tile has 2 rows (12 accumulators, no spill), the
# one-window tile 3 (PAIR_ROWS), and the pair's rows run in whole tiles of both (6): the
# dense matrices' tiles 12.0 -> 10.5 ms a step built for AVX2 on the Zen 4 (steps in
# turns), against the one-window driver twice.
PAIR_ROWS = {24: 3, 12: 2}
# The weight gradient's last panel, when its real columns fit in one vector (EDGES[panel]
# of them), runs a tile that narrow instead of summing zeros: 243 = 10 x 24 + 3, so the
# model's 243-column gradients did 8.6% more work than needed (the phase ran 2-4% faster).
EDGES = {24: 8, 12: 4}
# The ternary kernels likewise (243 = 15 x 16 + 3 = 20 x 12 + 3): a last panel whose
# columns fit in one vector runs a one-vector tile of NARROW_ROWS[panel] rows, its sums
# where the full tile's would lie (the rows left over, fewer than that, take the full
# tiles). In their earlier SLP form the extra path had made LLVM compile the main tile
# worse (the forward ran 40% slower); in IR the main tile is untouched. With 4 lanes a
# tile of 8 rows keeps 8 FMAs in flight (4 rows would wait on the FMA's latency).
NARROW_ROWS = {16: 9, 12: 8}
# The ternary tiles read their panel widened to float64 (hslm/vector_tiles.py,
# make_widen), TERNARY_CHUNK input indices at a time: a chunk is widened once for every
# row tile, and each tile goes on from the sums the chunk before left (make_tile's
# resume), so each sum is still one chain over i. The int8 tile converting in its loop
# ran 75-79 GFLOP/s here (8 windows of 27 rows, each matrix shape of hslm-3); widened
# whole panels 74-77 with 729 inputs (their 93 KB of float64 left L1, and X with it);
# chunks of 96: 88-94, and of 48, 64, 81, 112, 122, 128, 192, 256: 78-89 (timed in
# interleaved rounds, one process).
TERNARY_CHUNK = 96
# Panels of these widths also get a kernel whose chunks are widened to float32, each tile
# converting its vectors to float64 as it loads them (vcvtps2pd): half the bytes of the
# widening's stores, which a 4 x 12 tile's loop of 12 FMAs waits on, for one conversion a
# vector on a pipe beside the FMA's. hslm/micro.py takes it on AMD cores built for AVX2;
# on an Intel core the conversion takes one of the two FMA ports.
SINGLE_WIDENED = (12,)

HEADER = '''"""Register-tiled matrix micro-kernels. GENERATED by tools/gen_panel_kernels.py: do not edit.

B is a matrix [a, b] stored in column panels: P[q, i, c] = B[i, q * panel + c],
zero-padded past column b. Each output element is one sum over i = 0, 1, ...
in increasing order from 0.0, the same chain of additions as the plain loops
in hslm.layers; a tile of rows x panel sums is held in registers meanwhile.
ternary_panel_matmul_RxP (Y = alpha X . T) and panel_matmul_add_RxP (the weight
gradient, G += X . D): a tile of R rows and panels of P columns (hslm.micro
chooses one of each for the machine).
"""
import numpy as np

from .jit import kernel_entry
from .vector_tiles import (make_nonzero_bits, make_popcount, make_prefetch_for_writing,
                           make_sparse_rows_tile, make_tile, make_widen)

TERNARY_TILES = {tiles}
SINGLE_WIDENED = {single}  # panel widths whose ternary kernel also comes widened to float32
WGRAD_TILES = {wtiles}
WGRAD_WINDOWS = {wwindows}  # windows whose output gradients a thread holds in panels at once
TERNARY_CHUNK = {chunk}  # input indices per widened chunk of a ternary panel
SPARSE_PANELS = {sparse}  # panel width: panels side by side in the sparse rows' tile
SPARSE_SINGLE_WIDENED = {sparse_single}  # panel width: the sparse kernel widens to float32
PREFETCH_FOR_WRITING = make_prefetch_for_writing()
POPCOUNT = make_popcount()

# hslm's kernel options (hslm/jit.py), with reference counting: each kernel here allocates
# its scratch, and a function with no _nrt of its own would take that of the first kernel
# whose compile compiles it (Numba's inherit_if_not_set): one first compiled for a kernel that
# counts no references would fail to compile (tests/test_jit.py).
KERNEL = kernel_entry(allocates=True)
'''


WGRAD_DOC = ("G [n, b] += X [n, a] . D, D [a, b] in panels P: the weight gradient, X the\n"
             "    layer input transposed (gradient rows x positions), D the output gradient\n"
             "    (positions x columns). No contraction: these products are not exact.\n"
             "    fresh: G = 0.0 + X . D instead, whatever G held (the bits of G zeroed\n"
             "    and then added to, without a pass that zeroes it).")


def through_out(name, m, width, pad, x="x", p="p", fresh="fresh"):
    """Lines that add an m-row tile of `width` columns into G through `out` (G's columns
    before b, zero past them; a tile of a last panel that ends past column b)."""
    rr, at = ("rr", "rr * {width} + c".format(width=width)) if m > 1 else ("0", "c")
    loop = [f"{pad}for rr in range({m}):"] if m > 1 else []
    inner = pad + ("    " if m > 1 else "")
    return (loop + [f"{inner}for c in range({width}):",
                    f"{inner}    out[{at}] = 0.0 if {fresh} or c >= cols else G[r + {rr}, j + c]",
                    f"{pad}{name}({x} + r * xb, xs, {p}, a, out.ctypes.data, {width}, 0)"]
            + loop + [f"{inner}for c in range(cols):",
                      f"{inner}    G[r + {rr}, j + c] = out[{at}]"])


# The weight-gradient drivers ask for G's tile TILES_AHEAD tiles down the panel while
# they sum this one (prefetch for writing: G's lines were last touched by the optimiser
# or by the window before, and a tile's loop is too short to wait for them). On AMD Zen
# 4 the dense matrices' tiles took 0.7-1.3 ms a step less (docs/performance-history.md).
TILES_AHEAD = 2


def prefetch_tiles_ahead(rows, panel, n, j, indent):
    """Lines that prefetch (for writing) the rows of the tile TILES_AHEAD tiles below
    row r, columns j .. j + panel - 1, where it lies above row n."""
    first, last = TILES_AHEAD * rows, (TILES_AHEAD + 1) * rows
    return [f"{indent}if r + {last} <= {n}:  # (a hint: no value changes)",
            f"{indent}    for rr in range(r + {first}, r + {last}):",
            f"{indent}        PREFETCH_FOR_WRITING(g + (rr * gs + {j}) * 8, {panel * 8})"]


def wgrad_kernel(rows, panel):
    """The driver of one weight-gradient tile: the IR loop (hslm/vector_tiles.py, no
    contraction) adds a tile's sums straight into G, or, on a last panel that ends past
    column b, into `out` (G's columns before b, zero past them), copied back after."""
    lanes, edge = VECTOR_LANES[panel], EDGES[panel]
    vecs = panel // lanes
    names = {"tile": f"WGRAD_{rows}x{panel}", "row": f"WGRAD_ROW_{panel}",
             "edge": f"WGRAD_{rows}x{edge}_OF_{panel}", "edge row": f"WGRAD_ROW_{edge}_OF_{panel}"}
    shapes = {"tile": (rows, vecs, ""), "row": (1, vecs, ""),
              "edge": (rows, edge // lanes, f", p_stride={panel}"),
              "edge row": (1, edge // lanes, f", p_stride={panel}")}
    defs = "".join(f"{names[k]} = make_tile({m}, {v}, {lanes}, ternary=False, "
                   f"add_into=True{extra})\n" for k, (m, v, extra) in shapes.items())

    L = [defs, "", '@KERNEL',
         f"def panel_matmul_add_{rows}x{panel}(X, P, b, G, fresh):", f'    """{WGRAD_DOC}"""',
         "    n, a = X.shape",
         f"    if (P.shape[1] != a or P.shape[0] * {panel} < b or G.shape[0] != n "
         f"or G.shape[1] < b",
         "            or (X.size > 0 and X.strides[1] != 8) or (G.size > 0 and G.strides[1] != 8)",
         f"            or (P.size > 0 and (P.strides[1] != {panel * 8} or P.strides[2] != 8))):",
         '        raise ValueError("panel_matmul_add: the operands\' shapes do not agree")',
         f"    out = np.empty({rows * panel})",
         "    x, xb, xs = X.ctypes.data, X.strides[0], X.strides[0] // 8",
         "    g, gs = G.ctypes.data, G.strides[0] // 8",
         "    from_zero = 1 if fresh else 0  # the tiles store 0.0 + sum, not G + sum",
         "    for q in range(P.shape[0]):  # a panel is reused by every row while it is in cache",
         f"        j = q * {panel}", "        p = P.ctypes.data + q * P.strides[0]",
         f"        cols = min({panel}, b - j)", "        r = 0",
         f"        if cols <= {edge}:  # a narrow last panel: no sums of its padding",
         f"            while r + {rows} <= n:"]
    L += through_out(names["edge"], rows, edge, " " * 16) + [f"                r += {rows}",
                                                            "            while r < n:"]
    L += through_out(names["edge row"], 1, edge, " " * 16) + ["                r += 1",
                                                             "            continue",
                                                             f"        while r + {rows} <= n:",
                                                             f"            if cols == {panel}:"]
    L += prefetch_tiles_ahead(rows, panel, "n", "j", " " * 16)
    L += [f"                {names['tile']}(x + r * xb, xs, p, a, g + (r * gs + j) * 8, gs, "
          "from_zero)", "            else:"]
    L += through_out(names["tile"], rows, panel, " " * 16) + [f"            r += {rows}",
                                                             "        while r < n:",
                                                             f"            if cols == {panel}:"]
    L += [f"                {names['row']}(x + r * xb, xs, p, a, g + (r * gs + j) * 8, gs, "
          "from_zero)", "            else:"]
    L += through_out(names["row"], 1, panel, " " * 16) + ["            r += 1"]
    return "\n".join(L) + "\n" + wgrad_pair_kernel(rows, panel, vecs, lanes, names, edge)


def wgrad_pair_kernel(rows, panel, vecs, lanes, names, edge):
    """The driver of two windows at once: their full tiles in one pair tile of
    PAIR_ROWS[panel] rows (two sets of accumulators in one loop, added into G in window
    order); the rows and the columns left over go through the one-window tiles, window
    by window."""
    prow = PAIR_ROWS[panel]
    step = rows * prow // gcd(rows, prow)  # n_full: whole tiles of both the pair and the one
    name = f"WGRAD_{prow}x{panel}_PAIR"
    ahead = "\n".join(prefetch_tiles_ahead(prow, panel, "n_full", f"q * {panel}", " " * 12))
    edge_lines = "\n".join(through_out(names["edge"], rows, edge, " " * 20, "xw", "p", "first"))
    full_lines = "\n".join(through_out(names["tile"], rows, panel, " " * 20, "xw", "p", "first"))
    return f"""

{name} = make_tile({prow}, {vecs}, {lanes}, ternary=False, add_into=True, pair=True)


@KERNEL
def panel_matmul_add2_{rows}x{panel}(X, X2, P, P2, b, G, fresh):
    \"\"\"panel_matmul_add_{rows}x{panel}(X, P, b, G, fresh), then (X2, P2, b, G, False): two
    windows' sums added into G in window order (X2 and P2 shaped as X and P). Every
    full tile of both windows is summed in one loop (the pair tile: a tile is loaded,
    added to and stored once for the two, and its loop exits once), the same bits.\"\"\"
    n, a = X.shape
    if X2.shape != X.shape or X2.strides != X.strides or P2.shape != P.shape or P2.strides != P.strides:
        raise ValueError("panel_matmul_add2: the two windows' operands differ in shape")
    n_full = n - n % {step}
    q_full = b // {panel}
    x, xb, xs = X.ctypes.data, X.strides[0], X.strides[0] // 8
    x_off = (X2.ctypes.data - x) // 8
    p_off = (P2.ctypes.data - P.ctypes.data) // 8
    g, gs = G.ctypes.data, G.strides[0] // 8
    from_zero = 1 if fresh else 0
    for q in range(q_full):  # a panel pair is reused by every row while it is in cache
        p = P.ctypes.data + q * P.strides[0]
        for r in range(0, n_full, {prow}):
{ahead}
            {name}(x + r * xb, xs, x_off, p, p_off, a, g + (r * gs + q * {panel}) * 8,
                gs, from_zero)
    if q_full < P.shape[0]:  # the last panel, partly past column b: window by window
        out = np.empty({rows * panel})
        j = q_full * {panel}
        cols = b - j
        for pw, xw, first in ((P.ctypes.data, x, fresh), (P2.ctypes.data, X2.ctypes.data, False)):
            p = pw + q_full * P.strides[0]
            for r in range(0, n_full, {rows}):
                if cols <= {edge}:
{edge_lines}
                else:
{full_lines}
    if n_full < n:  # the rows left over
        panel_matmul_add_{rows}x{panel}(X[n_full:], P, b, G[n_full:], fresh)
        panel_matmul_add_{rows}x{panel}(X2[n_full:], P2, b, G[n_full:], False)
"""


TERNARY_DOC = ("Y [n, b] = alpha * (X [n, a] . T), T ternary [a, b] in panels P (int8:\n"
               "    -1, 0 and +1 convert to float64 exactly). Tiles of {sizes} rows (then single\n"
               "    rows) by one panel, each summed by an LLVM IR loop (hslm/vector_tiles.py)\n"
               "    with FMA where the core has it: each product x * t with t in {{-1, 0, +1}}\n"
               "    is exact, so fma(x, t, y) rounds once, exactly like y + x * t: the bits do\n"
               "    not change, on machines with or without FMA. Never call it with a\n"
               "    non-ternary matrix.")


def remainder_tiles(rows):
    """The ternary tile's row counts, largest first: rows, then the multiples of 3 below
    it (a team of threads sharing a window gives each a share of its rows, hslm/step.py:
    15 rows ran as 9 + 6 single rows, at a third of the speed of 9 + 6), then 1."""
    return [rows] + [m for m in (6, 3) if m < rows] + [1]


def ternary_kernel(rows, panel, single=False):
    """The driver of one ternary tile: per panel, per chunk of the input index, the panel's
    trits widened to float64 (float32 where single) once, then every row tile's IR loop
    goes on summing into `sums`; the driver scales the sums by alpha into Y, the columns
    before b only."""
    lanes = VECTOR_LANES[panel]
    sizes = remainder_tiles(rows)
    f32, opt = ("_F32", ", single=True") if single else ("", "")
    names = {m: (f"TILE_{m}x{panel}{f32}" if m > 1 else f"ROW_{panel}{f32}") for m in sizes}
    nrows = NARROW_ROWS[panel]
    narrow = f"TILE_{nrows}x{lanes}_OF_{panel}{f32}"
    widen = f"WIDEN_{panel}{f32}"
    defs = "".join(f"{names[m]} = make_tile({m}, {panel // lanes}, {lanes}, resume=True{opt})\n"
                   for m in sizes) + f"{widen} = make_widen({panel}{opt})\n"
    defs += (f"{narrow} = make_tile({nrows}, 1, {lanes}, resume=True, p_stride={panel}"
             f"{opt})\n")
    loops = f"""            if b - j <= {lanes}:  # a last panel of one vector's columns
                while r + {nrows} <= n:
                    {narrow}(x + 8 * (r * xs + k0), xs, wide, kn, s + 8 * {panel} * r, more)
                    r += {nrows}
"""
    for m in sizes:
        loops += f"""            while r + {m} <= n:
                {names[m]}(x + 8 * (r * xs + k0), xs, wide, kn, s + 8 * {panel} * r, more)
                r += {m}
"""
    doc = TERNARY_DOC.format(sizes=", ".join(str(m) for m in sizes[:-1]))
    if single:
        doc += ("\n    Each chunk of a panel is widened to float32, converted to float64 as the\n"
                "    tiles load it.")
    return f"""{defs}

@KERNEL
def ternary_panel_matmul_{rows}x{panel}{f32.lower()}(X, P, b, alpha, Y):
    \"\"\"{doc}\"\"\"
    n, a = X.shape
    if (P.shape[1] != a or P.shape[0] * {panel} < b or Y.shape[0] != n or Y.shape[1] < b
            or (X.size > 0 and X.strides[1] != 8)  # (an empty array's strides are 0)
            or (P.size > 0 and (P.strides[1] != {panel} or P.strides[2] != 1))):
        raise ValueError("ternary_panel_matmul: the operands' shapes do not agree")  # raw addresses
    # The rows' sums for one panel [n, {panel}], then a chunk of a panel widened, in one
    # allocation: an address taken with .ctypes.data does not keep its array alive (Numba
    # frees an array after its last use), and the sums are read at the end of every
    # panel. (As an array of its own, only ever addressed, the chunk was freed before the
    # loop: another thread's allocation could take it while the tiles used it.) Both
    # start on 64 bytes: Numba aligns an array on 32, and a 512-bit load that crosses
    # two cache lines costs two.
    # (+ 16: up to 7 elements to reach 64 bytes, up to 7 to round the sums to 8 elements)
    scratch = np.empty(n * {panel} + min(a, TERNARY_CHUNK) * {panel} + 16)
    first = (-scratch.ctypes.data) % 64 // 8
    sums = scratch[first:first + n * {panel}]
    s = sums.ctypes.data
    wide = s + 8 * ((n * {panel} + 7) // 8 * 8)
    x, xs = X.ctypes.data, X.strides[0] // 8
    for q in range(P.shape[0]):
        j = q * {panel}
        if j + {panel} < b:  # the next panel's output columns, on their way meanwhile
            for r in range(n):
                PREFETCH_FOR_WRITING(Y[r].ctypes.data + 8 * (j + {panel}),
                                     8 * min({panel}, b - j - {panel}))
        p = P.ctypes.data + q * P.strides[0]
        k0 = 0
        while True:  # chunks of the input index (at least one: a = 0 sums to 0.0)
            kn = min(TERNARY_CHUNK, a - k0)
            {widen}(p + {panel} * k0, kn, wide)
            more = 1 if k0 > 0 else 0
            r = 0
{loops}            k0 += TERNARY_CHUNK
            if k0 >= a:
                break
        cols = min({panel}, b - j)
        for r in range(n):
            for c in range(cols):
                Y[r, j + c] = alpha * sums[r * {panel} + c]
"""


# The ternary products whose input rows are mostly zeros (the ReLU's output in the
# forward's Wdown, its gradient in the backward's Wup): a row at a time over the nonzero
# inputs only (vector_tiles.make_sparse_rows_tile), SPARSE_PANELS[panel] panels side by
# side (their sums in registers), the input index in chunks of 64 (a mask word each,
# vector_tiles.make_nonzero_bits) whose panels are widened as the dense kernels' are:
# float32 with 12-column panels (AMD's 4-lane builds, micro.single_widened), float64
# with 16. Timed alone on an AMD Zen 4 (27 x 729 by 729 x 243, half the inputs zero),
# against the dense kernel: 1.45x with 3 panels of 12 (float32; 2 panels 1.23x, 4
# 1.13x with a last group of one), 1.38x with 2 panels of 16 (float64; float32 0.95x).
SPARSE_PANELS = {12: 3, 16: 2}
SPARSE_SINGLE_WIDENED = {12: True, 16: False}


def sparse_kernel(panel):
    """The driver of the product that skips its inputs' zeros: masks of the nonzero
    inputs, then per group of SPARSE_PANELS panels and chunk of 64 inputs the panels'
    chunks widened once for every row, each row's tile going on from the chunk before's
    sums; a last group of fewer panels runs a one-panel tile per panel."""
    lanes, panels = VECTOR_LANES[panel], SPARSE_PANELS[panel]
    single = SPARSE_SINGLE_WIDENED[panel]
    f32 = "_F32" if single else ""
    width, esize = panels * panel, 4 if single else 8
    # the chunks are widened by the dense kernel's widen of this panel width and precision
    # (ternary_kernel's WIDEN_<panel>[_F32], written before this kernel)
    full, one = f"SPARSE_{panels}x{panel}{f32}", f"SPARSE_1x{panel}{f32}"
    widen = f"WIDEN_{panel}{f32}"
    return f"""{full} = make_sparse_rows_tile({panels}, {panel}, {lanes}, {single})
{one} = make_sparse_rows_tile(1, {panel}, {lanes}, {single})
NONZERO_BITS_{lanes} = make_nonzero_bits({lanes})


@KERNEL
def ternary_sparse_matmul_{panel}{f32.lower()}(X, P, b, alpha, Y, most):
    \"\"\"Y [n, b] = alpha * (X [n, a] . T), T ternary [a, b] in panels P (int8), as
    ternary_panel_matmul_*x{panel} gives it, bit for bit, summing each row over its nonzero
    inputs only (a zero input adds +-0.0, which changes no bit of the sum). Returns False,
    and leaves Y as it was, when more than `most` of X's entries are nonzero (the dense
    kernel is then the faster).\"\"\"
    n, a = X.shape
    if (P.shape[1] != a or P.shape[0] * {panel} < b or Y.shape[0] != n or Y.shape[1] < b
            or (X.size > 0 and X.strides[1] != 8)
            or (P.size > 0 and (P.strides[1] != {panel} or P.strides[2] != 1))):
        raise ValueError("ternary_sparse_matmul: the operands' shapes do not agree")
    words = (a + 63) // 64
    masks = np.empty((n, words), np.int64)
    active = 0
    for r in range(n):
        x = X[r].ctypes.data
        for w in range(words):
            m = NONZERO_BITS_{lanes}(x + 8 * 64 * w, min(64, a - 64 * w))
            masks[r, w] = m
            active += POPCOUNT(m)
    if active > most * n * a:
        return False
    # the rows' sums [n, {width}], then {panels} panels' chunks widened, each [64, {panel}], in
    # one allocation (see ternary_panel_matmul_*: an address does not keep an array alive)
    scratch = np.empty(n * {width} + {panels} * 64 * {panel} * {esize} // 8 + 16)
    first = (-scratch.ctypes.data) % 64 // 8
    sums = scratch[first:first + n * {width}]
    if words == 0:  # no input: every sum is 0.0 (the tiles write them otherwise)
        sums[:] = 0.0
    s = sums.ctypes.data
    wide = s + 8 * ((n * {width} + 7) // 8 * 8)
    for q0 in range(0, P.shape[0], {panels}):
        nq = min({panels}, P.shape[0] - q0)
        for w in range(words):
            k0 = 64 * w
            kn = min(64, a - k0)
            for q in range(nq):
                {widen}(P.ctypes.data + (q0 + q) * P.strides[0] + {panel} * k0, kn,
                        wide + {esize} * 64 * {panel} * q)
            more = 1 if w > 0 else 0
            for r in range(n):
                x = X[r].ctypes.data + 8 * k0
                if nq == {panels}:
                    {full}(masks[r, w], x, wide, s + 8 * {width} * r, more)
                else:
                    for q in range(nq):
                        {one}(masks[r, w], x, wide + {esize} * 64 * {panel} * q,
                              s + 8 * ({width} * r + {panel} * q), more)
        j = q0 * {panel}
        cols = min(nq * {panel}, b - j)
        for r in range(n):
            for c in range(cols):
                Y[r, j + c] = alpha * sums[r * {width} + c]
    return True
"""


def render() -> str:
    out = HEADER.format(tiles=TERNARY_TILES, single=SINGLE_WIDENED, wtiles=WGRAD_TILES,
                        wwindows=WGRAD_WINDOWS, chunk=TERNARY_CHUNK, sparse=SPARSE_PANELS,
                        sparse_single=SPARSE_SINGLE_WIDENED)
    for rows, panel in TERNARY_TILES:
        out += "\n\n" + ternary_kernel(rows, panel)
        if panel in SINGLE_WIDENED:
            out += "\n\n" + ternary_kernel(rows, panel, single=True)
    for rows, panel in WGRAD_TILES:
        out += "\n\n" + wgrad_kernel(rows, panel)
    for panel in SPARSE_PANELS:
        out += "\n\n" + sparse_kernel(panel)
    return out


TARGET = Path(__file__).resolve().parent.parent / "hslm" / "panel_kernels.py"


def main():
    TARGET.write_text(render())


if __name__ == "__main__":
    main()
