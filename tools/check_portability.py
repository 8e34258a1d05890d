"""The same bytes on every Python and numpy: build a venv per (Python, numpy), run, compare.

    python tools/check_portability.py [--work DIR] [PYTHON ...]

For every Python interpreter given (default: the pyenv Pythons 3.10-3.13 found
under ~/.pyenv/versions) and for the oldest and the newest numpy that hslm
accepts there, it makes a venv, installs hslm from this checkout with that
numpy (pip picks a matching numba), runs the golden hslm-tiny run of
tests/test_golden.py (`hslm train --model hslm-tiny --seed 1729 --batch 4
--steps 3`) with a cold kernel cache of its own, and prints the data sha256 of
ckpt_3.bin and ckpt_3.state. Exit 0 when every row matches the golden digests.
Needs the package index (pip) and a few minutes per row.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_golden import GOLDEN_TINY, TINY_ARGS, data_sha256  # noqa: E402

# the oldest numpy with wheels for each Python that hslm's range (>= 1.24) admits
OLDEST_NUMPY = {"3.10": "1.24.4", "3.11": "1.24.4", "3.12": "1.26.4", "3.13": "2.1.3"}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def row(python: str, numpy_pin: str | None, work: Path):
    ver = sh([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"]).stdout.strip()
    tag = f"py{ver}-numpy{numpy_pin or 'newest'}"
    venv = work / tag
    if not venv.exists():
        sh([python, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pins = [f"numpy=={numpy_pin}"] if numpy_pin else []
    sh([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    sh([py, "-m", "pip", "install", "-q", str(ROOT), *pins])
    versions = sh([py, "-c", "import numpy, numba; print(numpy.__version__, numba.__version__)"]
                  ).stdout.split()
    out = work / f"run-{tag}"
    cache = work / f"cache-{tag}"
    shutil.rmtree(cache, ignore_errors=True)  # cold: every kernel compiled by this row's numba
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    t = time.perf_counter()
    p = subprocess.run([str(venv / "bin" / "hslm"), "train", *TINY_ARGS, "--out", str(out),
                        "--quiet"], capture_output=True, text=True, env=env, cwd=str(work))
    if p.returncode != 0:
        return f"Python {ver}, numpy {versions[0]}, numba {versions[1]}: FAILED {p.stderr.strip()}", False
    got = {n: data_sha256(out / n)[:16] for n in GOLDEN_TINY}
    ok = got == GOLDEN_TINY
    return (f"Python {ver:8s} numpy {versions[0]:7s} numba {versions[1]:7s} "
            f"bin {got['ckpt_3.bin']} state {got['ckpt_3.state']} "
            f"{'same' if ok else 'DIFFERENT'} ({time.perf_counter() - t:.0f} s)"), ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pythons", nargs="*")
    ap.add_argument("--work", default="/tmp/hslm-portability")
    a = ap.parse_args()
    pythons = a.pythons or sorted(
        p for p in glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-3]*/bin/python3")))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"golden: bin {GOLDEN_TINY['ckpt_3.bin']} state {GOLDEN_TINY['ckpt_3.state']}")
    all_ok = True
    for python in pythons:
        minor = ".".join(sh([python, "-c", "import sys; print(*sys.version_info[:2])"]
                            ).stdout.split())
        for pin in (OLDEST_NUMPY.get(minor), None):
            try:
                line, ok = row(python, pin, work)
            except subprocess.CalledProcessError as e:
                line, ok = f"{python} numpy {pin}: setup failed: {e.stderr.strip()[-300:]}", False
            print(line, flush=True)
            all_ok &= ok
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
