"""Speed 0 against an independent PyTorch f64 autograd oracle.

Logits, loss, every parameter tensor's gradient and dloss/dx_0 agree to a
relative 1e-9 (in practice ~1e-14): elementwise rtol 1e-9, with an absolute
floor of 1e-12 of the tensor's largest gradient for elements that cancel to
near zero, and a normwise check at 1e-9. The gradients compared are nonzero,
and each test says how many.
"""
import numpy as np
import pytest

from hslm.oracle_torch import oracle_window, vsa_stream
from hslm.vsa import vsa_terms

from helpers import K_CASES, k_for, setup, window_result

RTOL = 1e-9


def close(ours, ref, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    scale = np.abs(ref).max()
    assert scale > 0, f"{what}: the reference is all zeros; nothing would be compared"
    err = np.abs(ours - ref)
    assert err.max() <= RTOL * scale, f"{what}: normwise {err.max() / scale:.2e}"
    bad = err > RTOL * np.abs(ref) + 1e-12 * scale
    assert not bad.any(), f"{what}: {int(bad.sum())} elements beyond rtol {RTOL}"


CASES = [("hslm-test", True), ("hslm-test", False), ("hslm-3", True)]


@pytest.mark.parametrize("name,structured", CASES)
@pytest.mark.parametrize("k_case", K_CASES)
def test_speed0_matches_torch_autograd(name, structured, k_case):
    cfg, tb, ms, tokens = setup(name, structured)
    k = k_for(k_case, cfg.window)
    loss, logits, grad, dx0, w = window_result(0, cfg, tb, ms, tokens, k)
    t_loss, t_logits, t_grad, t_dx0, t_vsa = oracle_window(cfg, ms.theta, tb.vsa, tokens, k)
    assert np.array_equal(w.vsa, t_vsa), "VSA stream differs from the Python oracle"
    assert abs(loss - t_loss) <= RTOL * abs(t_loss)
    close(logits, t_logits, "logits")
    close(dx0, t_dx0[cfg.window - k:], "dloss/dx_0")
    offs = cfg.offsets()
    nonzero = 0
    for t, (tname, _, _) in enumerate(cfg.tensors()):
        close(grad[offs[t]:offs[t + 1]], t_grad[offs[t]:offs[t + 1]], f"gradient of {tname}")
        nonzero += int(np.count_nonzero(t_grad[offs[t]:offs[t + 1]]))
    # a comparison of zeros proves nothing: most of the model must get gradient
    print(f"{name} k={k}: {nonzero:,} of {cfg.n_params:,} gradients nonzero, all compared")
    assert nonzero > 0.5 * cfg.n_params if k > 1 else nonzero > 0.3 * cfg.n_params


def test_vsa_gate_fires_after_position_zero_with_a_structured_table():
    cfg, tb, ms, tokens = setup("hslm-test", True)
    out = vsa_terms(tb.vsa, tokens, cfg.blocks, cfg.width, cfg.window)
    fired = np.abs(out).sum(axis=2) > 0  # [nb, L]
    assert fired[:, 1:].any(), "a structured table must fire the gate at p > 0"
    assert np.array_equal(out, vsa_stream(cfg, tb.vsa, tokens))


def test_vsa_random_table_matches_python_oracle():
    cfg, tb, ms, tokens = setup("hslm-3", False)
    out = vsa_terms(tb.vsa, tokens, cfg.blocks, cfg.width, cfg.window)
    assert np.array_equal(out, vsa_stream(cfg, tb.vsa, tokens))
    assert np.abs(out[:, 0]).sum() > 0  # the gate fires at p = 0


@pytest.mark.parametrize("vsa_dim,window", [(36, 9), (41, 13), (100, 27), (1024, 81)])
@pytest.mark.parametrize("structured", [False, True], ids=["random", "structured"])
def test_vsa_stream_of_awkward_sizes_matches_python_oracle(vsa_dim, window, structured):
    """hslm.vsa pads each trit row to whole int16 vectors of 32 lanes: rows of 36, 41 and
    100 trits end inside a vector, 1024 fills 32 of them, and a window of 81 (the most
    the definition allows) gives the largest weighted sums. The control: the same
    tokens in another order give another stream."""
    from hslm.config import Config
    from hslm.tables import vsa_table

    cfg = Config(vocab=29, width=9, heads=3, head_width=3, mlp=27, blocks=2, window=window,
                 vsa_dim=vsa_dim)
    table = vsa_table(cfg, structured)
    tokens = np.random.default_rng(vsa_dim).integers(0, cfg.vocab, window + 1)
    out = vsa_terms(table, tokens, cfg.blocks, cfg.width, window)
    assert np.array_equal(out, vsa_stream(cfg, table, tokens))
    assert np.abs(out).sum() > 0
    other = vsa_terms(table, tokens[::-1].copy(), cfg.blocks, cfg.width, window)
    assert not np.array_equal(out, other)


@pytest.mark.parametrize("name,structured", CASES)
def test_validation_loss_and_cross_entropy_match_torch(name, structured):
    """Evaluation's two means (runner.loss: the label-smoothed objective, and the plain
    cross-entropy whose exp eval and the metrics call the perplexity) against torch: the
    oracle's loss, and torch.nn.functional.cross_entropy of the oracle's logits. The two
    figures differ by far more than the tolerance, so neither would pass for the other;
    on 1 and 3 threads they are the same bits."""
    import torch

    from hslm.oracle_torch import window_losses
    from hslm.step import StepRunner

    cfg, tb, ms, _ = setup(name, structured)
    k = cfg.window // 2 + 1
    windows = np.random.default_rng(5).integers(0, cfg.vocab, (5, cfg.window + 1))
    got = []
    for threads in (1, 3):
        runner = StepRunner(cfg, 3, threads)
        try:
            got.append(runner.loss(ms.kernel_model(), tb.vsa, windows, k))
        finally:
            runner.close()
    assert np.array(got[0]).tobytes() == np.array(got[1]).tobytes()
    offs = cfg.offsets()
    theta = torch.tensor(ms.theta)
    params = {n: theta[offs[t]:offs[t + 1]].reshape(s)
              for t, (n, s, _) in enumerate(cfg.tensors())}
    vsa = np.stack([vsa_stream(cfg, tb.vsa, w) for w in windows])
    t_loss, z, _ = window_losses(cfg, params, windows, vsa, k)
    targets = torch.as_tensor(windows[:, cfg.window - k + 1:])
    t_ce = torch.nn.functional.cross_entropy(z.reshape(-1, cfg.vocab), targets.reshape(-1))
    loss, ce = got[0]
    assert abs(loss - t_loss.item()) <= RTOL * abs(t_loss.item())
    assert abs(ce - t_ce.item()) <= RTOL * abs(t_ce.item())
    assert abs(loss - ce) > 1e3 * RTOL * abs(ce), (loss, ce)  # the control
