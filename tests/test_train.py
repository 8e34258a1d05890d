"""Whole runs: speeds and thread counts write the same bytes; resume; learning; diff."""
import re

import numpy as np
import pytest

from hslm import checkpoint as ckpt
from hslm.cli import main
from hslm.speeds import SPEEDS

TINY = ["--model", "hslm-tiny", "--seed", "1729", "--batch", "4"]


def run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def losses(out):
    return re.findall(r"loss (\d+\.\d+)", out)


def train(capsys, tmp_path, name, *extra, steps=3):
    d = tmp_path / name
    code, out, err = run(capsys, "train", *TINY, "--steps", steps, "--out", d, *extra)
    assert code == 0, err
    return d, out


def test_speeds_and_thread_counts_write_identical_checkpoints(tmp_path, capsys):
    ref, ref_out = train(capsys, tmp_path, "s0", "--speed", 0, "--threads", 1)
    assert len(losses(ref_out)) == 3
    # every speed at 1, 2, 3 and 8 threads (8 is more than this machine's cores)
    for speed, threads in [(s, n) for s in SPEEDS for n in (1, 2, 3, 8) if (s, n) != (0, 1)]:
        d, out = train(capsys, tmp_path, f"s{speed}t{threads}", "--speed", speed,
                       "--threads", threads)
        assert losses(out) == losses(ref_out), (speed, threads)
        for ext in ("bin", "state"):
            a = (ref / f"ckpt_3.{ext}").read_bytes()
            b = (d / f"ckpt_3.{ext}").read_bytes()
            assert a == b, f"speed {speed}, {threads} threads: ckpt_3.{ext} differs"
        code, out, _ = run(capsys, "diff", ref / "ckpt_3.bin", d / "ckpt_3.bin")
        assert code == 0 and out.startswith("identical")


def test_batches_beyond_one_group_of_weight_gradient_windows(tmp_path, capsys):
    """Speed 3 adds the windows into the weight gradient in groups of WGRAD_WINDOWS
    (their output gradients held in panels); a batch of several groups, with scored
    positions fewer than the window, must give speed 2's bytes at any thread count."""
    from hslm.panel_kernels import WGRAD_WINDOWS
    batch = 2 * WGRAD_WINDOWS + 3
    args = ("--batch", batch, "-k", 5)
    ref, _ = train(capsys, tmp_path, "s2", "--speed", 2, "--threads", 1, *args, steps=2)
    for threads in (1, 3):
        d, _ = train(capsys, tmp_path, f"s3t{threads}", "--speed", 3, "--threads", threads,
                     *args, steps=2)
        for ext in ("bin", "state"):
            assert (ref / f"ckpt_2.{ext}").read_bytes() == (d / f"ckpt_2.{ext}").read_bytes(), \
                f"{threads} threads: ckpt_2.{ext} differs"


def test_threads_beyond_the_batch_write_the_same_bytes(tmp_path, capsys):
    """More threads than windows (speed 3): each window's team of threads splits its rows,
    and the weight gradients start during the backward, stage by stage
    (StepRunner._gradient_teams); the bytes are one thread's."""
    # (batch, k, thread counts): k < L as well, where the records start at row s > 0 and
    # the staged chunks of the weight gradients read them from there
    for batch, k, counts in ((1, None, (2, 3, 5)), (2, None, (2, 3, 5)), (1, 5, (3,))):
        args = ("--speed", 3, "--batch", batch, "--eval-every", 1,
                *(("--loss-positions", k) if k else ()))
        tag = f"b{batch}k{k}"
        ref, ref_out = train(capsys, tmp_path, f"{tag}t1", "--threads", 1, *args)
        for threads in counts:
            d, out = train(capsys, tmp_path, f"{tag}t{threads}", "--threads", threads, *args)
            assert losses(out) == losses(ref_out), (batch, k, threads)
            for ext in ("bin", "state"):
                assert (d / f"ckpt_3.{ext}").read_bytes() == (ref / f"ckpt_3.{ext}").read_bytes(), \
                    f"batch {batch}, k {k}, {threads} threads: ckpt_3.{ext} differs"


def test_unit_stages_follow_the_backward():
    """A unit's stage is the backward stage that finishes its records: the head first
    (stage 0), then the blocks from the last (stage 1) to the first, with the embedding
    (after block 0). Its records are final only then."""
    from hslm.config import PRESETS
    from hslm.step import gradient_units, unit_stages
    cfg = PRESETS["hslm-3"]
    units, _ = gradient_units(cfg)
    stages = unit_stages(cfg, units)
    names = [n for n, _, _ in cfg.tensors()]
    by_name = {}
    for (t, _, _), st in zip(units, stages):
        by_name.setdefault(names[t], set()).add(int(st))
    assert by_name["Wout"] == by_name["bout"] == {0}
    assert by_name["blocks.2.Wq"] == by_name["blocks.2.bdown"] == {1}
    assert by_name["blocks.0.gamma"] == by_name["blocks.0.Wdown"] == by_name["E"] == {3}
    assert all(a >= b for a, b in zip(stages, stages[1:]))  # non-increasing: chunks by stage


def test_staged_weight_gradients_wait_for_their_stage():
    """Threads beyond the batch (windows.team_slot): a slot takes a weight-gradient chunk
    only once every slot has passed the chunk's backward stage. Three threads on one
    window (two members and a slot with no rows, which starts on the chunks at once)
    give one thread's gradient bit for bit. The negative control, run one slot after
    another: the rowless slot first, its stage counters preset as if every stage were
    passed, sums every chunk from records the backward has not written, and the
    gradient differs."""
    from hslm import step as step_module
    from hslm.config import PRESETS
    from hslm.layers import alloc_acts, alloc_record
    from hslm.params import ModelState, init_params
    from hslm.speeds import KERNEL_PANELS
    from hslm.tables import Tables
    from hslm.windows import team_counters, team_slot
    cfg = PRESETS["hslm-tiny"]
    tables = Tables(cfg)
    model = ModelState(cfg, init_params(cfg, 5), tables, plain=False).kernel_model()
    windows = np.random.default_rng(5).integers(0, cfg.vocab, (1, cfg.window + 1))
    L, k, nb, N = cfg.window, cfg.window, cfg.blocks, 3
    ref = np.zeros(cfg.n_params)
    step_module.Worker(cfg, 3).window(model, tables.vsa, windows[0], k, 1.0 / k, ref)
    rows = [(0, 5), (5, L), (L, L)]
    runner = step_module.StepRunner(cfg, 3, N)
    runner._team_rows, runner._team_rows_for = rows, (1, k)
    G = np.full(cfg.n_params, np.nan)
    runner.gradient(model, tables.vsa, windows, k, G)
    runner.close()
    assert G.tobytes() == ref.tobytes()

    A, R = alloc_acts(cfg.dims(), 1), alloc_record(cfg.dims(), 1)
    sync = team_counters(N, nb)
    sync[N + 1:N + nb + 2] = N  # every stage passed, before any has run
    G = np.full(cfg.n_params, np.nan)
    for j in (2, 0, 1):  # the rowless slot takes every chunk; the others find none left
        p0, p1 = rows[j]
        worker = runner.workers[j]
        assert team_slot(model, tables.vsa, windows, k, 1.0 / k, A, R, worker.scr,
                         worker.vsa_rows(p1), j, p0, p1, np.zeros((1, k)), sync, runner.units,
                         runner.staged_chunks, G, KERNEL_PANELS)
    assert not np.isnan(G).any() and G.tobytes() != ref.tobytes()


@pytest.mark.parametrize("B,N", [(2, 2), (1, 2), (3, 1)])
def test_each_slot_updates_its_share_once_the_gradient_is_whole(monkeypatch, B, N):
    """StepRunner.gradient(..., then): each thread slot j runs then(its optimiser share)
    in its own task (slot 0 on the calling thread), on the thread that ran its part of
    the gradient (windows and units, or a team's slot: B = 1), past a barrier: G is
    whole when any share is updated, even with slot 1's windows and units each held
    back 0.2 s. The negative control (slots of whole windows): with no wait before the
    update, slot 0 updates while slot 1's units are unwritten (NaN). An error in either
    slot, before the first barrier, between the two or in the update, is raised as it is
    (not as the barrier it broke), no share is updated where the error came before
    them, and nothing waits for ever. The per-position speeds update after their
    gradient, each share once."""
    import threading
    import time

    from hslm import step as step_module
    from hslm.slots import NO_GATE
    from hslm.spin import gate_opens
    from hslm.config import PRESETS
    from hslm.params import ModelState, init_params
    from hslm.tables import Tables
    cfg = PRESETS["hslm-tiny"]
    tables = Tables(cfg)
    model = ModelState(cfg, init_params(cfg, 5), tables, plain=False).kernel_model()
    windows = np.random.default_rng(5).integers(0, cfg.vocab, (B, cfg.window + 1))
    k = cfg.window
    name = "team_slot" if N > B else "windows_layerwise"
    real, real_units = getattr(step_module, name), step_module.gradients_from_records
    ran_on, fail = {}, {}

    def part(*args):  # slot j's gradient part (j: the tenth argument of both)
        j = args[9]
        if ("part", j) in fail:
            raise fail["part", j]
        ran_on.setdefault(j, set()).add(threading.get_ident())
        if j == 1:
            time.sleep(0.2)
        return real(*args)

    def units(*args):  # a slot's weight-gradient units (lo: the seventh argument)
        if args[6] > 0:  # not slot 0's
            if ("units", 1) in fail:
                raise fail["units", 1]
            time.sleep(0.2)
        return real_units(*args)
    monkeypatch.setattr(step_module, name, part)
    monkeypatch.setattr(step_module, "gradients_from_records", units)

    seen = []

    plain_model = ModelState(cfg, init_params(cfg, 5), tables).kernel_model()  # speeds 0-2

    def gradient_and_updates(speed=3):
        G = np.full(cfg.n_params, np.nan)
        updates = []
        seen.append(updates)

        def then(share, gate, target):  # (a kernel waits at its gate first)
            if not gate_opens(gate, target):
                return False
            updates.append((threading.get_ident(), tuple(share), bool(np.isnan(G).any())))
            if ("then", 1) in fail and tuple(share) == shares[1]:
                raise fail["then", 1]
        runner = step_module.StepRunner(cfg, speed, N)
        try:
            runner.gradient(model if speed == 3 else plain_model, tables.vsa, windows, k, G,
                            then=then)
            return updates
        finally:
            runner.close()

    shares = [tuple(x) for x in step_module.optimiser_shares(cfg, N)]
    updates = gradient_and_updates()
    assert sorted(u[1] for u in updates) == sorted(shares) and len(updates) == N
    assert not any(u[2] for u in updates)  # G whole at every update
    for ident, share, _ in updates:
        assert ran_on[shares.index(share)] == {ident}  # the slot's own thread
    updates = gradient_and_updates(speed=2)
    assert sorted(u[1] for u in updates) == sorted(shares) and not any(u[2] for u in updates)
    if N > 1 and N <= B:  # (a team's slots wait for each other inside the kernel too,
        # so there a missing barrier shows only by chance)
        def no_wait(self, then, barrier, marks, j):
            marks["optimiser"] = time.perf_counter()
            then(self.optimiser_shares[j], NO_GATE, 0)
        with monkeypatch.context() as m:
            m.setattr(step_module.StepRunner, "_optimise", no_wait)
            updates = gradient_and_updates()
        assert any(u[2] for u in updates)  # the control: an update before G was whole
    if N > 1:  # slot 0 runs on this thread, slot 1 on a slot thread: either may fail
        where = [("part", 0), ("part", 1), ("then", 1)] + [("units", 1)] * (N <= B)
        for key in where:
            fail.clear()
            fail[key] = ValueError(f"{key} failed")
            with pytest.raises(ValueError) as raised:
                gradient_and_updates()
            assert raised.value is fail[key]
            if key[0] != "then":
                assert seen[-1] == []  # the other found the barrier broken: no update


@pytest.mark.parametrize("N", [1, 2, 3, 16])
def test_optimiser_shares_cover_every_tensor_once_heaviest_first(N):
    """optimiser_shares: every tensor in exactly one share, each share increasing, the
    shares within one tensor's cost of each other (largest first to the least loaded),
    and the heaviest share slot 0's (the calling thread, which starts the step first),
    the rest in order of cost. The control: the greedy split alone, before the order,
    gives hslm-3's two slots the lighter share first."""
    from hslm import step as step_module
    from hslm.config import PRESETS
    cfg = PRESETS["hslm-3"]
    cost = step_module.optimiser_cost(cfg)
    shares = step_module.optimiser_shares(cfg, N)
    assert len(shares) == N
    assert sorted(int(t) for s in shares for t in s) == list(range(len(cost)))
    assert all(list(s) == sorted(s) for s in shares)
    loads = [float(cost[s].sum()) for s in shares]
    assert loads == sorted(loads, reverse=True)
    assert loads[0] - loads[-1] <= cost.max()
    if N == 2:
        assert loads[0] > loads[1]  # (the greedy split had given slot 0 the lighter one)


@pytest.mark.parametrize("N", [2, 3, 16])
def test_staged_chunks_go_first_to_the_slot_that_updates_their_tensors(N):
    """The teams' weight-gradient chunks (StepRunner.staged_chunks) cover every unit once,
    each within one backward stage, and carry as owner the slot whose optimiser share
    holds their tensors, grouped by owner and each owner's in the order taken (the
    head's stage first): so a slot writes the gradient it will update (windows.team_slot
    takes its own queue first). Every slot owns chunks; each has about 8 N in all."""
    from hslm import step as step_module
    from hslm.config import PRESETS
    cfg = PRESETS["hslm-3"]
    runner = step_module.StepRunner(cfg, 3, N)
    try:
        chunks, units = runner.staged_chunks, runner.units
        owner_of = {int(t): j for j, ts in enumerate(runner.optimiser_shares) for t in ts}
    finally:
        runner.close()
    stage = step_module.unit_stages(cfg, units)
    assert chunks.shape[1] == 4
    covered = np.concatenate([np.arange(u0, u1) for u0, u1, _, _ in chunks])
    assert sorted(covered) == list(range(len(units)))
    for u0, u1, st, owner in chunks:
        assert u1 > u0 and set(stage[u0:u1]) == {st}
        assert {owner_of[int(t)] for t in units[u0:u1, 0]} == {owner}
    assert list(chunks[:, 3]) == sorted(chunks[:, 3]) and set(chunks[:, 3]) == set(range(N))
    for o in range(N):
        mine = chunks[chunks[:, 3] == o]
        assert list(mine[:, 0]) == sorted(mine[:, 0], reverse=True)  # the head's first
        assert list(mine[:, 2]) == sorted(mine[:, 2])
    assert 4 * N <= len(chunks) <= 16 * N + 2 * len(set(stage)), len(chunks)


@pytest.mark.parametrize("name,B,thread_counts", [("hslm-tiny", 2, (1, 2, 3)),
                                                   ("hslm-3", 3, (2, 4))])
def test_speed3_step_gradient_is_speed0s_windows_in_order(name, B, thread_counts):
    """A speed-3 step's gradient (StepRunner: the windows phase on threads, the weight
    gradients two windows a tile, units split across threads; with threads beyond the
    batch, teams and staged chunks) has the bits of speed 0's windows added one at a
    time in window order (Worker.window adds into what its output holds). Speed 3
    overwrites each unit of G: G filled with NaN before the step gets the same bytes.
    The control: the per-window path into NaN keeps NaN everywhere."""
    from hslm import step as step_module
    from hslm.config import PRESETS
    from hslm.params import ModelState, init_params
    from hslm.tables import Tables
    cfg = PRESETS[name]
    tables = Tables(cfg)
    model = ModelState(cfg, init_params(cfg, 7), tables).kernel_model()
    k = cfg.window
    windows = np.random.default_rng(7).integers(0, cfg.vocab, (B, cfg.window + 1))

    def per_window(start):
        out = np.full(cfg.n_params, start)
        worker = step_module.Worker(cfg, 0)
        for w in range(B):
            worker.window(model, tables.vsa, windows[w], k, 1.0 / (k * B), out)
        return out

    ref = per_window(0.0)
    assert np.isnan(per_window(np.nan)).all()  # adding into what out holds keeps it
    for threads in thread_counts:
        runner = step_module.StepRunner(cfg, 3, threads)
        G = np.full(cfg.n_params, np.nan)
        runner.gradient(model, tables.vsa, windows, k, G)
        runner.close()
        assert G.tobytes() == ref.tobytes(), f"{threads} threads"


def test_resume_is_byte_identical_to_an_uninterrupted_run(tmp_path, capsys):
    full, _ = train(capsys, tmp_path, "full", "--save-every", 2, steps=5)
    part, _ = train(capsys, tmp_path, "part", steps=2)
    for ext in ("bin", "state"):
        assert (full / f"ckpt_2.{ext}").read_bytes() == (part / f"ckpt_2.{ext}").read_bytes()
    code, out, err = run(capsys, "train", "--resume", part / "ckpt_2.state", "--steps", 5,
                         "--speed", 2, "--threads", 2)
    assert code == 0, err
    for ext in ("bin", "state"):
        assert (full / f"ckpt_5.{ext}").read_bytes() == (part / f"ckpt_5.{ext}").read_bytes()
    # Negative control: what is resumed decides the bytes. The same run's step-2 files
    # with the state's data stream (its RNG) taken from another seed's run give other
    # bytes at step 5, though parameters, optimiser and every flag are the same.
    other, _ = train(capsys, tmp_path, "other", "--seed", 1730, steps=2)
    from hslm import checkpoint as ckpt
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ckpt_2.bin").write_bytes((part / "ckpt_2.bin").read_bytes())
    st = ckpt.read(part / "ckpt_2.state")
    rng = ckpt.read(other / "ckpt_2.state").meta["rng"]
    assert rng != st.meta["rng"]
    (mixed / "ckpt_2.state").write_bytes(ckpt.encode([(n, st.tensor(n)) for n in st.names()],
                                                     dict(st.meta, rng=rng)))
    code, out, err = run(capsys, "train", "--resume", mixed / "ckpt_2.state", "--steps", 5)
    assert code == 0, err
    assert (mixed / "ckpt_5.bin").read_bytes() != (full / "ckpt_5.bin").read_bytes()


def test_loss_goes_down(tmp_path, capsys):
    d, out = train(capsys, tmp_path, "learn", "--lr", "0.01", "--warmup", 0, "--batch", 8,
                   steps=30)
    ls = [float(x) for x in losses(out)]
    first, last, valid = map(float, re.search(
        r"first (\d+\.\d+), last (\d+\.\d+), valid (\d+\.\d+)", out).groups())
    assert first == ls[0] and last == ls[-1]
    assert np.mean(ls[-5:]) < ls[0] - 0.6, ls
    assert valid < first - 0.6


def test_diff_reports_what_differs(tmp_path, capsys):
    a, _ = train(capsys, tmp_path, "a", steps=2)
    b, _ = train(capsys, tmp_path, "b", "--lr", "0.002", steps=2)
    code, out, _ = run(capsys, "diff", a / "ckpt_2.bin", b / "ckpt_2.bin")
    assert code == 1
    assert "blocks.0.Wq:" in out and "elements differ" in out and "first at [" in out
    code, out, _ = run(capsys, "diff", a / "ckpt_2.state", b / "ckpt_2.state")
    assert code == 1 and "metadata hyper: lr 0.001 != 0.002" in out and "adam.m:" in out
    # a long value is cut where the two first differ, not hidden behind a digest of it
    pa = ckpt.read(a / "ckpt_2.state").meta["params_sha256"]
    assert f"metadata params_sha256: {pa[:24]}... (64 chars) != " in out
    assert "header_sha256" not in out  # derived from the rest of the header: noise


def test_checkpoints_are_safetensors_and_self_describing(tmp_path, capsys):
    from safetensors.numpy import load_file
    d, _ = train(capsys, tmp_path, "st", steps=1)
    ck = ckpt.read(d / "ckpt_1.bin", expect_kind="params")
    loaded = load_file(str(d / "ckpt_1.bin"))
    cfg = ck.config
    assert list(loaded) and sum(v.size for v in loaded.values()) == cfg.n_params
    for name, shape, _ in cfg.tensors():
        assert loaded[name].shape == shape
        assert np.array_equal(loaded[name], ck.tensor(name))
    st = load_file(str(d / "ckpt_1.state"))
    assert st["adam.m"].shape == (cfg.n_params,)
    code, out, _ = run(capsys, "info", d / "ckpt_1.bin")
    assert code == 0 and "checksum  ok" in out and "blocks.1.Wdown" in out and "31,350" in out
