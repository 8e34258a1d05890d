"""hslm.jit: how the kernels are compiled (one copy per plain signature; inner kernels
without Python entry points; reference counting only where a kernel allocates)."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit
from numba.core.caching import NullCache
from numba.core.errors import TypingError

from hslm.jit import kernel_entry, kernel_inner

FIRST, SECOND = 1, 2  # constants a kernel passes its callee, as layers.py passes WQ, WK...


def scale(x, k):
    return x * k


def caller_of(callee):
    def calls_with_constants(x):
        return callee(x, FIRST) + callee(x, SECOND) + callee(x, 3)
    return calls_with_constants


def uncached(kernel):
    """Compiled in every test run: the checks run, and a caller types its callees, only
    when it compiles (not when it is loaded from the cache)."""
    kernel._cache = NullCache()
    return kernel


scaled = kernel_inner(scale)
calls_scaled_with_constants = uncached(kernel_entry(caller_of(scaled)))
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


def head(a):
    return a[:2]


def sum_of_head_of(callee):
    def sum_of_head(a):
        h = callee(a)
        return h[0] + h[1]
    return sum_of_head


def same(a):
    return a


def test_a_kernel_that_does_not_count_references_cannot_hand_back_an_array():
    """Without allocates=True (no reference counting) a kernel returning its argument
    (Numba itself refuses a view or a new array there) is refused as it compiles: its
    caller would drop a count never taken, and free an array still in use. The control:
    with allocates=True it compiles and returns it."""
    x = np.arange(4.0)
    with pytest.raises(TypeError, match=r"test_jit\.same returns an array: it must count"):
        uncached(kernel_entry(same))(x)
    assert uncached(kernel_entry(allocates=True)(same))(x) is x


def test_a_kernel_that_does_not_count_references_cannot_call_one_that_returns_an_array():
    """A caller without reference counting would keep the count its callee took for the
    returned array (the array never freed): refused as the caller compiles, naming the
    callee. The controls: the caller with allocates=True runs; and the leak is real, not
    supposed: the same pair built by Numba's own njit (_nrt=False on the caller), called
    from a kernel that counts (as hslm's entry points that allocate do), leaves the
    argument's Python reference count one higher after each call."""
    counted_head = uncached(kernel_inner(allocates=True)(head))
    with pytest.raises(TypingError, match=r"test_jit\.head returns an array, so a kernel"):
        uncached(kernel_entry(sum_of_head_of(counted_head)))(np.arange(4.0))
    x = np.arange(4.0)
    counting = uncached(kernel_entry(allocates=True)(sum_of_head_of(counted_head)))
    assert counting(x) == 1.0
    before = sys.getrefcount(x)
    for _ in range(10):
        counting(x)
    assert sys.getrefcount(x) == before
    middle = njit(_nrt=False)(sum_of_head_of(njit(_nrt=True)(head)))
    leaking = njit(_nrt=True)(lambda a: middle(a))
    assert leaking(x) == 1.0
    before = sys.getrefcount(x)
    for _ in range(10):
        leaking(x)
    assert sys.getrefcount(x) == before + 10


def test_a_kernel_without_reference_counting_reads_and_writes_arrays():
    """The default (no reference counting): a kernel given arrays, and passing views of
    them to another, computes what it did with counting, and leaves no count behind."""
    def fill_halves(a):
        inner_fill(a[:2], 1.0)
        inner_fill(a[2:], 2.0)

    def fill(a, v):
        for i in range(a.shape[0]):
            a[i] = v

    inner_fill = uncached(kernel_inner(fill))
    plain = uncached(kernel_entry(fill_halves))
    x = np.zeros(4)
    before = sys.getrefcount(x)
    for _ in range(10):
        plain(x)
    assert list(x) == [1.0, 1.0, 2.0, 2.0] and sys.getrefcount(x) == before


def makes_scratch(n):
    s = np.empty(n)
    s[:] = 1.0
    return s.sum()


def calls_with(callee):
    def call(n):
        return callee(n)
    return call


def test_a_plain_njit_kernel_that_allocates_says_so_or_it_takes_its_callers_flags():
    """Numba gives a function with no _nrt of its own the reference counting of the kernel
    whose compile first compiles it (inherit_if_not_set): called first from a kernel that
    counts no references, a plain njit function that allocates fails to compile. So
    the generated panel kernels (each allocates its scratch) are kernel_entry(allocates=
    True); the control: the same function with _nrt=True compiles from the same caller."""
    plain = njit(cache=False)(makes_scratch)
    with pytest.raises(TypingError):
        uncached(kernel_entry(calls_with(plain)))(3)
    explicit = njit(cache=False, _nrt=True)(makes_scratch)
    assert uncached(kernel_entry(calls_with(explicit)))(3) == 3.0
    from hslm import panel_kernels
    kernels = [v for k, v in vars(panel_kernels).items()
               if k.startswith(("ternary_panel_matmul_", "panel_matmul_add",
                                "ternary_sparse_matmul_"))]
    assert len(kernels) == 9 and all(k.targetoptions.get("_nrt") is True for k in kernels)


def every_kind_of_flags():
    """Numba's compile flags: unset, set to their default, set otherwise, in combinations."""
    from numba.core.compiler import Flags
    options = ["nrt", "boundscheck", "error_model", "no_cpython_wrapper", "inline", "fastmath"]
    values = {"nrt": [True, False], "boundscheck": [None, True, False],
              "error_model": ["python", "numpy"], "no_cpython_wrapper": [True, False],
              "inline": ["never", "always"], "fastmath": [False, True]}
    out = [Flags()]
    rng = np.random.default_rng(7)
    for _ in range(60):
        f = Flags()
        for name in rng.choice(options, size=rng.integers(1, 4), replace=False):
            vs = values[name]
            setattr(f, name, vs[rng.integers(len(vs))])
        out.append(f)
    return out


def test_numba_flags_hash_and_compare_as_numba_does():
    """hslm/__init__.py answers Numba's flag comparisons without building every option's
    value (2.7% of a first run's compile): the same answer as Numba's for every pair and
    the same hash. The control: the shortcut it starts with (stored values equal) alone
    would call flags unequal that Numba calls equal (an option set to its default)."""
    from numba.core.compiler import Flags
    from numba.core.targetconfig import TargetConfig
    numba_eq = TargetConfig.__eq__.numba_eq  # (an AttributeError: not installed)
    numba_hash = TargetConfig.__hash__.numba_hash
    flags = every_kind_of_flags()
    equal_pairs = stored_differs = 0
    for a in flags:
        assert hash(a) == numba_hash(a)
        for b in flags:
            assert (a == b) == numba_eq(a, b) and (a != b) == (not numba_eq(a, b))
            equal_pairs += numba_eq(a, b)
            stored_differs += bool(numba_eq(a, b) and a._values != b._values)
    assert equal_pairs > len(flags) and stored_differs > 0
    unset, default = Flags(), Flags()
    default.nrt = False  # (the default)
    assert unset._values != default._values and unset == default and numba_eq(unset, default)


def test_a_flags_class_with_its_own_property_is_compared_by_numba():
    """A TargetConfig whose option reads through a property of its own is left to
    Numba's comparison (it might read something else than the stored value)."""
    from numba.core.targetconfig import Option, TargetConfig

    class Own(TargetConfig):
        level = Option(type=int, default=0, doc="a level")

    Own.level = property(lambda self: 1)  # (reads 1, whatever is stored)
    a, b = Own(), Own()
    a._values["level"] = 5
    assert a == b  # Numba's: both read 1; the stored values alone would say unequal


def test_numba_error_messages_are_not_coloured_unless_the_user_says(tmp_path):
    """Numba colours each of the ~22,000 error messages its typing makes and discards in
    a first run's compile (2.4% of it); hslm turns that off before Numba is imported,
    unless the user set NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING. The control: Numba
    imported without hslm colours them (where colorama is installed)."""
    import os
    import subprocess
    pytest.importorskip("colorama")
    code = "import {0}; from numba.core import errors; print(type(errors.termcolor()).__name__)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"}

    def scheme(first, **user):
        p = subprocess.run([sys.executable, "-c", code.format(first)], env={**env, **user},
                           capture_output=True, text=True, check=True)
        return p.stdout.strip()

    assert scheme("hslm") == "NOPColorScheme"
    assert scheme("numba") == "HighlightColorScheme"
    # the user's setting wins (Numba reads an empty value as "colour them")
    assert scheme("hslm", NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING="") == "HighlightColorScheme"


def test_kernels_have_no_c_entry_point():
    """No kernel gets Numba's C-callable wrapper (no_cfunc_wrapper, hslm/jit.py): it serves
    only a kernel used as a first-class function value, and each cost a module of its own
    to optimise and make machine code of. A kernel_entry keeps its Python entry point;
    the control: plain njit makes both."""
    import importlib
    import re
    entry = uncached(kernel_entry(scale))
    assert entry(2.0, 3.0) == 6.0

    def defined(kernel):
        code = kernel.inspect_llvm(kernel.signatures[0])
        return re.findall(r'^define [^@]*@"?([^"( ]+)', code, re.M)

    names = defined(entry)
    assert any(n.startswith("_ZN7cpython") for n in names), names  # the Python entry
    assert not any(n.startswith("cfunc.") for n in names), names
    plain = njit(cache=False)(scale)
    assert plain(2.0, 3.0) == 6.0
    assert any(n.startswith("cfunc.") for n in defined(plain))
    from hslm.jit import KernelDispatcher
    kernels = [v for m in ("layers", "kernels", "windows", "optim", "params", "vsa",
                           "panel_kernels")
               for v in vars(importlib.import_module(f"hslm.{m}")).values()
               if isinstance(v, KernelDispatcher)]  # (hslm.jit's three kinds)
    assert len(kernels) > 30
    assert all(k.targetoptions.get("no_cfunc_wrapper") is True for k in kernels)


def twice_plus_one(x):
    y = x + x
    return y + 1.0


def calls_a_part_twice(part):
    def caller(x):
        return part(x) * part(x + 1.0)
    return caller


def test_an_inlined_part_is_not_copied_and_compiles_to_the_same_code():
    """hslm/__init__.py: a kernel part's IR, derived afresh for each call site, is inlined
    without Numba's two deep copies of it (3% of a first run's compile). The same code
    results (the control: Numba's own inline_function, copies and all); the copies are
    gone (counted); and once installed (at the first compile) it stays."""
    import copy
    from numba.core import inline_closurecall as ic
    from numba.core import ir
    from hslm.jit import kernel_part
    uncached(kernel_entry(scale))(1.0, 2.0)  # (a compile: installs it if none has yet)
    ours = ic.InlineWorker.inline_function
    numba_inline_function = ours.numba_inline_function  # (an AttributeError: not installed)
    deepcopy = copy.deepcopy

    def compiled(inline_function):
        """The caller's machine code, compiled with this inline_function, and how many
        IR blocks were deep-copied meanwhile."""
        copied = []

        def counting(x, memo=None):
            copied.append(isinstance(x, ir.Block))
            return deepcopy(x, memo)

        part = kernel_part(twice_plus_one)
        caller = uncached(kernel_entry(calls_a_part_twice(part)))
        ic.InlineWorker.inline_function = inline_function
        copy.deepcopy = counting
        try:
            assert caller(2.0) == 5.0 * 7.0
        finally:
            copy.deepcopy = deepcopy
            ic.InlineWorker.inline_function = ours
        asm = caller.inspect_asm(caller.signatures[0])
        return [x for x in asm.splitlines() if "\t" in x and "calls_a_part_twice" not in x], \
            sum(copied)

    asm_ours, copied_ours = compiled(ours)
    asm_numba, copied_numba = compiled(numba_inline_function)
    assert asm_ours == asm_numba and len(asm_ours) > 10
    assert copied_ours == 0 and copied_numba >= 4  # two copies of each block, two sites


def as_command_and_program(probe):
    """probe's output words, run in a process that poses as the hslm command (sys.argv[0]
    'hslm' where the probe has {argv}, before it imports hslm) and in a plain program."""
    out = {}
    for name, argv in (("command", "sys.argv[0] = 'hslm'\n"), ("program", "")):
        p = subprocess.run([sys.executable, "-c", probe.format(argv=argv)], capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        out[name] = p.stdout.split()
    return out


@pytest.mark.skipif(importlib.util.find_spec("scipy") is None
                    or importlib.util.find_spec("cffi") is None,
                    reason="needs SciPy and cffi installed (Numba loads them where they are)")
def test_the_hslm_command_loads_no_blas_or_cffi_into_numba():
    """Numba's first refresh imports SciPy's BLAS and cffi where installed (0.7 s of a
    start); hslm's kernels use neither, so its own processes hide them: there Numba has
    no BLAS. A program that imports hslm (the control) keeps Numba's as it is."""
    probe = ("import sys\n{argv}import hslm\nfrom hslm import kernels\n"
             "import numba.np.arraymath as a\n"
             "print(a._HAVE_BLAS, 'cffi' in sys.modules, 'scipy.linalg' in sys.modules)")
    out = as_command_and_program(probe)
    assert out["command"] == ["False", "False", "False"]
    assert out["program"] == ["True", "True", "True"]


def test_the_hslm_command_compiles_without_loop_strength_reduction():
    """hslm's own processes set LLVM's options (hslm.LLVM_OPTIONS: LSR off, 9% of a first
    run's compile, no speed lost); a program that imports hslm (the control) keeps LLVM as
    it is. Seen in the machine code of a loop whose index LSR would turn into a pointer.
    The bits do not depend on it: the golden runs go through the command
    (tests/test_golden.py)."""
    probe = ("import sys\n{argv}import hslm\nimport numpy as np\nfrom numba import njit\n"
             "@njit\ndef f(a, s, n):\n    t = 0.0\n    for i in range(n):\n"
             "        t += a[i * s]\n    return t\n"
             "print(f(np.arange(12.0), 3, 4))\n"
             "print(list(f.inspect_asm().values())[0].count('imul'))")
    out = as_command_and_program(probe)
    assert out["command"][0] == out["program"][0] == "18.0"
    # without LSR the index i * s is multiplied in the loop; with it, a pointer steps along
    assert int(out["command"][1]) > int(out["program"][1])


# The MLP weight-gradient tiles compiled alone for a core of 16 vector registers (AVX2):
# for each, the vector instructions in its function that move a register to or from the
# stack, and the function's length.
ACTIVE_TILE_SPILLS = r"""
import re
import hslm
from numba import njit
from hslm import kernels

def alone(tile):
    @njit("void(" + ", ".join(["intp"] * 14) + ")", cache=False)
    def run(a, b, c, d, e, f, g, h, i, j, k, l, m, n):
        tile(a, b, c, d, e, f, g, h, i, j, k, l, m, n)
    return run.inspect_asm(run.signatures[0])

for name in ("ACTIVE_ROW", "ACTIVE_ROW_LESS"):
    body = []
    for line in alone(getattr(kernels, name)).splitlines():
        label = re.match(r"([A-Za-z_][\w$.]*):", line)
        if label:  # a function: the tile's has its mask walk (tzcnt)
            if any("tzcnt" in x for x in body):
                break
            body = []
        else:
            body.append(line)
    print(name, sum(1 for x in body if "mm" in x and "(%rsp)" in x), len(body))
"""


def test_the_mlp_weight_gradient_tiles_keep_their_sums_in_registers_on_avx2():
    """Each row of the active-row tile ends by adding its sums into the row, or, for a
    step's first window, storing them. Where the first way was written 0.0 + sum, LLVM
    sank both ways' additions into one, with a phi of 0.0 or the base for each of 13
    vectors: 26 live for 16 registers, so every row copied its bases through the stack
    (30 vector moves to and from the stack in the tile alone) and W_up's and W_down's
    gradients ran 7% slower, built for AVX2 (docs/performance-history.md, 2026-12-04
    23:00). Now no vector goes to the stack in the two tiles of a model's rows (243
    columns: 13 and 12 vectors). (Negative control, run by hand: the tiles as they were
    give 30 and 24. The clamped tile of narrower rows, ACTIVE_ROW_ANY, holds a register
    for each vector's offset and spills in its loop, as its docstring says: 51 then, 20
    now.)"""
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    p = subprocess.run([sys.executable, "-c", ACTIVE_TILE_SPILLS], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split()[1:] for line in p.stdout.splitlines()}
    assert set(rows) == {"ACTIVE_ROW", "ACTIVE_ROW_LESS"}, p.stdout
    for name, (spills, length) in rows.items():
        assert int(length) > 100 and int(spills) == 0, (name, spills, length)
