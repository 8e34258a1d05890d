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
  of the start positions where it was created (one byte pool, a segment per pair).
  All occurrences of a pair (x, y) are created at once: at the start for two bytes,
  else by the merge that creates max(x, y); later merges only remove occurrences. So
  a segment is sorted and never grows: it is stored as the gaps between its
  positions (the first from 0), each a varint (7 bits a byte), about 1.4 bytes an
  entry on text where a uint32 took 4. An entry that no longer holds its pair is
  recognised (ids written at a position only increase, so tok[p] == x means p is
  still the start of that x) and skipped. A list rewritten with some of its entries
  (the merged pair's list becomes the list of replaced starts; compaction drops dead
  entries) never needs more bytes than it had, so both happen in place. When the
  pool is full its segments are compacted: a segment more than half dead (its
  pair's count against its entries) is filtered, reading tok; the others are moved
  as they are, which is far cheaper and, measured on text, keeps the pool as small.
  When compaction frees too little, the pool grows by a quarter.
* the neighbours' count changes of a merge are summed per neighbour id in two small
  tables and applied after its pass: four scattered updates per occurrence of a
  vocab^2 table were most of the time of the large first merges.
* the best pair comes from a max-heap of (count, -pair) with lazy deletion: after
  each merge every pair whose count changed is pushed with its new count; an entry
  whose count is no longer current is dropped when it surfaces.

Memory: 2 bytes (tok) + about 1.4 x 1.25 bytes (pool) per corpus byte on text, plus
tables of vocab^2 entries. Encoding with given merges (apply_by_spans, below) needs no
counts: it encodes the text a span at a time in tables that stay in the core's caches,
in parts at once (by_spans, join_parts), the spans and parts joined at cuts proved to be
boundaries of the whole text's tokens; the same kernel with the merges forced in their
order (exactly applying each merge in one pass, in order) is its fallback, and a short
text's and a large vocabulary's.

The kernels run without the GIL and watch ctl[0]: a caller that sets it to 1 gets
the kernel back within a fraction of a second (the result is then unusable). ctl[1]
reports merges done (the span encoders: the share of the text done, in merges); ctl[2]
bpe_kernel's phase (0 indexing, 1 merging, 2 output) and ctl[3] its compactions of the
position lists so far.
"""
from __future__ import annotations

import concurrent.futures

import numpy as np
from numba import njit

N_SPECIAL = 4
BYTE0 = N_SPECIAL
FIRST_MERGE = N_SPECIAL + 256
STOP_EVERY = 1 << 20   # positions between two looks at the stop flag
DEAD_SHARE_FILTERED = 2   # compaction filters a list when 1/2 or more of it is dead


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


@njit(cache=True, nogil=True, inline="always")
def _varint_len(g):
    """Bytes of g as a varint (7 bits a byte, low bits first, high bit = more follow)."""
    b = 1
    while g >= 128:
        g >>= 7
        b += 1
    return b


@njit(cache=True, nogil=True, inline="always")
def _put(pool, w, g):
    """Writes g as a varint at pool[w]; returns the position after it."""
    while g >= 128:
        pool[w] = np.uint8((g & 127) | 128)
        g >>= 7
        w += 1
    pool[w] = np.uint8(g)
    return w + 1


@njit(cache=True, nogil=True, inline="always")
def _get(pool, r):
    """The varint at pool[r] and the position after it."""
    g = np.int64(0)
    sh = 0
    while True:
        c = np.int64(pool[r])
        r += 1
        g |= (c & 127) << sh
        if c < 128:
            return g, r
        sh += 7


@njit(cache=True, nogil=True)
def _compact(tok, n, V, L, counts, pool, seg_start, seg_len, seg_n, keep_p, keep_len, ctl):
    """Moves every live segment to the front of the pool, in place, in the order they
    lie; the segment keep_p is kept verbatim (its first keep_len bytes). A segment
    at most half dead (its pair's count against its entries) is copied as it is,
    without reading tok; the others are decoded, filtered and encoded again, which
    never needs more bytes (the gap to the next kept entry is the sum of the gaps it
    replaces). Returns the new end."""
    VV = V * V
    live = np.zeros(VV, np.bool_)
    m = 0
    for p in range(VV):
        if p == keep_p:
            seg_len[p] = keep_len
        if seg_len[p] > 0 and (counts[p] > 0 or p == keep_p):
            live[p] = True
            m += 1
        elif p != keep_p:
            seg_len[p] = 0
            seg_n[p] = 0
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
        r = seg_start[p]
        e = r + seg_len[p]
        seg_start[p] = w
        if p == keep_p or (seg_n[p] - counts[p]) * DEAD_SHARE_FILTERED < seg_n[p]:
            for j in range(e - r):           # forwards: w <= r
                pool[w + j] = pool[r + j]
            w += e - r
        else:
            x = p // V
            y = p - x * V
            lx = L[x]
            pos = np.int64(0)
            kept = np.int64(0)
            k = 0
            while r < e:
                g, r = _get(pool, r)
                pos += g
                if tok[pos] == x and pos + lx < n and tok[pos + lx] == y:
                    w = _put(pool, w, pos - kept)
                    kept = pos
                    k += 1
            seg_n[p] = k
        seg_len[p] = w - seg_start[p]
        seen += seg_len[p]
        if seen >= STOP_EVERY:
            seen = 0
            if ctl[0] != 0:
                return w
    return w


@njit(cache=True, nogil=True)
def _list_sizes(tok, V, ctl):
    """Each adjacent pair's count and the bytes of its position list (varint gaps), from
    one pass over tok; (None-like empty arrays) when stopped through ctl[0]."""
    n = tok.shape[0]
    VV = V * V
    counts = np.zeros(VV, np.int64)
    nbytes = np.zeros(VV, np.int64)
    last = np.zeros(VV, np.int64)       # the last position counted, per pair
    ctl[2] = 0
    for i in range(n - 1):
        p = np.int64(tok[i]) * V + tok[i + 1]
        counts[p] += 1
        nbytes[p] += _varint_len(i - last[p])
        last[p] = i
        if (i & (STOP_EVERY - 1)) == 0 and ctl[0] != 0:
            break
    return counts, nbytes


@njit(cache=True, nogil=True)
def bpe_kernel(tok, V, merges, n_merges, learn, counts, seg_len, pool, ctl):
    """Learns (learn=True: fills merges[:, :]) or applies (merges given) up to n_merges
    merges on tok in place; afterwards tok[:n_tokens] is the token stream. counts and
    seg_len come from _list_sizes; pool (uint8) holds at least their sum.
    Returns (merges done, n_tokens, peak pool bytes); (-1, -1, 0) when stopped through
    ctl[0]."""
    n = tok.shape[0]
    if n == 0:
        return 0, 0, 0
    VV = V * V
    L = np.zeros(V, np.int64)
    for i in range(BYTE0, BYTE0 + 256):
        L[i] = 1
    seg_start = np.zeros(VV, np.int64)
    seg_n = np.zeros(VV, np.int64)      # entries, dead ones included
    last = np.zeros(VV, np.int64)       # the last position listed, while lists are written
    off = 0
    for p in range(VV):
        seg_start[p] = off
        off += seg_len[p]
        seg_len[p] = 0
        seg_n[p] = counts[p]
    cap = pool.shape[0]
    for i in range(n - 1):
        p = np.int64(tok[i]) * V + tok[i + 1]
        seg_len[p] = _put(pool, seg_start[p] + seg_len[p], i - last[p]) - seg_start[p]
        last[p] = i
        if (i & (STOP_EVERY - 1)) == 0 and ctl[0] != 0:
            return -1, -1, 0
    last = np.zeros(0, np.int64)
    end = off
    peak = cap
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
    left = np.zeros(V, np.int64)    # per merge: occurrences with x before them, y after
    right = np.zeros(V, np.int64)
    keybytes = np.zeros(2 * V, np.int64)
    keyn = np.zeros(2 * V, np.int64)
    keylast = np.zeros(2 * V, np.int64)
    ntok = n
    ctl[2] = 1
    m = 0
    while m < n_merges:
        if ctl[0] != 0:
            return -1, -1, 0
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
        r = s0
        e = s0 + seg_len[p]
        w = s0          # the segment of (a, b) is rewritten with the replaced starts
        s = np.int64(0)
        wrote = np.int64(0)
        k = 0
        nt = 0
        while r < e:
            g, r = _get(pool, r)
            s += g
            if tok[s] != a:
                continue
            if s + La >= n or tok[s + La] != b:
                continue
            q = s + LN
            if s > 0:  # (x, a) becomes (x, N): counted by x, applied after the loop
                left[tok[s - 1]] += 1
            if q < n:  # (b, y) becomes (N, y)
                right[tok[q]] += 1
            counts[p] -= 1
            if La > 1:
                tok[s + La - 1] = 0
            if Lb > 1:
                tok[s + La] = 0
            tok[s] = N
            tok[s + LN - 1] = N
            w = _put(pool, w, s - wrote)
            wrote = s
            k += 1
        ntok -= k
        # the neighbours' count changes, summed per neighbour in two small tables rather
        # than four scattered updates per occurrence (the sums are the same)
        for x in range(V):
            if left[x] != 0:
                nt = _count_change(counts, stamp, touched, nt, m, x * V + a, -left[x])
                nt = _count_change(counts, stamp, touched, nt, m, x * V + N, left[x])
                left[x] = 0
            if right[x] != 0:
                nt = _count_change(counts, stamp, touched, nt, m, b * V + x, -right[x])
                nt = _count_change(counts, stamp, touched, nt, m, N * V + x, right[x])
                right[x] = 0
        kept_len = w - s0
        # the new pairs' lists, by key: x for (x, N), V + y for (N, y); their sizes first
        keybytes[:] = 0
        keyn[:] = 0
        keylast[:] = 0
        total = 0
        r = s0
        s = np.int64(0)
        for j in range(k):
            g, r = _get(pool, r)
            s += g
            if s > 0:
                x = np.int64(tok[s - 1])
                if x != N:
                    ps = s - L[x]
                    keybytes[x] += _varint_len(ps - keylast[x])
                    keylast[x] = ps
                    keyn[x] += 1
            if s + LN < n:
                key = V + tok[s + LN]
                keybytes[key] += _varint_len(s - keylast[key])
                keylast[key] = s
                keyn[key] += 1
        for key in range(2 * V):
            total += keybytes[key]
        if end + total > cap:
            ctl[3] += 1
            end = _compact(tok, n, V, L, counts, pool, seg_start, seg_len, seg_n, p, kept_len,
                           ctl)
            if ctl[0] != 0:
                return -1, -1, 0
            s0 = seg_start[p]
            if end + total > cap - cap // 16:   # still (almost) full: grow by a quarter
                ncap = max(cap + cap // 4, end + total + cap // 8)
                bigger = np.empty(ncap, np.uint8)
                for i in range(end):  # (a slice assignment compiles Numba's shape-error
                    bigger[i] = pool[i]  # message: 2 s of a first run)
                pool = bigger
                cap = ncap
                peak = max(peak, cap)
        for key in range(2 * V):
            if keyn[key] > 0:
                q = key * V + N if key < V else N * V + (key - V)
                seg_start[q] = end
                seg_len[q] = 0
                seg_n[q] = keyn[key]
                end += keybytes[key]
            keylast[key] = 0
        r = s0
        s = np.int64(0)
        for j in range(k):
            g, r = _get(pool, r)
            s += g
            if s > 0:
                x = np.int64(tok[s - 1])
                if x != N:
                    q = x * V + N
                    ps = s - L[x]
                    seg_len[q] = _put(pool, seg_start[q] + seg_len[q], ps - keylast[x]) \
                        - seg_start[q]
                    keylast[x] = ps
            if s + LN < n:
                y = np.int64(tok[s + LN])
                q = N * V + y
                seg_len[q] = _put(pool, seg_start[q] + seg_len[q], s - keylast[V + y]) \
                    - seg_start[q]
                keylast[V + y] = s
        seg_len[p] = 0
        seg_n[p] = 0
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
    return m, w, peak


# ------------------------------------------------ applying given merges, a span at a time
# Applying merges needs no pair counts, only each merge's occurrences, in its turn. Over
# the whole text bpe_kernel's position lists are gigabytes, written and read at scattered
# places (about 130 ns a byte of text); a span of SPAN_BYTES is encoded alone in tables
# that stay in the core's caches (a bucket of places per merge), and the spans are joined
# at cuts that are proved to be token boundaries of the whole text's stream:
#
# * if the stream of merges applied to a text never joins two tokens across a place q,
#   each merge's pass acts on the two sides as it would on each alone (a pair that spans
#   q is never taken, and the left-to-right pass starts afresh at q), so the text's
#   tokens are the tokens of [.., q) alone followed by those of [q, ..) alone. Tokens
#   only grow, so a token boundary of an encoded span was one after every merge, and the
#   span's tokens left of it are those of that part alone.
# * whether the stream joins across q follows from the two tokens that end up beside q
#   (x ending the left part, y starting the right part) and the merges alone: after
#   merge m the token ending at q is the node of x's right spine (x, its second part,
#   that one's second part, ...) made last by merge m or before, and likewise the token
#   starting at q is on y's left spine. Merge m = (a, b) joins across q when the tokens
#   beside q before it are a and b, unless a == b and the left one was taken first by the
#   pair on its left (the token ending at q is then merge m's own): _cut_holds.
# So a span's tokens are kept up to a boundary in its last TAIL_BYTES whose cut holds
# with the first token of the next span, which starts there; a span with no such
# boundary is encoded over more text. bpe_kernel's forced merges, the same tokens, are
# the fallback (a span past LONGEST_SPAN: no such text has been seen).
SPAN_BYTES = 1 << 16
TAIL_BYTES = 1 << 10
CUT_TRIES = 8           # boundaries tried for a span's cut before it is made longer
LONGEST_SPAN = 1 << 20
RANK_TABLE_MOST = 1 << 26   # bytes of the pair -> merge table; a larger vocabulary: bpe_kernel
# A shorter text is encoded by bpe_kernel, which a run's tokenizer has compiled already:
# the span encoders compile in 7-11 s (the 2-core Xeon) and save about 100 ns a byte, so
# below some 70 MB a first use spends longer compiling it than it saves (a text is
# encoded once: its tokens are cached), and a prompt would wait seconds for it.
SPANS_FROM = 1 << 26


@njit(cache=True, nogil=True, inline="always")
def _spine_at(t, step, side, merges):
    """The token on t's left (side 0) or right (side 1) spine that holds that end of t
    after merge `step` (-1: before the first)."""
    while t >= FIRST_MERGE and t - FIRST_MERGE > step:
        t = merges[t - FIRST_MERGE, side]
    return t


@njit(cache=True, nogil=True)
def _cut_holds(x, y, merges, rank, V):
    """True when merges applied in order to a text never join across a place where,
    applied to each side alone, token x ends the left side and token y starts the right
    (the comment above)."""
    s = x
    while True:
        t = y
        while True:
            m = rank[s * V + t]
            if m >= 0 and _spine_at(x, m - 1, 1, merges) == s \
                    and _spine_at(y, m - 1, 0, merges) == t \
                    and not (s == t and _spine_at(x, m, 1, merges) == FIRST_MERGE + m):
                return False
            if t < FIRST_MERGE:
                break
            t = merges[t - FIRST_MERGE, 0]
        if s < FIRST_MERGE:
            break
        s = merges[s - FIRST_MERGE, 1]
    return True


@njit(cache=True, nogil=True, inline="always")
def _push(head, npos, nnext, nn, r, i):
    """Place i into merge r's bucket as entry nn; returns the next entry's index."""
    npos[nn] = i
    nnext[nn] = head[r]
    head[r] = nn
    return nn + 1


@njit(cache=True, nogil=True)
def _encode_span(tok, s, e, merges, rank, V, ids, nxt, prv, head, npos, nnext, gather,
                 out_tok, out_pos):
    """The merges applied in order to tok[s:e] alone: returns the token count c, with
    out_tok[:c] the tokens and out_pos[:c] their starts (from s). A bucket of places per
    merge (places pushed as their pair is made; an entry whose pair has changed since
    is passed over); merge m's places taken left to right where its two ids are one
    (the only pairs whose occurrences overlap). The pairs a merge makes hold its new id,
    so they are merged later, never by a merge already done."""
    n = e - s
    M = merges.shape[0]
    for m in range(M):
        head[m] = -1
    for i in range(n):
        ids[i] = tok[s + i]
        nxt[i] = i + 1
        prv[i] = i - 1
    nn = 0
    for i in range(n - 1):
        r = rank[ids[i] * V + ids[i + 1]]
        if r >= 0:
            nn = _push(head, npos, nnext, nn, r, i)
    for m in range(M):
        h = head[m]
        if h < 0:
            continue
        a = merges[m, 0]
        b = merges[m, 1]
        N = FIRST_MERGE + m
        g = 0
        while h >= 0:
            gather[g] = npos[h]
            g += 1
            h = nnext[h]
        if a == b:
            gather[:g].sort()
        for u in range(g):
            i = gather[u]
            j = nxt[i]
            if ids[i] != a or j >= n or ids[j] != b:
                continue
            ids[i] = N
            ids[j] = -1
            k = nxt[j]
            nxt[i] = k
            if k < n:
                prv[k] = i
                r = rank[N * V + ids[k]]
                if r >= 0:
                    nn = _push(head, npos, nnext, nn, r, i)
            q = prv[i]
            if q >= 0:
                r = rank[ids[q] * V + N]
                if r >= 0:
                    nn = _push(head, npos, nnext, nn, r, q)
    c = 0
    i = 0
    while i < n:
        out_tok[c] = ids[i]
        out_pos[c] = i
        c += 1
        i = nxt[i]
    return c


@njit(cache=True, nogil=True)
def _unencode(tokens, out, end, merges):
    """The byte ids of `tokens` written to out, ending before `end`, the last token's
    first (so out may be the array the tokens lie at the front of: a token's bytes end
    at or after the place it is read from); returns where they start."""
    stack = np.empty(merges.shape[0] + 1, np.int64)  # (a token's merges nest M deep at most)
    for u in range(tokens.shape[0] - 1, -1, -1):
        stack[0] = tokens[u]
        top = 1
        while top > 0:
            top -= 1
            x = stack[top]
            while x >= FIRST_MERGE:  # its first part kept for later, its second walked
                stack[top] = merges[x - FIRST_MERGE, 0]
                top += 1
                x = merges[x - FIRST_MERGE, 1]
            end -= 1
            out[end] = x
    return end


@njit(cache=True, nogil=True)
def apply_by_spans(tok, V, merges, rank, span, tail, longest, ctl):
    """The merges applied in order to tok (ids), in place, a span at a time (the comment
    above): returns the token count; -1 when stopped through ctl[0] (tok is then
    unusable); -2 when a span would pass `longest` bytes, with tok as it came (the
    caller applies the merges by bpe_kernel). ctl[1]: merges' share of the text done,
    as bpe_kernel's count of merges. span >= 1."""
    n = tok.shape[0]
    M = merges.shape[0]
    if n == 0:
        return 0
    if span < 1:
        raise ValueError("apply_by_spans: a span is 1 byte or more")
    cap = min(n, max(longest, span)) + 1
    ids = np.empty(cap, np.int32)
    nxt = np.empty(cap, np.int32)
    prv = np.empty(cap, np.int32)
    head = np.empty(max(M, 1), np.int32)
    npos = np.empty(3 * cap + 16, np.int32)
    nnext = np.empty(3 * cap + 16, np.int32)
    gather = np.empty(3 * cap + 16, np.int32)
    a_tok = np.empty(cap, np.int32)
    a_pos = np.empty(cap, np.int32)
    b_tok = np.empty(cap, np.int32)
    b_pos = np.empty(cap, np.int32)
    w = 0        # tokens written: tok[:w], the tokens of tok[:p] as it came
    p = 0
    x = -1       # the token ending at p (none at 0)
    e = min(n, span)
    c = _encode_span(tok, p, e, merges, rank, V, ids, nxt, prv, head, npos, nnext, gather,
                     a_tok, a_pos)
    while e < n:
        if ctl[0] != 0:
            return -1
        ctl[1] = M * p // n
        lo = max(1, e - p - tail)
        k = c - 1  # the first boundary in the span's last `tail` bytes (or its last),
        while k > 1 and a_pos[k - 1] >= lo:  # then the ones before it: the further from
            k -= 1                            # the span's end, the likelier to hold
        found = False
        e2 = e
        c2 = 0
        tries = 0
        while k >= 1 and tries < CUT_TRIES:
            q = p + a_pos[k]
            e2 = min(n, q + span)
            c2 = _encode_span(tok, q, e2, merges, rank, V, ids, nxt, prv, head, npos, nnext,
                              gather, b_tok, b_pos)
            if _cut_holds(a_tok[k - 1], b_tok[0], merges, rank, V):
                found = True
                break
            k -= 1
            tries += 1
        if found:
            tok[w:w + k] = a_tok[:k]
            w += k
            x = a_tok[k - 1]
            p += a_pos[k]
            e = e2
            c = c2
            a_tok, b_tok = b_tok, a_tok
            a_pos, b_pos = b_pos, a_pos
            continue
        if e - p >= longest:  # (no cut: the text's bytes back, for bpe_kernel)
            _unencode(tok[:w], tok, p, merges)
            return -2
        e = min(n, p + min(longest, 2 * (e - p)))  # the span over more text
        c = _encode_span(tok, p, e, merges, rank, V, ids, nxt, prv, head, npos, nnext,
                         gather, a_tok, a_pos)
        if x >= 0 and not _cut_holds(x, a_tok[0], merges, rank, V):
            _unencode(tok[:w], tok, p, merges)  # (the cut behind held with the shorter span's
            return -2                      # first token, not with this one's)
    tok[w:w + c] = a_tok[:c]
    ctl[1] = M
    return w + c


# A text is cut into parts of at least PART_BYTES_LEAST, encoded at once by threads of
# their own (apply_by_spans on each part alone), and joined by join_parts: around each
# place where two parts meet, the bytes of some of the left part's last tokens and the
# right part's first (JOIN_REACH bytes each way, more where that fails) are encoded
# alone, and that window's tokens replace theirs where both its ends hold as cuts
# (_cut_holds, with the tokens kept beside them). A part's tokens are the tokens of its
# bytes alone, and those between two of its token boundaries the tokens of those bytes
# alone (the rule above), so every place the result is joined at is a checked cut.
PART_BYTES_LEAST = 1 << 24
JOIN_REACH = 1 << 12


@njit(cache=True, nogil=True)
def join_parts(tok, starts, counts, V, merges, rank, reach, longest, ctl):
    """tok[starts[t]:starts[t] + counts[t]] holding the tokens of part t, the ids
    tok[starts[t]:starts[t + 1]] alone (starts[T] = the text's length): the text's
    tokens written to tok[:w]; returns w; -1 when stopped through ctl[0] (tok is then
    unusable); -2 with every part's ids as they came where a window with no cut would
    pass `longest` bytes or cover the parts beside it (the caller then encodes the whole
    text otherwise)."""
    T = counts.shape[0]
    M = merges.shape[0]
    L = np.ones(V, np.int64)  # each id's bytes
    for m in range(M):
        L[FIRST_MERGE + m] = L[merges[m, 0]] + L[merges[m, 1]]
    keep_from = np.zeros(T, np.int64)  # part t's tokens kept: [keep_from[t], keep_to[t])
    keep_to = counts.astype(np.int64)
    win_tok = np.empty(0, tok.dtype)   # the windows' tokens, one after another: the
    win_at = np.zeros(T + 1, np.int64)  # window after part t is win_tok[win_at[t]:win_at[t + 1]]
    nwin = 0
    for t in range(T - 1):
        sl, sr = starts[t], starts[t + 1]
        r = reach
        while True:
            if ctl[0] != 0:
                return -1
            i = counts[t]
            b = 0
            while i > keep_from[t] + 1 and b < r:  # (one token of the part kept, at least)
                i -= 1
                b += L[tok[sl + i]]
            j = 0
            f = 0
            while j < counts[t + 1] - 1 and f < r:
                f += L[tok[sr + j]]
                j += 1
            if b + f > longest or (b + f == 0):
                _unencode_parts(tok, starts, counts, merges)
                return -2
            window = np.empty(b + f, tok.dtype)
            q = _unencode(tok[sr:sr + j], window, b + f, merges)  # the right part's bytes,
            _unencode(tok[sl + i:sl + counts[t]], window, q, merges)  # then the left's
            c = apply_by_spans(window, V, merges, rank, b + f, 0, b + f, ctl)  # (one span)
            if _cut_holds(tok[sl + i - 1], window[0], merges, rank, V) \
                    and _cut_holds(window[c - 1], tok[sr + j], merges, rank, V):
                break
            if i <= keep_from[t] + 1 and j >= counts[t + 1] - 1:
                _unencode_parts(tok, starts, counts, merges)
                return -2
            r *= 2
        keep_to[t] = i
        keep_from[t + 1] = j
        if nwin + c > win_tok.shape[0]:
            bigger = np.empty(2 * (nwin + c), tok.dtype)
            bigger[:nwin] = win_tok[:nwin]
            win_tok = bigger
        win_tok[nwin:nwin + c] = window[:c]
        nwin += c
        win_at[t + 1] = nwin
    win_at[T] = nwin  # (none after the last part)
    # The tokens moved to the front in place where each part's kept tokens lie at or
    # after where they go; a window can hold more tokens than those it replaces (bytes
    # a | b c d, merges (a, b), (b, c), (bc, d): [a][bcd] as two parts, [ab][c][d] as
    # one), which a part of few merges before it may not make up for: through `out` then.
    w = 0
    in_place = True
    for t in range(T):
        if w > starts[t] + keep_from[t]:
            in_place = False
        w += keep_to[t] - keep_from[t] + win_at[t + 1] - win_at[t]
    out = tok if in_place else np.empty(w, tok.dtype)
    w = 0
    for t in range(T):
        for u in range(keep_from[t], keep_to[t]):
            out[w] = tok[starts[t] + u]
            w += 1
        for u in range(win_at[t], win_at[t + 1]):
            out[w] = win_tok[u]
            w += 1
    if not in_place:
        tok[:w] = out
    ctl[1] = M
    return w


@njit(cache=True, nogil=True)
def _unencode_parts(tok, starts, counts, merges):
    """Each part's ids back from its tokens (join_parts' and by_spans' -2)."""
    for t in range(counts.shape[0]):
        if counts[t] >= 0:
            _unencode(tok[starts[t]:starts[t] + counts[t]], tok[starts[t]:starts[t + 1]],
                      starts[t + 1] - starts[t], merges)


def by_spans(tok, vocab, merges, rank, parts, ctl, sizes=None):
    """apply_by_spans on tok, or on `parts` parts of it at once (a thread each) joined by
    join_parts: the token count; -1 stopped through ctl[0]; -2 with tok as it came.
    sizes: (span, tail, longest span, join reach), by default the module's."""
    span, tail, longest, reach = sizes or (SPAN_BYTES, TAIL_BYTES, LONGEST_SPAN, JOIN_REACH)
    if parts == 1:
        return apply_by_spans(tok, vocab, merges, rank, span, tail, longest, ctl)
    n = tok.shape[0]
    starts = np.array([n * t // parts for t in range(parts + 1)], np.int64)
    ctls = [np.array([ctl[0], 0, 0, 0], np.int64) for _ in range(parts)]  # (stopped already)
    with concurrent.futures.ThreadPoolExecutor(parts, thread_name_prefix="hslm-bpe") as pool:
        running = [pool.submit(apply_by_spans, tok[starts[t]:starts[t + 1]], vocab, merges,
                               rank, span, tail, longest, ctls[t]) for t in range(parts)]
        while True:
            done, left = concurrent.futures.wait(running, timeout=0.05)
            if not left:
                break
            if ctl[0] != 0 or any(f.exception() for f in done):
                for c in ctls:  # (each part stops at its next span; the pool waits)
                    c[0] = 1
                break
            ctl[1] = sum(int(c[1]) for c in ctls) // parts
        counts = np.array([f.result() for f in running], np.int64)
    if ctl[0] != 0 or (counts == -1).any():
        return -1
    if (counts == -2).any():  # (every part's ids back, for bpe_kernel)
        _unencode_parts(tok, starts, counts, merges)
        return -2
    return join_parts(tok, starts, counts, vocab, merges, rank, reach, longest, ctl)


def rank_table(merges, vocab: int):
    """[vocab^2] int32: the merge of pair (x, y) at x * vocab + y, or -1 (the first where a
    pair repeats, as applying them in order takes it)."""
    merges = np.asarray(merges, np.int64).reshape(-1, 2)
    rank = np.full(vocab * vocab, -1, np.int32)
    at = (merges[:, 0] * vocab + merges[:, 1])[::-1]
    rank[at] = np.arange(merges.shape[0], dtype=np.int32)[::-1]
    return rank


# position lists with their room, per corpus byte (see run): about 1.5 on English-like text,
# 2.45 measured on 106 MB of random Unicode (2.0 had been assumed)
POOL_BYTES_PER_BYTE = 2.5


def memory_needed(vocab: int, n_bytes: int, learn: bool = True) -> int:
    """Bytes bpe_kernel touches for a text of n_bytes: five vocab^2 int64 tables (pair
    counts, list starts, lengths and entries, merge stamps; a sixth while indexing), the
    position lists (varint gaps: about 1.4 bytes an entry on text, plus 25% room; a text
    of random bytes needs more and the pool grows), the ids, and the heap's first fill
    (its worst-case reserve is allocated but never touched)."""
    ids = n_bytes * np.dtype(ids_dtype(vocab)).itemsize
    heap = 16 * min(vocab * vocab, n_bytes) if learn else 0
    return 48 * vocab * vocab + int(POOL_BYTES_PER_BYTE * n_bytes) + ids + heap


def ids_dtype(vocab: int):
    return np.uint16 if vocab <= 65535 else np.uint32


def run(tok: np.ndarray, vocab: int, merges=None, slack=0.25, ctl=None, info=None,
        threads=1):
    """learn (merges None: returns (merges int64 [m, 2], n_tokens)) or apply merges
    (returns (merges, n_tokens)); tok (ids_dtype) is changed in place. slack: the
    position lists' room, as a share of their first size. info (a dict), if given,
    gets "pool_bytes": the largest the position lists' pool was (slack and info apply to
    bpe_kernel only). Merges given are applied by spans to a text of SPANS_FROM bytes or more, in
    up to `threads` parts at once."""
    if tok.shape[0] >= 2 ** 32 - 1:
        raise ValueError("texts of 4 GiB or more are not supported")
    ctl = np.zeros(4, np.int64) if ctl is None else ctl
    learn = merges is None
    if learn:
        buf = np.zeros((max(vocab - FIRST_MERGE, 0), 2), np.int64)
    else:
        buf = np.ascontiguousarray(merges, dtype=np.int64).reshape(-1, 2)
        made = FIRST_MERGE + np.arange(buf.shape[0])[:, None]  # (the kernels index their
        if buf.shape[0] > vocab - FIRST_MERGE or (buf < BYTE0).any() or (buf >= made).any():
            raise ValueError("merges must join bytes and earlier merges, within the "
                             "vocabulary")  # tables by these ids, unchecked)
    n_merges = buf.shape[0]
    if not learn and tok.shape[0] >= SPANS_FROM and 4 * vocab * vocab <= RANK_TABLE_MOST:
        parts = max(1, min(threads, tok.shape[0] // PART_BYTES_LEAST))
        w = by_spans(tok, vocab, buf, rank_table(buf, vocab), parts, ctl)
        if w == -1:
            raise KeyboardInterrupt
        if w >= 0:
            return buf, w
    counts, seg_len = _list_sizes(tok, vocab, ctl)
    if ctl[0] != 0:
        raise KeyboardInterrupt
    first = int(seg_len.sum())
    # allocated by numpy, which asks for transparent huge pages on large arrays: the
    # kernel's scattered writes into the lists then miss the TLB far less
    pool = np.empty(first + int(first * slack) + 16, np.uint8)
    m, w, pool_bytes = bpe_kernel(tok, vocab, buf, n_merges, learn, counts, seg_len, pool,
                                  ctl)
    del pool
    if m < 0:
        raise KeyboardInterrupt
    if info is not None:
        info["pool_bytes"] = int(pool_bytes)
    return (buf[:m] if learn else buf), w
