"""hslm: a Numba CPU trainer for ternary HSLM language models."""
import os as _os
import sys as _sys

__version__ = "0.2.0"


def _writable_kernel_cache():
    """Numba caches compiled kernels beside the source; an install the user cannot
    write to (system site-packages) would fail at import, so point Numba at the
    user's cache folder instead, unless NUMBA_CACHE_DIR is already set."""
    if "NUMBA_CACHE_DIR" in _os.environ or "numba" in _sys.modules:
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.access(here, _os.W_OK):
        return
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache")
    _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(base, "hslm", "numba")


def _prefer_512_bit_vectors():
    """On AVX-512 machines let LLVM use 512-bit vectors (it prefers 256 by default):
    the register-tiled kernels run about a third faster. The width never changes a
    result (nothing is reassociated), only speed. Must happen before Numba is imported;
    a NUMBA_CPU_FEATURES set by the user wins, and HSLM_VECTOR_WIDTH=256 opts out."""
    if ("NUMBA_CPU_FEATURES" in _os.environ or "numba" in _sys.modules
            or _os.environ.get("HSLM_VECTOR_WIDTH") == "256"):
        return
    try:
        import llvmlite.binding as ll
        features = ll.get_host_cpu_features()
    except Exception:  # no llvmlite or an unknown CPU: keep Numba's defaults
        return
    if features.get("avx512f"):
        _os.environ["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"


_writable_kernel_cache()
_prefer_512_bit_vectors()
