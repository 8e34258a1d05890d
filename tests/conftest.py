"""Every kernel the suite runs compiled once, before any test: with a cold Numba cache
(a fresh clone, or any edit to hslm, whose digest is in every kernel's cache stamp) the
first run of each kind would print "compiling kernels" lines into output that tests
read line by line, and spend its compile inside their timeouts. Warm, a few seconds."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels(tmp_path_factory):
    # speeds 0-3, and 2 threads on a batch of 1 (the kernels that split a window)
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "bench", "--model", "hslm-tiny",
                        "--speed", "0,1,2,3", "--threads", "1,2", "--batch", "1", "--steps",
                        "1", "--no-torch", "--no-profile"], cwd=tmp_path_factory.mktemp("warm"),
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout + p.stderr
