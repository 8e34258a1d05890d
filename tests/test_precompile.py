"""A first run compiles its kernels as jobs in several processes (hslm/precompile.py)."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hslm import precompile
from hslm.precompile import JOBS, Board

from helpers import ROOT, running



def test_an_unwritable_install_and_home_cache_kernels_in_the_temporary_folder(tmp_path,
                                                                              monkeypatch):
    """An install that cannot be written (a read-only image) puts Numba's cache in the
    user's cache folder; where that cannot be written either (HOME=/ or /nonexistent, as
    containers run), Numba's own fallbacks failed too and the import ended in a traceback
    ("no locator available"): the cache goes to the temporary folder, in a folder of this
    user's that no one else can write (one that others could have planted is not taken).
    Control: a writable home's cache folder is taken first."""
    import tempfile

    import hslm
    monkeypatch.delitem(sys.modules, "numba")  # (as before Numba is imported)
    monkeypatch.setenv("NUMBA_CACHE_DIR", "")  # (so that it is unset again afterwards: the
    monkeypatch.delenv("NUMBA_CACHE_DIR")      # later tests' runs must not take it)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(hslm._os, "access", lambda path, mode: False)  # the install
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    mine = tmp_path / "tmp" / f"hslm-numba-{os.getuid()}"
    mine.mkdir(mode=0o777)
    mine.chmod(0o777)  # as another user could have made it: not taken (its index is a pickle)
    monkeypatch.setenv("HOME", "/proc/nonexistent")
    hslm._writable_kernel_cache()
    assert os.environ["NUMBA_CACHE_DIR"] == "/proc/nonexistent/.cache/hslm/numba"
    mine.rmdir()
    for home, expect in (("/proc/nonexistent", mine),
                         (str(tmp_path / "home"), tmp_path / "home" / ".cache" / "hslm" / "numba")):
        monkeypatch.setenv("HOME", home)
        monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
        hslm._writable_kernel_cache()
        assert os.environ["NUMBA_CACHE_DIR"] == str(expect) and expect.is_dir()
    assert mine.stat().st_mode & 0o777 == 0o700

def test_jobs_for_each_loop_order():
    assert "per position" not in precompile.jobs_for([3])
    assert {"backward", "weight gradients"} & set(precompile.jobs_for([0, 2])) == set()
    assert "team" not in precompile.jobs_for([3])  # threads beyond the batch only
    assert "team" not in precompile.jobs_for([0, 2], teams=True)  # no layerwise speed
    both = precompile.jobs_for([2, 3], teams=True)
    assert set(both) == set(JOBS)
    assert precompile.jobs_for([3]) == [j for j in JOBS if j in precompile.jobs_for([3])]
    # with teams, what the teams' kernel waits for goes before the forward's blocks
    assert both.index("weight gradients") < both.index("backward") < both.index("forward blocks")
    for order in (list(JOBS), both):  # dependencies come earlier in the priority order
        for job, deps in JOBS.items():
            assert all(order.index(d) < order.index(job) for d in deps), job


def _board(tmp_path, jobs):
    (tmp_path / "jobs.json").write_text('{"jobs": %s, "vocab": 729}' % str(jobs).replace("'", '"'))
    return Board(tmp_path)


def test_the_board_runs_each_job_once_after_its_dependencies(tmp_path, monkeypatch):
    """Three workers sharing one folder (threads here, processes in a run): every job runs
    exactly once, never before the jobs it needs have finished."""
    runs, lock = [], threading.Lock()

    def fake_job(name, vocab):
        t0 = time.perf_counter()
        time.sleep(0.05 if name != "ternary tile" else 0.2)
        with lock:
            runs.append((name, t0, time.perf_counter()))

    monkeypatch.setattr(precompile, "_run_job", fake_job)
    monkeypatch.setattr(precompile, "_locked_cache_saves", lambda *paths: _no_lock())
    jobs = precompile.jobs_for([2, 3])
    workers = [threading.Thread(target=_board(tmp_path, jobs).work) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert sorted(r[0] for r in runs) == sorted(jobs)
    ended = {name: t1 for name, _, t1 in runs}
    for name, t0, _ in runs:
        assert all(ended[d] <= t0 for d in JOBS[name]), name
    assert all(_board(tmp_path, jobs).done(j) for j in jobs)


def test_a_failed_job_does_not_hold_up_the_others(tmp_path, monkeypatch):
    """A job that raises is marked done (failed), and the jobs that need it still run:
    they compile what it left undone themselves."""
    ran = []

    def fake_job(name, vocab):
        if name == "ternary tile":
            raise RuntimeError("no")
        ran.append(name)

    monkeypatch.setattr(precompile, "_run_job", fake_job)
    monkeypatch.setattr(precompile, "_locked_cache_saves", lambda *paths: _no_lock())
    board = _board(tmp_path, precompile.jobs_for([3]))
    with pytest.raises(RuntimeError):
        board.work()
    assert (tmp_path / "ternary tile.done").read_text().startswith("failed")
    board.work()
    assert "forward" in ran and "backward" in ran


def test_a_job_whose_owner_died_does_not_hold_up_the_others(tmp_path, monkeypatch):
    """A job claimed by a helper that died before finishing it never gets its .done:
    the jobs that need it run anyway (they compile what it left), even while other
    helpers are alive; one claimed by a live process is waited for."""
    ran = []
    monkeypatch.setattr(precompile, "_run_job", lambda name, vocab: ran.append(name))
    monkeypatch.setattr(precompile, "_locked_cache_saves", lambda *paths: _no_lock())
    board = _board(tmp_path, ["ternary tile", "weight-gradient tile", "model",
                              "forward blocks"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "ternary tile.claim").write_text(str(dead.pid))  # its owner is gone
    (tmp_path / "model.claim").write_text(str(os.getpid()))  # alive: this process
    worker = threading.Thread(target=board.work)  # (no give_up: the helpers are alive)
    worker.start()
    deadline = time.monotonic() + 30  # (polled: a loaded machine may take a while)
    while ran != ["weight-gradient tile"] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # forward blocks must go on waiting for the model, not run
    assert board.settled("ternary tile") and not board.settled("model")
    assert ran == ["weight-gradient tile"] and worker.is_alive()  # waits on the model
    board.finish("model", True, time.time())
    worker.join(10)
    assert not worker.is_alive() and ran == ["weight-gradient tile", "forward blocks"]


def _sessions(tmp_path, monkeypatch, reasons):
    """session() with a lock of the test's own and needed() answering reasons in turn;
    ParallelCompile recorded, not run. Returns what it records."""
    made = []
    lock_path = tmp_path / "compile.lock"
    monkeypatch.setattr(precompile.CompileLock, "for_cache",
                        classmethod(lambda cls: cls(lock_path)))
    answers = iter(reasons)
    monkeypatch.setattr(precompile, "needed", lambda speeds, teams=False: next(answers))

    class Recorded(precompile._Nothing):
        def __init__(self, speeds, vocab, echo, jobs, processes, reason, lock, on_stop=None):
            made.append(reason)
            self.lock = lock

        def __exit__(self, *exc):
            self.lock.release()
            return False

    monkeypatch.setattr(precompile, "ParallelCompile", Recorded)
    return made, lock_path


def test_a_run_waits_for_another_runs_compile_of_the_same_cache_then_compiles_nothing(
        tmp_path, monkeypatch):
    """Two first runs at once had each compiled every kernel (88 s against 16-25 s on a
    2-core Xeon): a run that finds the cache's compile lock held waits for it, saying
    so, and then compiles only what is still missing (here nothing)."""
    made, lock_path = _sessions(tmp_path, monkeypatch, ["new kernels since the last run", ""])
    other = precompile.CompileLock(lock_path)
    assert other.take()
    other.note("first run on this machine")
    said = []
    compiling = precompile.session([3], 729, said.append)
    assert isinstance(compiling, precompile._AfterAnother) and made == []
    released = threading.Event()
    threading.Timer(0.5, lambda: (other.note(""), released.set(), other.release())).start()
    with compiling:
        compiling.finish()
    assert released.is_set()  # it waited for the other's jobs
    # (the other's reason: its helpers may have put the first kernels in the cache already)
    assert made == [] and said[0] == ("waiting for the kernels another hslm process is "
                                      "compiling (first run on this machine) ...")
    assert precompile.CompileLock(lock_path).take()  # and let go of the lock


def test_a_run_after_another_compiles_what_is_still_missing_and_a_free_lock_compiles_at_once(
        tmp_path, monkeypatch):
    """What the other run left (its speeds were not these, or it was stopped) is
    compiled after the wait, under the lock; with the lock free (the control), the
    run compiles at once."""
    made, lock_path = _sessions(tmp_path, monkeypatch, ["first run on this machine",
                                                        "new kernels since the last run"])
    other = precompile.CompileLock(lock_path)
    assert other.take()
    compiling = precompile.session([3], 729, None)
    threading.Timer(0.2, other.release).start()
    with compiling:
        compiling.finish()
    # (said as what it is: the other run's speeds were not these, or it was stopped, in
    # which case its own reason stands; "new kernels since the last run" had been said)
    assert made == ["kernels the other process did not compile"]
    made.clear()
    monkeypatch.setattr(precompile, "needed", lambda speeds, teams=False: "a reason")
    with precompile.session([3], 729, None):
        pass
    assert made == ["a reason"]


def test_a_compile_that_was_stopped_gives_its_reason_to_the_next(tmp_path, monkeypatch):
    """A first run stopped while compiling leaves kernels in the cache: the next run's
    compile is still the first run's, not "new kernels since the last run". A compile
    that finished leaves no reason behind (the control)."""
    made, lock_path = _sessions(tmp_path, monkeypatch, ["new kernels since the last run"] * 2)
    stopped = precompile.CompileLock(lock_path)
    assert stopped.take()
    stopped.note("first run on this machine")
    stopped.release()  # (its process ended, the note still there)
    with precompile.session([3], 729, None):
        pass
    lock_path.write_text("")  # a compile that finished
    with precompile.session([3], 729, None):
        pass
    assert made == ["first run on this machine", "new kernels since the last run"]


def test_a_parallel_compile_frees_the_lock_once_its_jobs_are_done(tmp_path, monkeypatch):
    """Another run waiting goes on once the jobs are done, not once this run has read its
    text (finish() comes after); a compile that ends with a job not done keeps its note."""
    monkeypatch.setattr(precompile, "_run_job", lambda name, vocab: None)
    monkeypatch.setattr(precompile, "_locked_cache_saves", lambda *paths: _no_lock())
    lock = precompile.CompileLock(tmp_path / "compile.lock")
    assert lock.take()
    with precompile.ParallelCompile([3], 729, None, ["model"], 1, "first run", lock) as c:
        assert (tmp_path / "compile.lock").read_text() == "first run"
        assert not precompile.CompileLock(tmp_path / "compile.lock").take()
        c.board.work()  # (the job done, by a helper in a run)
        deadline = time.monotonic() + 10
        while lock.file is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert precompile.CompileLock(tmp_path / "compile.lock").take()  # before finish()
    assert (tmp_path / "compile.lock").read_text() == ""
    lock = precompile.CompileLock(tmp_path / "compile2.lock")
    assert lock.take()
    with precompile.ParallelCompile([3], 729, None, ["model"], 1, "first run", lock):
        pass  # stopped before its job
    assert (tmp_path / "compile2.lock").read_text() == "first run"
    assert precompile.CompileLock(tmp_path / "compile2.lock").take()


class _no_lock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_a_first_run_compiles_in_parallel_and_then_compiles_nothing(tmp_path):
    """An empty kernel cache: `hslm train` says it compiles, its jobs compile speed 3's
    kernels (in one process per core) while the text is tokenized, and nothing compiles
    after them, in training or evaluation; then speed 2's jobs, and a speed-2 run compiles
    nothing either: the jobs' argument types are the run's. A run started meanwhile on
    the same cache waits for the first's jobs and compiles nothing of theirs."""
    code = """
import sys
import click
from numba.core import event
from hslm import precompile
from hslm.cli import cli
phase, late = ["jobs"], []
finish = precompile.ParallelCompile.finish
def finish_then_watch(self):
    finish(self)
    phase[0] = "run"
precompile.ParallelCompile.finish = finish_then_watch
class Listener(event.Listener):
    def on_start(self, ev):
        if phase[0] == "run":
            late.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
out = sys.argv[1]
cli(["train", "--model", "hslm-tiny", "--steps", "2", "--batch", "3", "--threads", "2",
     "--eval-every", "1", "--out", out + "3"], standalone_mode=False)
phase[0] = "jobs"
precompile.compile_first([2], 300, echo=lambda m: click.echo(m, err=True))
cli(["train", "--model", "hslm-tiny", "--steps", "2", "--batch", "3", "--speed", "2",
     "--threads", "2", "--eval-every", "1", "--quiet", "--out", out + "2"],
    standalone_mode=False)
print("compiled after the jobs:", late)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (tmp_path / "second.txt").write_text((ROOT / "README.md").read_text())
    with running(first, 600):
        said = [first.stderr.readline()]  # (its compile lock is held from here on)
        # A second run started meanwhile on the same cache waits for the first's kernels
        # and compiles none itself (two had each compiled everything).
        second = subprocess.run([sys.executable, "-c", SECOND_RUN, str(tmp_path / "second")],
                                env=env, capture_output=True, text=True, timeout=600)
        out, err = first.communicate(timeout=600)
    err = "".join(said) + err
    assert first.returncode == 0, err
    notices = [l for l in err.splitlines() if l.startswith("compiling kernels in ")]
    assert len(notices) == 2 and err.count("compiled in") == 2, err
    assert "compiled after the jobs: []" in out, out
    assert list((tmp_path / "cache").rglob("*.nbi"))  # (a negative control: it did compile)
    assert second.returncode == 0, second.stderr
    assert second.stderr.startswith("waiting for the kernels another hslm process is compiling "
                                    "(first run on this machine) ..."), second.stderr
    assert "compiling kernels in" not in second.stderr, second.stderr
    assert "compiled after the wait: []" in second.stdout, second.stdout
    assert "then: ['<lambda>']" in second.stdout, second.stdout  # (the listener's control)


SECOND_RUN = """
import sys
from numba.core import event
from hslm import precompile
from hslm.cli import cli
phase, compiled = ["wait"], {"wait": [], "run": []}
wait = precompile.CompileLock.wait
def wait_then_watch(self, *args):
    wait(self, *args)
    phase[0] = "run"
precompile.CompileLock.wait = wait_then_watch
class Listener(event.Listener):
    def on_start(self, ev):
        compiled[phase[0]].append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
cli(["train", "--model", "hslm-tiny", "--steps", "2", "--batch", "3", "--threads", "2",
     "--data", sys.argv[1] + ".txt", "--eval-every", "1", "--out", sys.argv[1]],
    standalone_mode=False)
print("compiled after the wait:", compiled["run"])
from numba import njit
njit(lambda x: x + 1)(1)  # (the listener's control)
print("then:", compiled["run"])
"""


def test_the_helpers_import_this_hslm_whatever_folder_the_run_was_started_in(tmp_path,
                                                                                monkeypatch):
    """The README's quick start runs `pip install . && hslm train` in a clone, whose
    hslm/ source folder is then the working folder. The helpers run `python -m
    hslm.precompile`, which puts the working folder first on the path: they had imported
    the clone's hslm and compiled it into the clone's cache, and the run compiled its
    kernels again (33 s, not 15). They now start in the folder that holds the run's own
    hslm. A stand-in for such a clone (an hslm that leaves a mark when imported) in the
    working folder: with the helper's folder and environment it is not imported (the
    control: from the working folder, it is)."""
    decoy, mark = tmp_path / "hslm", tmp_path / "decoy imported"
    decoy.mkdir()
    (decoy / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    started = []

    class Helper:  # a helper that ends at once, having recorded how it was started
        def __init__(self, args, **kw):
            started.append((args, kw))

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    with monkeypatch.context() as m:
        m.setattr(precompile.subprocess, "Popen", Helper)
        with precompile.ParallelCompile([3], 300, None, ["ternary tile"], 2, "a test"):
            pass
    (args, kw), = started
    assert args[1:3] == ["-m", "hslm.precompile"]
    which = [sys.executable, "-c", "import hslm; print(hslm.__file__)"]
    here = subprocess.run(which, cwd=kw.get("cwd"), env=kw["env"], capture_output=True,
                          text=True, timeout=120)
    assert here.returncode == 0 and here.stdout.strip() == precompile.__file__.replace(
        "precompile.py", "__init__.py"), here
    assert not mark.exists()
    there = subprocess.run(which, env=kw["env"], capture_output=True, text=True, timeout=120)
    assert mark.exists() and str(decoy) in there.stdout, there  # (the control)


@pytest.mark.slow
def test_sigterm_while_compiling_leaves_no_helper_and_no_folder(tmp_path):
    """SIGTERM during a first run's compile: the run ends of the signal as before, its
    helpers are stopped and its compile folder removed. It says so, and removes the
    --out folder it had made (left, with its lock and nothing else, and no line, before;
    a warm run's SIGTERM already did both)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "TMPDIR": str(tmp)}
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", "--model", "hslm-tiny",
                          "--steps", "2", "--out", str(tmp_path / "out")], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with running(p, timeout=600):
        line = p.stderr.readline()  # the notice: the helpers are at work
        assert line.startswith("compiling kernels in "), line
        time.sleep(1)
        assert (tmp_path / "out").is_dir()  # (the control: made before the compile)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == -signal.SIGTERM
        assert p.stderr.read() == "error: terminated\n"
    time.sleep(0.5)
    assert not list(tmp.glob("hslm-compile-*"))  # (the cache-save lock file stays, by design)
    assert not (tmp_path / "out").exists()

    def mentions_tmp(pid):
        try:
            return str(tmp) in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            return False
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and mentions_tmp(pid)]


STALE_INDEX = r"""
import pickle
import hslm.layers
from hslm.mathfn import log
from numba.core import caching
log(2.0)  # compiled (or loaded), so its index exists
cache_file = log._cache._cache_file
# an index an older hslm could have left: Numba's version, then data naming a class
# that has since moved away from hslm.layers
Gone = type("Gone", (), {"__module__": "hslm.layers"})
hslm.layers.Gone = Gone
data = pickle.dumps((cache_file._source_stamp, {("sig",): Gone()}))
del hslm.layers.Gone
with open(cache_file._index_path, "wb") as f:
    pickle.dump(cache_file._version, f)
    f.write(data)
load = caching.IndexDataCacheFile._load_index
try:  # negative control: Numba's own reading of it fails
    load.numba_load_index(cache_file)
    print("numba read it")
except AttributeError:
    print("numba failed")
print("hslm read", load(cache_file))
"""


def test_a_cache_filled_on_another_cpu_model_is_not_taken_for_warm(monkeypatch):
    """Numba's index keys each entry by the target it was compiled for (the triple, the
    CPU's name and features). A cache filled on another CPU model (a checkout shared by a
    cluster's nodes) had counted as warm: no parallel compile and no message, every kernel
    compiled in the run's one process. Control: this machine's entries count."""
    from hslm.optim import adamw_kernel
    from hslm.precompile import in_cache
    assert in_cache(adamw_kernel)  # (cached by the suite's first compile: conftest.py)
    codegen = type(adamw_kernel.targetctx.codegen())
    real = codegen.magic_tuple
    monkeypatch.setattr(codegen, "magic_tuple",
                        lambda self: (real(self)[0], "another-cpu", real(self)[2]))
    assert not in_cache(adamw_kernel)


def test_a_stale_kernel_cache_index_from_another_version_is_compiled_over(tmp_path):
    """Numba unpickles a cache index before checking it is this source's; an index whose
    pickled types name a class that moved (as hslm.layers.Model did) crashed the run.
    hslm reads such an index as empty, so the kernels compile afresh, and the next run
    (a new process, as after an upgrade) loads and runs them."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", STALE_INDEX], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "numba failed" in out.stdout and "hslm read {}" in out.stdout, out.stdout
    again = subprocess.run([sys.executable, "-c", "from hslm.mathfn import log; print(log(2.0))"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == repr(float(np.log(2.0))), again


PROBE_CALLEE = """from numba import njit

VALUE = {value}


@njit(cache=True)
def value():
    return VALUE
"""
PROBE_CALLER = """from numba import njit

from ._probe_callee import value


@njit(cache=True)
def twice():
    return 2 * value()
"""
RUN_PROBE = """import sys
import hslm
if sys.argv[1] == "numba's stamps":  # the negative control: each file's own stamp only
    from numba.core import caching
    m = caching._SourceFileBackedLocatorMixin
    m.get_source_stamp = m.get_source_stamp.numba_get_source_stamp
from hslm._probe_caller import twice
print(twice())
"""


def probe_package(tmp_path, code, stamps):
    """A copy of the package in tmp_path/pkg/hslm (for probe files beside or in it) and
    run(): `code` run with `stamps` in a fresh process on that copy, with a kernel cache
    of its own; returns the integers it printed."""
    pkg = tmp_path / "pkg" / "hslm"
    pkg.mkdir(parents=True)
    for f in (ROOT / "hslm").glob("*.py"):
        (pkg / f.name).write_bytes(f.read_bytes())
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(tmp_path / "pkg")}

    def run():
        p = subprocess.run([sys.executable, "-c", code, stamps], env=env, text=True,
                           capture_output=True, timeout=300, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return [int(v) for v in p.stdout.split()]

    return pkg, run


@pytest.mark.parametrize("stamps", ["hslm's stamps", "numba's stamps"])
def test_a_change_in_one_file_recompiles_the_cached_kernels_of_the_others(tmp_path, stamps):
    """A cached kernel holds the code of the kernels it calls from other files, which
    Numba's cache does not follow: after a change to _probe_callee.py alone, the cached
    twice() of _probe_caller.py still ran the old value() (the control shows it). hslm
    stamps its kernels with a digest of the whole package, so they compile again."""
    pkg, run = probe_package(tmp_path, RUN_PROBE, stamps)
    (pkg / "_probe_caller.py").write_text(PROBE_CALLER)
    (pkg / "_probe_callee.py").write_text(PROBE_CALLEE.format(value=1))
    assert run() == [2] and run() == [2]  # compiled, then loaded from the cache
    (pkg / "_probe_callee.py").write_text(PROBE_CALLEE.format(value=5))
    assert run() == ([10] if stamps == "hslm's stamps" else [2])


OUTSIDE_PROBE = """from hslm._probe_callee import value
from hslm.jit import kernel_entry


@kernel_entry
def twice():
    return 2 * value()
"""
PLAIN_PROBE = """from numba import njit

from hslm._probe_callee import value


@njit(cache=True)
def thrice():  # the control: a plain Numba kernel, in a file of its own
    return 3 * value()
"""


RUN_OUTSIDE = """import sys
import hslm
if sys.argv[1] == "numba's stamps":  # the negative control: each file's own stamp only
    from numba.core import caching
    m = caching._SourceFileBackedLocatorMixin
    m.get_source_stamp = m.get_source_stamp.numba_get_source_stamp
import outside_probe, plain_probe
print(outside_probe.twice(), plain_probe.thrice())
"""


@pytest.mark.parametrize("stamps", ["hslm's stamps", "numba's stamps"])
def test_kernels_made_outside_the_package_follow_its_source_too(tmp_path, stamps):
    """The tests' entry points (tests/kernel_entries.py) are hslm.jit kernels in a file
    outside the package, holding its kernels' code: after a change to one of hslm's
    files alone, such a cached kernel had run the old code (a test of the old
    active_rows_grad passed). hslm.jit's kernels get the package's stamp wherever their
    file lies (the whole file's kernels); a plain njit kernel of another file keeps
    Numba's own stamp and runs the old code, and so does the hslm.jit kernel under
    Numba's stamps (the controls)."""
    pkg, run = probe_package(tmp_path, RUN_OUTSIDE, stamps)
    (pkg.parent / "outside_probe.py").write_text(OUTSIDE_PROBE)
    (pkg.parent / "plain_probe.py").write_text(PLAIN_PROBE)
    (pkg / "_probe_callee.py").write_text(PROBE_CALLEE.format(value=1))
    assert run() == [2, 3] and run() == [2, 3]  # compiled, then loaded from the cache
    (pkg / "_probe_callee.py").write_text(PROBE_CALLEE.format(value=5))
    # hslm.jit's kernel compiled again under hslm's stamps; the plain one is stale
    assert run() == ([10, 3] if stamps == "hslm's stamps" else [2, 3])


SAVE_FAILS = """import resource, sys
import hslm
if sys.argv[1] == "numba's save":  # the negative control
    from numba.core import caching
    caching.Cache.save_overload = caching.Cache.save_overload.numba_save_overload
from hslm import precompile
print(precompile.CACHE_LOCK)
from hslm.mathfn import log
print(log(2.0))
"""


@pytest.mark.parametrize("save", ["hslm's save", "numba's save"])
def test_no_room_to_write_costs_the_kernel_cache_and_parallel_compiles_not_the_run(tmp_path,
                                                                                   save):
    """With no byte writable (a file-size limit of 0; a full disk alike), importing
    hslm.precompile raised (no usable temporary folder for its lock) and a kernel that
    compiled raised from Numba's cache save: a traceback either way, from a command that
    writes nothing of its own (hslm eval). Now: no parallel compile, and a warning."""
    import resource

    def no_room():
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT),
           "TMPDIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", SAVE_FAILS, save], env=env, capture_output=True,
                       text=True, timeout=300, preexec_fn=no_room)
    if save == "numba's save":
        assert p.returncode == 1 and "OSError" in p.stderr, p.stderr
        return
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["None", repr(float(np.log(2.0)))]
    assert p.stderr.count("warning: cannot save compiled kernels in Numba's cache") == 1


FULL_CACHE = """import sys
import hslm
from hslm import precompile
precompile.processes_to_use = lambda n: 2  # (a helper, whatever this machine's cores)
if sys.argv[1] != "no room":  # (the folder's room as if there: the probe passes)
    precompile._cache_takes_a_kernel = lambda kernel: True
with precompile.session([3], 729, echo=lambda m: print(m, flush=True)) as compiling:
    if sys.argv[1] == "a save failed here first":  # (the tokenizer's, as the text was read)
        hslm.note_kernel_cache_failure("File too large")
    compiling.finish()
print("failure:", hslm.kernel_cache_failure())
"""


@pytest.mark.parametrize("case", ["no room", "a save fails", "a save failed here first"])
def test_a_kernel_cache_that_cannot_be_written_stops_the_parallel_compile(tmp_path, case):
    """A full disk under Numba's cache (here: files of at most 64 KiB, where a kernel's
    data is larger and the compile's own small files fit): every process of a first
    run's parallel compile went on compiling jobs whose kernels could not be saved (and
    each job compiled its callees again); the run then compiled every kernel once more,
    and said "first run only". Now a file of a large kernel's size is written in the
    cache's folder first: with no room for it, no helper starts; where the room is there
    and a save fails all the same, the first failed save stops the compile in every
    process, saying why (with no word of compiling where this process's own had failed
    before it said one: the tokenizer's, as the text was read). Either way the run then
    compiles as it goes, and says so."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT),
           "TMPDIR": str(tmp_path), "HSLM_COMPILE_LOG": str(tmp_path / "log")}
    p = subprocess.run([sys.executable, "-c", FULL_CACHE, case], env=env, capture_output=True,
                       text=True, timeout=300, preexec_fn=small_files)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("warning: cannot save compiled kernels in Numba's cache "
                          "(File too large)") == 1, p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1] == "failure: File too large", lines
    if case == "no room":
        assert lines == ["failure: File too large"] and not (tmp_path / "log").exists()
        assert not [f for f in (tmp_path / "cache").rglob(".hslm-room-*")]  # (removed)
        return
    if case == "a save fails":  # (else stopped before a word of compiling)
        assert lines[0].startswith("compiling kernels in 2 processes (first run on this "
                                   "machine)")
        lines = lines[1:]
    assert lines[0].startswith("stopped compiling in 2 processes after ") and lines[0].endswith(
        " s: Numba's cache cannot be written (File too large), so the run compiles its "
        "kernels as it goes"), lines
    # no job began after the first failed save: at most one a process, each unfinished
    log = (tmp_path / "log").read_text().splitlines()
    assert len(log) == len(precompile.jobs_for([3])), log
    done = [ln for ln in log if not ln.endswith(": -")]
    assert len(done) <= 2 and all(" failed " in ln or " ok " in ln for ln in done), log


def test_compile_profile_tool_reads_a_first_runs_timeline_from_the_compile_log(tmp_path,
                                                                                 capsys):
    """tools/compile_profile.py --first-run's timeline: each job's process and span from the
    lines HSLM_COMPILE_LOG collects (a job not done is left out), by start, from the first
    one's; each process's busy time and what it waited, up to the last job's end."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("compile_profile",
                                                  ROOT / "tools" / "compile_profile.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (tmp_path / "jobs.json").write_text("{}")
    board = Board.__new__(Board)  # the marker as a job writes it, as the log copies it
    board.folder = tmp_path
    board.finish("backward", True, 1002.5)
    marker = (tmp_path / "backward.done").read_text()
    (job, pid, began, _), = tool.job_timeline(f"backward: {marker}")
    assert (job, pid, began) == ("backward", os.getpid(), 0.0)
    rows = tool.job_timeline("backward: ok 11 1002.5 1009.0\nmodel: ok 12 1000.5 1001.5\n"
                             "team: -\nforward: ok 12 1001.5 1004.0\n")
    assert rows == [("model", 12, 0.0, 1.0), ("forward", 12, 1.0, 3.5),
                    ("backward", 11, 2.0, 8.5)]
    tool.print_timeline(rows)
    out = capsys.readouterr().out
    assert "process 11: 1 jobs,  6.50 s; waiting or done  2.00 s of the  8.50 s" in out, out
    assert "process 12: 2 jobs,  3.50 s; waiting or done  5.00 s of the  8.50 s" in out, out
    assert out.index("  model ") < out.index("  forward ") < out.index("  backward "), out
    tool.print_timeline([])
    assert "no compile jobs ran" in capsys.readouterr().out


def test_compile_profile_tool_times_each_job_and_kernel():
    """tools/compile_profile.py: a job's time, each kernel's own compile time with LLVM's
    part of it, the machine code of a kernel the job compiled (its tile's FMAs are
    vector instructions; the Python entry point's unboxing mostly not), and with
    --passes Numba's and LLVM's passes by time. An unknown job is one line and exit 1,
    with nothing compiled."""
    import re
    tool = str(ROOT / "tools" / "compile_profile.py")
    r = subprocess.run([sys.executable, tool, "--jobs", "ternary tile", "--passes",
                        "--asm", "hslm.micro.ternary_panel_matmul"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    numba_passes = r.stdout.split("Numba's passes")[1].split("LLVM's passes")[0]
    assert float(re.search(r"^ +(\d+\.\d\d)  nopython_type_inference$", numba_passes,
                           re.M).group(1)) > 0, r.stdout
    llvm_passes = r.stdout.split("LLVM's passes")[1].split("machine code of")[0]
    assert float(re.search(r"^ +(\d+\.\d\d)  InstCombinePass$", llvm_passes,
                           re.M).group(1)) > 0, r.stdout
    assert re.search(r"^  ternary tile +\d+\.\d s$", r.stdout, re.M), r.stdout
    own, llvm = map(float, re.search(r"^ +(\d+\.\d\d) +(\d+\.\d\d) +1  hslm\.panel_kernels\."
                                     r"ternary_panel_matmul_\d+x\d+(?:_f32)?$", r.stdout,
                                     re.M).groups())
    assert 0 < llvm < own
    code = dict((name[:8], (int(n), int(v))) for n, v, name in re.findall(
        r"^ +(\d+) +(\d+)  (\S+ternary_panel_matmul\S+)$", r.stdout, re.M))
    kernel, entry = code["_ZN4hslm"], code["_ZN7cpyt"]
    assert kernel[1] > entry[1] and kernel[1] >= 12, code
    bad = subprocess.run([sys.executable, tool, "--jobs", "no such job"],
                         capture_output=True, text=True, timeout=120)
    assert (bad.returncode, bad.stdout) == (1, "") and bad.stderr.count("\n") == 1
    assert "no compile job 'no such job'" in bad.stderr


def test_a_compile_lock_that_is_not_this_users_own_file_or_cannot_lock_compiles_alone(
        tmp_path, monkeypatch):
    """The lock's name in the temporary folder is known to every user: a link planted
    there is not followed (the file it names is neither truncated nor locked), and a file
    system without flock (ENOSYS, ENOLCK: Lustre, some NFS) had made every first run wait
    forever for a holder that was not there. Either way the run compiles on its own
    (take() True, nothing held); a lock another process holds is waited for (False)."""
    import errno
    import fcntl
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "planted.lock")
    lock = precompile.CompileLock(tmp_path / "planted.lock")
    assert lock.take() and lock.file is None
    assert lock.noted() == "" and victim.read_text() == "keep"
    held = precompile.CompileLock(tmp_path / "c.lock")
    assert held.take() and held.file is not None
    assert not precompile.CompileLock(tmp_path / "c.lock").take()  # (the control: busy)
    held.release()

    # a FIFO there: opening it had blocked (noted) or raised "not seekable" (take)
    os.mkfifo(tmp_path / "fifo.lock")
    lock = precompile.CompileLock(tmp_path / "fifo.lock")
    assert lock.take() and lock.file is None and lock.noted() == ""
    # Numba's saves take the first lock that is this user's own file, a run's private
    # folder's last: neither the link nor the FIFO
    with precompile._locked_cache_saves(tmp_path / "planted.lock", tmp_path / "fifo.lock",
                                        tmp_path / "saves.lock"):
        assert (tmp_path / "saves.lock").is_file()
    assert victim.read_text() == "keep"

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = precompile.CompileLock(tmp_path / "c.lock")
    assert lock.take() and lock.file is None and lock.no_flock
    # and then no parallel compile: Numba's saves could not be locked there either (the
    # helpers' kernels had not been saved, and the next run compiled them all again)
    monkeypatch.setattr(precompile.CompileLock, "for_cache",
                        classmethod(lambda cls: cls(tmp_path / "c.lock")))
    monkeypatch.setattr(precompile, "needed", lambda speeds, teams=False: "a reason")
    assert isinstance(precompile.session([3], 729, None), precompile._Nothing)
