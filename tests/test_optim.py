"""AdamW with per-tensor clipping against torch.optim.AdamW; the schedule."""
import math

import numpy as np
import torch

from hslm.optim import adamw_step, learning_rate


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
    for step in range(1, 6):
        lr = learning_rate(step, 0.01, 2, 5)
        g = rng.normal(size=offs[-1]) * (0.1 if step % 2 else 3.0)  # clipped on even steps
        adamw_step(theta, g, m, v, offs, decay, step, lr, 0.01, norms, 0, 3)
        for i, t in enumerate(ts):
            gi = torch.tensor(g[offs[i]:offs[i + 1]].copy())
            norm = gi.norm()
            t.grad = gi / norm if norm > 1.0 else gi  # clip each tensor to norm 1 on its own
            opt.param_groups[i]["lr"] = lr
        opt.step()
        ref = np.concatenate([t.detach().numpy() for t in ts])
        np.testing.assert_allclose(theta, ref, rtol=1e-12, atol=1e-14)
        assert np.allclose(norms, [np.linalg.norm(g[offs[i]:offs[i + 1]]) for i in range(3)])


def test_schedule():
    assert learning_rate(1, 1.0, 10, 100) == 0.1
    assert learning_rate(10, 1.0, 10, 100) == 1.0
    assert math.isclose(learning_rate(55, 1.0, 10, 100), 0.55)
    assert math.isclose(learning_rate(100, 1.0, 10, 100), 0.1)
    assert math.isclose(learning_rate(5000, 1.0, 10, 100), 0.1)
    assert math.isclose(learning_rate(1, 1.0, 0, 100), 0.1 + 0.45 * (1 + math.cos(math.pi / 100)))
