"""hslm: a Numba CPU trainer for ternary HSLM language models."""
import os as _os
import sys as _sys

__version__ = "0.2.0"
# Variables an MPI launcher sets in each rank (mpiexec of MPICH, Open MPI, PMIx, MVAPICH)
MPI_LAUNCH_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK",
                        "MV2_COMM_WORLD_SIZE")
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launch_value(names, default=None):
    """The first of these launcher variables that is set (a rank's number or the ranks'
    count, as the launcher wrote it, before MPI starts), else default."""
    return next((_os.environ[v] for v in names if v in _os.environ), default)
# pyproject.toml's run-time dependencies, by the names they are imported as (llvmlite comes
# with numba)
RUN_TIME_PACKAGES = frozenset({"numba", "llvmlite", "numpy", "click"})


def missing_package_line(error: ModuleNotFoundError):
    """The command's one error line for a run-time package that is not installed (hslm
    run from a checkout that pip never installed), or None for any other module (one of
    hslm's own, say: a bug, to be shown whole)."""
    if error.name not in RUN_TIME_PACKAGES:
        return None
    return (f"error: hslm needs the Python package {error.name}, which is not installed for "
            f"{_sys.executable} (pip install . installs hslm with numba, numpy and click)")


def main_or_missing_package():
    """hslm.cli.main, imported; a run-time package missing at that import (click and numpy
    are imported by the CLI's modules, numba later, by the command) is the one line."""
    try:
        from .cli import main
    except ModuleNotFoundError as e:
        line = missing_package_line(e)
        if line is None:
            raise
        print(line, file=_sys.stderr)
        _sys.exit(2)
    return main


def launch() -> str | None:
    """How this process was started as the hslm command: "script" (the console script,
    a program named hslm), "module" (`python -m hslm`) or "checkout" (the checkout's
    cli.py, by any path or link); None for a program that imports hslm (or `python -m
    hslm.precompile`, a first run's helper)."""
    argv0 = _sys.argv[0] if _sys.argv else ""
    here = _os.path.dirname(_os.path.abspath(__file__))
    if argv0 == "-m":  # runpy imports the package before the module it runs
        orig = list(getattr(_sys, "orig_argv", []))
        if "-mhslm" in orig or ("-m" in orig[:-1] and orig[orig.index("-m") + 1] == "hslm"):
            return "module"
        return None
    if not argv0:
        return None
    if _os.path.basename(argv0) == "hslm":
        return "script"
    real = _os.path.realpath(argv0)
    if real == _os.path.join(here, "__main__.py"):  # (what runpy leaves in argv[0] later)
        return "module"
    return "checkout" if real == _os.path.join(_os.path.dirname(here), "cli.py") else None


def _the_hslm_command() -> bool:
    """Whether this process is the hslm command (launch), not a program importing it."""
    return launch() is not None


def _early_signal(signum, frame):
    """Ctrl-C, SIGTERM or SIGHUP while the command is still starting (Python importing
    numpy, Numba and hslm, about half a second): nothing is open or written yet, so stop
    at once with the CLI's one line and exit status, not a traceback from inside an
    import."""
    import signal

    from .errors import stop_word  # (imported with the handler: no import is begun here)
    rank = launch_value(MPI_RANK_VARIABLES, "0")
    if rank == "0":  # under MPI (mpiexec forwards a signal to every rank) rank 0 says it
        _os.write(2, f"error: {stop_word(signum)}\n".encode())
    if launched_by_mpi():
        # die by the signal itself: an MPI launcher ends the other ranks when one is killed
        # by a signal, but not when one exits with a status before joining MPI (then they
        # waited forever in MPI's start for a rank that was gone)
        signal.signal(signum, signal.SIG_DFL)
        _os.kill(_os.getpid(), signum)
    _os._exit(128 + signum)  # 130, 143, 129


def launched_by_mpi(env=None) -> bool:
    """Whether an MPI launcher started this process (HSLM_MPI=1 forces MPI, HSLM_MPI=0
    ignores it). Here, not in hslm.distributed, so that _early_signal can ask without
    importing numpy in a signal handler."""
    env = _os.environ if env is None else env
    forced = env.get("HSLM_MPI")
    if forced in ("0", "1"):
        return forced == "1"
    return any(v in env for v in MPI_LAUNCH_VARIABLES)


def _stop_quietly_while_starting():
    """For the hslm command only (a program importing hslm keeps its own handlers): the
    three signals end the start-up with one line (_early_signal) until hslm.cli.main()
    puts Python's handlers back and handles them itself. First of all, so that Numba's
    import is covered."""
    if not _the_hslm_command():
        return
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    from .errors import TERMINATING  # (SIGTERM and SIGHUP; for _early_signal, stop_word)
    for s in (signal.SIGINT, *TERMINATING):
        if signal.getsignal(s) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(s, _early_signal)


def end_of_start_up():
    """hslm.cli.main(): the command's own handling takes over from _early_signal: Ctrl-C
    raises KeyboardInterrupt, SIGTERM and SIGHUP errors.Terminated (one line, 143 or 129,
    as Ctrl-C: their default end had killed a command, `hslm sample` drawing or `hslm
    train` importing its modules, with no line and its folder left). Under MPI SIGTERM
    and SIGHUP keep their default end until train's handler: a rank that raised would
    wait for the others to end their command to agree (a signal to one rank of `mpiexec
    ... hslm sample` took 30 s to end the job), where one killed by it ends them."""
    import signal

    from .errors import TERMINATING, raise_terminated
    for s in (signal.SIGINT, *TERMINATING):
        if signal.getsignal(s) is _early_signal:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT
                          else signal.SIG_DFL if launched_by_mpi() else raise_terminated)


def _writable_kernel_cache():
    """Numba caches compiled kernels beside the source; an install the user cannot
    write to (system site-packages) would fail at import, so point Numba at the
    user's cache folder instead (XDG_CACHE_HOME or ~/.cache), or, where that cannot be
    written either (a read-only image run with HOME=/ or /nonexistent: Numba's own
    fallbacks fail too, and the import had ended in a traceback), at one in the
    temporary folder; unless NUMBA_CACHE_DIR is already set."""
    if "NUMBA_CACHE_DIR" in _os.environ or "numba" in _sys.modules:
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.access(here, _os.W_OK):
        return
    import tempfile
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache")
    home_cache = _os.path.join(base, "hslm", "numba")
    if not _writable_folder(home_cache):
        try:  # only this user's own folder, which no one else can write: Numba's index is
            # a pickle, so a folder another user planted there would run their code
            private = _os.path.join(tempfile.gettempdir(), f"hslm-numba-{_os.getuid()}")
        except (OSError, AttributeError):  # (no temporary folder; no getuid here)
            private = None
        if private is not None and _writable_folder(private, private=True):
            home_cache = private
    _os.environ["NUMBA_CACHE_DIR"] = home_cache  # (nowhere writable: Numba says so)


def _writable_folder(folder, private=False) -> bool:
    """Whether folder is (made if need be) a folder a file can be made in; private: made
    0o700, and only if it is this user's and no one else may write it."""
    import stat
    import tempfile
    try:
        _os.makedirs(folder, mode=0o700 if private else 0o777, exist_ok=True)
        st = _os.lstat(folder)
        if private and (st.st_uid != _os.getuid() or st.st_mode & 0o022
                        or not stat.S_ISDIR(st.st_mode)):
            return False
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        return False
    return True


def _prefer_512_bit_vectors():
    """On AVX-512 machines let LLVM use 512-bit vectors (it prefers 256 by default):
    the register-tiled kernels run about a third faster. The width never changes a
    result (nothing is reassociated), only speed. Must happen before Numba is imported;
    a NUMBA_CPU_FEATURES set by the user wins, and HSLM_VECTOR_WIDTH=256 opts out.
    Where a program imported Numba first it is too late: say so once (on this project's
    Zen 5 the MLP's weight-gradient tile ran 0.97 ms a window batch built that way,
    against 0.60), and go on with 256-bit vectors."""
    if "NUMBA_CPU_FEATURES" in _os.environ or _os.environ.get("HSLM_VECTOR_WIDTH") == "256":
        return
    try:
        import llvmlite.binding as ll
        features = ll.get_host_cpu_features()
    except Exception:  # no llvmlite or an unknown CPU: keep Numba's defaults
        return
    if not features.get("avx512f"):
        return
    if _sys.modules.get("numba") is not None:  # (None: an import of it is blocked)
        import warnings
        warnings.warn("numba was imported before hslm, so hslm's kernels use 256-bit vectors "
                      "on this AVX-512 core: slower, the same results. Import hslm first "
                      "(or set HSLM_VECTOR_WIDTH=256 to keep 256 bits quietly).", stacklevel=3)
        return
    _os.environ["NUMBA_CPU_FEATURES"] = features.flatten() + ",-prefer-256-bit"


def _tolerate_stale_kernel_caches():
    """Numba unpickles a kernel cache's index before it checks that the index belongs to
    this source, so an index left by another hslm version whose kernels' argument types
    name a class since moved (hslm.layers.Model, now in hslm.params) stopped the run with
    a traceback instead of compiling afresh. Such an index is stale: read it as empty
    (Numba then compiles and writes a new one). Runs after the three settings above, which
    must precede Numba's import."""
    import pickle

    try:
        from numba.core import caching
        load_index = caching.IndexDataCacheFile._load_index
    except (ImportError, AttributeError):  # another Numba: leave it as it is
        return
    if getattr(load_index, "hslm_tolerant", False):
        return

    def tolerant_load_index(self):
        try:
            return load_index(self)
        except (AttributeError, ImportError, EOFError, TypeError, ValueError,
                pickle.UnpicklingError):
            return {}

    tolerant_load_index.hslm_tolerant = True
    tolerant_load_index.numba_load_index = load_index  # (a test's negative control)
    caching.IndexDataCacheFile._load_index = tolerant_load_index


# The files of the kernels hslm.jit made, wherever they lie: their caches are stamped
# with the package's digest (_kernel_caches_follow_the_whole_package).
KERNEL_FILES = set()


def _kernel_caches_follow_the_whole_package():
    """Numba's cache of a kernel is stamped with the kernel's own source file only (its
    documentation: cache invalidation "fails to recognize changes in symbols defined in
    a different file"), yet the cached code holds every kernel it calls and every
    constant it read, from hslm's other files: after a change to kernels.py alone (a
    checkout, an editable install) the cached kernels of windows.py ran the old
    kernels.py. So each of hslm's kernels is stamped with a digest of every .py file of
    the package as well, taken at import: any change to hslm's source compiles them all
    again (as an upgrade does). So is every kernel hslm.jit makes in a file outside the
    package (the tests' entry points, tests/kernel_entries.py, which hold hslm's kernels
    inside them: after a change to kernels.py alone a test had run the old code)."""
    import hashlib

    try:
        from numba.core import caching
        mixin = caching._SourceFileBackedLocatorMixin
        numba_stamp = mixin.get_source_stamp
    except (ImportError, AttributeError):  # another Numba: leave it as it is
        return
    if getattr(numba_stamp, "hslm_package", None) is not None:
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    h = hashlib.sha256()
    try:
        for name in sorted(n for n in _os.listdir(here) if n.endswith(".py")):
            with open(_os.path.join(here, name), "rb") as f:
                data = f.read()
            h.update(b"%s %d\n" % (name.encode(), len(data)) + data)
    except OSError:  # not a folder of files (hslm run from a zip): Numba's stamps alone
        return
    package = h.hexdigest()

    def get_source_stamp(self):
        stamp = numba_stamp(self)
        path = _os.path.abspath(self._py_file)
        if _os.path.dirname(path) == here or path in KERNEL_FILES:
            return stamp, package
        return stamp

    get_source_stamp.hslm_package = package
    get_source_stamp.numba_get_source_stamp = numba_stamp  # (a test's negative control)
    mixin.get_source_stamp = get_source_stamp


_CACHE_SAVE_FAILURES = []  # why this process's first kernel could not be saved


def kernel_cache_failure() -> str | None:
    """Why Numba's cache could not save a kernel this process compiled (the first
    failure: "No space left on device"), or None where every save has gone through."""
    return _CACHE_SAVE_FAILURES[0] if _CACHE_SAVE_FAILURES else None


def note_kernel_cache_failure(why: str):
    """The first failure to save in Numba's cache (kernel_cache_failure), said once."""
    if _CACHE_SAVE_FAILURES:
        return
    _CACHE_SAVE_FAILURES.append(why)
    if not _os.environ.get("HSLM_QUIET_CACHE_WARNINGS"):
        from . import distributed  # (under MPI rank 0 alone prints)
        if distributed.is_writer():
            print(f"warning: cannot save compiled kernels in Numba's cache ({why}); they will "
                  "compile again next run", file=_sys.stderr)


def _kernel_cache_saves_may_fail():
    """A kernel that compiled but cannot be saved in Numba's cache (a full disk, a file-size
    limit, a cache folder made read-only) stopped the run with a traceback from Numba's
    cache; the cache only saves time, so the run goes on with a warning (once) and the
    kernel compiles again next time."""
    try:
        from numba.core import caching
        numba_save = caching.Cache.save_overload
    except (ImportError, AttributeError):
        return
    if getattr(numba_save, "numba_save_overload", None) is not None:
        return

    def save_overload(self, sig, data):
        try:
            numba_save(self, sig, data)
        except OSError as e:
            note_kernel_cache_failure(e.strerror or str(e))

    save_overload.numba_save_overload = numba_save  # (a test's negative control)
    caching.Cache.save_overload = save_overload


def _plain_numba_error_messages():
    """Numba's typing and lowering find most implementations by trying candidates and
    catching the errors of those that do not fit: some 22,000 error messages in a first
    run's compile, each coloured for a terminal where colorama is installed (wrapping
    stdout and stderr anew each time), though none is ever shown. Numba's own switch for
    plain messages (NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING, documented for test runs)
    takes that 2.4% off the compile; hslm's errors are one plain line anyway. Before
    Numba is imported; a value set by the user wins."""
    if "numba" not in _sys.modules:
        _os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")


def _faster_numba_flag_comparisons():
    """Numba finds an overloaded function's compiled implementation in a dict keyed by,
    among others, the compile flags in force: some 33,000 hashes and 74,000 comparisons
    of flags in a first run's compile, each building a dict of all 22 options through
    their properties (TargetConfig.values): 2.7% of the compile. The same answers,
    cheaply: Numba's hash is that of the sorted option names (sorted(self.values()) sorts
    the keys), one number per class; and two flags of one class are equal where each
    option set in either reads the same in both (what each option's property reads:
    the stored value, else the class's default), the unset ones being the defaults on
    both sides. A class whose options are not all plain properties goes to Numba's."""
    try:
        from numba.core import targetconfig
        TargetConfig = targetconfig.TargetConfig
        numba_hash, numba_eq = TargetConfig.__hash__, TargetConfig.__eq__
        numba_getter = type(TargetConfig).__init__  # (the metaclass makes the properties)
    except (ImportError, AttributeError):  # another Numba: leave it as it is
        return
    if getattr(numba_eq, "numba_eq", None) is not None:
        return
    hashes, plain = {}, {}

    def plain_options(cls) -> bool:
        """Whether each option of cls reads through the getter Numba's metaclass made."""
        if cls not in plain:
            plain[cls] = all(
                isinstance(p := getattr(cls, name, None), property) and p.fget is not None
                and p.fget.__qualname__.startswith(numba_getter.__qualname__ + ".")
                for name in cls.options)
        return plain[cls]

    def __hash__(self):
        cls = type(self)
        h = hashes.get(cls)
        if h is None:
            h = hashes[cls] = hash(tuple(sorted(cls.options)))
        return h

    def __eq__(self, other):
        cls = type(self)
        if type(other) is not cls or not plain_options(cls):
            return numba_eq(self, other)
        a, b = self._values, other._values
        if a == b:
            return True
        options = cls.options
        for name in a.keys() | b.keys():
            option = options.get(name)
            if option is None:
                return numba_eq(self, other)
            x, y = a.get(name, option.default), b.get(name, option.default)
            if x is not y and x != y:  # (as a dict comparison compares values)
                return False
        return True

    __hash__.numba_hash, __eq__.numba_eq = numba_hash, numba_eq  # (a test's controls)
    TargetConfig.__hash__, TargetConfig.__eq__ = __hash__, __eq__


def _an_hslm_process() -> bool:
    """The hslm command, or one of its first run's compile helpers (`python -m
    hslm.precompile`): a process that runs hslm's kernels and nothing else's."""
    orig = list(getattr(_sys, "orig_argv", []))
    return _the_hslm_command() or ("-m" in orig[:-1]
                                   and orig[orig.index("-m") + 1] == "hslm.precompile")


class _hidden_from_import:
    """`with _hidden_from_import("scipy"):` an import of scipy (or of one of its modules)
    raises ImportError within the block, where scipy was not imported before it."""

    def __init__(self, *names):
        self.names = names

    def __enter__(self):
        self.hidden = [m for m in self.names if m not in _sys.modules]
        for m in self.hidden:
            _sys.modules[m] = None

    def __exit__(self, *exc):
        for m in self.hidden:
            if m in _sys.modules and _sys.modules[m] is None:
                del _sys.modules[m]
        return False


_UNUSED_BY_KERNELS = ("scipy.linalg", "cffi")  # what Numba would import for kernels to call


def _numba_registries_without_blas_or_cffi():
    """Numba's first context refresh (as the first kernel is loaded or compiled) imports
    SciPy's BLAS, to offer np.dot and np.linalg inside kernels, and cffi, where either is
    installed: 0.7 s of every start here (Numba's import and first refresh, 1.53 against
    0.80 s without them). hslm's kernels call neither (a BLAS orders its sums its own way,
    machine by machine: no bit may depend on one), so in hslm's own processes that refresh
    runs with both hidden from import; a kernel that called np.dot would then fail to
    compile, loudly. A program that imports hslm keeps Numba as it is."""
    if not _an_hslm_process():
        return
    try:
        from numba.core import cpu
        load = cpu.CPUContext.load_additional_registries
    except (ImportError, AttributeError):  # another Numba: leave it as it is
        return
    if getattr(load, "numba_load_additional_registries", None) is not None:
        return
    with _hidden_from_import(*_UNUSED_BY_KERNELS):  # the modules that ask for them at import
        from numba.core.typing import cffi_utils  # noqa: F401
        from numba.np import arraymath  # noqa: F401

    def load_additional_registries(self):
        with _hidden_from_import(*_UNUSED_BY_KERNELS):
            try:
                return load(self)
            finally:
                cpu.CPUContext.load_additional_registries = load  # the first refresh only

    load_additional_registries.numba_load_additional_registries = load
    cpu.CPUContext.load_additional_registries = load_additional_registries


def _inlined_parts_not_copied():
    """Numba inlines each kernel part (inline="always", hslm/jit.py) into its caller with
    an IR it derives afresh from the part's bytecode (InlineWorker.inline_function), which
    inline_ir then deep-copies twice: once because it mutates what it is given (other
    callers pass an IR they keep), once to return an unmutated original, which this
    caller discards. For an IR made for this one call both copies are waste: 2.0 s of a
    first run's compile on the first-generation Zen (510 blocks, 3%). Inside
    inline_function's own call of inline_ir the module's copy.deepcopy returns its
    argument; every other use of inline_ir copies as before. The same IR is inlined, so
    the same code results (tests/test_jit.py). Installed when Numba first compiles
    (its compile event), so that a run whose kernels all come from the cache does not
    import Numba's inliner (0.1 s)."""
    try:
        from numba.core import event
    except ImportError:  # another Numba: leave it as it is
        return
    if any(getattr(x, "hslm_first_compile", False) for x in event._registered["numba:compile"]):
        return

    class FirstCompile(event.Listener):
        """Makes the change at the start of Numba's first compile; nothing after."""
        hslm_first_compile = True
        done = False

        def on_start(self, ev):
            if not self.done:
                self.done = True
                _not_copying_inline_function()

        def on_end(self, ev):
            pass

    event.register("numba:compile", FirstCompile())


def _not_copying_inline_function():
    """_inlined_parts_not_copied's change, made once, where this Numba's inliner is the
    one it mirrors."""
    import copy
    import threading

    try:
        from numba.core import inline_closurecall as ic
        worker = ic.InlineWorker
        numba_inline_function = worker.inline_function
    except (ImportError, AttributeError):
        return
    if getattr(numba_inline_function, "numba_inline_function", None) is not None:
        return
    names = set(numba_inline_function.__code__.co_names)
    if getattr(ic, "copy", None) is not copy or not {"run_untyped_passes", "inline_ir"} <= names:
        return  # not the two steps mirrored below
    fresh = threading.local()

    class CopyModule:
        """inline_closurecall's `copy`: the copy module, but for deepcopy while
        inline_function's fresh IR is being inlined."""

        def __getattr__(self, name):
            return getattr(copy, name)

        @staticmethod
        def deepcopy(x, memo=None):
            return x if getattr(fresh, "ir", False) else copy.deepcopy(x, memo)

    def inline_function(self, caller_ir, block, i, function, arg_typs=None):
        callee_ir = self.run_untyped_passes(function)  # (Numba's inline_function, but ...)
        fresh.ir = True  # (... this IR is not copied)
        try:
            return self.inline_ir(caller_ir, block, i, callee_ir, function.__code__.co_freevars,
                                  arg_typs=arg_typs)
        finally:
            fresh.ir = False

    inline_function.numba_inline_function = numba_inline_function  # (a test's control)
    ic.copy = CopyModule()
    worker.inline_function = inline_function


# LLVM's options for the code of hslm's own processes (llvmlite.binding.set_option): see
# set_llvm_options.
LLVM_OPTIONS = ("-disable-lsr",)


def set_llvm_options() -> None:
    """LLVM's loop strength reduction (LSR: a code generation pass that rewrites a loop's
    index arithmetic into pointers stepped along) took 9% of a first run's compile on an
    AMD Zen 4 (the first run "compiled in" 18.7 s on average without it against 17.0 s,
    three runs each in turns; LLVM's own timers 2.1 of 20.8 s), and the kernels ran as fast
    without it: steps in turns (tools/ab_steps.py, 60 pairs) 0.990x as built and 0.996x
    built for AVX2, within the noise (docs/performance-history.md, 2026-12-04 19:40-20:10). The
    hot loops are LLVM IR that steps its own pointers (hslm/vector_tiles.py). No value can
    change: the pass rewrites integer index arithmetic only, and the golden runs check it.
    LLVM's options belong to the whole process, so hslm sets them in its own processes
    only (the command and its compile helpers); a program that imports hslm keeps LLVM as
    it is, and its kernels, cached or not, give the same bits."""
    import llvmlite.binding as llvm
    for option in LLVM_OPTIONS:
        llvm.set_option("", option)


def _llvm_options_in_hslm_processes():
    if _an_hslm_process():
        set_llvm_options()


_stop_quietly_while_starting()
_writable_kernel_cache()
_prefer_512_bit_vectors()
_plain_numba_error_messages()
_tolerate_stale_kernel_caches()
_kernel_caches_follow_the_whole_package()
_kernel_cache_saves_may_fail()
_faster_numba_flag_comparisons()
_inlined_parts_not_copied()
_numba_registries_without_blas_or_cffi()
_llvm_options_in_hslm_processes()
