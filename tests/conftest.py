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


@pytest.fixture(scope="session", autouse=True)
def compile_locks_removed():
    """A kernel cache's compile lock is a file in the temporary folder, named after the
    cache's folder (hslm.precompile.CompileLock); the suite makes about 170 caches of its
    own, in folders that go, and their locks go with them. Only a lock that is free (no
    process compiles) and not the lock of the cache this process uses is removed."""
    from hslm import precompile
    if precompile.CACHE_LOCK is None:
        yield
        return
    pattern = f"{precompile.CACHE_LOCK.stem}-compile-*.lock"
    mine = precompile.CompileLock.for_cache().path
    before = set(precompile.CACHE_LOCK.parent.glob(pattern)) | {mine}
    yield
    for path in set(precompile.CACHE_LOCK.parent.glob(pattern)) - before:
        lock = precompile.CompileLock(path)
        if lock.take() and lock.file is not None:
            path.unlink(missing_ok=True)
            lock.release()
