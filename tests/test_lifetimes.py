"""Scratch memory lives as long as the kernels use it.

Numba frees an array after its last use, and an address taken with `.ctypes.data` is
not a use that keeps it: a buffer allocated in a kernel and then only addressed is
freed before the loop that writes and reads it. Alone, the freed block is seldom
handed out again before the kernel returns; with threads sharing the allocator's arena
(many threads, or MALLOC_ARENA_MAX=1, a common container setting) another thread's
allocation takes it, and the two write over each other: wrong bits or a crash.
The ternary kernels' widened chunk was such a buffer (found by a black-box audit:
`--threads 2` under MALLOC_ARENA_MAX=1 changed the validation loss or aborted).
"""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import gen_panel_kernels  # noqa: E402

ALLOCATORS = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like"}


def only_addressed_arrays(source: str):
    """(function, name) of every array a function allocates (np.empty and the like)
    whose every later use is `name.ctypes.data`: nothing keeps such an array alive
    while its address is used."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        allocated = set()
        for node in ast.walk(fn):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Attribute)
                    and node.value.func.attr in ALLOCATORS
                    and isinstance(node.value.func.value, ast.Name)
                    and node.value.func.value.id == "np"):
                allocated.add(node.targets[0].id)
        for name in sorted(allocated):
            uses = [n for n in ast.walk(fn)
                    if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
            addressed = [n for n in uses
                         if isinstance(parents.get(n), ast.Attribute) and parents[n].attr == "ctypes"
                         and isinstance(parents.get(parents[n]), ast.Attribute)
                         and parents[parents[n]].attr == "data"]
            if uses and len(addressed) == len(uses):
                found.append((fn.name, name))
    return found


# The ternary kernel as it was: the widened chunk an array of its own, only addressed.
EARLY_FREED = """\
    sums = np.empty(n * {panel})  # [n, {panel}]: the rows' sums for one panel
    s = sums.ctypes.data
    trits = np.empty(min(a, TERNARY_CHUNK) * {panel})  # a chunk of a panel, widened
    wide = trits.ctypes.data
"""


def early_freed_kernel(rows, panel):
    """The generator's ternary kernel with its scratch made the old way."""
    text = gen_panel_kernels.ternary_kernel(rows, panel)
    start = text.index("    # The rows' sums for one panel")
    end = text.index("    x, xs = X.ctypes.data")
    return text[:start] + EARLY_FREED.format(panel=panel) + text[end:]


def test_no_kernel_array_is_only_addressed():
    offenders = []
    for path in sorted((ROOT / "hslm").glob("*.py")) + [ROOT / "tools" / "gen_panel_kernels.py"]:
        offenders += [(path.name, *f) for f in only_addressed_arrays(path.read_text())]
    assert offenders == []
    # negative control: the old kernel is caught, by name
    rows, panel = gen_panel_kernels.TERNARY_TILES[0]
    name = f"ternary_panel_matmul_{rows}x{panel}"
    assert only_addressed_arrays(early_freed_kernel(rows, panel)) == [(name, "trits")]
    assert only_addressed_arrays(gen_panel_kernels.ternary_kernel(rows, panel)) == []


# Two threads call a ternary kernel over and over on their own operands (the kernels
# release the GIL) and compare every result with the one made alone; MALLOC_ARENA_MAX=1
# puts both threads' allocations in one arena.
CONTENTION = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import hslm.micro as micro
    from hslm.vector_tiles import make_tile, make_widen
    from numba import njit
    kernel = micro.ternary_panel_matmul
    if sys.argv[1] == "early-freed":  # the old kernel, compiled here from its text
        namespace = {"np": np, "njit": njit, "make_tile": make_tile,
                     "make_widen": make_widen, "TERNARY_CHUNK": 96}
        exec(sys.stdin.read().replace("cache=True", "cache=False"), namespace)
        kernel = namespace[micro.ternary_panel_matmul.__name__]
    P_ = micro.TERNARY_PANEL
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(2):
        X = rng.standard_normal((27, 243))
        T = rng.integers(-1, 2, (243, 729)).astype(np.int8)
        npan = (729 + P_ - 1) // P_
        P = np.zeros((npan, 243, P_), np.int8)
        for q in range(npan):
            c = T[:, q * P_:(q + 1) * P_]
            P[q, :, :c.shape[1]] = c
        Y = np.empty((27, 729))
        kernel(X, P, 729, 0.5, Y)
        cases.append((X, P, Y.copy()))
    wrong = [0, 0]
    def work(t):
        X, P, alone = cases[t]
        Y = np.empty_like(alone)
        for _ in range(300):
            kernel(X, P, 729, 0.5, Y)
            wrong[t] += Y.tobytes() != alone.tobytes()
    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(sum(wrong))
""")


def wrong_results_under_contention(which: str, kernel_text: str = "") -> int:
    env = dict(os.environ, MALLOC_ARENA_MAX="1")
    p = subprocess.run([sys.executable, "-c", CONTENTION, which], input=kernel_text, env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:  # a crash is the hazard too
        return -p.returncode if p.returncode < 0 else 10**6
    return int(p.stdout.split()[-1])


def test_ternary_kernel_under_a_shared_allocator_arena():
    import hslm.micro as micro
    assert wrong_results_under_contention("installed") == 0
    # negative control: the kernel with its chunk freed early goes wrong (or crashes)
    # under the same contention; 263 of 600 results were wrong here
    text = early_freed_kernel(micro.TERNARY_ROWS, micro.TERNARY_PANEL)
    # (tries until it shows: the threads must overlap, which a loaded machine may delay)
    assert any(wrong_results_under_contention("early-freed", text) != 0 for _ in range(5))


def test_raw_pointer_drivers_refuse_operands_that_do_not_agree():
    """The tiles read and write through raw addresses, with no bounds checks of their own:
    each driver checks its operands' shapes first (a guard-page run found every caller in
    bounds; these checks keep a future caller so). The control: agreeing operands run."""
    import numpy as np
    import pytest

    import hslm.micro as micro
    from kernel_entries import active_masks, active_rows_grad

    P_, W = micro.TERNARY_PANEL, micro.WGRAD_PANEL
    X = np.ones((5, 20))
    P = np.zeros((2, 20, P_), np.int8)
    micro.ternary_panel_matmul(X, P, 2 * P_, 1.0, np.empty((5, 2 * P_)))  # control
    c = np.ascontiguousarray  # the kernels are compiled for contiguous operands
    for bad in ((c(X[:, :19]), P, np.empty((5, 2 * P_))), (X, P, np.empty((4, 2 * P_))),
                (X, P, np.empty((5, 2 * P_ - 1))), (X, c(P[:, :19]), np.empty((5, 2 * P_)))):
        with pytest.raises(ValueError, match="shapes do not agree"):
            micro.ternary_panel_matmul(bad[0], bad[1], 2 * P_, 1.0, bad[2])
    XT, PD, G = np.ones((6, 27)), np.ones((2, 27, W)), np.zeros((6, 2 * W))
    micro.panel_matmul_add(XT, PD, 2 * W, G, True)  # control
    for bad in ((c(XT[:, :26]), PD, G), (XT, PD, G[:5]), (XT, PD, c(G[:, :-1])), (XT, PD[:1], G)):
        with pytest.raises(ValueError, match="shapes do not agree"):
            micro.panel_matmul_add(bad[0], bad[1], 2 * W, bad[2], True)
    L, F, n = 30, 10, micro.ACTIVE_LANES + 3
    S, D = np.ones((L, F)), np.ones((L, n))
    M = np.zeros(((L + 63) // 64, F), np.int64)
    active_masks(S, 0, F, M)
    active_rows_grad(M, S, D, 0, n, 0, F, np.zeros((F, n)), True)  # control
    with pytest.raises(ValueError, match="shapes do not agree"):  # narrower than a vector
        active_rows_grad(M, S, D, 0, micro.ACTIVE_LANES - 1, 0, F, np.zeros((F, n)), True)
    with pytest.raises(ValueError, match="shapes do not agree"):  # O too short
        active_rows_grad(M, S, D, 0, n, 0, F, np.zeros((F - 1, n)), True)


def test_the_kernels_buffers_start_on_64_bytes():
    """Activations, records and scratch start on a cache line (numpy gives 16 bytes), and
    the weight gradient's output-gradient panels have each window's row on one too: their
    512-bit loads then never cross two lines (the phase ran about 3% faster here)."""
    from hslm.config import PRESETS
    from hslm.layers import alloc_acts, alloc_record, alloc_scratch, zeros_on_64
    dims = PRESETS["hslm-3"].dims()
    for group in (alloc_acts(dims, 3), alloc_record(dims, 3), alloc_scratch(dims)):
        for name, a in zip(group._fields, group):
            assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous and not a.any(), name
    dy = alloc_scratch(dims).dy_panels
    assert all(dy[w].ctypes.data % 64 == 0 for w in range(dy.shape[0]))
    for _ in range(50):  # whatever numpy's allocator hands out
        for s in [(1,), (7, 3), (3, 1, 5)]:
            assert zeros_on_64(s).shape == s and zeros_on_64(s).ctypes.data % 64 == 0
    assert zeros_on_64((2, 0, 5)).shape == (2, 0, 5)  # (an empty array has no loads)
