"""Text from a trained model: a sliding window of the last L tokens, one token at a time."""
from __future__ import annotations

from collections import deque

import numpy as np
from numba import njit

from .data import N_SPECIAL
from .errors import HslmError
from .mathfn import exp
from .rng import Stream
from .step import Worker


@njit(cache=True)
def draw_index(z, u):
    """The id whose cumulative share of sum(exp(z - max z)) first exceeds u in [0, 1):
    the weights, their running sum and the comparison in one fixed order, with
    hslm.mathfn's exp, so a seed gives the same text on every machine."""
    m = -np.inf
    for j in range(z.shape[0]):
        if z[j] > m:
            m = z[j]
    total = 0.0
    for j in range(z.shape[0]):
        total += exp(z[j] - m)
    target = u * total
    acc = 0.0
    last = 0
    for j in range(z.shape[0]):
        w = exp(z[j] - m)
        if w > 0.0:
            last = j
            acc += w
            if acc > target:
                return j
    return last  # u * total rounded up to the total: the last id with any weight


def next_token_logits(worker: Worker, model, vsa_table, context: np.ndarray, L: int):
    """Logits after `context` (at most L ids). Attention and the VSA stream are
    causal, so padding the window after the context changes nothing before it."""
    n = len(context)
    window = np.zeros(L + 1, np.int64)  # PAD after the context
    window[:n] = context
    worker.window_loss(model, vsa_table, window, L)  # forward, all L positions to the head
    return worker.logits[n - 1].copy()


def sample(worker, model, vsa_table, prompt_ids, n_tokens, temperature, top_k, seed, L,
           bos_id=1, each=None, drawable=None):
    """Returns the generated ids (the prompt excluded); each(t), if given, is called with
    each id as it is drawn (the CLI prints as it goes), and then nothing is kept but the
    window's context (a run of any length in constant memory), so it returns [].
    drawable: ids from it up are never
    drawn (the tokenizer's pieces end there: a text too short for the vocabulary's merges
    leaves ids that stand for nothing, which training never made targets)."""
    rng = Stream.seeded("sample", seed)
    ids = deque(list(prompt_ids) if len(prompt_ids) else [bos_id], maxlen=L)
    out = []
    for _ in range(n_tokens):
        z = next_token_logits(worker, model, vsa_table, np.array(ids, np.int64), L)
        z[:N_SPECIAL] = -np.inf  # PAD, BOS, EOS and UNK are never targets
        if drawable is not None:
            z[drawable:] = -np.inf
        if not np.isfinite(z[N_SPECIAL:drawable]).all():  # (every weight NaN: PAD drawn)
            raise HslmError("the model's logits are not finite (NaN or infinite): its "
                            "parameters are too large to sample from")
        if temperature <= 0:
            t = int(np.argmax(z))
        else:
            with np.errstate(over="ignore"):
                scaled = z / temperature
                if np.isinf(scaled[N_SPECIAL:drawable]).any():  # near the largest double
                    scaled = (z - z.max()) / temperature  # (only then: a seed's text's bits)
            z = scaled
            if top_k and top_k < len(z):
                cut = np.partition(z, -top_k)[-top_k]
                z = np.where(z >= cut, z, -np.inf)
            t = draw_index(z, rng.uniform(1)[0])
        ids.append(t)
        if each is None:
            out.append(t)
        else:
            each(t)
    return out
