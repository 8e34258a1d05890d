"""An independent oracle: the same model and objective in PyTorch f64, with autograd.

Test and benchmark code only (torch is not a run-time dependency). It shares
nothing with the Numba kernels but the parameter layout and the VSA table: the
tables, the VSA stream and the K-position objective are written again here from
the spec, batched over the window as a PyTorch user would write them. Earlier
keys and values are constants of each position's backward: for p != j the
score and the mix use k_j.detach() and v_j.detach().
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .config import PHI, Config


def tables(cfg: Config, dtype):
    d, L, dh = cfg.width, cfg.window, cfg.head_width
    i = torch.arange(d, dtype=torch.float64)
    f = PHI ** (-2.0 * torch.div(i, 2, rounding_mode="floor") / d) * 3.0 / math.pi
    ang = torch.arange(L, dtype=torch.float64)[:, None] * f[None, :]
    pos = torch.where(torch.arange(d) % 2 == 0, torch.sin(ang), torch.cos(ang))
    c = torch.arange(dh // 2, dtype=torch.float64)
    theta = torch.arange(L, dtype=torch.float64)[:, None] * PHI ** (-2.0 * c / dh)[None, :]
    return pos.to(dtype), torch.cos(theta).to(dtype), torch.sin(theta).to(dtype)


def vsa_stream(cfg: Config, table: np.ndarray, tokens) -> np.ndarray:
    """Spec section 6 in plain Python integers; returns [nb, L, d]."""
    L, D, d = cfg.window, cfg.vsa_dim, cfg.width
    tau = [np.roll(table[int(tokens[p])].astype(np.int64), p) for p in range(L)]
    out = np.zeros((cfg.blocks, L, d))
    for b in range(cfg.blocks):
        nxt = []
        for p in range(L):
            g = [int(tau[p] @ tau[j]) for j in range(p + 1)]
            n = [int(tau[j] @ tau[j]) for j in range(p + 1)]
            sims = [g[j] / math.sqrt(n[p] * n[j]) if n[p] * n[j] else 0.0 for j in range(p + 1)]
            gate = max(sims[:p]) if p > 0 else sims[0]
            acc = np.zeros(D, np.int64)
            for j in range(p + 1):
                if g[j] > 0:
                    w = max([1] + [c for c in range(1, 11) if c * c * n[p] * n[j] <= 100 * g[j] ** 2])
                    acc += w * tau[j]
            ctx = np.sign(acc)
            if gate >= 1.0 / PHI:
                out[b, p] = 0.1 * ctx[: 4 * d].reshape(d, 4).mean(axis=1)
            nxt.append(ctx)
        tau = nxt
    return out


def ternary(W):
    """alpha T in the forward, identity (straight-through) in the backward."""
    a = W.detach().abs().mean()
    a = torch.where(a <= 1e-6, torch.ones_like(a), a)
    Wd = W.detach()
    one, zero = torch.ones_like(Wd), torch.zeros_like(Wd)
    T = torch.where(Wd > a / 2, one, torch.where(Wd < -a / 2, -one, zero))
    return a * T + (W - Wd)


def rms(x):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)


def rotate(x, cos, sin, H, dh):
    """x [..., L, H*dh]: pairs (c, c + dh//2) of each head turned by the position's angle."""
    half = dh // 2
    xs = x.reshape(*x.shape[:-1], H, dh)
    a, b, rest = xs[..., :half], xs[..., half:2 * half], xs[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([a * c - b * s, a * s + b * c, rest], dim=-1)
    return out.reshape(x.shape)


def window_losses(cfg: Config, params: dict, tokens, vsa, k: int, x0=None, dtype=torch.float64):
    """Batched forward of windows tokens [B, L+1] (vsa [B, nb, L, d]).

    Returns (mean loss, logits of scored positions [B, k, V], x0)."""
    d, H, dh, L = cfg.width, cfg.heads, cfg.head_width, cfg.window
    pos, cos, sin = tables(cfg, dtype)
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    B = tokens.shape[0]
    if x0 is None:
        x0 = params["E"][tokens[:, :L]] + pos
    x = x0
    eye = torch.eye(L, dtype=dtype)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    vsa = torch.as_tensor(vsa, dtype=dtype)
    for b in range(cfg.blocks):
        P = lambda n: params[f"blocks.{b}.{n}"]
        n = rms(x) * P("gamma")
        q = rotate(n @ ternary(P("Wq")), cos, sin, H, dh).reshape(B, L, H, dh).transpose(1, 2)
        kk = rotate(n @ ternary(P("Wk")), cos, sin, H, dh).reshape(B, L, H, dh).transpose(1, 2)
        v = (n @ ternary(P("Wv"))).reshape(B, L, H, dh).transpose(1, 2)
        # s_pj = q_p . k_j with k_j a constant for j != p
        s = q @ kk.detach().transpose(-1, -2) * (1 - eye) + torch.diag_embed((q * kk).sum(-1))
        s = (s * cfg.attn_scale).masked_fill(~causal, -math.inf)
        a = torch.softmax(s, dim=-1)
        o = (a * (1 - eye)) @ v.detach() + torch.diagonal(a, dim1=-2, dim2=-1)[..., None] * v
        o = o.transpose(1, 2).reshape(B, L, d)
        h = x + o @ ternary(P("Wo"))
        r = torch.relu(h @ ternary(P("Wup")) + P("bup"))
        x = h + (r @ ternary(P("Wdown")) + P("bdown")) + vsa[:, b]
    z = cfg.head_scale * (rms(x[:, L - k:]) @ ternary(params["Wout"])) + params["bout"]
    tgt = tokens[:, L - k + 1:]
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(-1, tgt[..., None])[..., 0]
    smooth = lse - z.mean(-1)
    loss = (0.9 * nll + 0.1 * smooth).mean()
    return loss, z, x0


def oracle_window(cfg: Config, theta: np.ndarray, table: np.ndarray, tokens, k: int):
    """Loss, scored logits [k, V], flat gradient and dloss/dx_0 [L, d] for one window."""
    offs = cfg.offsets()
    flat = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    params = {name: flat[offs[t]:offs[t + 1]].reshape(shape)
              for t, (name, shape, _) in enumerate(cfg.tensors())}
    vsa = vsa_stream(cfg, table, tokens)[None]
    pos, _, _ = tables(cfg, torch.float64)
    tok = torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long)
    x0 = (params["E"][tok[:, :cfg.window]] + pos).detach().requires_grad_(True)
    # x0 as a leaf gives dloss/dx_0; the embedding's gradient flows through E separately
    loss, z, _ = window_losses(cfg, params, tokens[None], vsa, k, x0=x0)
    loss_e, _, _ = window_losses(cfg, params, tokens[None], vsa, k)
    (g,) = torch.autograd.grad(loss_e, flat)
    (gx,) = torch.autograd.grad(loss, x0)
    return loss.item(), z[0].detach().numpy(), g.numpy(), gx[0].numpy(), vsa[0]
