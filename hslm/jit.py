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

Reference counting (Numba's NRT) only where a kernel needs it: `@kernel_inner(allocates=
True)` (and kernel_entry's alike) for one that makes an array (np.empty ...), returns
one or calls a kernel that returns one; the others are compiled without it. The arrays
a kernel is given live in Python for the whole call, and the struct arguments (the
Model, the Acts ...) hold 53 of them: counting them at every assignment and inlined
call was a fifth of the long kernels' LLVM code (windows_backward: 731 decrements, 456
increments and the field extractions around them); without it the forward's blocks and
the backward compile a fifth faster (docs/performance-history.md, 2026-12-03 07:35).
Numba itself refuses to compile an allocation where counting is off; the one unsafe
pairing, an array handed back across the line (a count never taken, then dropped: a
freed array in use; or taken and never dropped: a leak), is refused here when it
compiles (KernelDispatcher).
"""
from __future__ import annotations

import os

from numba import config, types
from numba.core.errors import TypingError
from numba.core.registry import CPUDispatcher
from numba.core.targetconfig import ConfigStack

from . import KERNEL_FILES

# njit's own options (nopython, no bounds check) and ours. No C entry point
# (no_cfunc_wrapper): Numba's C-callable wrapper of a kernel serves only a kernel used as
# a first-class function value, which hslm never does, and each cost a module of its own
# through LLVM's optimiser and code generator (some 2% of a first run's compile).
OPTIONS = dict(nopython=True, boundscheck=None, nogil=True, error_model="numpy",
               no_cfunc_wrapper=True)


def holds_arrays(t) -> bool:
    """Whether a value of Numba type t holds an array (itself, or in a tuple)."""
    if isinstance(t, types.Array):
        return True
    return isinstance(t, types.BaseTuple) and any(holds_arrays(x) for x in t.types)


class KernelDispatcher(CPUDispatcher):
    """A Numba dispatcher whose calls from other kernels are typed without Literal types
    (types.unliteral): one compiled copy per plain signature. It refuses the two
    compiles that would miscount an array's references (module docstring)."""

    def get_call_template(self, args, kws):
        template = super().get_call_template(tuple(types.unliteral(a) for a in args),
                                             {k: types.unliteral(v) for k, v in kws.items()})
        caller = ConfigStack().top_or_none()  # (the flags of the kernel being compiled)
        callee = self.overloads.get(tuple(template[2]))
        if (caller is not None and not caller.nrt and callee is not None
                and holds_arrays(callee.signature.return_type)):
            raise TypingError(f"{self._name()} returns an array, so a kernel that calls it "
                              "must count references: give the caller allocates=True "
                              "(hslm/jit.py)")
        return template

    def add_overload(self, cres):
        if not self.targetoptions["_nrt"] and holds_arrays(cres.signature.return_type):
            raise TypeError(f"{self._name()} returns an array: it must count references "
                            "(allocates=True, hslm/jit.py)")
        super().add_overload(cres)

    def _name(self):
        return f"{self.py_func.__module__}.{self.py_func.__qualname__}"


class InnerKernelDispatcher(KernelDispatcher):
    """A kernel compiled without a Python entry point (no_cpython_wrapper): Numba's own
    call from Python would jump to a null address, so it is refused here."""

    def __call__(self, *args, **kws):
        raise TypeError(f"{self._name()} runs only inside other kernels "
                        "(hslm.jit.kernel_inner): call a kernel that calls it")


def _decorator(dispatcher_class, **options):
    """@kind, or @kind(allocates=True) for a kernel that makes or returns an array, or
    calls a kernel that returns one (it counts references)."""
    def decorate(py_func=None, *, allocates=False):
        if py_func is None:
            return lambda f: decorate(f, allocates=allocates)
        if config.DISABLE_JIT:
            return py_func
        kernel = dispatcher_class(py_func=py_func, locals={},
                                  targetoptions={**OPTIONS, **options, "_nrt": allocates})
        # (its cache stamped with hslm's source as well, wherever its file lies: hslm/__init__)
        KERNEL_FILES.add(os.path.abspath(py_func.__code__.co_filename))
        kernel.enable_caching()
        return kernel
    return decorate


kernel_entry = _decorator(KernelDispatcher)
# (no Python entry point either: like the C one, it cost a module of its own)
kernel_inner = _decorator(InnerKernelDispatcher, no_cpython_wrapper=True)
kernel_part = _decorator(KernelDispatcher, inline="always")
