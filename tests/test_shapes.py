"""Every speed exact on awkward shapes: where the register-tiled kernels' edges are.

Odd head widths, MLP widths and vocabularies that are not multiples of the panel
(24, 16 or 12 columns) or the tile (3 or 9 rows), one block, a window of 2, widths below the
tile size: speeds 1-3 against speed 0 with == on the bits (k = L and k = 1,
random and structured VSA tables), speed 0 against the PyTorch f64 oracle, and
whole runs from a JSON model file at every speed and 1-3 threads.
"""
import json

import numpy as np
import pytest

from hslm.config import Config
from hslm.layers import wout_index
from hslm.oracle_torch import oracle_window
from hslm import panel_kernels
from hslm.panel_kernels import SINGLE_WIDENED, TERNARY_TILES, WGRAD_TILES
from hslm.speeds import SPEEDS
from hslm.params import ModelState, init_params
from hslm.tables import Tables

from helpers import K_CASES, k_for, window_result
from test_oracle import close
from test_speeds import assert_same_window, reordered_wout_gradient
from test_train import run

SHAPES = {
    # odd head width (5), one block, a window of 2, a width (10) below every panel
    "odd-head-window-2": Config(vocab=31, width=10, heads=2, head_width=5, mlp=25, blocks=1,
                                window=2, vsa_dim=40),
    # width 14 < one panel, mlp 50 = 2 panels + 2, vocab 263 = 10 panels + 23
    "narrow": Config(vocab=263, width=14, heads=2, head_width=7, mlp=50, blocks=2, window=5,
                     vsa_dim=56),
    # every dimension odd and prime-ish: 33 = 24 + 9, 97 = 4 * 24 + 1, 101 = 4 * 24 + 5
    "odd": Config(vocab=101, width=33, heads=3, head_width=11, mlp=97, blocks=1, window=13,
                  vsa_dim=132),
    # one head, a vocabulary of 761 = 31 panels + 17, window 7 (not a multiple of 3 rows)
    "one-head": Config(vocab=761, width=27, heads=1, head_width=27, mlp=53, blocks=2, window=7,
                       vsa_dim=108),
    # heads of 2 columns (one rotary pair each); width 6, below the AVX-512 active-row
    # tile's lanes; mlp and vocab below every panel
    "head-width-2": Config(vocab=11, width=6, heads=3, head_width=2, mlp=7, blocks=2,
                           window=9, vsa_dim=24),
    # width 2, below every build's active-row lanes: Wup and Wdown take the dense route
    "width-2": Config(vocab=11, width=2, heads=1, head_width=2, mlp=3, blocks=1, window=4,
                      vsa_dim=8),
    # a window past 64 positions: the ReLU's masks take two words per unit
    "window-70": Config(vocab=31, width=9, heads=1, head_width=9, mlp=17, blocks=1, window=70,
                        vsa_dim=36),
}


def test_the_shapes_reach_the_kernels_edges():
    """For every tile (hslm.micro picks one of each kind by machine)."""
    for rows, panel in TERNARY_TILES + WGRAD_TILES:
        for cfg in SHAPES.values():
            assert any(n % panel for n in (cfg.width, cfg.mlp, cfg.vocab))
        assert any(c.window % rows for c in SHAPES.values())
        assert any(c.width < panel for c in SHAPES.values())
    assert any(c.head_width % 2 for c in SHAPES.values())
    assert any(c.head_width == 2 for c in SHAPES.values())
    assert any(c.width < 4 for c in SHAPES.values())  # below ACTIVE_LANES on every build
    assert any(c.window > 64 for c in SHAPES.values())  # two mask words


@pytest.mark.parametrize("n,a,b", [(27, 243, 729), (7, 33, 101), (2, 10, 9), (13, 50, 17),
                                   (26, 20, 40), (12, 5, 16), (9, 0, 16), (15, 40, 33),
                                   (14, 7, 20), (5, 96, 20), (4, 97, 33), (3, 192, 16),
                                   (6, 729, 17), (27, 243, 243)])
def test_every_ternary_tile_gives_the_plain_sums_bit_for_bit(n, a, b):
    """Each machine runs one tile; all must give the bits of the plain loop (each sum
    over i in order from 0.0), whatever rows and columns are left over (the 9-row tile's
    remainders run in tiles of 6 and 3 rows, then single rows; a last panel of one
    vector's columns runs the narrow tile, 9 or 8 rows, then the full ones: 17, 20, 33,
    40 and 243 columns), and whatever the input length against the chunks the panels
    are widened in (panel_kernels.TERNARY_CHUNK: 96, 97, 192, 243 and 729 inputs end
    at, just past and inside a chunk)."""
    rng = np.random.default_rng(n * a + b)
    X = rng.standard_normal((n, a))
    T = rng.integers(-1, 2, (a, b)).astype(np.float64)
    plain = np.zeros((n, b))
    for i in range(a):  # y = ((0 + x0 t0) + x1 t1) + ...: row by row, in order
        plain += X[:, i:i + 1] * T[i]
    plain *= 0.37
    kernels = 0
    for rows, panel in TERNARY_TILES:
        npan = -(-b // panel)
        P = np.zeros((npan, a, panel), np.int8)
        for q in range(npan):
            cols = T[:, q * panel:(q + 1) * panel]
            P[q, :, :cols.shape[1]] = cols
        # the panel's chunks widened to float64, and (SINGLE_WIDENED) to float32
        for name in [f"{rows}x{panel}"] + [f"{rows}x{panel}_f32"] * (panel in SINGLE_WIDENED):
            Y = np.zeros((n, b))
            getattr(panel_kernels, f"ternary_panel_matmul_{name}")(X, P, b, 0.37, Y)
            assert Y.tobytes() == plain.tobytes(), f"tile {name}"
            kernels += 1
    assert kernels == 3
    # negative control: the same sums taken in another order differ in some bits
    other = np.zeros((n, b))
    for i in reversed(range(a)):
        other += X[:, i:i + 1] * T[i]
    assert a < 3 or (other * 0.37).tobytes() != plain.tobytes()


def sparse_input(rng, n, a, active):
    """n x a inputs, about `active` of them nonzero, and the values a skip must get right:
    an all-zero row, -0.0 (skipped), NaN and inf (kept: dense gives NaN from inf . 0)."""
    X = rng.standard_normal((n, a))
    X[rng.random((n, a)) >= active] = 0.0
    if n >= 3 and a >= 6:
        X[0] = 0.0
        X[1, 3], X[1, 1], X[2, 5] = -0.0, np.inf, np.nan
    return X


def panels_of(T, panel):
    npan = -(-T.shape[1] // panel)
    P = np.zeros((npan, T.shape[0], panel), np.int8)
    for q in range(npan):
        cols = T[:, q * panel:(q + 1) * panel]
        P[q, :, :cols.shape[1]] = cols
    return P


@pytest.mark.parametrize("n,a,b", [(27, 729, 243), (7, 33, 101), (3, 64, 9), (13, 65, 17),
                                   (5, 128, 40), (4, 200, 300), (1, 63, 12), (9, 0, 16),
                                   (6, 729, 17), (27, 243, 729), (3, 129, 20)])
def test_every_sparse_kernel_gives_the_dense_bits(n, a, b):
    """The products that skip their inputs' zeros (panel_kernels.ternary_sparse_matmul_*;
    hslm.micro takes one where it pays) against the dense kernel of their panel width, bit
    for bit: inputs ending at, just past and inside a chunk of 64 (a mask word; 129: a last
    chunk of one input), a last
    group of fewer panels than a tile holds (9, 17, 40, 101 and 300 columns), every input
    zero and none, -0.0, NaN and inf. Above `most` nonzero the kernel declines and leaves Y
    as it was. The control: a tile that skipped NaN as well (were the masks built with an
    ordered compare) would give finite sums where the dense kernel's are NaN."""
    rng = np.random.default_rng(n * a + b)
    T = rng.integers(-1, 2, (a, b)).astype(np.int8)
    kernels = 0
    for panel, single in panel_kernels.SPARSE_SINGLE_WIDENED.items():
        rows = dict((p, r) for r, p in TERNARY_TILES)[panel]
        dense = getattr(panel_kernels, f"ternary_panel_matmul_{rows}x{panel}")
        sparse = getattr(panel_kernels, f"ternary_sparse_matmul_{panel}{'_f32' * single}")
        P = panels_of(T, panel)
        for active in (0.0, 0.3, 0.5, 1.0):
            X = sparse_input(rng, n, a, active)
            want, got = np.full((n, b), 7.0), np.full((n, b), 7.0)
            dense(X, P, b, 0.37, want)
            assert sparse(X, P, b, 0.37, got, 1.0)
            assert got.tobytes() == want.tobytes(), (panel, active)
            if n >= 3 and a >= 6:
                assert np.isnan(want[2]).all() and np.isnan(got[2]).all()
                X[2, 5] = 0.0  # the control: NaN skipped as a zero would be
                sparse(X, P, b, 0.37, got, 1.0)
                assert not np.isnan(got[2]).any()
        X = sparse_input(rng, n, a, 0.9)
        untouched = np.full((n, b), 7.0)
        declined = not sparse(X, P, b, 0.37, untouched, 0.5)
        if n * a > 0:
            assert declined and (untouched == 7.0).all()
        else:  # no input at all: nothing above `most`, and every sum is 0.0
            assert not declined and untouched.tobytes() == np.zeros((n, b)).tobytes()
        kernels += 1
    assert kernels == 2


def test_the_sparse_kernels_are_taken_only_on_amd_family_19h():
    from hslm.micro import skips_relu_zeros
    cores = {("AuthenticAMD", "25"): True, ("AuthenticAMD", "26"): False,
             ("AuthenticAMD", "23"): False, ("GenuineIntel", "6"): False,
             ("AuthenticAMD", "x"): False}
    for (vendor, family), skips in cores.items():
        assert skips_relu_zeros({"vendor_id": vendor, "cpu family": family}) is skips


@pytest.mark.parametrize("n,a,b", [(36, 27, 729), (7, 33, 101), (2, 10, 9), (13, 27, 17),
                                   (13, 27, 243), (5, 7, 32), (4, 9, 28)])
def test_every_weight_gradient_tile_gives_the_plain_sums_bit_for_bit(n, a, b):
    """G += X . D for each tile: each sum over i in order from 0.0, then added to G
    (a multiply and an add per term, never fused), whatever rows and columns are
    left over, and on a narrow last panel (243, 32 and 28 columns end in one); fresh,
    G = 0.0 + X . D over G full of NaN. Likewise two windows a call (the pair driver):
    G = (G + S1) + S2."""
    rng = np.random.default_rng(n * a + b)
    X = rng.standard_normal((n, a))
    D = rng.standard_normal((a, b))
    G0 = rng.standard_normal((n, b))
    s = np.zeros((n, b))
    for i in range(a):
        s += X[:, i:i + 1] * D[i]
    plain = G0 + s
    X2 = rng.standard_normal((n, a)) * 3.0  # a second window
    D2 = rng.standard_normal((a, b))
    s2 = np.zeros((n, b))
    for i in range(a):
        s2 += X2[:, i:i + 1] * D2[i]
    P2 = {}
    for _, panel in WGRAD_TILES:
        npan = -(-b // panel)
        P2[panel] = np.zeros((npan, a, panel))
        for q in range(npan):
            cols = D2[:, q * panel:(q + 1) * panel]
            P2[panel][q, :, :cols.shape[1]] = cols

    for rows, panel in WGRAD_TILES:
        npan = -(-b // panel)
        P = np.zeros((npan, a, panel))
        for q in range(npan):
            cols = D[:, q * panel:(q + 1) * panel]
            P[q, :, :cols.shape[1]] = cols
        G = G0.copy()
        kernel = getattr(panel_kernels, f"panel_matmul_add_{rows}x{panel}")
        kernel(X, P, b, G, False)
        assert G.tobytes() == plain.tobytes(), f"tile {rows}x{panel}"
        G = np.full((n, b), np.nan)
        kernel(X, P, b, G, True)
        assert G.tobytes() == (0.0 + s).tobytes(), f"tile {rows}x{panel}, fresh"
        # two windows a call: the second window's sums added after the first's
        pair = getattr(panel_kernels, f"panel_matmul_add2_{rows}x{panel}")
        G = G0.copy()
        pair(X, X2, P, P2[panel], b, G, False)
        assert G.tobytes() == (plain + s2).tobytes(), f"pair {rows}x{panel}"
        G = np.full((n, b), np.nan)
        pair(X, X2, P, P2[panel], b, G, True)
        assert G.tobytes() == ((0.0 + s) + s2).tobytes(), f"pair {rows}x{panel}, fresh"
    assert (G0 + (s + s2)).tobytes() != (plain + s2).tobytes()  # the windows summed first
    # negative controls: the terms in another order, or added straight into G
    other = np.zeros((n, b))
    for i in reversed(range(a)):
        other += X[:, i:i + 1] * D[i]
    assert (G0 + other).tobytes() != plain.tobytes()
    straight = G0.copy()
    for i in range(a):
        straight += X[:, i:i + 1] * D[i]
    assert straight.tobytes() != plain.tobytes()


def plain_attention(q, K, V, do, p, H, dh, scale, e_order=None):
    """Position p's attention and its backward as plain Python loops, every sum in order
    from 0.0 (the scores' over e_order, when given: the negative control)."""
    from hslm.mathfn import exp
    A = np.zeros((H, p + 1))
    o, dq, dk, dv = (np.zeros(H * dh) for _ in range(4))
    for h in range(H):
        c0 = h * dh
        for j in range(p + 1):
            s = 0.0
            for e in (range(dh) if e_order is None else e_order):
                s += q[c0 + e] * K[j, c0 + e]
            A[h, j] = s * scale
        m = max(A[h])
        for j in range(p + 1):
            A[h, j] = exp(A[h, j] - m)
        z = 0.0
        for j in range(p + 1):
            z += A[h, j]
        for j in range(p + 1):
            A[h, j] = A[h, j] / z
        for e in range(dh):
            acc = 0.0
            for j in range(p + 1):
                acc += A[h, j] * V[j, c0 + e]
            o[c0 + e] = acc
        da, sum_ad = np.zeros(p + 1), 0.0
        for j in range(p + 1):
            acc = 0.0
            for e in range(dh):
                acc += do[c0 + e] * V[j, c0 + e]
            da[j] = acc
            sum_ad += A[h, j] * acc
        g = [(A[h, j] * (da[j] - sum_ad)) * scale for j in range(p + 1)]
        for e in range(dh):
            acc = 0.0
            for j in range(p + 1):
                acc += g[j] * K[j, c0 + e]
            dq[c0 + e] = acc
            dk[c0 + e] = g[p] * q[c0 + e]
            dv[c0 + e] = A[h, p] * do[c0 + e]
    return A, o, dq, dk, dv


@pytest.mark.parametrize("heads,head_width,window", [(3, 81, 27), (3, 11, 13), (2, 7, 5),
                                                     (1, 27, 30), (2, 25, 49)])
def test_attention_in_panels_gives_the_plain_sums_bit_for_bit(heads, head_width, window):
    """attention_rows and attention_rows_backward, reading the cache from its panels
    (cache_panels), against the plain loops at every position: head widths and windows
    below, at and past a panel (ATTN_PANEL columns) and past two; the rows in ranges
    that start and end inside a group of ATTN_GROUP, the backward's from a record row
    s > 0 as well. The control: the scores summed over e in reverse give other bits."""
    from hslm.layers import alloc_acts, alloc_scratch
    from kernel_entries import attention_rows, attention_rows_backward, backward_panels, cache_panels
    d = heads * head_width
    cfg = Config(vocab=31, width=d, heads=heads, head_width=head_width, mlp=9, blocks=1,
                 window=window, vsa_dim=4 * d)
    A = alloc_acts(cfg.dims(), 1)
    rng = np.random.default_rng(window)
    A.q[0, 0], A.k[0, 0], A.v[0, 0] = (rng.standard_normal((window, d)) for _ in range(3))
    do = rng.standard_normal(d)
    for p0, p1 in ((0, window // 2), (window // 2, window)):  # rows in two ranges
        cache_panels(A, 0, 0, p0, p1, heads, head_width)
    scale = 1.0 / np.sqrt(head_width)
    ranges = ((0, 1), (1, window // 2 + 1), (window // 2 + 1, window))
    for p0, p1 in ranges:
        attention_rows(A.q[0, 0], A.k_cols[0, 0], A.v_rows[0, 0], p0, p1, heads, head_width,
                       scale, A.attn[0, 0], A.attn_out[0, 0])
    DO = np.tile(do, (window, 1))
    DQ, DK, DV = (np.zeros((window, d)) for _ in range(3))
    S = alloc_scratch(cfg.dims())  # the backward's panels, of the rows each range needs
    for r0, r1 in ranges:
        backward_panels(A, 0, 0, r0, r1, heads, head_width, S.v_cols[0], S.k_rows[0])
        attention_rows_backward(A.q[0, 0], S.v_cols[0], S.k_rows[0], A.attn[0, 0], 0,
                                r0, r1, heads, head_width, scale, DO, DQ, DK, DV)
    s0 = window // 3  # record rows from position s0 on, as with k < window
    late = [np.zeros((window - s0, d)) for _ in range(3)]
    for r0, r1 in ((0, 2), (2, window - s0)):
        backward_panels(A, 0, 0, 0, s0 + r1, heads, head_width, S.v_cols[0], S.k_rows[0])
        attention_rows_backward(A.q[0, 0], S.v_cols[0], S.k_rows[0], A.attn[0, 0], s0,
                                r0, r1, heads, head_width, scale, DO, *late)
    for grads, late_grads in zip((DQ, DK, DV), late):
        assert late_grads.tobytes() == grads[s0:].tobytes()
    for p in range(window):
        o, dq, dk, dv = A.attn_out[0, 0, p], DQ[p], DK[p], DV[p]
        ref = plain_attention(A.q[0, 0, p], A.k[0, 0], A.v[0, 0], do, p, heads, head_width,
                              scale)
        got = (A.attn[0, 0, p][:, :p + 1].copy(), o, dq, dk, dv)
        for name, a, b in zip(("probabilities", "o", "dq", "dk", "dv"), got, ref):
            assert a.tobytes() == b.tobytes(), f"{name} at position {p}"
    control = plain_attention(A.q[0, 0, p], A.k[0, 0], A.v[0, 0], do, p, heads, head_width,
                              scale, e_order=range(head_width - 1, -1, -1))
    assert control[0].tobytes() != got[0].tobytes()


_cache = {}


def setup(name, structured):
    key = (name, structured)
    if key not in _cache:
        cfg = SHAPES[name]
        tb = Tables(cfg, structured_vsa=structured)
        ms = ModelState(cfg, init_params(cfg, 3), tb)
        tokens = np.random.default_rng(1).integers(0, cfg.vocab, cfg.window + 1)
        _cache[key] = cfg, tb, ms, tokens
    return _cache[key]


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("structured", [False, True], ids=["random-vsa", "structured-vsa"])
@pytest.mark.parametrize("k_case", K_CASES)
def test_every_speed_is_bit_identical_on_awkward_shapes(name, structured, k_case):
    cfg, tb, ms, tokens = setup(name, structured)
    k = k_for(k_case, cfg.window)
    ref = window_result(0, cfg, tb, ms, tokens, k)[:4]
    assert np.count_nonzero(ref[2]) > 0.3 * cfg.n_params
    for speed in (s for s in SPEEDS if s != 0):
        assert_same_window(window_result(speed, cfg, tb, ms, tokens, k), ref, f"speed {speed}")


@pytest.mark.parametrize("name", ["odd", "one-head"])
def test_negative_control_on_an_awkward_shape(name):
    cfg, tb, ms, tokens = setup(name, False)
    k = cfg.window
    ref = window_result(0, cfg, tb, ms, tokens, k)[:4]
    loss, logits, grad, dx0, worker = window_result(3, cfg, tb, ms, tokens, k)
    t = wout_index(cfg.dims())
    offs = cfg.offsets()
    bad = grad.copy()
    bad[offs[t]:offs[t + 1]] = reordered_wout_gradient(cfg, worker, k)
    with pytest.raises(AssertionError, match="gradient: [1-9][0-9]* of"):
        assert_same_window((loss, logits, bad, dx0), ref, "reordered")


@pytest.mark.parametrize("name", SHAPES)
def test_speed0_matches_torch_on_awkward_shapes(name):
    cfg, tb, ms, tokens = setup(name, False)
    k = cfg.window
    loss, logits, grad, dx0, _ = window_result(0, cfg, tb, ms, tokens, k)
    t_loss, t_logits, t_grad, t_dx0, _ = oracle_window(cfg, ms.theta, tb.vsa, tokens, k)
    assert abs(loss - t_loss) <= 1e-9 * abs(t_loss)
    close(logits, t_logits, "logits")
    close(dx0, t_dx0, "dloss/dx_0")
    offs = cfg.offsets()
    for t, (tname, _, _) in enumerate(cfg.tensors()):
        close(grad[offs[t]:offs[t + 1]], t_grad[offs[t]:offs[t + 1]], f"gradient of {tname}")


def test_whole_runs_from_a_json_model_agree_at_every_speed_and_thread_count(tmp_path, capsys):
    model = tmp_path / "narrow.json"
    model.write_text(json.dumps({f: getattr(SHAPES["narrow"], f) for f in
                                 ("vocab", "width", "heads", "head_width", "mlp", "blocks",
                                  "window", "vsa_dim")}))
    args = ["train", "--model", model, "--seed", 5, "--batch", 3, "--steps", 2, "--quiet"]
    code, _, err = run(capsys, *args, "--speed", 0, "--threads", 1, "--out", tmp_path / "ref")
    assert code == 0, err
    ref = {e: (tmp_path / "ref" / f"ckpt_2.{e}").read_bytes() for e in ("bin", "state")}
    for speed in (s for s in SPEEDS if s != 0):
        for threads in (1, 2, 3):
            out = tmp_path / f"s{speed}t{threads}"
            code, _, err = run(capsys, *args, "--speed", speed, "--threads", threads,
                               "--out", out)
            assert code == 0, err
            for e in ("bin", "state"):
                assert (out / f"ckpt_2.{e}").read_bytes() == ref[e], (speed, threads, e)


@pytest.mark.parametrize("fields,message", [
    ({"heads": 3, "head_width": 9}, "heads * head_width must equal width (3 * 9 = 27, width 243):"
                                    " set head_width to 81"),
    # (the fix given satisfies the other rules too: "set head_width to 1" had been given)
    ({"width": 3, "heads": 3, "head_width": 2, "vsa_dim": 12},
     "(3 * 2 = 6, width 3): set heads to 1 and head_width to 3"),
    ({"heads": 4, "head_width": 2, "width": 10, "vsa_dim": 40}, "set width to 8"),
    # (no heads fix keeps vsa_dim's rule: one right on the heads, not "width must be at
    # least 2")
    ({"heads": 3, "head_width": 16, "width": 64, "vsa_dim": 128}, "set width to 48"),
    ({"head_width": 1, "heads": 243}, "head_width must be at least 2"),
    ({"vsa_dim": 100}, "vsa_dim must be at least 4 * width = 972"),
    ({"window": 82}, "window must be at most 81"),
    ({"blocks": 0}, "blocks must be a positive integer, got 0"),
    ({"mlp": 2.5}, "mlp must be a positive integer, got 2.5"),
    # (as the file has them: Python's repr had said True, None and '8')
    ({"vocab": True}, "vocab must be a positive integer, got true"),
    ({"mlp": None}, "mlp must be a positive integer, got null"),
    ({"heads": "8"}, 'heads must be a positive integer, got "8"'),
    ({"vocab": 10**9}, "vocab must be at most 1,048,576"),
    ({"depth": 3}, "unknown depth"),
])
def test_a_bad_model_file_is_one_line_that_says_what_to_fix(tmp_path, capsys, fields, message):
    obj = {"vocab": 729, "width": 243, "heads": 3, "head_width": 81, "mlp": 729, "blocks": 3,
           "window": 27, "vsa_dim": 1024}
    obj.update(fields)
    p = tmp_path / "m.json"
    p.write_text(json.dumps(obj))
    code, out, err = run(capsys, "train", "--model", p, "--out", tmp_path / "o")
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_model_file_with_a_byte_order_mark_is_read_and_an_empty_one_is_called_so(tmp_path,
                                                                                    capsys):
    """A config saved with a UTF-8 byte order mark (some editors do) had been refused with
    Python's advice "decode using utf-8-sig"; an empty one was "Expecting value: line 1
    column 1 (char 0)". The first is read, the second called empty, text that is not
    JSON called so. Control: the config without the mark, the same."""
    cfg = b'{"vocab": 300, "width": 12, "heads": 2, "head_width": 6, "mlp": 24, "blocks": 1, ' \
          b'"window": 9, "vsa_dim": 64}'
    outs = []
    for name, raw in (("plain", cfg), ("bom", b"\xef\xbb\xbf" + cfg)):
        (tmp_path / f"{name}.json").write_bytes(raw)
        code, out, err = run(capsys, "info", tmp_path / f"{name}.json")
        assert code == 0, err
        outs.append(out.splitlines()[1].split(None, 1)[1])
    assert outs[0] == outs[1]
    for raw, message in ((b"", "is empty"), (b"  \n", "is empty"),
                         (b"\xef\xbb\xbf\n", "is empty"),
                         (b"vocab: 300", "is not JSON: Expecting value"),
                         (cfg.replace(b'300', '"\u00e9"'.encode()),
                          'vocab must be a positive integer, got "\u00e9"')):
        (tmp_path / "m.json").write_bytes(raw)
        code, out, err = run(capsys, "train", "--model", tmp_path / "m.json", "--out",
                             tmp_path / "o")
        assert code == 2 and f"model config {tmp_path / 'm.json'}" in err and message in err, err


def test_info_lists_the_presets_with_their_parameter_counts(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0
    for line in ("hslm-3          2,130,138", "hslm-3-deep     3,905,253",
                 "hslm-3-wide     7,802,487", "hslm-3-long     2,130,138"):
        assert line in out


def test_train_says_the_parameter_count_and_memory_before_step_1(tmp_path, capsys):
    code, out, err = run(capsys, "train", "--model", "hslm-tiny", "--steps", 1, "--out",
                         tmp_path / "o", "--threads", 1)
    assert code == 0, err
    header = out.splitlines()[0]
    assert header.startswith("model 31,350 parameters, about ") and " MiB for " in header


def test_requantisation_writes_the_panels_of_the_thresholded_matrices():
    """Every ternary tensor's panels, as requantisation writes them for this machine's
    panel width (vector trits, byte copies and transposes), against numpy: Pf[q, i, c] =
    T[i, q P + c] and Pb[q, j, c] = T[q P + c, j], zero past the matrix."""
    from hslm.micro import TERNARY_PANEL as P
    checked = 0
    for cfg in SHAPES.values():
        st = ModelState(cfg, init_params(cfg, 3), Tables(cfg), plain=False)
        st.theta[::97] = np.nan  # a NaN gives a zero trit
        st.requantize()
        checked += check_panels(st, P)
    assert checked > 10


def check_panels(st, P):
    checked = 0
    for t in np.flatnonzero(st.is_ternary):
        m, n = int(st.rows[t]), int(st.cols[t])
        W = st.theta[st.offs[t]:st.offs[t + 1]].reshape(m, n)
        half = st.alpha[t] / 2.0
        T = np.where(W > half, 1, np.where(W < -half, -1, 0)).astype(np.int8)
        for M, panels, offs in ((T, st.Pf, st.pf_offs), (T.T, st.Pb, st.pb_offs)):
            rows, cols = M.shape
            npan = -(-cols // P)
            padded = np.zeros((rows, npan * P), np.int8)
            padded[:, :cols] = M
            want = padded.reshape(rows, npan, P).transpose(1, 0, 2)
            assert panels[offs[t]:offs[t + 1]].tobytes() == want.tobytes()
        assert st.zeros[t] == np.count_nonzero(T == 0)
        checked += 1
    return checked


@pytest.mark.parametrize("width", [12, 16])
def test_byte_transposes_copies_and_trits_in_vectors(width):
    """The vector byte moves requantisation uses, for both panel widths: a 16 x 16
    transpose storing `width` bytes per column, a `width`-byte copy, and float64 to
    trits 8 or 16 at a time (its zero count too); none writes past its bytes."""
    from numba import njit
    from hslm.vector_tiles import make_copy_bytes, make_transpose_bytes, make_trits
    transpose, copy = make_transpose_bytes(width), make_copy_bytes(width)
    trits = make_trits(width - width % 8)  # lanes 8 and 16

    @njit
    def moves(src, n, dst, row, out, x, half, t):
        transpose(src.ctypes.data + 3, n, dst.ctypes.data)
        copy(row.ctypes.data, out.ctypes.data)
        return trits(x.ctypes.data, x.shape[0], half, t.ctypes.data)

    rng = np.random.default_rng(width)
    n = 40
    src = rng.integers(-128, 128, (16, n)).astype(np.int8)
    dst = np.full(16 * width + 8, 99, np.int8)
    row, out = rng.integers(-1, 2, 20).astype(np.int8), np.full(24, 99, np.int8)
    lanes = width - width % 8
    x = rng.normal(size=3 * lanes + 5)
    x[[0, 3, 5, 7]] = [np.nan, 0.5, -0.5, np.inf]
    t = np.full(x.size, 99, np.int8)
    done = moves(src, n, dst, row, out, x, 0.5, t)
    want = src[:width, 3:19].T  # [16 columns, width rows]
    assert dst[:16 * width].tobytes() == np.ascontiguousarray(want).tobytes()
    assert (dst[16 * width:] == 99).all()
    assert out[:width].tobytes() == row[:width].tobytes() and (out[width:] == 99).all()
    assert done == np.count_nonzero(t[:3 * lanes] == 0) > 0
    exact = np.where(x > 0.5, 1, np.where(x < -0.5, -1, 0)).astype(np.int8)
    assert t[:3 * lanes].tobytes() == exact[:3 * lanes].tobytes()
    assert (t[3 * lanes:] == 99).all()
    assert exact[0] == 0 and exact[3] == 0 and exact[7] == 1
    control = np.where(x >= 0.5, 1, np.where(x <= -0.5, -1, 0)).astype(np.int8)
    assert control[:3 * lanes].tobytes() != t[:3 * lanes].tobytes()


@pytest.mark.parametrize("k,F,n", [(27, 40, 243), (81, 9, 17), (9, 27, 9), (64, 12, 130),
                                   (65, 7, 121), (27, 5, 52), (7, 11, 8), (27, 13, 486)])
def test_the_relu_weight_gradient_over_active_positions_is_the_dense_sum(k, F, n):
    """active_rows_grad (the MLP's weight gradients: only the positions where ReLU unit
    j is active) gives the dense sums' bits: every position's product added in order
    from 0.0, the zero ones included; fresh, 0.0 + the sum over O full of NaN. The
    shapes reach every tile (the 16 and 15 vector tiles on AVX-512, 13 and 12 on AVX2,
    the narrower tile), a mask of two words (k > 64) and the overlapping last vector.
    Negative controls: the positions summed in reverse, or one active position left out,
    give other bits."""
    from kernel_entries import active_masks, active_rows_grad
    rng = np.random.default_rng(k * F + n)
    relu = np.maximum(rng.standard_normal((k, F)), 0.0)
    relu[:, 0] = 0.0  # a unit never active: its row is 0.0 + 0.0
    d_u = np.where(relu > 0, rng.standard_normal((k, F)), 0.0)
    factors = {"Wdown (the ReLU's output)": relu, "Wup (d_u, 0.0 where the ReLU is)": d_u}
    D = rng.standard_normal((k, n + 5))
    M = np.empty(((k + 63) // 64, F), np.int64)
    active_masks(relu, 0, F, M)
    assert (M != 0).sum() > 0 and M.shape[0] == (2 if k > 64 else 1)
    for name, S in factors.items():
        for c0 in (0, 5):
            s = np.zeros((F, n))
            for t in range(k):
                s += S[t][:, None] * D[t, c0:c0 + n][None, :]
            O0 = rng.standard_normal((F, n + 3))
            O = O0.copy()
            active_rows_grad(M, S, D, c0, c0 + n, 1, F, O[1:], False)
            assert O[1:, :n].tobytes() == (O0[1:, :n] + s[1:]).tobytes(), name
            assert O[0].tobytes() == O0[0].tobytes() and O[:, n:].tobytes() == O0[:, n:].tobytes()
            O = np.full((F, n), np.nan)
            active_rows_grad(M, S, D, c0, c0 + n, 0, F, O, True)
            assert O.tobytes() == (0.0 + s).tobytes(), name + ", fresh"
    # the controls: the same products summed over the positions in reverse give other
    # bits (so the comparison above sees the order) ...
    rev = np.zeros((F, n))
    for t in reversed(range(k)):
        rev += S[t][:, None] * D[t, c0:c0 + n][None, :]
    assert (0.0 + rev).tobytes() != O.tobytes()
    # ... and leaving out one active position changes them
    j = int(np.argmax((relu > 0).sum(axis=0)))
    t = int(np.nonzero(relu[:, j] > 0)[0][-1])
    M[t // 64, j] &= ~(np.int64(1) << np.int64(t % 64))
    O = np.full((F, n), np.nan)
    active_rows_grad(M, relu, D, 0, n, 0, F, O, True)
    dense = np.zeros(n)
    for t2 in range(k):
        dense += relu[t2, j] * D[t2, :n]
    assert O[j].tobytes() != dense.tobytes()


@pytest.mark.parametrize("k,F,j0,j1", [(27, 729, 0, 729), (27, 729, 243, 486), (65, 13, 3, 11),
                                      (128, 9, 0, 9), (1, 5, 4, 5), (27, 8, 5, 5)])
def test_active_masks_set_the_bits_of_positive_entries_in_their_columns_only(k, F, j0, j1):
    """active_masks: bit t % 64 of word t // 64 of column j is set exactly where X[t, j]
    > 0.0 (NaN, -0.0, +0.0 and negatives are not), for j0 <= j < j1, over masks that held
    other bits; the columns outside are left as they were (a team's W_down makes its own
    units' masks). Control: a mask with one bit flipped differs."""
    from kernel_entries import active_masks
    rng = np.random.default_rng(k * 7 + F + j0)
    X = rng.standard_normal((k, F))
    X[rng.random((k, F)) < 0.1] = np.nan
    X[rng.random((k, F)) < 0.1] = -0.0
    X[rng.random((k, F)) < 0.1] = 0.0
    words = (k + 63) // 64
    M0 = rng.integers(-2**62, 2**62, (words, F), dtype=np.int64)
    M = M0.copy()
    active_masks(X, j0, j1, M)
    want = M0.copy()
    for j in range(j0, j1):
        for w in range(words):
            bits = 0
            for t in range(64 * w, min(k, 64 * w + 64)):
                if X[t, j] > 0.0:
                    bits |= 1 << (t % 64)
            want[w, j] = np.array(bits, np.uint64).astype(np.int64)
    assert M.tobytes() == want.tobytes()
    if j1 > j0:
        want[0, j0] ^= 1
        assert M.tobytes() != want.tobytes()


@pytest.mark.parametrize("F, w", [(729, 128), (729, 115), (8, 8), (13, 7), (5, 21), (1, 1), (0, 9)])
def test_wup_transposes_copy_every_element_and_nothing_else(F, w):
    """transpose_rows (W_up's sums between G and its scratch, in 8 x 8 blocks) is the
    transpose, on shapes with and without whole blocks, into the rows of a wider G that
    it must leave alone past column F."""
    from kernel_entries import transpose_rows
    T = np.random.default_rng(F * 31 + w).standard_normal((F, w))
    G = np.full((w, F + 3), np.nan)
    transpose_rows(T, G[:, :F])
    assert G[:, :F].tobytes() == np.ascontiguousarray(T.T).tobytes()
    assert np.isnan(G[:, F:]).all()
    back = np.full((F, w), np.nan)
    transpose_rows(G[:, :F], back)
    assert back.tobytes() == T.tobytes()
