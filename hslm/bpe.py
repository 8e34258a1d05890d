"""Byte-level BPE, learned and applied in time about linear in the text.

The merges are exactly those of the plain algorithm (hslm.data's rules: each merge
joins the most frequent adjacent pair over the whole byte stream, counting every
adjacent occurrence, so 'aaa' counts (a, a) twice; ties go to the smaller
(first id, second id); merges continue while some pair occurs at least twice; a
merge replaces non-overlapping occurrences left to right). Instead of rescanning
the stream for every merge:

* the stream lives in one array `tok` (uint16 for vocabularies up to 65,535) indexed
  by byte position. A token spanning bytes [s, e] holds its id at s and at e
  ("boundary tags"); the positions inside hold 0 (PAD, never a token). The next
  token starts at s + len(tok[s]), the previous one at s - len(tok[s - 1]): no
  linked list is needed, 2 bytes per corpus byte.
* every adjacent pair has its exact count (a dense vocab x vocab table) and a list
  of the start positions where it was created (one pool of uint32 positions, a
  segment per pair). All occurrences of a pair (x, y) are created at once: at the
  start for two bytes, else by the merge that creates max(x, y); later merges only
  remove occurrences. So a segment is sorted and never grows; an entry that no
  longer holds its pair is recognised (ids written at a position only increase, so
  tok[p] == x means p is still the start of that x) and skipped. When the pool is
  full, its segments are compacted, keeping only live entries.
* the best pair comes from a max-heap of (count, -pair) with lazy deletion: after
  each merge every pair whose count changed is pushed with its new count; an entry
  whose count is no longer current is dropped when it surfaces.

Memory: 2 bytes (tok) + 4 x 1.25 bytes (pool) per corpus byte, plus tables of
vocab^2 entries. Encoding with given merges uses the same kernel (merges forced in
their order), which is exactly applying each merge in one pass, in order.

The kernel runs without the GIL and watches ctl[0]: a caller that sets it to 1
gets the kernel back within a fraction of a second (the result is then unusable).
ctl[1] reports merges done, ctl[2] the phase (0 indexing, 1 merging, 2 output).
"""
from __future__ import annotations

import numpy as np
from numba import njit

N_SPECIAL = 4
BYTE0 = N_SPECIAL
FIRST_MERGE = N_SPECIAL + 256
STOP_EVERY = 1 << 20   # positions between two looks at the stop flag


@njit(cache=True, nogil=True)
def _heap_push(hc, hp, size, c, p):
    """Max-heap on (count, then the smaller pair id)."""
    i = size
    while i > 0:
        par = (i - 1) >> 1
        if hc[par] > c or (hc[par] == c and hp[par] < p):
            break
        hc[i] = hc[par]
        hp[i] = hp[par]
        i = par
    hc[i] = c
    hp[i] = p
    return size + 1


@njit(cache=True, nogil=True)
def _heap_pop(hc, hp, size):
    size -= 1
    if size == 0:
        return 0
    c = hc[size]
    p = hp[size]
    i = 0
    while True:
        lft = 2 * i + 1
        if lft >= size:
            break
        best = lft
        r = lft + 1
        if r < size and (hc[r] > hc[lft] or (hc[r] == hc[lft] and hp[r] < hp[lft])):
            best = r
        if c > hc[best] or (c == hc[best] and p < hp[best]):
            break
        hc[i] = hc[best]
        hp[i] = hp[best]
        i = best
    hc[i] = c
    hp[i] = p
    return size


@njit(cache=True, nogil=True, inline="always")
def _count_change(counts, stamp, touched, nt, m, q, delta):
    """counts[q] += delta, and q listed once in touched during merge m; returns the list's
    new length."""
    counts[q] += delta
    if stamp[q] != m:
        stamp[q] = m
        touched[nt] = q
        nt += 1
    return nt


@njit(cache=True, nogil=True)
def _compact(tok, n, V, L, counts, pool, seg_start, seg_len, keep_p, keep_k, ctl):
    """Moves every segment's live entries to the front of the pool, in place; the
    segment keep_p is kept verbatim (its first keep_k entries). Returns the new end."""
    VV = V * V
    live = np.zeros(VV, np.bool_)
    m = 0
    for p in range(VV):
        if p == keep_p:
            seg_len[p] = keep_k
        if seg_len[p] > 0 and (counts[p] > 0 or p == keep_p):
            live[p] = True
            m += 1
        elif p != keep_p:
            seg_len[p] = 0
    ids = np.empty(m, np.int64)
    starts = np.empty(m, np.int64)
    j = 0
    for p in range(VV):
        if live[p]:
            ids[j] = p
            starts[j] = seg_start[p]
            j += 1
    order = np.argsort(starts)
    w = 0
    seen = 0
    for oi in range(m):
        p = ids[order[oi]]
        s0 = seg_start[p]
        ln = seg_len[p]
        seg_start[p] = w
        if p == keep_p:
            for j in range(ln):
                pool[w] = pool[s0 + j]
                w += 1
        else:
            x = p // V
            y = p - x * V
            lx = L[x]
            for j in range(ln):
                e = pool[s0 + j]
                if tok[e] == x and e + lx < n and tok[e + lx] == y:
                    pool[w] = e
                    w += 1
        seg_len[p] = w - seg_start[p]
        seen += ln
        if seen >= STOP_EVERY:
            seen = 0
            if ctl[0] != 0:
                return w
    return w


@njit(cache=True, nogil=True)
def bpe_kernel(tok, V, merges, n_merges, learn, slack, ctl):
    """Learns (learn=True: fills merges[:, :]) or applies (merges given) up to n_merges
    merges on tok in place; afterwards tok[:n_tokens] is the token stream.
    Returns (merges done, n_tokens); (-1, -1) when stopped through ctl[0]."""
    n = tok.shape[0]
    if n == 0:
        return 0, 0
    VV = V * V
    L = np.zeros(V, np.int64)
    for i in range(BYTE0, BYTE0 + 256):
        L[i] = 1
    counts = np.zeros(VV, np.int64)
    seg_start = np.zeros(VV, np.int64)
    seg_len = np.zeros(VV, np.int64)
    ctl[2] = 0
    for i in range(n - 1):
        counts[np.int64(tok[i]) * V + tok[i + 1]] += 1
        if (i & (STOP_EVERY - 1)) == 0 and ctl[0] != 0:
            return -1, -1
    cap = n + np.int64(n * slack) + 16
    pool = np.empty(cap, np.uint32)   # callers keep n below 2**32
    off = 0
    for p in range(VV):
        seg_start[p] = off
        off += counts[p]
    for i in range(n - 1):
        p = np.int64(tok[i]) * V + tok[i + 1]
        pool[seg_start[p] + seg_len[p]] = i
        seg_len[p] += 1
        if (i & (STOP_EVERY - 1)) == 0 and ctl[0] != 0:
            return -1, -1
    end = off
    # heap of candidate pairs (learning only)
    hcap = (min(VV, n) + n_merges * (4 * V + 4) + 16) if learn else 1
    hc = np.empty(hcap, np.int64)
    hp = np.empty(hcap, np.int64)
    hsize = 0
    if learn:
        for p in range(VV):
            if counts[p] >= 2:
                hsize = _heap_push(hc, hp, hsize, counts[p], p)
    stamp = np.full(VV, -1, np.int64)
    touched = np.empty(4 * V + 8, np.int64)
    keycnt = np.zeros(2 * V, np.int64)
    ntok = n
    ctl[2] = 1
    m = 0
    while m < n_merges:
        if ctl[0] != 0:
            return -1, -1
        if learn:
            found = False
            p = 0
            while hsize > 0:
                c = hc[0]
                p = hp[0]
                hsize = _heap_pop(hc, hp, hsize)
                if counts[p] == c:
                    found = True
                    break
            if not found:
                break
            a = p // V
            b = p - a * V
            merges[m, 0] = a
            merges[m, 1] = b
        else:
            a = merges[m, 0]
            b = merges[m, 1]
            p = a * V + b
        N = FIRST_MERGE + m
        La = L[a]
        Lb = L[b]
        LN = La + Lb
        L[N] = LN
        s0 = seg_start[p]
        k = 0
        nt = 0
        for j in range(seg_len[p]):
            s = pool[s0 + j]
            if tok[s] != a:
                continue
            if s + La >= n or tok[s + La] != b:
                continue
            r = s + LN
            if s > 0:  # (x, a) becomes (x, N)
                x = np.int64(tok[s - 1])
                nt = _count_change(counts, stamp, touched, nt, m, x * V + a, -1)
                nt = _count_change(counts, stamp, touched, nt, m, x * V + N, 1)
            if r < n:  # (b, y) becomes (N, y)
                y = np.int64(tok[r])
                nt = _count_change(counts, stamp, touched, nt, m, b * V + y, -1)
                nt = _count_change(counts, stamp, touched, nt, m, N * V + y, 1)
            counts[p] -= 1
            if La > 1:
                tok[s + La - 1] = 0
            if Lb > 1:
                tok[s + La] = 0
            tok[s] = N
            tok[s + LN - 1] = N
            pool[s0 + k] = s   # the segment of (a, b) now lists the replaced starts
            k += 1
        ntok -= k
        # the new pairs' occurrences, counted by key: x for (x, N), V + y for (N, y)
        keycnt[:] = 0
        total = 0
        for j in range(k):
            s = pool[s0 + j]
            if s + LN < n:
                keycnt[V + tok[s + LN]] += 1
                total += 1
            if s > 0:
                x = tok[s - 1]
                if x != N:
                    keycnt[x] += 1
                    total += 1
        if end + total > cap:
            end = _compact(tok, n, V, L, counts, pool, seg_start, seg_len, p, k, ctl)
            if ctl[0] != 0:
                return -1, -1
            s0 = seg_start[p]
        for key in range(2 * V):
            if keycnt[key] > 0:
                q = key * V + N if key < V else N * V + (key - V)
                seg_start[q] = end
                seg_len[q] = 0
                end += keycnt[key]
        for j in range(k):
            s = pool[s0 + j]
            if s > 0:
                x = np.int64(tok[s - 1])
                if x != N:
                    q = x * V + N
                    pool[seg_start[q] + seg_len[q]] = s - L[x]
                    seg_len[q] += 1
            if s + LN < n:
                q = N * V + tok[s + LN]
                pool[seg_start[q] + seg_len[q]] = s
                seg_len[q] += 1
        seg_len[p] = 0
        if learn:
            for j in range(nt):
                q = touched[j]
                if counts[q] >= 2:
                    hsize = _heap_push(hc, hp, hsize, counts[q], q)
        m += 1
        ctl[1] = m
    # the stream, moved to the front of tok
    ctl[2] = 2
    i = 0
    w = 0
    while i < n:
        t = tok[i]
        tok[w] = t
        w += 1
        i += L[t]
    return m, w


def memory_needed(vocab: int, n_bytes: int, learn: bool = True) -> int:
    """Bytes bpe_kernel touches for a text of n_bytes: four vocab^2 int64 tables (pair
    counts, position-list starts and lengths, merge stamps), the position lists (uint32
    plus 25% room), the ids, and the heap's first fill (its worst-case reserve is
    allocated but never touched)."""
    ids = n_bytes * np.dtype(ids_dtype(vocab)).itemsize
    heap = 16 * min(vocab * vocab, n_bytes) if learn else 0
    return 32 * vocab * vocab + 5 * n_bytes + ids + heap


def ids_dtype(vocab: int):
    return np.uint16 if vocab <= 65535 else np.uint32


def run(tok: np.ndarray, vocab: int, merges=None, slack=0.25, ctl=None):
    """learn (merges None: returns (merges int64 [m, 2], n_tokens)) or apply merges
    (returns (merges, n_tokens)); tok (ids_dtype) is changed in place."""
    if tok.shape[0] >= 2 ** 32 - 1:
        raise ValueError("texts of 4 GiB or more are not supported")
    ctl = np.zeros(4, np.int64) if ctl is None else ctl
    learn = merges is None
    if learn:
        buf = np.zeros((max(vocab - FIRST_MERGE, 0), 2), np.int64)
        n_merges = buf.shape[0]
    else:
        buf = np.ascontiguousarray(merges, dtype=np.int64).reshape(-1, 2)
        n_merges = buf.shape[0]
    m, w = bpe_kernel(tok, vocab, buf, n_merges, learn, slack, ctl)
    if m < 0:
        raise KeyboardInterrupt
    return (buf[:m] if learn else buf), w
