"""AdamW with per-tensor clipping against torch.optim.AdamW; the schedule."""
import math

import numpy as np
import torch

from hslm.optim import adamw_step, adamw_tensors, bias_corrections, learning_rate


def test_adamw_matches_torch():
    rng = np.random.default_rng(0)
    sizes = [50, 7, 300]
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    decay = np.array([True, False, True])
    theta = rng.normal(size=offs[-1])
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    ts = [torch.tensor(theta[offs[i]:offs[i + 1]].copy(), requires_grad=True) for i in range(3)]
    groups = [{"params": [ts[i]], "weight_decay": 0.01 if decay[i] else 0.0} for i in range(3)]
    opt = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    norms = np.zeros(3)
    sums = np.zeros(3)
    moments = np.zeros(3)
    for step in range(1, 6):
        lr = learning_rate(step, 0.01, 2, 5)
        g = rng.normal(size=offs[-1]) * (0.1 if step % 2 else 3.0)  # clipped on even steps
        adamw_step(theta, g, m, v, offs, decay, *bias_corrections(step), lr, 0.01, norms,
                   sums, moments, 0, 3)
        for i, t in enumerate(ts):
            gi = torch.tensor(g[offs[i]:offs[i + 1]].copy())
            norm = gi.norm()
            t.grad = gi / norm if norm > 1.0 else gi  # clip each tensor to norm 1 on its own
            opt.param_groups[i]["lr"] = lr
        opt.step()
        ref = np.concatenate([t.detach().numpy() for t in ts])
        np.testing.assert_allclose(theta, ref, rtol=1e-12, atol=1e-14)
        for i in range(3):  # the fused sum |w| (for alpha) is the plain loop's, to the bit
            s = 0.0
            for w in theta[offs[i]:offs[i + 1]]:
                s += abs(float(w))
            assert np.float64(sums[i]).tobytes() == np.float64(s).tobytes()
        assert np.allclose(norms, [np.linalg.norm(g[offs[i]:offs[i + 1]]) for i in range(3)])


def reference_adamw(theta, g, m, v, offs, decay, bc1, bc2, lr, wd, t0, t1, norm_sum=None):
    """adamw_step in plain Python floats, one element at a time (IEEE, no FMA): the bits
    every implementation must give. norm_sum replaces the norm's in-order sum (the
    negative control)."""
    theta, m, v = theta.copy(), m.copy(), v.copy()
    T = len(offs) - 1
    norms, sums, moments = np.zeros(T), np.zeros(T), np.zeros(T)
    step_size, sbc2 = lr / bc1, math.sqrt(bc2)
    for t in range(t0, t1):
        a, b = int(offs[t]), int(offs[t + 1])
        ss = 0.0
        for e in range(a, b):
            ss += float(g[e]) * float(g[e])
        if norm_sum is not None:
            ss = norm_sum(g[a:b])
        norms[t] = norm = math.sqrt(ss)
        clip = 1.0 / norm if norm > 1.0 else 1.0
        w_decay = 1.0 - lr * wd if decay[t] else 1.0
        s = sm = 0.0
        for e in range(a, b):
            ge = float(g[e]) * clip
            me = 0.9 * float(m[e]) + (1.0 - 0.9) * ge
            ve = 0.999 * float(v[e]) + (1.0 - 0.999) * (ge * ge)
            m[e], v[e] = me, ve
            theta[e] = float(theta[e]) * w_decay - step_size * (me / (math.sqrt(ve) / sbc2 + 1e-8))
            s += abs(float(theta[e]))
            sm += abs(me) + ve
        sums[t], moments[t] = s, sm
    return theta, m, v, norms, sums, moments


def test_adamw_is_the_plain_loops_to_the_bit():
    """The vector loop with its three in-order sums (the norm's running ahead into the
    next tensors) gives the plain loops' bits: awkward sizes (0, 1, primes, a tail past
    the vectors, a tensor longer than the one before, whose norm the cursor has not finished),
    clipped and unclipped tensors, and the tensors split into ranges, or into shares that
    are not contiguous, as threads split them. The control: one norm summed pairwise
    (np.sum) instead of in order differs."""
    rng = np.random.default_rng(3)
    sizes = [5, 1, 13, 300, 2, 0, 64, 3, 1031, 7]
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    T = len(sizes)
    decay = np.array([t % 3 != 1 for t in range(T)])
    theta, m = rng.normal(size=offs[-1]), rng.normal(size=offs[-1]) * 1e-3
    v = np.abs(rng.normal(size=offs[-1])) * 1e-6
    g = rng.normal(size=offs[-1]) * np.repeat([0.01, 5.0, 0.3, 0.2, 9.0, 1, 0.01, 1.0, 0.05, 3.0],
                                              sizes)
    args = (offs, decay, *bias_corrections(7), 0.003, 0.01)
    ref = reference_adamw(theta, g, m, v, *args, 0, T)
    for ranges in ([(0, T)], [(0, 3), (3, 4), (4, T)], [(0, 5), (5, 6), (6, T)], [(0, 8), (8, T)]):
        got = [theta.copy(), m.copy(), v.copy(), np.zeros(T), np.zeros(T), np.zeros(T)]
        for t0, t1 in ranges:
            adamw_step(got[0], g, got[1], got[2], *args, got[3], got[4], got[5], t0, t1)
        for name, a, b in zip(("theta", "m", "v", "norms", "sum |w|", "moments"), got, ref):
            assert a.tobytes() == b.tobytes(), f"{name} differs with ranges {ranges}"
    # threads' shares of tensors that are not contiguous (hslm.step.optimiser_shares):
    # the norm cursor jumps from one listed tensor to the next, over empty ones too
    for shares in ([[0, 2, 5, 8], [1, 3, 4, 6, 7, 9]], [[9], [5, 6], [0, 1, 2, 3, 4, 7, 8]]):
        got = [theta.copy(), m.copy(), v.copy(), np.zeros(T), np.zeros(T), np.zeros(T)]
        for share in shares:
            adamw_tensors(got[0], g, got[1], got[2], *args, got[3], got[4], got[5],
                          np.array(share, np.int64))
        for name, a, b in zip(("theta", "m", "v", "norms", "sum |w|", "moments"), got, ref):
            assert a.tobytes() == b.tobytes(), f"{name} differs with shares {shares}"
    control = reference_adamw(theta, g, m, v, *args, 0, T, norm_sum=lambda x: np.sum(x * x))
    assert control[3].tobytes() != ref[3].tobytes()


def test_adamw_loop_gives_the_same_bits_at_every_width():
    """The loop at 1, 4 and 8 doubles a vector (hslm.micro.adam_lanes picks 4 or 8 by
    the core) gives the same parameters, moments and in-order sums, byte for byte, over a
    length with a tail past the vectors. The control: the same terms summed pairwise
    (np.sum) differ from the loop's in-order sums."""
    from numba import njit

    from hslm.adam_loop import N_PARAMS, make_adam_loop

    def runner(lanes):
        loop = make_adam_loop(lanes)

        @njit
        def run(g, m, v, w, params, sums, h):
            loop(g.ctypes.data, m.ctypes.data, v.ctypes.data, w.ctypes.data, g.shape[0],
                 params.ctypes.data, sums.ctypes.data, h.ctypes.data)
        return run

    rng = np.random.default_rng(5)
    n = 1003
    g, h = rng.normal(size=n), rng.normal(size=n) * 7.0
    m0, v0 = rng.normal(size=n) * 1e-3, np.abs(rng.normal(size=n)) * 1e-6
    w0 = rng.normal(size=n)
    params = np.array([0.7, 0.99, 0.003 / 0.3, math.sqrt(0.05), 0.9, 0.1, 0.999, 0.001, 1e-8])
    assert params.shape[0] == N_PARAMS
    out = {}
    sums0 = np.array([1.5, 2.75, 4.0])  # running sums from earlier calls, a lane each
    for lanes in (1, 4, 8):
        m, v, w, sums = m0.copy(), v0.copy(), w0.copy(), sums0.copy()
        runner(lanes)(g, m, v, w, params, sums, h)
        out[lanes] = b"".join(a.tobytes() for a in (m, v, w, sums))
        if lanes == 1:
            in_order = sums
            pairwise = sums0 + np.array([np.sum(np.abs(w)), np.sum(np.abs(m) + v),
                                         np.sum(h * h)])
    assert out[4] == out[1] and out[8] == out[1]
    assert pairwise.tobytes() != in_order.tobytes()
    # and the formula of its docstring, element by element in Python (IEEE doubles)
    clip, decay, step, sqrt_bc2, b1, omb1, b2, omb2, eps = (float(p) for p in params)
    m, v, w = ([float(x) for x in a] for a in (m0, v0, w0))
    sums = [float(x) for x in sums0]
    for i in range(n):
        gi = float(g[i]) * clip
        m[i] = b1 * m[i] + omb1 * gi
        v[i] = b2 * v[i] + omb2 * (gi * gi)
        w[i] = w[i] * decay - step * (m[i] / (math.sqrt(v[i]) / sqrt_bc2 + eps))
        sums = [sums[0] + abs(w[i]), sums[1] + (abs(m[i]) + v[i]),
                sums[2] + float(h[i]) * float(h[i])]
    assert out[1] == b"".join(np.array(a).tobytes() for a in (m, v, w, sums))
    # NaN, infinities and -0.0 take the same way at every width (the sums then NaN)
    g[[3, 10, 17]] = [np.nan, np.inf, -0.0]
    w0[[5, 12]] = [-np.inf, -0.0]
    special = set()
    for lanes in (1, 4, 8):
        m, v, w, sums = m0.copy(), v0.copy(), w0.copy(), sums0.copy()
        runner(lanes)(g, m, v, w, params, sums, h)
        special.add(b"".join(a.tobytes() for a in (m, v, w, sums)))
    assert len(special) == 1 and np.isnan(w[3]) and np.isnan(sums[0])


def test_adam_lanes_are_8_only_on_amd_512_bit_builds():
    from hslm.micro import adam_lanes
    cores = {("AuthenticAMD", "26", True): 8, ("AuthenticAMD", "26", False): 4,
             ("AuthenticAMD", "25", True): 8, ("AuthenticAMD", "25", False): 4,
             ("AuthenticAMD", "23", False): 4, ("GenuineIntel", "6", True): 4,
             ("AuthenticAMD", "x", True): 4}
    for (vendor, family, wide), lanes in cores.items():
        assert adam_lanes({"vendor_id": vendor, "cpu family": family}, wide) == lanes


def test_ternary_chunks_are_widened_to_float32_only_on_amd_4_lane_builds():
    """hslm.micro.single_widened: AMD (Zen on, family 17h+) with the 12-column panels of
    4-lane builds; never with 512-bit vectors' 16-column panels, nor on Intel."""
    from hslm.micro import single_widened
    cores = {("AuthenticAMD", "26", 12): True, ("AuthenticAMD", "25", 12): True,
             ("AuthenticAMD", "23", 12): True, ("AuthenticAMD", "25", 16): False,
             ("GenuineIntel", "6", 12): False, ("AuthenticAMD", "21", 12): False,
             ("AuthenticAMD", "x", 12): False}
    for (vendor, family, panel), single in cores.items():
        assert single_widened({"vendor_id": vendor, "cpu family": family}, panel) is single


def test_schedule():
    assert learning_rate(1, 1.0, 10, 100) == 0.1
    assert learning_rate(10, 1.0, 10, 100) == 1.0
    assert math.isclose(learning_rate(55, 1.0, 10, 100), 0.55)
    assert math.isclose(learning_rate(100, 1.0, 10, 100), 0.1)
    assert math.isclose(learning_rate(5000, 1.0, 10, 100), 0.1)
    assert math.isclose(learning_rate(1, 1.0, 0, 100), 0.1 + 0.45 * (1 + math.cos(math.pi / 100)))


def test_training_matches_an_independent_torch_training_loop():
    """20 steps of hslm's trainer against autograd + torch.optim.AdamW on the same
    windows and schedule (the schedule computed here, from the hyper-parameters): the
    parameters agree to ~1e-14 throughout."""
    import copy

    from hslm.config import PRESETS
    from hslm.data import Corpus
    from hslm.oracle_torch import vsa_stream, window_losses
    from hslm.step import StepRunner
    from hslm.train import Hyper, Run

    cfg = PRESETS["hslm-tiny"]
    corpus = Corpus.load(None, cfg.vocab, cfg.window)
    h = Hyper(batch=4, loss_positions=5, lr=0.01, warmup=3, decay_steps=15, weight_decay=0.01)

    def schedule(step):  # written here again, not taken from the trainer (Run.lr_at)
        if step <= h.warmup:  # linear warm-up from 0, then cosine down to 10% of the peak
            return h.lr * step / h.warmup
        progress = min((step - h.warmup) / (h.decay_steps - h.warmup), 1.0)
        return h.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
    run = Run.fresh(cfg, h, corpus)
    rng = copy.deepcopy(run.rng)
    offs = cfg.offsets()
    params = [torch.tensor(run.state.theta[offs[t]:offs[t + 1]].reshape(s).copy(),
                           requires_grad=True) for t, (_, s, _) in enumerate(cfg.tensors())]
    named = {n: p for (n, _, _), p in zip(cfg.tensors(), params)}
    kinds = [k for _, _, k in cfg.tensors()]
    opt = torch.optim.AdamW([{"params": [p], "weight_decay": 0.01 if k == "ternary" else 0.0}
                             for p, k in zip(params, kinds)], lr=0.01)
    runner = StepRunner(cfg, 3, 1)
    for step in range(1, 21):
        ours = run.train_step(runner)
        w = corpus.draw_windows(rng, h.batch, cfg.window)
        vs = np.stack([vsa_stream(cfg, run.tables.vsa, x) for x in w])
        loss, _, _ = window_losses(cfg, named, w, vs, h.loss_positions)
        opt.zero_grad()
        loss.backward()
        for p in params:
            n = p.grad.norm()
            if n > 1.0:
                p.grad /= n
        for g in opt.param_groups:
            g["lr"] = schedule(step)
        opt.step()
        theirs = torch.cat([p.detach().flatten() for p in params]).numpy()
        assert abs(ours - loss.item()) <= 1e-12 * abs(ours)
        np.testing.assert_allclose(run.state.theta, theirs, rtol=0, atol=1e-12)
    runner.close()


def test_requantise_counts_the_zero_trits_it_makes():
    """The zero share the metrics report is requantisation's by-product: it must be
    the count of |W| <= alpha / 2 over the ternary matrices."""
    from hslm.config import PRESETS
    from hslm.params import ModelState, init_params
    from hslm.tables import Tables
    cfg = PRESETS["hslm-tiny"]
    st = ModelState(cfg, init_params(cfg, 1), Tables(cfg), plain=False)
    st.theta *= np.random.default_rng(0).uniform(0.5, 1.5, st.theta.shape)
    st.requantize()
    for t in np.flatnonzero(st.is_ternary):
        seg = st.theta[st.offs[t]:st.offs[t + 1]]
        assert st.zeros[t] == np.count_nonzero(np.abs(seg) <= st.alpha[t] / 2)
    assert 0 < st.zeros.sum() < st.theta.size


def test_requantising_as_the_optimiser_goes_gives_the_same_trits():
    """adamw_tensors with trits requantises each tensor right after its update (the
    training step's path): alpha, the trits in every layout and the zero counts must be
    the bytes of updating every tensor first and requantising afterwards."""
    from hslm.config import PRESETS
    from hslm.params import ModelState, init_params
    from hslm.step import optimiser_shares
    from hslm.tables import Tables
    cfg = PRESETS["hslm-tiny"]
    rng = np.random.default_rng(3)
    g = rng.normal(size=cfg.n_params) * 0.05
    decay = np.ones(len(cfg.offsets()) - 1, bool)
    args = (decay, *bias_corrections(4), 0.01, 0.1)
    for plain, threads in ((True, 1), (False, 2)):
        states = [ModelState(cfg, init_params(cfg, 5), Tables(cfg), plain=plain) for _ in range(3)]
        T = len(states[0].offs) - 1
        sums = [[np.zeros(T) for _ in range(3)] for _ in states]
        moments = [(np.full(cfg.n_params, 1e-3), np.full(cfg.n_params, 1e-6)) for _ in states]
        for i, st in enumerate(states):
            for share in optimiser_shares(cfg, threads):
                adamw_tensors(st.theta, g, *moments[i], st.offs, *args, *sums[i], share,
                              st.trits() if i == 0 else None)
        states[1].requantize(abs_sums=sums[1][1])
        states[2].requantize(abs_sums=sums[2][2])  # negative control: sum |m| + v as sum |w|
        fields = ("alpha", "zeros", "Pf", "Pb") + (("Tf", "Tb") if plain else ())
        for name in fields:
            assert getattr(states[0], name).tobytes() == getattr(states[1], name).tobytes(), name
        assert states[0].theta.tobytes() == states[1].theta.tobytes()
        assert states[0].alpha.tobytes() != states[2].alpha.tobytes()
