"""Shared test helpers: one window at a speed, and exact comparisons."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from hslm.config import PRESETS
from hslm.params import ModelState, init_params
from hslm.step import Worker
from hslm.tables import Tables

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running(proc, timeout):
    """The process killed when the block ends, however it ends, or after timeout seconds
    (its pipes then end, so a loop over its lines cannot wait forever): a failed test
    leaves no run behind (one once wrote 69 GB of checkpoints into /tmp)."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        yield proc
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()


def setup(name, structured, seed=1):
    cfg = PRESETS[name]
    tb = Tables(cfg, structured_vsa=structured)
    ms = ModelState(cfg, init_params(cfg, seed), tb)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, cfg.window + 1)
    return cfg, tb, ms, tokens


def window_result(speed, cfg, tb, ms, tokens, k):
    """(loss, logits of scored positions, gradient, dloss/dx_0 of scored positions, worker)."""
    w = Worker(cfg, speed)
    out = np.zeros(cfg.n_params)
    loss = w.window(ms.kernel_model(), tb.vsa, tokens, k, 1.0 / k, out)
    L = cfg.window
    return loss, w.logits[L - k:].copy(), out, w.dx0(k).copy(), w


def assert_bits_equal(a, b, what):
    """Exact equality, by bits (so -0.0 != +0.0), with a count of the elements that differ."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    b = np.ascontiguousarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    neq = a.view(np.uint64) != b.view(np.uint64)
    n = int(np.count_nonzero(neq))
    assert n == 0, f"{what}: {n} of {a.size} elements differ (max |diff| {np.abs(a - b).max():.3e})"


def hslm(*args, cwd=None):
    """Run the CLI in a fresh process: (exit code, stdout, stderr)."""
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


def one_line_error(code, out, err):
    """The CLI failed with exactly one line `error: ...` on stderr, and no traceback."""
    assert code != 0
    assert "Traceback" not in err and "Traceback" not in out
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# The scored positions k a bit-identity test runs at: all (k = L), one (k = 1), and
# some but not all (k = L // 2 + 1: the record rows start at s = L - k > 0 and more
# than one row is scored; for L = 2 that is k = L again), as ids for
# pytest.mark.parametrize.
K_CASES = ["k=L", "k=mid", "k=1"]


def k_for(case: str, L: int) -> int:
    return {"k=L": L, "k=mid": L // 2 + 1, "k=1": 1}[case]
