"""MPI data parallelism (hslm/distributed.py): `mpiexec -n P hslm train` writes the bytes
of one process, for any P and batch; resume across P; faults end every rank.

Skipped when mpi4py or mpiexec is missing (pip install '.[mpi]')."""
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hslm import distributed
from hslm.config import PRESETS

from helpers import ROOT, assert_bits_equal, setup

MPIEXEC = shutil.which("mpiexec")
try:
    import mpi4py  # noqa: F401
    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False
needs_mpi = pytest.mark.skipif(not (MPIEXEC and HAVE_MPI4PY),
                               reason="needs mpi4py and mpiexec: pip install '.[mpi]'")

TINY = ["--model", "hslm-tiny", "--seed", "1729", "-q"]
TEXT_A = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(600))


def env():
    e = {k: v for k, v in os.environ.items() if k not in distributed.LAUNCH_VARIABLES}
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("HSLM_MPI_TEST_FAIL", None)
    return e


def hslm(*args, ranks=None, extra_env=None, timeout=120, file_size_limit=None):
    """file_size_limit: RLIMIT_FSIZE for the launcher and the ranks (a write past it fails
    with EFBIG: Python ignores SIGXFSZ), standing in for a full disk."""
    cmd = [sys.executable, str(ROOT / "cli.py"), *map(str, args)]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd

    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**env(), **(extra_env or {})},
                       preexec_fn=limit if file_size_limit else None)
    return p.returncode, p.stdout, p.stderr


def train(out, *args, ranks=None, threads=1, extra_env=None):
    code, stdout, err = hslm("train", *TINY, "--out", out, "--threads", threads, *args,
                             ranks=ranks, extra_env=extra_env)
    assert code == 0, err
    return stdout


def same_bytes(a, b, step):
    for ext in ("bin", "state"):
        assert (a / f"ckpt_{step}.{ext}").read_bytes() == (b / f"ckpt_{step}.{ext}").read_bytes(), \
            f"ckpt_{step}.{ext} differs"


# ------------------------------------------------------------- in one process
def test_without_mpi_nothing_imports_mpi4py():
    code = ("import sys; from hslm.cli import main\n"
            "try: main(['info'])\n"
            "except SystemExit: pass\n"
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(),
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert not distributed.launched_by_mpi({})
    assert distributed.launched_by_mpi({"PMI_RANK": "0"})
    assert distributed.launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "4"})
    assert not distributed.launched_by_mpi({"PMI_RANK": "0", "HSLM_MPI": "0"})
    assert distributed.launched_by_mpi({"HSLM_MPI": "1"})


def test_windows_split_in_contiguous_runs():
    for B in range(1, 20):
        for P in range(1, 9):
            rs = distributed.ranges(B, P)
            assert rs[0][0] == 0 and rs[-1][1] == B
            for r, (lo, hi) in enumerate(rs):
                assert all(w * P // B == r for w in range(lo, hi))
                assert lo <= hi
            assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))


def test_chunks_cover_the_gradient_in_order():
    from hslm.step import gradient_units
    for name in ("hslm-tiny", "hslm-3"):
        cfg = PRESETS[name]
        units, _ = gradient_units(cfg)
        for target in (1, 1000, distributed.CHUNK_ELEMENTS, 10 ** 9):
            ch = distributed.unit_chunks(cfg, units, target)
            assert ch[0][0] == 0 and ch[-1][1] == cfg.n_params and ch[-1][3] == len(units)
            assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(ch, ch[1:]))


def test_window_sums_fold_exactly_and_a_reordered_sum_does_not():
    """What the pipeline relies on: 0 + S_w == S_w to the bit (no -0.0 in a window's
    sum), and ((0 + S_0) + S_1) + ... in window order is the step's gradient. The
    negative control: an order MPI's Allreduce may use ((S_0 + S_1) + (S_2 + S_3))
    differs in bytes, so the tests below could catch a reordered reduction."""
    from hslm.step import StepRunner, Worker
    cfg, tb, ms, _ = setup("hslm-tiny", False)
    rng = np.random.default_rng(5)
    B, k = 4, cfg.window
    windows = rng.integers(0, cfg.vocab, (B, cfg.window + 1))
    scale = 1.0 / (k * B)
    model = ms.kernel_model()
    S = []
    for w in range(B):
        out = np.zeros(cfg.n_params)
        Worker(cfg, 3).window(model, tb.vsa, windows[w], k, scale, out)
        assert not np.any(np.signbit(out) & (out == 0.0)), "a window sum holds -0.0"
        assert_bits_equal(0.0 + out, out, "0 + S_w")
        S.append(out)
    G = np.zeros(cfg.n_params)
    StepRunner(cfg, 3, 1).gradient(model, tb.vsa, windows, k, G)
    seq = np.zeros(cfg.n_params)
    for s in S:
        seq += s
    assert_bits_equal(seq, G, "window-order fold vs the step's gradient")
    tree = (S[0] + S[1]) + (S[2] + S[3])
    assert np.any(tree.view(np.uint64) != G.view(np.uint64)), \
        "negative control: a reordered sum should differ in some bits"


# ------------------------------------------------------------------ under MPI
@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """One-process runs (speed 3, 2 threads): 4 steps, saved at 2 and 4."""
    base = tmp_path_factory.mktemp("ref")
    out = {}
    for batch in (2, 4, 5):
        d = base / f"b{batch}"
        train(d, "--batch", batch, "--steps", 4, "--save-every", 2, threads=2)
        out[batch] = d
    return out


MEMORY = {  # how the ranks hold the model and records: the summary's words, the environment
    "shared": ("parameters in shared memory", {}),
    "messages": ("updated parameters to all", {"HSLM_MPI_SHARED": "0"}),
    "nodes of 2": ("the ranks of a node share memory", {"HSLM_MPI_TEST_NODE_SIZE": "2"}),
}


@needs_mpi
@pytest.mark.parametrize("speed,batch,ranks,reduction,memory,slow", [
    (3, 4, 2, "records", "shared", True), (3, 5, 2, "records", "messages", False),
    (2, 4, 2, None, "shared", True), (2, 5, 3, None, "messages", False),
    (3, 2, 3, "running sums", "shared", False), (3, 5, 3, "running sums", "shared", True),
    (3, 4, 3, "records", "nodes of 2", True), (3, 5, 3, "running sums", "nodes of 2", False),
    (2, 5, 3, None, "nodes of 2", False), (1, 4, 2, None, "messages", False),
    (0, 2, 2, None, "shared", False)])
def test_mpi_checkpoints_equal_one_process(refs, tmp_path, speed, batch, ranks, reduction,
                                           memory, slow):
    """Speed 3 either moves the windows' records or passes running sums (the run
    chooses: records when they weigh less, always on one node sharing memory;
    HSLM_MPI_REDUCTION forces one); speeds 0-2 pass running sums. The ranks of a
    node share one copy of the model and the records, and the nodes pass messages
    (HSLM_MPI_TEST_NODE_SIZE pretends that there are several nodes);
    HSLM_MPI_SHARED=0 makes every rank pass messages. Checkpoints at steps 2 and 4
    (saved mid-run, from the shared copy where there is one) are one process's.

    `slow`: rank 1 sleeps before its windows and before its optimiser writes (a test
    hook): were a barrier missing, the others would read records or parameters it
    has not written yet, or it would read what they already overwrote (taking out
    the barrier after the windows fails these cases, and others)."""
    d = tmp_path / "mpi"
    words, env = MEMORY[memory]
    if reduction:
        env = {**env, "HSLM_MPI_REDUCTION": reduction}
    if slow:
        env = {**env, "HSLM_MPI_TEST_SKEW": "1:0.15"}
    stdout = train(d, "--batch", batch, "--steps", 4, "--speed", speed, "--save-every", 2,
                   ranks=ranks, extra_env=env)
    same_bytes(refs[batch], d, 2)
    same_bytes(refs[batch], d, 4)
    assert "MB sent per step" in stdout
    assert words in stdout, stdout
    assert sum(w in stdout for w in {w for w, _ in MEMORY.values()}) == 1, stdout
    if reduction:  # the summary names the reduction the steps took
        assert ("records to" in stdout) == (reduction == "records"), stdout
        assert ("running sums to" in stdout) == (reduction == "running sums"), stdout
    assert sorted(p.name for p in d.glob("ckpt_*")) == [
        "ckpt_2.bin", "ckpt_2.state", "ckpt_4.bin", "ckpt_4.state"]


@needs_mpi
def test_too_little_shared_memory_falls_back_to_messages(refs, tmp_path):
    """A node whose /dev/shm cannot hold the model and the records (a container's 64
    MB): one notice, then every rank passes messages, with the same bytes."""
    code, stdout, err = hslm("train", *TINY, "--out", tmp_path, "--threads", 1, "--batch", 4,
                             "--steps", 4, ranks=2, extra_env={"HSLM_MPI_TEST_SHM_ROOM": "1000"})
    assert code == 0, err
    assert "free in /dev/shm" in stdout and stdout.count("passes messages") == 1, stdout
    assert "updated parameters to all" in stdout, stdout
    same_bytes(refs[4], tmp_path, 4)


@needs_mpi
def test_ranks_placed_in_turn_are_renumbered_by_node(refs, tmp_path):
    """Nodes that take ranks in turn (--map-by node; pretended: ranks 0 and 2 on one
    node, 1 on the other): hslm renumbers them so that each node's are consecutive,
    the ranks of a node share memory, and the bytes are one process's."""
    stdout = train(tmp_path, "--batch", 5, "--steps", 4, "--save-every", 2, ranks=3,
                   extra_env={"HSLM_MPI_TEST_NODE_SIZE": "rr2", "HSLM_MPI_TEST_SKEW": "1:0.1"})
    assert "the ranks of a node share memory" in stdout and "2 nodes" in stdout, stdout
    same_bytes(refs[5], tmp_path, 2)
    same_bytes(refs[5], tmp_path, 4)


@needs_mpi
@pytest.mark.parametrize("speed,shared", [(3, False)])
def test_mpi_metrics_equal_one_process(tmp_path, speed, shared):
    """Every figure of the metrics file but the timings (loss, learning rate, gradient
    norm, the ternary zero share, the validation loss) is one process's: the ranks
    gather what each owner requantised, alpha and zero counts included (or, sharing
    memory, read them where each owner wrote them)."""
    import json
    runs = {}
    for ranks in (None, 2):
        d = tmp_path / f"r{ranks}"
        train(d, "--batch", 4, "--steps", 3, "--speed", speed, "--eval-every", 2,
              "--metrics", d / "m.jsonl", ranks=ranks,
              extra_env={"HSLM_MPI_SHARED": "1" if shared else "0"})
        runs[ranks] = [{k: v for k, v in json.loads(line).items() if k not in ("tok_s", "time")}
                       for line in (d / "m.jsonl").read_text().splitlines()]
    assert runs[None] == runs[2] and any("ternary_zero_share" in r for r in runs[2])
    assert any("cross_entropy" in r for r in runs[2])
    assert len({r["ternary_zero_share"] for r in runs[2] if "ternary_zero_share" in r}) > 1


@needs_mpi
def test_mpi_json_model_and_threads_per_rank(tmp_path):
    cfg = tmp_path / "m.json"
    fields = {f: getattr(PRESETS["hslm-test"], f) for f in
              ("vocab", "width", "heads", "head_width", "mlp", "blocks", "window", "vsa_dim")}
    fields["vocab"] = 280  # the byte-level tokenizer needs at least 260
    cfg.write_text(json.dumps(fields))
    args = ["--model", cfg, "--seed", "3", "--batch", 3, "--steps", 3, "-q"]
    code, _, err = hslm("train", *args, "--out", tmp_path / "one", "--threads", 1)
    assert code == 0, err
    code, _, err = hslm("train", *args, "--out", tmp_path / "two", "--threads", 2, ranks=2)
    assert code == 0, err
    same_bytes(tmp_path / "one", tmp_path / "two", 3)


@needs_mpi
@pytest.mark.parametrize("shared", ["1", "0"])
def test_ranks_with_different_threads(refs, tmp_path, shared):
    """Ranks launched with different --threads (mpiexec's A : B form): the bytes of one
    process. The warm-up had drawn as many windows as each rank's own threads take, so
    the ranks' first collectives disagreed on the batch (shared memory: a reshape error
    on rank 1; messages: MPICH's "Message truncated")."""
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--batch", "4", "--steps", "4",
           "--save-every", "2", "--out", str(tmp_path / "o"), "--threads"]
    cmd = [MPIEXEC, "-n", "1", *one, "1", ":", "-n", "1", *one, "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                       env={**env(), "HSLM_MPI_SHARED": shared})
    assert p.returncode == 0, p.stderr
    same_bytes(refs[4], tmp_path / "o", 4)


@needs_mpi
def test_a_rank_that_cannot_join_mpi_ends_the_run(tmp_path):
    """A rank without mpi4py (a fake package that fails to import, on its PYTHONPATH
    alone) says so in one line and dies by SIGTERM, so that the launcher ends the other,
    which waits in MPI's start (in C, where no Python handler runs: before, with Ctrl-C
    and SIGTERM caught there, only SIGKILL had ended it, and an exit status left it
    waiting for good)."""
    fake = tmp_path / "fake" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named mpi4py")\n')
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--batch", "2", "--steps", "2",
           "--threads", "1", "--out", str(tmp_path / "o")]
    cmd = [MPIEXEC, "-n", "1", *one, ":", "-n", "1", "-env", "PYTHONPATH", str(fake.parent),
           *one]
    start = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert p.returncode != 0 and "error: launched by MPI, but mpi4py is not installed" in p.stderr
    assert time.monotonic() - start < 60, "the other rank was left waiting"
    assert not (tmp_path / "o").exists()


@needs_mpi
def test_a_rank_left_waiting_in_mpis_start_says_why(tmp_path):
    """A rank that ends with a status before it starts MPI (here a shell in its place, as a
    wrapper script without exec leaves it) leaves the other waiting in MPI's start, where
    the launcher does not end it. After HSLM_MPI_START_NOTICE seconds the waiting rank
    says so in one line (a child process watches: MPI's start holds the GIL), and Ctrl-C
    ends the run. A start that returns in time says nothing."""
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--batch", "2", "--steps", "2",
           "--threads", "1"]
    p = subprocess.Popen([MPIEXEC, "-n", "1", *one, "--out", str(tmp_path / "o"), ":", "-n", "1",
                          "sh", "-c", "exit 3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**env(), "HSLM_MPI_START_NOTICE": "1"})
    lines = queue.Queue()  # stderr's lines, read aside: a rank left waiting writes nothing else
    threading.Thread(target=lambda: [lines.put(x) for x in p.stderr], daemon=True).start()
    try:
        seen = None
        deadline = time.monotonic() + 60
        while seen is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if "in MPI's start for the other ranks" in line:
                seen = line
        assert seen is not None, "no word from the rank left waiting"
        assert seen.startswith("hslm: rank 0 of 2 has waited 1 s in MPI's start") and \
            "Ctrl-C or SIGTERM ends the run" in seen, seen
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and not (tmp_path / "o").exists()
    # every rank starts: the watch ends with the start, quietly (the notice's 2 s are
    # longer than the run's start and shorter than the run, 5-6 s here)
    code, _, err = hslm("train", *TINY, "--batch", 2, "--steps", 100, "--threads", 1,
                        "--out", tmp_path / "ok", ranks=2, extra_env={"HSLM_MPI_START_NOTICE": "2"})
    assert code == 0 and "MPI's start" not in err, err


@needs_mpi
def test_resume_across_rank_counts(refs, tmp_path):
    # one process to step 2, then 3 ranks to step 4
    a = tmp_path / "a"
    train(a, "--batch", 4, "--steps", 2)
    code, _, err = hslm("train", "--resume", a / "ckpt_2.state", "--steps", 4, "-q",
                        "--threads", 1, ranks=3)
    assert code == 0, err
    same_bytes(refs[4], a, 4)
    # 2 ranks to step 2, then one process to step 4
    b = tmp_path / "b"
    train(b, "--batch", 4, "--steps", 2, ranks=2)
    same_bytes(refs[4], b, 2)
    code, _, err = hslm("train", "--resume", b / "ckpt_2.state", "--steps", 4, "-q")
    assert code == 0, err
    same_bytes(refs[4], b, 4)


@needs_mpi
def test_a_failing_rank_stops_every_rank(tmp_path):
    t0 = time.monotonic()
    code, stdout, err = hslm("train", *TINY, "--batch", 4, "--steps", 50, "--out", tmp_path,
                             ranks=3, extra_env={"HSLM_MPI_TEST_FAIL": "1:2"}, timeout=60)
    assert code != 0
    assert time.monotonic() - t0 < 30
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert errors == ["error: rank 1 of 3: test hook HSLM_MPI_TEST_FAIL: rank 1 fails at step 2"]
    assert "Traceback" not in err
    assert not list(tmp_path.glob("ckpt_*"))


def sigterm_to_rank_1(p, out, ready):
    """SIGTERM to rank 1 of the run p (start_two_ranks into out) once ready() returns:
    (p's exit status, its stdout and stderr together)."""
    try:
        ready()
        os.kill(rank_pids(str(out))[1], signal.SIGTERM)
        stdout, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, stdout + err


def rank_pids(marker):
    """{rank: pid} of the MPI ranks whose command line holds `marker` (Linux /proc)."""
    pids = {}
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            envs = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        rank = [e for e in envs if e.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="))]
        if marker.encode() in cmd and rank:
            pids[int(rank[0].split(b"=")[1])] = int(d)
    return pids


def running(pid):
    """Whether a process is alive (a zombie waiting to be reaped is not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_two_ranks(tmp_path, out, *args, extra_env=None):
    """`mpiexec -n 2 hslm train` of TINY into out, its metrics in tmp_path / m.jsonl,
    started: (the launcher's Popen, a function that waits until a step is recorded, when
    every rank is past its start, its handlers in)."""
    metrics = tmp_path / "m.jsonl"
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(ROOT / "cli.py"), "train", *TINY,
           "--out", out, "--threads", 1, "--metrics", metrics, *args]
    p = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**env(), **(extra_env or {})})

    def wait_for_a_step(seconds, poll=0.2):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text()):
            time.sleep(poll)
    return p, wait_for_a_step


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks in /proc")
def test_a_killed_rank_stops_every_rank(tmp_path):
    """SIGKILL on one rank mid-run (it can say nothing): the launcher ends the others
    within seconds, though they wait at a node barrier (shared memory); no traceback,
    and no checkpoint is written."""
    out = tmp_path / "run"
    p, wait_for_a_step = start_two_ranks(tmp_path, out, "--batch", 4, "--steps", 10 ** 6)
    try:
        wait_for_a_step(60)
        pids = rank_pids(str(out))
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 20
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert "Traceback" not in err
    assert not list(out.glob("ckpt_*"))
    assert not any(running(pid) for pid in pids.values())


@needs_mpi
@pytest.mark.parametrize("bad", [0, 1])
def test_one_rank_failing_before_the_first_step_stops_every_rank(tmp_path, bad):
    """A path only one rank cannot read: that rank reports it, naming itself, and every
    rank leaves at once (the healthy ones had hung, agreeing a second time)."""
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--steps", "10", "--batch",
           "1", "--threads", "1", "--out", str(tmp_path / "o")]
    missing = ["--data", str(tmp_path / "missing.txt")]
    cmd = [MPIEXEC, "-n", "1", *one, *(missing if bad == 0 else []), ":",
           "-n", "1", *one, *(missing if bad == 1 else [])]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env())
    assert p.returncode == 2 and time.monotonic() - t0 < 30
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: rank {bad} of 2: data file not found: {tmp_path / 'missing.txt'}"]
    assert not (tmp_path / "o").exists()  # rank 0's new folder is removed as for a bad text


@needs_mpi
@pytest.mark.parametrize("differ", ["text", "steps"])
def test_ranks_given_different_runs_are_refused_before_training(tmp_path, differ):
    """Each rank reads its own --data: a path naming other files on another node had
    trained one model on a mix of texts (the ranks' parameters agreeing all along), and
    ranks given different --steps had waited on each other forever. The ranks compare
    what their runs are before the first step."""
    (tmp_path / "a.txt").write_text(TEXT_A)
    (tmp_path / "b.txt").write_text(TEXT_A.replace("e", "o"))
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--batch", "2", "--threads",
           "1", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "a.txt")]
    other = {"text": ["--steps", "3", "--data", str(tmp_path / "b.txt")],
             "steps": ["--steps", "4"]}[differ]
    cmd = [MPIEXEC, "-n", "1", *one, "--steps", "3", ":", "-n", "1", *one, *other]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    assert "rank(s) [1] differ from rank 0 in" in errors[0]
    assert ("text" in errors[0] and "tokenizer" in errors[0]) if differ == "text" else (
        "--steps" in errors[0] and "text" not in errors[0])
    assert not list((tmp_path / "o").glob("ckpt_*"))
    cmd = [MPIEXEC, "-n", "2", *one, "--steps", "3"]  # control: the same run on both
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert p.returncode == 0 and (tmp_path / "o" / "ckpt_3.bin").exists(), p.stderr


@needs_mpi
@pytest.mark.parametrize("variable,values", [("HSLM_MPI_REDUCTION", ("records", "running sums")),
                                             ("HSLM_MPI_SHARED", ("1", "0"))])
def test_ranks_given_other_mpi_settings_are_refused_not_left_waiting(tmp_path, variable,
                                                                     values):
    """HSLM_MPI_REDUCTION and HSLM_MPI_SHARED decide what the ranks do together: ranks
    given other values (`-env` per rank) had waited on each other for ever, in C, where
    neither SIGTERM nor one Ctrl-C ended them. Refused once MPI starts, in one line.
    Control: the same values on both train."""
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--batch", "2", "--steps",
           "2", "--threads", "1", "--out", str(tmp_path / "o")]
    cmd = [MPIEXEC, "-n", "1", "-env", variable, values[0], *one,
           ":", "-n", "1", "-env", variable, values[1], *one]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and errors == [
        "error: the ranks were not given the same MPI settings: rank(s) [1] differ from rank "
        f"0 in {variable}; nothing trained"], p.stderr
    cmd = [MPIEXEC, "-n", "2", "-env", variable, values[1], *one]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert p.returncode == 0 and (tmp_path / "o" / "ckpt_2.bin").exists(), p.stderr


@needs_mpi
def test_a_rank_whose_own_setting_is_bad_ends_the_run(tmp_path):
    """A bad value in one rank's environment: that rank said so and exited with a status
    before joining MPI, and the others waited in MPI's start for it until killed. It now
    dies by SIGTERM after its line, so the launcher ends the others."""
    one = [sys.executable, str(ROOT / "cli.py"), "train", *TINY, "--batch", "2", "--steps",
           "2", "--threads", "1", "--out", str(tmp_path / "o")]
    cmd = [MPIEXEC, "-n", "1", "-env", "HSLM_MPI_START_NOTICE", "100", *one,
           ":", "-n", "1", "-env", "HSLM_MPI_SHARED", "x", *one]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert p.returncode != 0 and time.monotonic() - t0 < 60, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "HSLM_MPI_SHARED must be 1" in errors[0], p.stderr
    assert not list((tmp_path / "o").glob("ckpt_*"))


@needs_mpi
def test_bad_flags_are_reported_once(tmp_path):
    code, _, err = hslm("train", *TINY, "--batch", 0, "--out", tmp_path, ranks=3)
    assert code == 2
    assert err.strip() == "error: --batch must be at least 1, got 0"
    code, _, err = hslm("train", "--no-such-flag", ranks=2)
    assert code == 2 and err.count("error:") == 1, err


@needs_mpi
@pytest.mark.parametrize("case", ["a bad flag on rank 1", "a bad flag on rank 0",
                                  "train and another command", "train and a diff that differs",
                                  "eval failing on rank 1"])
def test_ranks_that_do_not_agree_before_training_end_at_once(tmp_path, case):
    """A flag only one rank was given wrong (mpiexec's A : B form) had left the others
    waiting for ever in the ranks' start (the rank at fault quiet where it was not rank
    0); so had a rank running another command than train beside ranks that train, and any
    other command failing on one rank and not on another. Every rank now makes the same
    one collective before the first step, whatever its command did: one line, and every
    rank ends."""
    py = [sys.executable, str(ROOT / "cli.py")]
    one = [*py, "train", *TINY, "--steps", "2", "--batch", "2", "--threads", "1",
           "--out", str(tmp_path / "o")]
    if case.startswith("eval"):  # (another command under mpiexec runs whole on each rank)
        train(tmp_path / "run", "--steps", "1", "--batch", "2")
        ck = tmp_path / "run" / "ckpt_1.bin"
        a, b = [*py, "eval", str(ck)], [*py, "eval", str(tmp_path / "missing.bin")]
        expect = f"error: rank 1 of 2: checkpoint not found: {tmp_path / 'missing.bin'}"
    elif case.startswith("train and"):  # (a command's own status, diff's 1: the same)
        b = [*py, "info"]
        if case.endswith("differs"):
            train(tmp_path / "r1", "--steps", "1", "--batch", "2")
            train(tmp_path / "r2", "--steps", "1", "--batch", "2", "--seed", "7")
            b = [*py, "diff", str(tmp_path / "r1" / "ckpt_1.bin"),
                 str(tmp_path / "r2" / "ckpt_1.bin")]
        a = one
        expect = "error: rank 1 of 2 ran another command than rank 0's train"
    else:
        a, b = (one, [*one, "--speed", "7"])[::1 if case.endswith("1") else -1]
        expect = f"error: rank {case[-1]} of 2: Invalid value for '--speed'"
    cmd = [MPIEXEC, "-n", "1", *a, ":", "-n", "1", *b]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert time.monotonic() - t0 < 60, "a rank was left waiting"
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and errors[0].startswith(expect), p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "o").exists()
    if case.startswith("eval"):  # control: both ranks evaluate
        p = subprocess.run([MPIEXEC, "-n", "1", *a, ":", "-n", "1", *a], capture_output=True,
                           text=True, timeout=120, env=env())
        assert p.returncode == 0 and p.stdout.startswith("valid loss"), p.stderr


@needs_mpi
def test_sigterm_saves_one_checkpoint_and_stops_every_rank(tmp_path):
    p, wait_for_a_step = start_two_ranks(tmp_path, tmp_path / "run", "--batch", 4, "--steps",
                                         10 ** 6, "--log-every", 1)
    try:
        wait_for_a_step(120)  # however slow
        p.send_signal(signal.SIGTERM)
        stdout, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    ckpts = sorted((tmp_path / "run").glob("ckpt_*"))
    assert len(ckpts) == 2, ckpts
    assert "SIGTERM: stopped after step" in stdout + err
    assert err.count("SIGTERM: finishing the current step") == 1
    # the resume command starts the ranks again (it had left out `mpiexec -n 2`), run
    # verbatim for one more step
    line = [ln for ln in (stdout + err).splitlines() if ln.startswith("resume with: ")]
    assert len(line) == 1, stdout + err
    argv = shlex.split(line[0][len("resume with: "):])
    assert argv[:3] == ["mpiexec", "-n", "2"] and argv[4:6] == [str(ROOT / "cli.py"), "train"], argv
    step = int(argv[argv.index("--resume") + 1].split("ckpt_")[1].split(".")[0])
    argv[argv.index("--steps") + 1] = str(step + 1)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env())
    assert p.returncode == 0 and "MPI: 2 ranks" in p.stdout, p.stderr
    assert (tmp_path / "run" / f"ckpt_{step + 1}.bin").exists()


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks in /proc")
def test_a_stop_on_one_rank_in_the_final_evaluation_is_said_and_agreed(tmp_path):
    """SIGTERM to one rank (not rank 0) after the last step, while the ranks evaluate: the
    run had ended 143 with no word (rank 0, which prints, had not got the signal, and
    said its usual end). The ranks agree on it: rank 0 says the run stopped, the last
    step saved, and every rank exits 143, as one process does."""
    out = tmp_path / "run"
    p, wait_for_a_step = start_two_ranks(tmp_path, out, "--batch", 2, "--steps", 1,
                                         "--eval-windows", 20000)
    # step 1 recorded: the final evaluation runs
    code, said = sigterm_to_rank_1(p, out, lambda: wait_for_a_step(120, poll=0.05))
    assert code == 128 + signal.SIGTERM, said
    assert "SIGTERM: stopped after step 1, the last; saved" in said, said
    assert (out / "ckpt_1.bin").exists()


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks in /proc")
def test_a_stop_on_one_rank_in_a_periodic_evaluation_stops_after_its_step(tmp_path):
    """SIGTERM to one rank (not rank 0) while the ranks evaluate after step 1 of 3: the
    ranks had agreed on it only after the next step, so step 2 was trained and saved (one
    process stops after step 1). They now agree once the evaluation is done."""
    out = tmp_path / "run"
    p, wait_for_a_step = start_two_ranks(tmp_path, out, "--batch", 2, "--steps", 3,
                                         "--eval-every", 1, "--eval-windows", 20000)
    # step 1 recorded: its evaluation runs
    code, said = sigterm_to_rank_1(p, out, lambda: wait_for_a_step(120, poll=0.05))
    assert code == 128 + signal.SIGTERM, said
    assert "SIGTERM: stopped after step 1; saved" in said and "step 1: valid " in said, said
    assert sorted(f.name for f in out.glob("ckpt_*")) == ["ckpt_1.bin", "ckpt_1.state"]


SLOW_SAVE = """import os, time
import hslm.checkpoint as checkpoint
write = checkpoint.write_atomic_files

def slow(files, *args, **kwargs):  # (rank 0 alone writes a checkpoint)
    if any("ckpt_" in str(path) for path, _ in files):
        with open(os.environ["SLOW_SAVE_MARK"], "a") as f:
            f.write("saving\\n")
        time.sleep(3)
    return write(files, *args, **kwargs)
checkpoint.write_atomic_files = slow
"""


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks in /proc")
def test_a_stop_on_one_rank_during_rank_0s_periodic_save_stops_after_its_step(tmp_path):
    """SIGTERM to rank 1 while rank 0 writes step 1's checkpoint (made slow here): rank 1
    had already entered the ranks' agreement on a stop, a blocking collective that held
    its signal handler off until rank 0 came, so the stop counted a step later (step 2
    trained and saved). The ranks now wait for each other where a handler runs."""
    (tmp_path / "inj").mkdir()
    (tmp_path / "inj" / "sitecustomize.py").write_text(SLOW_SAVE)
    mark, out = tmp_path / "saving", tmp_path / "run"
    p, _ = start_two_ranks(tmp_path, out, "--batch", 2, "--steps", 4, "--save-every", 1,
                           extra_env={"SLOW_SAVE_MARK": str(mark), "PYTHONPATH": str(
                               tmp_path / "inj") + os.pathsep + env()["PYTHONPATH"]})

    def saving():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not mark.exists():
            time.sleep(0.05)
        time.sleep(0.5)  # rank 1 is past its part of the save, waiting for rank 0
    code, said = sigterm_to_rank_1(p, out, saving)
    assert code == 128 + signal.SIGTERM, said
    assert "SIGTERM: stopped after step 1; saved" in said, said
    assert sorted(f.name for f in out.glob("ckpt_*")) == ["ckpt_1.bin", "ckpt_1.state"]


@needs_mpi
def test_a_diverging_run_is_reported_once_as_in_one_process(tmp_path):
    """The finiteness check looks at each rank's own tensors; the ranks agree, rank 0
    reports the same line one process prints, and nothing non-finite is saved."""
    # a huge learning rate (its step size lr / (1 - beta1) past a double's range) makes a
    # parameter non-finite at step 1 while the loss is finite, so the per-tensor search
    # (each rank its own tensors, then agreed) must name it
    args = [*TINY, "--batch", 4, "--steps", 3, "--save-every", 1, "--lr", "1e308",
            "--weight-decay", "0", "--warmup", 0]
    code1, _, err1 = hslm("train", *args, "--out", tmp_path / "one")
    code2, _, err2 = hslm("train", *args, "--out", tmp_path / "mpi", ranks=2)
    code3, _, err3 = hslm("train", *args, "--out", tmp_path / "mpi3", ranks=3)
    one, two, three = ([ln for ln in e.splitlines() if ln.startswith("error:")]
                       for e in (err1, err2, err3))
    assert code1 == code2 == code3 == 2 and len(one) == 1 and one == two == three, (err1, err2)
    assert "of tensor" in one[0] and "not finite" in one[0], one
    assert (sorted(p.name for p in (tmp_path / "one").glob("ckpt_*"))
            == sorted(p.name for p in (tmp_path / "mpi").glob("ckpt_*")))


@needs_mpi
def test_metrics_failure_saves_on_every_rank_and_stops(tmp_path):
    """Rank 0 alone writes metrics; its failure is agreed after the step, then every
    rank takes part in the save (rank 0 gathers the moments) and the run stops."""
    # a file-size limit standing in for a full disk (a device as --metrics is refused up
    # front): above what MPI's shared memory and the checkpoints need, and the metrics
    # file made (sparse) to 100 bytes short of it, so its first record fails
    limit = 1 << 30
    m = tmp_path / "m.jsonl"
    with open(m, "wb") as f:  # (ending in blank lines: a file that ends in anything else
        blank = 1 << 17  # but a record is not a metrics file, and is refused up front)
        f.truncate(limit - 100 - blank)
        f.seek(limit - 100 - blank)
        f.write(b"\n" * blank)
    code, _, err = hslm("train", *TINY, "--batch", 4, "--steps", 3, "--metrics", m,
                        "--out", tmp_path / "m", ranks=2, timeout=60, file_size_limit=limit)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "cannot write --metrics" in errors[0], err
    train(tmp_path / "ref", "--batch", 4, "--steps", 1)
    same_bytes(tmp_path / "ref", tmp_path / "m", 1)


@needs_mpi
def test_an_unknown_reduction_is_one_clear_error(tmp_path):
    code, _, err = hslm("train", *TINY, "--batch", 2, "--steps", 1, "--out", tmp_path, ranks=2,
                        extra_env={"HSLM_MPI_REDUCTION": "allreduce"})
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "HSLM_MPI_REDUCTION" in errors[0], err
    assert "Traceback" not in err


@needs_mpi
def test_mpi_batch_beyond_one_group_of_weight_gradient_windows(tmp_path):
    """A batch of several WGRAD_WINDOWS groups (19 windows), both reductions, 2 ranks."""
    train(tmp_path / "one", "--batch", 19, "--steps", 2, "-k", 5)
    for reduction in ("records", "running sums"):
        train(tmp_path / reduction, "--batch", 19, "--steps", 2, "-k", 5, ranks=2,
              extra_env={"HSLM_MPI_REDUCTION": reduction})
        same_bytes(tmp_path / "one", tmp_path / reduction, 2)


SHARE_TWICE = """
import numpy as np
from hslm import distributed
from hslm.config import PRESETS
from hslm.params import ModelState, init_params
from hslm.tables import Tables
cfg = PRESETS["hslm-tiny"]
state = ModelState(cfg, init_params(cfg, 1729), Tables(cfg))
want = {n: getattr(state, n).copy() for n in ("theta", "Tf", "Tb", "alpha", "zeros", "Pf", "Pb")}
world = distributed.init()
for _ in range(3):  # each share replaces the block the state's arrays live in
    world.share_state(state, batch=2)
    assert world.shared  # (too little /dev/shm would share nothing: no test then)
    for n, a in want.items():
        assert getattr(state, n).tobytes() == a.tobytes(), n
world.close()
open(f"rank{world.rank}", "w").write("same values")
"""


def test_sharing_the_model_again_copies_it_before_freeing_its_old_block(tmp_path):
    """shared_arrays frees the block it replaces only after the copy from it (it was freed
    first: rank 0 copied from unmapped memory, a segfault)."""
    script = tmp_path / "share_twice.py"
    script.write_text(SHARE_TWICE)
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True,
                       text=True, timeout=120, env=env(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["same values"] * 2


@needs_mpi
def test_other_commands_under_mpiexec_report_as_one_process(tmp_path):
    """Another command than train runs whole on every rank, rank 0 alone printing. Three
    ways it had not: `hslm plot`'s warning came once per rank; a name too long (an
    OSError the checks did not foresee) read "error: OSError: [Errno 36] ..." with exit
    1, where one process says "error: NAME: File name too long", exit 2; and `hslm bench`
    timed every rank at once on the same cores, each writing --json (the report then
    held another rank's figures than the table printed): it is refused, in one line.
    Controls: one process's plot warning and long-name line, the same."""
    m = tmp_path / "m.jsonl"
    m.write_text('{"kind":"train","step":1,"loss":5.0}\n{"kind":"train","st')
    long = tmp_path / ("a" * 300)
    for ranks in (None, 2):
        code, out, err = hslm("plot", m, "-o", tmp_path / "p.png", ranks=ranks)
        assert code == 0 and err.count("warning: ") == 1 and "partial record" in err, err
        code, out, err = hslm("train", *TINY, "--steps", 1, "--out", long, ranks=ranks)
        assert code == 2 and err.strip() == f"error: {long}: File name too long", err
    code, out, err = hslm("bench", "--model", "hslm-tiny", "--speed", 3, "--steps", 1,
                          "--no-torch", "--no-profile", "--json", tmp_path / "b.json", ranks=2)
    assert code == 2 and err.strip() == ("error: hslm bench times one process: run it without "
                                         "mpiexec (its ranks would time each other on the same "
                                         "cores, and each write --json)"), err
    assert not (tmp_path / "b.json").exists()


@needs_mpi
def test_ranks_whose_commands_end_differently_are_said(tmp_path):
    """`hslm diff` under mpiexec with paths naming other files on another node: rank 0
    printed "identical" and the launcher exited 1 (rank 1's "differ"), with no line
    saying why. Rank 0 now says the ranks' statuses differ. Controls: ranks that agree
    (both "identical", both "differ") print no such line."""
    train(tmp_path / "r1", "--steps", 1, "--batch", 2)
    train(tmp_path / "r2", "--steps", 1, "--batch", 2, "--seed", 7)
    for node, other in (("same", "r1"), ("other", "r2")):  # x.bin and y.bin on two "nodes"
        (tmp_path / node).mkdir()
        shutil.copy(tmp_path / "r1" / "ckpt_1.bin", tmp_path / node / "x.bin")
        shutil.copy(tmp_path / other / "ckpt_1.bin", tmp_path / node / "y.bin")
    diff = [sys.executable, str(ROOT / "cli.py"), "diff", "x.bin", "y.bin"]

    def run(dir0, dir1):
        p = subprocess.run([MPIEXEC, "-n", "1", "-wdir", str(tmp_path / dir0), *diff, ":",
                            "-n", "1", "-wdir", str(tmp_path / dir1), *diff],
                           capture_output=True, text=True, timeout=120, env=env())
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, p.stdout, [ln for ln in p.stderr.splitlines() if ln.strip()]
    code, out, err = run("same", "other")
    assert code == 1 and out.startswith("identical: x.bin and y.bin"), (out, err)
    assert err == ["error: the ranks' commands ended differently: rank 0 with exit status 0 "
                   "(the output above is rank 0's alone), rank 1 with 1 (do the paths name "
                   "other files on other nodes?)"], err
    code, out, err = run("other", "same")
    assert code == 1 and out.startswith("differ: x.bin and y.bin"), (out, err)
    assert len(err) == 1 and "rank 0 with exit status 1" in err[0] and "rank 1 with 0" in err[0]
    for node, expect in (("same", 0), ("other", 1)):  # controls: the ranks agree
        code, out, err = run(node, node)
        assert code == expect and err == [], (code, err)


SPY_ON_TOKENIZING = """
import os

from hslm import data, userlock

made = data._made_tokens


def spy(*a):
    with open(os.environ["TOKENIZED_LOG"], "a") as f:
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
        mine = len(os.sched_getaffinity(0))  # (a launcher may bind a rank to a core)
        f.write(f"{rank} {'all' if a[-1] == mine > 1 else a[-1]}\\n")  # (the cores given)
    return made(*a)


data._made_tokens = spy
if os.environ.get("NO_FLOCK"):  # a temporary folder without flock: nothing is held
    userlock.UserLock.take = lambda self: True
    userlock.UserLock.held_elsewhere = lambda self: None
"""


@needs_mpi
@pytest.mark.parametrize("case", ["one machine", "nodes of 2", "no flock"])
def test_the_ranks_of_rank_0s_machine_make_a_texts_tokens_once(tmp_path, case):
    """Three ranks miss the token cache of a new text at once. On rank 0's machine rank 0
    makes the tokens, with the machine's cores, and writes the cache; the others wait,
    then read it (an MPI run of P ranks on a large text had held P times its memory). A
    rank on another machine (pretended: nodes of 2) makes its own, on one core. Control:
    where nothing can be locked, every rank makes them, one core each, as before. The
    checkpoint is one process's."""
    (tmp_path / "inj").mkdir()
    (tmp_path / "inj" / "sitecustomize.py").write_text(SPY_ON_TOKENIZING)
    text = tmp_path / "t.txt"
    text.write_text(TEXT_A * 3)
    log = tmp_path / "made.log"
    (tmp_path / "tmp").mkdir()
    extra = {"TOKENIZED_LOG": str(log), "HSLM_CACHE_DIR": "", "TMPDIR": str(tmp_path / "tmp"),
             "PYTHONPATH": str(tmp_path / "inj") + os.pathsep + env()["PYTHONPATH"]}
    if case == "nodes of 2":
        extra["HSLM_MPI_TEST_NODE_SIZE"] = "2"
    if case == "no flock":
        extra["NO_FLOCK"] = "1"
    args = ["--data", text, "--batch", 3, "--steps", 2]
    train(tmp_path / "one", *args, extra_env={"HSLM_CACHE_DIR": ""})
    train(tmp_path / "mpi", *args, ranks=3, extra_env=extra)
    same_bytes(tmp_path / "one", tmp_path / "mpi", 2)
    made = sorted(tuple(line.split()) for line in log.read_text().splitlines())
    every = "all" if len(os.sched_getaffinity(0)) > 1 else "1"
    assert made == {"one machine": [("0", every)], "nodes of 2": [("0", every), ("2", "1")],
                    "no flock": [("0", "1"), ("1", "1"), ("2", "1")]}[case], made
    assert not list(tmp_path.glob("mpi/.*tmp*"))
    assert not list(tmp_path.glob("tmp/hslm-tokens-*"))  # (the lock's file, removed)
