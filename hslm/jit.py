"""How hslm compiles its kernels: Numba's njit with one set of options, in three kinds.

    kernel_entry  a kernel that Python calls (other kernels may call it too)
    kernel_inner  a kernel that only other kernels call: Numba builds no Python entry
                  point for it (calling it from Python raises a TypeError, not a crash)
    kernel_part   a part inlined into the one kernel that calls it (hslm/layers.py)

Each is cached on disk, releases the GIL and divides as numpy does (x / 0 is inf or
nan, not an exception), and each is typed for its arguments' plain types. Numba
otherwise compiles a callee once for each constant a kernel passes it (its Literal
types): tensor_index(dims, b, WQ) and the like made nine copies of tensor_index,
quantize_into(..., True, ...) a second quantize_into, and copies that one process
compiled were not found in the cache by another that passed other constants. With
the Python entry points that no one calls left out as well (and AdamW one kernel), the
compile jobs, one after another on a 2-core first-generation AMD Zen, fell from 68 s
to 56 s and a first run's compile from 40 s to 35 s (README, "Start-up"). Nothing here
changes what a kernel computes: the same source, the same operations, the same bits.
"""
from __future__ import annotations

from numba import config, types
from numba.core.registry import CPUDispatcher

# njit's own options (nopython, no bounds check) and ours
OPTIONS = dict(nopython=True, boundscheck=None, nogil=True, error_model="numpy")


class KernelDispatcher(CPUDispatcher):
    """A Numba dispatcher whose calls from other kernels are typed without Literal types
    (types.unliteral): one compiled copy per plain signature."""

    def get_call_template(self, args, kws):
        return super().get_call_template(tuple(types.unliteral(a) for a in args),
                                         {k: types.unliteral(v) for k, v in kws.items()})


class InnerKernelDispatcher(KernelDispatcher):
    """A kernel compiled without a Python entry point (no_cpython_wrapper): Numba's own
    call from Python would jump to a null address, so it is refused here."""

    def __call__(self, *args, **kws):
        raise TypeError(f"{self.py_func.__module__}.{self.py_func.__qualname__} runs only "
                        "inside other kernels (hslm.jit.kernel_inner): call a kernel that "
                        "calls it")


def _decorator(dispatcher_class, **options):
    def decorate(py_func):
        if config.DISABLE_JIT:
            return py_func
        kernel = dispatcher_class(py_func=py_func, locals={},
                                  targetoptions={**OPTIONS, **options})
        kernel.enable_caching()
        return kernel
    return decorate


kernel_entry = _decorator(KernelDispatcher)
# (no C entry point either: the Python one and the C one each cost a module of their own
# through LLVM's optimiser and code generator)
kernel_inner = _decorator(InnerKernelDispatcher, no_cpython_wrapper=True,
                          no_cfunc_wrapper=True)
kernel_part = _decorator(KernelDispatcher, inline="always")
