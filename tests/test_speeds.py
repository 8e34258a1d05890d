"""Speeds 1, 2 and 3 give the same bits as speed 0, compared with ==.

Logits of every scored position, the loss, every one of the gradients and
dloss/dx_0 of every scored position. The negative controls show that the
comparison sees a single reordered sum.
"""
import numpy as np
import pytest

from hslm.kernels import weight_grad_rows
from hslm.layers import wout_index
from hslm.speeds import SPEEDS

from helpers import K_CASES, assert_bits_equal, k_for, setup, window_result
from kernel_entries import output_grad_panels

REFERENCE = 0  # the oracle every other speed is compared with

CASES = [("hslm-test", True), ("hslm-test", False), ("hslm-3", False)]
_reference = {}


def reference(name, structured, k):
    key = (name, structured, k)
    if key not in _reference:
        cfg, tb, ms, tokens = setup(name, structured)
        _reference[key] = window_result(0, cfg, tb, ms, tokens, k)[:4]
    return _reference[key]


def assert_same_window(res, ref, label):
    loss, logits, grad, dx0 = res[:4]
    r_loss, r_logits, r_grad, r_dx0 = ref
    assert_bits_equal(np.array([loss]), np.array([r_loss]), f"{label} loss")
    assert_bits_equal(logits, r_logits, f"{label} logits")
    assert_bits_equal(grad, r_grad, f"{label} gradient")
    assert_bits_equal(dx0, r_dx0, f"{label} dloss/dx_0")


@pytest.mark.parametrize("name,structured", CASES)
@pytest.mark.parametrize("k_case", K_CASES)
@pytest.mark.parametrize("speed", [s for s in SPEEDS if s != REFERENCE])
def test_speed_is_bit_identical_to_speed0(speed, name, structured, k_case):
    cfg, tb, ms, tokens = setup(name, structured)
    k = k_for(k_case, cfg.window)
    ref = reference(name, structured, k)
    res = window_result(speed, cfg, tb, ms, tokens, k)
    assert_same_window(res, ref, f"speed {speed}")
    nz = int(np.count_nonzero(res[2]))
    print(f"speed {speed} {name} k={k}: {nz:,} of {cfg.n_params:,} gradients nonzero, all ==")
    if name == "hslm-3":
        assert nz > (10**6 if k > 1 else 10**5)


def reordered_wout_gradient(cfg, worker, k):
    """The speed-3 Wout weight gradient with its partial sums swapped: positions
    summed in reverse order (a test helper, not product code)."""
    L, V, d = cfg.window, cfg.vocab, cfg.width
    X = np.ascontiguousarray(worker.acts.x_final_normed[0, L - k:][::-1])
    DY = np.ascontiguousarray(worker.rec.d_head[0, :k][::-1])
    G = np.zeros((d, V))
    pd = output_grad_panels(DY, np.zeros(k * (V + 32)))
    weight_grad_rows(X, 0, d, pd, V, G, np.zeros(d * k), False)
    return G.ravel()


@pytest.mark.parametrize("name", ["hslm-test", "hslm-3"])
def test_negative_control_reordered_sum_fails_the_gradient_test(name):
    cfg, tb, ms, tokens = setup(name, False)
    k = cfg.window
    ref = reference(name, False, k)
    res = window_result(3, cfg, tb, ms, tokens, k)
    loss, logits, grad, dx0, worker = res
    assert_same_window(res, ref, "speed 3")  # the unmodified kernel passes
    t = wout_index(cfg.dims())
    offs = cfg.offsets()
    bad = grad.copy()
    bad[offs[t]:offs[t + 1]] = reordered_wout_gradient(cfg, worker, k)
    # same values to rounding ...
    np.testing.assert_allclose(bad, ref[2], rtol=1e-12, atol=1e-15)
    # ... but the bit-identity test fails on the gradient, and only there
    with pytest.raises(AssertionError, match="gradient: [1-9][0-9]* of"):
        assert_same_window((loss, logits, bad, dx0), ref, "reordered")
    assert_bits_equal(logits, ref[1], "logits")
    assert_bits_equal(dx0, ref[3], "dloss/dx_0")


def test_generated_panel_kernels_are_current():
    """hslm/panel_kernels.py is what tools/gen_panel_kernels.py writes."""
    import importlib.util

    from helpers import ROOT
    spec = importlib.util.spec_from_file_location("gen", ROOT / "tools" / "gen_panel_kernels.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render() == gen.TARGET.read_text(), "run: python tools/gen_panel_kernels.py"


def team_window(cfg, tb, ms, tokens, k, rows, order=None, preset=0):
    """A window's forward and backward by a team of threads, one member after another
    (member j runs rows[j]; order: the members' running order, by default theirs, in which
    no wait ever blocks; preset: each member's progress counter before the start).
    Returns (logits of the scored rows, every record field, row losses, the acts)."""
    from hslm.layers import alloc_acts, alloc_record, alloc_scratch
    from hslm.speeds import KERNEL_PANELS
    from hslm.windows import window_rows_forward, windows_backward
    dims = cfg.dims()
    A, R = alloc_acts(dims, 1), alloc_record(dims, 1)
    model = ms.kernel_model()
    T, nb, L = len(rows), cfg.blocks, cfg.window
    s = L - k
    progress = np.full(T + 1, preset, np.int64)
    progress[T] = 0
    row_losses = np.full((1, k), np.nan)
    windows = tokens.reshape(1, -1)
    for j in (order or range(T)):
        p0, p1 = rows[j]
        if p1 > p0:
            vsa = np.zeros((nb, p1, cfg.width))
            assert window_rows_forward(model, tb.vsa, tokens, k, A, 0, vsa, p0, p1, progress,
                                       j, 0, 1, j, T, KERNEL_PANELS)
    for j in range(T):
        p0, p1 = rows[j]
        r0, r1 = max(p0, s) - s, max(p1, s) - s
        windows_backward(model, windows, k, 1.0 / k, A, R, alloc_scratch(dims), 0, 1, r0, r1,
                         row_losses, KERNEL_PANELS, True, nb, 0)
    return A.logits[0, s:].copy(), [f[0].copy() for f in R], row_losses, A


@pytest.mark.parametrize("name", ["hslm-test", "hslm-3"])
@pytest.mark.parametrize("k_all", [True, False], ids=["k=L", "k<L"])
def test_a_team_of_threads_gives_every_row_the_whole_windows_bits(name, k_all):
    """Threads beyond the batch split a window's rows (hslm.step.team_rows): each member
    runs the layers over its rows, waiting before each block's attention for the keys and
    values of the rows before it, and the backward of its scored rows. Every split gives
    the bits of the whole window's layers: logits, losses, every record the weight
    gradients read. Negative control: a member that does not wait for the rows before
    it (their counters preset, and run first) attends to an empty cache, and differs."""
    from hslm.step import team_rows
    cfg, tb, ms, tokens = setup(name, False)
    L = cfg.window
    k = L if k_all else L // 2 + 1
    ref_logits, ref_records, ref_losses, _ = team_window(cfg, tb, ms, tokens, k, [(0, L)])
    splits = [team_rows(L, k, T) for T in (2, 3, 4, 7)]
    splits += [[(0, 1), (1, L - 1), (L - 1, L)], [(0, L - 2), (L - 2, L), (L, L)]]
    for rows in splits:
        logits, records, losses, _ = team_window(cfg, tb, ms, tokens, k, rows)
        assert_bits_equal(logits, ref_logits, f"{rows}: logits")
        assert_bits_equal(losses, ref_losses, f"{rows}: row losses")
        from hslm.layers import RECORD_FIELDS
        assert len(records) == len(ref_records) == len(RECORD_FIELDS)  # every field compared
        for (f, _), got, want in zip(RECORD_FIELDS, records, ref_records):
            if f in ("d_logits", "d_head", "d_x0"):  # [L, .]: rows past k are unused
                got, want = got[:k], want[:k]
            else:
                got, want = got[:, :k], want[:, :k]
            assert_bits_equal(got, want, f"{rows}: {f}")
    rows = team_rows(L, L, 2)
    logits, _, _, _ = team_window(cfg, tb, ms, tokens, L, rows, order=[1, 0],
                                  preset=cfg.blocks)
    full, _, _, _ = team_window(cfg, tb, ms, tokens, L, [(0, L)])
    assert logits.tobytes() != full.tobytes()


def test_team_rows_cover_the_window_in_order():
    """Consecutive ranges from 0 to L, at most L // 3 members with rows (the rest empty),
    the later rows' members with fewer rows (their attention costs more)."""
    from hslm.step import MIN_TEAM_ROWS, team_rows
    for L, k in ((27, 27), (27, 1), (9, 9), (2, 2), (13, 5)):
        for T in range(1, 12):
            rows = team_rows(L, k, T)
            assert len(rows) == T
            busy = [r for r in rows if r[1] > r[0]]
            assert busy[0][0] == 0 and busy[-1][1] == L
            assert all(a[1] == b[0] for a, b in zip(busy, busy[1:]))
            assert len(busy) == min(T, max(1, L // MIN_TEAM_ROWS))
            assert all(r == (L, L) for r in rows[len(busy):])
    assert team_rows(27, 27, 2) == [(0, 15), (15, 27)]


def test_a_waiting_member_gives_up_when_the_team_aborts():
    """A member waiting for a member before it returns False once progress[-1] is set
    (another member failed), instead of waiting forever; with the counter there, True.
    It waits for every counter it names, not the first alone: the team test runs its
    members in order, so every wait there is met before it starts (a wait on member 0
    alone passed it; a review found it by mutation)."""
    from hslm.spin import wait_for
    progress = np.zeros(4, np.int64)
    progress[3] = 1
    assert not wait_for(progress, 0, 1, 2, 1, 3)
    for published in ([1, 0, 0, 1], [0, 1, 0, 1]):  # counters 0 and 1
        progress[:] = published
        assert not wait_for(progress, 0, 1, 2, 1, 3)
    for published in ([1, 1, 0, 1], [0, 0, 1, 1]):  # counters 0 and 2 (a stride of 2)
        progress[:] = published
        assert not wait_for(progress, 0, 2, 2, 1, 3)
    progress[:] = [1, 0, 1, 1]
    assert wait_for(progress, 0, 2, 2, 1, 3)
    progress[:] = [2, 1, 0, 1]
    assert not wait_for(progress, 0, 1, 2, 2, 3)  # counter 1 short of the value, 2
    progress[:] = [1, 1, 0, 0]
    assert wait_for(progress, 0, 1, 2, 1, 3)
