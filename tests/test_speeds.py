"""Speeds 1, 2 and 3 give the same bits as speed 0, compared with ==.

Logits of every scored position, the loss, every one of the gradients and
dloss/dx_0 of every scored position. The negative controls show that the
comparison sees a single reordered sum.
"""
import numpy as np
import pytest

from hslm.kernels import output_grad_panels, weight_grad_rows
from hslm.layers import wout_index
from hslm.speeds import SPEEDS

from helpers import assert_bits_equal, setup, window_result

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
@pytest.mark.parametrize("k_all", [True, False], ids=["k=L", "k=1"])
@pytest.mark.parametrize("speed", [s for s in SPEEDS if s != REFERENCE])
def test_speed_is_bit_identical_to_speed0(speed, name, structured, k_all):
    cfg, tb, ms, tokens = setup(name, structured)
    k = cfg.window if k_all else 1
    ref = reference(name, structured, k)
    res = window_result(speed, cfg, tb, ms, tokens, k)
    assert_same_window(res, ref, f"speed {speed}")
    nz = int(np.count_nonzero(res[2]))
    print(f"speed {speed} {name} k={k}: {nz:,} of {cfg.n_params:,} gradients nonzero, all ==")
    if name == "hslm-3":
        assert nz > (10**6 if k_all else 10**5)


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
