"""Golden digests: the bytes of a run are pinned, and the same on every machine.

The data sha256 of ckpt_N.bin (the parameters) and ckpt_N.state (AdamW's moments)
depend only on hslm's format, the config, the hyper-parameters, the seed and the
text (README: "What the bytes depend on"). A change that moves one of these
digests must say why in its commit.

"Another machine" on this one: the same run in a fresh process with the C
library's CPU-specific variants turned down (GLIBC_TUNABLES), numpy's SIMD
dispatch turned off (NPY_DISABLE_CPU_FEATURES), and (slow: a cold compile each,
hslm-tiny and hslm-3) the kernels compiled for a baseline x86-64 CPU
(NUMBA_CPU_NAME=generic), for an AVX2 CPU (NUMBA_CPU_NAME=haswell) and, on AVX-512
machines, with 256-bit vectors only.
"""
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from helpers import ROOT

TINY_ARGS = ["--model", "hslm-tiny", "--seed", "1729", "--batch", "4", "--steps", "3"]
# hslm train --model hslm-tiny --seed 1729 --batch 4 --steps 3 (speed 3, the default)
GOLDEN_TINY = {
    "ckpt_3.bin": "334757f949a90a4e",
    "ckpt_3.state": "63360cae658b9a07",
}
# the same run's whole files (headers included: config, tokenizer, RNG, hyper-parameters)
GOLDEN_TINY_FILES = {
    "ckpt_3.bin": "8f43e63914cba32a",
    "ckpt_3.state": "ce883a8b9ad81769",
}
# hslm train --steps 2 --seed 1729 (hslm-3, the built-in corpus, speed 3)
GOLDEN_HSLM3 = {
    "ckpt_2.bin": "f395d790a8d4c926",
    "ckpt_2.state": "15846c7e57749bc8",
}
# the README's quick start: hslm train --speed 3 --steps 10 --seed 1729
GOLDEN_QUICKSTART_BIN = "b0e43665a240fe014d973380e817bf7e8a40fe28bab6efb1a0b88ecf7329b7fc"
# numpy >= 2.3 names its x86 dispatch targets by level; older ones by feature
NUMPY_SIMD_OFF = ("X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_KNL AVX512_KNM "
                  "AVX512_SKX AVX512_CLX AVX512_CNL AVX2 FMA3 AVX F16C")


def file_sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def data_sha256(path) -> str:
    """sha256 of a checkpoint's data section (what GOLDEN_* pin), read independently of
    hslm's loader: u64 header length, header, data."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    json.loads(raw[8:8 + n])
    return hashlib.sha256(raw[8 + n:]).hexdigest()


def child_env(env_extra=None):
    """This process's environment with env_extra; a value None removes the variable
    (NUMBA_CPU_FEATURES, which importing hslm here set on an AVX-512 machine, must go for
    a child that is to choose its vector width itself)."""
    env = dict(os.environ)
    for key, value in (env_extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def kernel_choice(env_extra=None):
    """(ternary tile rows, panel width, 512-bit vectors?) that a fresh process with env_extra
    compiles for."""
    p = subprocess.run([sys.executable, "-c", "import hslm.micro as m; "
                        "print(m.TERNARY_ROWS, m.TERNARY_PANEL, m.wide_vectors())"],
                       env=child_env(env_extra), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    rows, panel, wide = p.stdout.split()
    return int(rows), int(panel), wide == "True"


def train_in_fresh_process(out, args, env_extra=None):
    env = child_env(env_extra)
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", *args, "--out", str(out),
                        "--quiet"], env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr
    return {name: data_sha256(out / name)[:16] for name in sorted(os.listdir(out))
            if name.startswith("ckpt_")}


def file_digests(out):
    return {name: file_sha256(out / name)[:16] for name in sorted(os.listdir(out))
            if name.startswith("ckpt_")}


def npy_features_accepted():
    """NPY_DISABLE_CPU_FEATURES with only the names this numpy knows (others are errors)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__  # noqa: PLC0415
    names = [f for f in NUMPY_SIMD_OFF.split() if f in __cpu_dispatch__]
    return " ".join(names)


def test_golden_tiny_run(tmp_path):
    assert train_in_fresh_process(tmp_path / "run", TINY_ARGS) == GOLDEN_TINY
    # the whole files, headers included (tokenizer, RNG state, hyper-parameters, metadata)
    assert file_digests(tmp_path / "run") == GOLDEN_TINY_FILES


def test_golden_digests_notice_a_change(tmp_path):
    """Negative control: another seed (1730 for 1729) moves every digest."""
    other = train_in_fresh_process(tmp_path / "run", [*TINY_ARGS[:3], "1730", *TINY_ARGS[4:]])
    assert set(other) == set(GOLDEN_TINY)
    assert all(other[k] != GOLDEN_TINY[k] for k in other)


@pytest.mark.parametrize("env", [
    {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA,-AVX,-FMA4,-AVX512F"},
    {"NPY_DISABLE_CPU_FEATURES": "numpy"},
], ids=["glibc-no-fma-avx", "numpy-no-simd"])
def test_same_bytes_on_another_machine(tmp_path, env):
    if "NPY_DISABLE_CPU_FEATURES" in env:
        features = npy_features_accepted()
        if not features:
            pytest.skip("this numpy dispatches to no SIMD target that could be turned off")
        env = {"NPY_DISABLE_CPU_FEATURES": features}
    assert train_in_fresh_process(tmp_path / "run", TINY_ARGS, env) == GOLDEN_TINY
    assert file_digests(tmp_path / "run") == GOLDEN_TINY_FILES


def test_same_bytes_with_threads_sharing_one_allocator_arena(tmp_path):
    """Threads beyond the cores, their allocations in one arena (MALLOC_ARENA_MAX=1, a
    common container setting): the golden bytes. A kernel whose scratch was freed while
    in use (tests/test_lifetimes.py) gave other bytes or crashed here."""
    args = [*TINY_ARGS, "--threads", "4"]
    assert train_in_fresh_process(tmp_path / "run", args, {"MALLOC_ARENA_MAX": "1"}) == GOLDEN_TINY


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["generic-cpu", "avx2", "256-bit"])
def test_same_bytes_with_other_kernels(tmp_path, variant):
    """The kernels compiled for another CPU (their own cache folder: a cold compile), for
    hslm-tiny and hslm-3: a baseline x86-64 CPU (no FMA, SSE2), an AVX2 CPU (Haswell's
    features: 16 registers, the 4 x 12 tiles) and, on an AVX-512 machine, its own
    features at 256-bit vectors. Each child is first shown to choose the narrow tiles:
    a child that kept this process's 512-bit setting would test nothing new."""
    import llvmlite.binding as ll  # noqa: PLC0415
    from hslm.micro import wide_vectors  # noqa: PLC0415
    host = ll.get_host_cpu_features()
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    if variant == "generic-cpu":
        env.update(NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="")
    elif variant == "avx2":
        if not (host.get("avx2") and host.get("fma")):
            pytest.skip("not an AVX2 machine: Haswell's code would not run here")
        env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="")
    else:
        if not host.get("avx512f"):
            pytest.skip("not an AVX-512 machine: 256-bit vectors are already the only width")
        env.update(HSLM_VECTOR_WIDTH="256", NUMBA_CPU_FEATURES=None)
    assert kernel_choice(env) == (4, 12, False)
    if wide_vectors():  # the control: a child keeping this process's setting goes wide
        assert kernel_choice({"NUMBA_CACHE_DIR": env["NUMBA_CACHE_DIR"]}) == (9, 16, True)
    assert train_in_fresh_process(tmp_path / "run", TINY_ARGS, env) == GOLDEN_TINY
    assert file_digests(tmp_path / "run") == GOLDEN_TINY_FILES
    assert train_in_fresh_process(tmp_path / "hslm-3", ["--steps", "2", "--seed", "1729"],
                                  env) == GOLDEN_HSLM3


def test_golden_hslm3_run(tmp_path):
    assert train_in_fresh_process(tmp_path / "run", ["--steps", "2", "--seed", "1729"]) == \
        GOLDEN_HSLM3


def test_the_readme_quick_start_digest(tmp_path):
    """The digest the README publishes for its quick start (a user checks it with hslm info)."""
    out = tmp_path / "ckpt"
    train_in_fresh_process(out, ["--speed", "3", "--steps", "10", "--seed", "1729"])
    assert data_sha256(out / "ckpt_10.bin") == GOLDEN_QUICKSTART_BIN
    readme = (ROOT / "README.md").read_text()
    assert f"data sha256 {GOLDEN_QUICKSTART_BIN}" in readme
