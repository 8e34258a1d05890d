"""hslm.jit: how the kernels are compiled (one copy per plain signature; inner kernels
without Python entry points)."""
import numpy as np
import pytest
from numba import njit
from numba.core.caching import NullCache

from hslm.jit import kernel_entry, kernel_inner

FIRST, SECOND = 1, 2  # constants a kernel passes its callee, as layers.py passes WQ, WK...


def scale(x, k):
    return x * k


def caller_of(callee):
    def calls_with_constants(x):
        return callee(x, FIRST) + callee(x, SECOND) + callee(x, 3)
    return calls_with_constants


scaled = kernel_inner(scale)
calls_scaled_with_constants = kernel_entry(caller_of(scaled))
# compiled in every test run (a caller loaded from the cache would not type its callee)
calls_scaled_with_constants._cache = NullCache()
# the control: the same functions as Numba's own njit compiles them
scaled_plain = njit(scale)
calls_scaled_plain_with_constants = njit(caller_of(scaled_plain))


def test_a_callee_is_compiled_once_whatever_constants_it_is_given():
    """Three constants, one compiled copy of the callee (its argument typed int64, not
    Literal[int](1), Literal[int](2), ...). The control: Numba's own njit makes a copy
    for each constant."""
    assert calls_scaled_with_constants(2.0) == 12.0
    assert [str(sig[1]) for sig in scaled.overloads] == ["int64"]
    assert calls_scaled_plain_with_constants(2.0) == 12.0
    assert len(scaled_plain.overloads) == 3, list(scaled_plain.overloads)


def test_an_inner_kernel_called_from_python_is_refused_not_a_crash():
    """kernel_inner builds no Python entry point; Numba would jump to a null address
    (a segmentation fault), hslm raises a TypeError that names the kernel. The control:
    the kernel that calls it runs from Python."""
    calls_scaled_with_constants(1.0)
    with pytest.raises(TypeError, match=r"test_jit\.scale runs only inside other kernels"):
        scaled(1.0, 2)
    assert calls_scaled_with_constants(np.float64(0.5)) == 3.0
