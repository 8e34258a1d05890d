"""The loop orders, and nothing else: the layers (hslm/layers.py) in the order a speed runs them.

For one window of L+1 tokens with its last k positions scored (s = L - k), every
loop order computes the same bits (docs/model.md, section 9): the window's loss,
the logits of the scored positions, dloss/dx_0 of the scored positions, and the
window's gradient S_w added into `out` (out += S_w, each element summed over
the scored positions in position order from 0.0).

    per_position   for each position p: p's column (embedding, every block, the
                   head) against the KV cache of positions < p; at a scored p,
                   its backward, streaming its weight-gradient products into the
                   window's accumulator. recompute_prefix: before each scored p,
                   the forward of the whole prefix 0..p again (the oracle).
    layerwise      each layer over all positions of the window (of all of a
                   thread's windows) before the next, forward then backward;
                   the weight gradients afterwards from the windows' records,
                   a held block of gradient rows at a time (gradients_from_records).
    rows of a      layerwise, for a team of threads sharing one window (threads
    window         beyond the batch): each member the layers over its own rows,
                   waiting before each block's attention for the members whose
                   rows come first (window_rows_forward); the backward by rows;
                   a thread's whole share in one call (team_slot).
"""
from __future__ import annotations

import time

import numpy as np

from .config import TENSORS_PER_BLOCK
from .jit import kernel_entry, kernel_inner, kernel_part
from .kernels import (PREFETCH_TO_L2, active_masks, active_rows_grad, aligned_rows, aligned_view,
                      column_sum_rows, columns_to_l2, copy_rows, input_columns,
                      output_grad_panels, transpose_rows)
from .micro import WGRAD_PANEL, panel_matmul_add, panel_matmul_add2
from .layers import (CLOCK_LOSS, CLOCK_OPERANDS, CLOCK_RELU_MATRICES, COLUMN_SUM, MATRIX,
                     RELU_INPUT, block_backward, block_forward, block_keys_values, block_queries,
                     blocks_backward, blocks_forward, embed_forward, head_backward, head_forward,
                     loss_rows, part_ends, part_starts, relu_side, view1, view2,
                     window_loss_rows, weight_grad_operands)
from .spin import add, gate_opens, publish, wait_for
from .vsa import vsa_window

# A constant 0 passed where the same kernel elsewhere gets a variable: Numba compiles a
# kernel again for each literal argument it is called with (a 1-1.3 s compile each,
# weight_grad_operands' included), not for an int64 made at run time.
NO_LITERAL_0 = np.int64(0)


# ------------------------------------------------------------ per position
@kernel_inner
def position_forward(model, A, w, tokens, vsa, p, kv_only_last, with_head, kernel):
    """Position p's column: embedding, every block (its keys and values join the
    cache), and with_head the logits."""
    D = model.dims
    embed_forward(model, A, w, tokens, p, p + 1)
    for b in range(D.blocks):
        s = p + 1 if kv_only_last and b == D.blocks - 1 else p
        block_forward(model, A, w, vsa, b, p, p + 1, s, kernel)
    if with_head:
        head_forward(model, A, w, p, p + 1, kernel)


@kernel_inner(allocates=True)
def stream_weight_grads(model, A, R, w, tokens, s, k, r, acc):
    """Add scored row r's products into the window accumulator acc (every tensor)."""
    offs = model.offs
    for t in range(offs.shape[0] - 1):
        kind, X, DY, m, n = weight_grad_operands(model, A, R, w, t, s, k)
        if kind == MATRIX:
            G = view2(acc, offs, t, m, n)
            x = X[r]
            dy = DY[r]
            for i in range(m):
                xi = x[i]
                g = G[i]
                for j in range(n):
                    g[j] += xi * dy[j]
        elif kind == COLUMN_SUM:
            g = view1(acc, offs, t)
            for j in range(n):
                g[j] += DY[r, j]
        else:  # EMBED_ROWS: E[t_p] += dloss/dx_0[p]
            E = view2(acc, offs, t, m, n)
            tok = tokens[s + r]
            for i in range(n):
                E[tok, i] += DY[r, i]


@kernel_entry(allocates=True)
def window_per_position(model, tokens, vsa, k, scale, A, R, S, acc, out, recompute_prefix,
                        kv_only_unscored, kernel):
    """Speeds 0-2: one position at a time. acc is the window's accumulator (zeroed
    here), added into out at the end. Returns the window's mean loss."""
    D = model.dims
    L = D.window
    s = L - k
    acc[:] = 0.0
    loss_sum = 0.0
    row_loss = np.empty(k)
    for p in range(L):
        scored = p >= s
        if recompute_prefix:
            if not scored:
                continue
            for j in range(p + 1):
                position_forward(model, A, 0, tokens, vsa, j, kv_only_last=False,
                                 with_head=j == p, kernel=kernel)
        else:
            position_forward(model, A, 0, tokens, vsa, p,
                             kv_only_last=kv_only_unscored and not scored, with_head=scored,
                             kernel=kernel)
        if scored:
            r = p - s
            window_loss_rows(A, R, 0, tokens, s, r, r + 1, scale, row_loss)
            loss_sum += row_loss[r]
            head_backward(model, A, R, S, 0, s, r, r + 1, kernel)
            for b in range(D.blocks - 1, -1, -1):  # (S holds the backward's panels of
                # each block's cache up to the row before: only this row's are added)
                block_backward(model, A, R, S, 0, b, s, r, r + 1, s + r if r > 0 else 0,
                               kernel)
            stream_weight_grads(model, A, R, 0, tokens, s, k, r, acc)
    for i in range(acc.shape[0]):
        out[i] += acc[i]
    return loss_sum / k


# --------------------------------------------------------------- layerwise
def windows_layerwise(model, vsa_table, windows, vsa, k, scale, A, R, S, first, step, losses,
                      kernel, timings=None):
    """Speed 3 for windows first, first + step, ... of a batch (one thread's share):
    each layer runs for all of them before the next layer, so a layer's matrices
    are read once from memory and then from cache. Forward and the backward
    through every layer's input; the weight gradients come later, from the
    records (gradients_from_records). losses[w] gets window w's mean loss.
    (Kernels apart, so that a first run can compile them in several processes.)
    timings (a dict, hslm bench's profile): the forward's and the backward's seconds
    are added to its "forward" and "backward"."""
    row_losses = np.empty((windows.shape[0], k))
    t0 = time.perf_counter()
    windows_forward(model, vsa_table, windows, vsa, k, A, first, step, kernel)
    t1 = time.perf_counter()
    windows_backward(model, windows, k, scale, A, R, S, first, step, 0, k, row_losses, kernel,
                     True, model.dims.blocks, 0)
    if timings is not None:
        timings["forward"] = timings.get("forward", 0.0) + t1 - t0
        timings["backward"] = timings.get("backward", 0.0) + time.perf_counter() - t1
    mean_losses(row_losses, k, first, step, losses)


def windows_forward(model, vsa_table, windows, vsa, k, A, first, step, kernel):
    """Forward of windows first, first + step, ...: VSA stream, embedding, blocks and
    the head at the last k positions, into A. Three kernels called from here rather than
    one that calls them: one would hold, and compile again, all of the blocks' code."""
    L = model.dims.window
    B = windows.shape[0]
    windows_embed(model, vsa_table, windows, vsa, A, first, step)
    every_block_forward(model, A, vsa, first, step, B, L, L - k, kernel)
    windows_head(model, A, first, step, B, L - k, L, kernel)


@kernel_entry
def windows_embed(model, vsa_table, windows, vsa, A, first, step):
    """windows_forward's first part: each window's VSA stream and embedding."""
    D = model.dims
    for w in range(first, windows.shape[0], step):
        vsa_window(vsa_table, windows[w], D.blocks, D.width, vsa[w])
        embed_forward(model, A, w, windows[w], 0, D.window)


@kernel_entry
def every_block_forward(model, A, vsa, first, step, B, L, s, kernel):
    """windows_forward's blocks, block by block (in the last block only the scored rows
    go past their keys and values)."""
    D = model.dims
    for b in range(D.blocks):
        blocks_forward(model, A, vsa, b, first, step, B, 0, L,
                       s if b == D.blocks - 1 else 0, kernel)


@kernel_entry
def windows_head(model, A, first, step, B, s, L, kernel):
    """windows_forward's last part: the head at rows s..L-1 of each window."""
    for w in range(first, B, step):
        head_forward(model, A, w, s, L, kernel)


@kernel_entry
def window_rows_forward(model, vsa_table, tokens, k, A, w, vsa, p0, p1, progress, slot, first,
                        step, member, abort, kernel):
    """Rows p0..p1-1 of window w's forward, for member `member` of the window's team
    (threads beyond the batch): members take consecutive rows, and the team's member j
    is thread slot first + j step. Each row gets the bits windows_forward gives it.
    A row attends to the keys and values of every row before it: after putting its rows'
    keys and values of block b into the cache, a member publishes progress[slot] = b + 1,
    and waits for every member before it to have done so before block b's attention.
    vsa [nb, p1, d] is the member's own: the stream's rows 0..p1-1 (a row's stream
    depends on every row before it, so each member computes the earlier rows again
    rather than wait for them; they cost least). Returns False if the team gave up
    (progress[abort] set: another member failed)."""
    D = model.dims
    s = D.window - k
    vsa_window(vsa_table, tokens, D.blocks, D.width, vsa)
    embed_forward(model, A, w, tokens, p0, p1)
    for b in range(D.blocks):
        block_keys_values(model, A, w, b, p0, p1, kernel)
        publish(progress, slot, b + 1)
        if not wait_for(progress, first, step, member, b + 1, abort):
            return False
        # in the last block only the scored rows go past their keys and values
        block_queries(model, A, w, vsa, b, max(p0, s) if b == D.blocks - 1 else p0, p1,
                      kernel)
    q0 = max(p0, s)
    if q0 < p1:
        head_forward(model, A, w, q0, p1, kernel)
    return True


def team_counters(slots, blocks):
    """The zeroed counters team_slot's threads share for one step (its sync)."""
    return np.zeros(2 * slots + blocks + 2, np.int64)


@kernel_entry
def team_slot(model, vsa_table, windows, k, scale, A, R, S, vsa, slot, p0, p1, row_losses, sync,
              units, chunks, G, kernel):
    """Thread slot `slot`'s share of a step's gradient when threads outnumber the B windows
    (hslm.step.StepRunner._gradient_teams), in one call, with no Python between its
    parts: as member slot // B of window slot % B's team, rows p0..p1-1 of the window's
    forward (window_rows_forward); then its scored rows' backward in stages (the head,
    then each block from the last down); then weight-gradient chunks until none is left.
    sync (team_counters(N, nb), N slots): [0, N) each slot's forward progress, N
    the abort flag, N + 1 + st how many slots have passed backward stage st, N + nb + 2 + o
    how many of owner o's chunks have been taken. chunks [C, 4]: (u0, u1, stage, owner),
    grouped by owner, each owner's in the order they are taken (the head's stage first);
    each is summed once every slot has passed its stage, as its records are then final
    (into G, fresh: gradients_from_records). A slot takes its own chunks first (owner ==
    slot: the tensors it updates in the optimiser, so their gradient stays in its core's
    caches), then what is left of the others'. Taken by any slot in stage order, half
    the gradient a slot updated had been written on the other core, and where the two
    cores were on different dies the chunks took 1.55 -> 2.57 ms of a batch-1 step here.
    Returns False if the team gave up (another slot failed)."""
    D = model.dims
    nb = D.blocks
    B = windows.shape[0]
    N = (sync.shape[0] - nb - 2) // 2
    s = D.window - k
    w = slot % B
    if p1 > p0:
        if not window_rows_forward(model, vsa_table, windows[w], k, A, w, vsa, p0, p1, sync,
                                   slot, w, B, slot // B, N, kernel):
            return False
    r0, r1 = max(p0, s) - s, max(p1, s) - s
    for stage in range(nb + 1):  # 0: loss and head; then block nb - stage
        if r1 > r0:
            b1 = nb if stage == 0 else nb - stage + 1
            windows_backward(model, windows, k, scale, A, R, S, w, B, r0, r1, row_losses,
                             kernel, stage == 0, b1, nb - stage)
        add(sync, N + 1 + stage, 1)
    C = chunks.shape[0]
    for j in range(N):  # its own queue first, then the others' (what is left of them)
        o = (slot + j) % N
        q0 = 0
        while q0 < C and chunks[q0, 3] < o:
            q0 += 1
        q1 = q0
        while q1 < C and chunks[q1, 3] == o:
            q1 += 1
        while True:
            c = q0 + add(sync, N + nb + 2 + o, 1)
            if c >= q1:
                break
            if not wait_for(sync, N + 1 + chunks[c, 2], 1, 1, N, N):
                return False
            gradients_from_records(model, A, R, windows, k, units, chunks[c, 0], chunks[c, 1],
                                   G, S.xt, S.dy_panels, True, sync, NO_LITERAL_0)
    return True


@kernel_entry
def windows_backward(model, windows, k, scale, A, R, S, first, step, r0, r1, row_losses, kernel,
                     head, b1, b0):
    """Backward through the layers' inputs of windows first, first + step, ... (after
    their forward), record rows r0..r1-1 (positions s + r0 .. s + r1 - 1), into their
    records R: with head, the loss (row_losses[w, r] gets row r's loss) and the head;
    then blocks b1 - 1 down to b0. A row's backward reads only its own rows of the
    forward and the cache (attention's earlier keys and values are constants of a
    row's backward, docs/model.md, 7), so any split of the rows gives the same bits. The
    whole backward is (0, k, True, blocks, 0); in stages, a block's weight gradients may
    start once its own backward is done (step.StepRunner), as its records are then final."""
    s = model.dims.window - k
    B = windows.shape[0]
    if head:
        for w in range(first, B, step):
            c0 = part_starts(model)
            window_loss_rows(A, R, w, windows[w], s, r0, r1, scale, row_losses[w])
            part_ends(model, CLOCK_LOSS, c0)
            head_backward(model, A, R, S, w, s, r0, r1, kernel)
    for b in range(b1 - 1, b0 - 1, -1):
        blocks_backward(model, A, R, S, b, first, step, B, s, r0, r1, kernel)


@kernel_entry
def mean_losses(row_losses, k, first, step, losses):
    """losses[w] = window w's mean loss: its rows' losses summed in row order from 0.0,
    over k (windows first, first + step, ...)."""
    for w in range(first, row_losses.shape[0], step):
        total = 0.0
        for r in range(k):
            total += row_losses[w, r]
        losses[w] = total / k


# Rows of a W_up or W_down gradient summed over a group's windows before the next rows:
# the rows stay in L2 while the windows pass (relu_weight_grads). (The same 36 as
# kernels.WGRAD_ROW_BLOCK, but chosen apart: 18 and 72 timed no differently here.)
RELU_ROW_BLOCK = 36


@kernel_inner(allocates=True)
def windows_scratch(flat, room, rest, B):
    """Scratch for relu_weight_grads: (buffer, windows) where the buffer holds `windows`
    (at most B: the group of windows, whose copies should stay in L2) parts of `room`
    elements and `rest` elements after them: flat where it holds at least one window's,
    else a new array of one window's (a model with windows too long for the scratch:
    not a preset)."""
    n = min(B, (flat.size - rest) // room)
    if n >= 1:
        return flat, n
    return np.empty(room + rest), 1


@kernel_part
def relu_weight_grads(model, A, R, B, t, s, k, units, u0, u1, out, WG, fresh, M, masks_of):
    """gradients_from_records' units u0..u1-1 of tensor t, the Wup or Wdown of a block,
    over the positions where each ReLU unit j is active (active_rows_grad): the other
    positions' products are +-0.0, which change no bit of these sums, and they are half
    of all. G's rows j for Wdown (input relu [k, F]); for Wup (output gradient d_u,
    0.0 wherever relu is) its columns j, each unit's rows i0..i1 summed as rows of
    T = G[i0:i1]^T in scratch and copied into G when every window has added. The dense
    factor's rows go through aligned scratch (kernels.aligned_rows), every window's of a
    group at once; then RELU_ROW_BLOCK rows of G (or T) at a time take the group's
    windows, so that they stay in cache while the windows pass, where G (1.4 MB for
    hslm-3's Wdown) had gone to L3 and back for each window. Each element gets the
    windows in window order, as in the dense tiles. While a block of Wdown's rows takes
    its windows, the next block's rows of G are asked into L2, a piece before each
    window (prefetch_to_l2): copying the sums into G had waited on its lines, last
    touched by the optimiser a step ago (0.71 -> 0.30 ms a step on the 2-core Xeon,
    batch 8; the whole block's lines at once slowed the sums after them). Asking for
    Wup's lines of G while its rows are summed slowed the sums by more than it saved;
    transpose_rows asks for them a strip ahead instead. Before each window's call, that
    window's sparse factor for the next block of rows (its k rows' columns j1..) is asked
    into L2 too (columns_to_l2): Wdown's tile took 3.79 ms a step, 3.28 run again at once
    with those lines near, and the tile's own asks reach only 8 units ahead.

    M [B, words, F] holds the windows' masks of active positions (active_masks), every
    column's, for block masks_of[0]: W_up makes them and W_down, the block's next
    matrix, uses them again (making its own, of its units' rows, had cost 0.95 ms a step
    here); a W_down with no W_up before it in the call makes its units' own."""
    D = model.dims
    d, F = D.width, D.mlp
    b = (t - 1) // TENSORS_PER_BLOCK
    flat = WG.reshape(WG.size)
    group = min(B, WG.shape[0])  # windows a group, as the dense matrices' (WGRAD_WINDOWS)
    ra, rb = units[u0, 1], units[u1 - 1, 2]
    if relu_side(D, t) == RELU_INPUT:  # Wdown, G [F, d]: the units are its rows j
        G = view2(out, model.offs, t, F, d)
        known = masks_of[0] == b
        room = k * (d + 15) + 7  # aligned_rows' part of the scratch, a window's
        buf, nw = windows_scratch(flat, room, RELU_ROW_BLOCK * (d + 15) + 7, group)
        for w0 in range(0, B, nw):
            w1 = min(w0 + nw, B)
            for w in range(w0, w1):
                if not known:
                    active_masks(A.relu[w, b, s:], ra, rb, M[w])
                aligned_rows(R.d_block_out[w, b, :k], buf, (w - w0) * room)
            for j0 in range(ra, rb, RELU_ROW_BLOCK):
                j1 = min(j0 + RELU_ROW_BLOCK, rb)
                # G's rows (243 doubles apart) summed in rows that start on 64 bytes
                rows = aligned_view(buf, nw * room, j1 - j0, d)
                if not (fresh and w0 == 0):  # go on from G's sums
                    copy_rows(G[j0:j1], rows)
                ahead = (min(j1 + RELU_ROW_BLOCK, rb) - j1) * d * 8  # the next block's G
                for w in range(w0, w1):
                    if ahead > 0:  # on its way while these rows are summed, a piece a window
                        a0 = ahead * (w - w0) // (w1 - w0)
                        PREFETCH_TO_L2(G[j1].ctypes.data + a0,
                                       ahead * (w - w0 + 1) // (w1 - w0) - a0)
                    if j1 < rb:  # this window's factor for the next block of rows
                        columns_to_l2(A.relu[w, b, s:], j1, min(j1 + RELU_ROW_BLOCK, rb))
                    dy = aligned_view(buf, (w - w0) * room, k, d)
                    active_rows_grad(M[w], A.relu[w, b, s:], dy, 0, d, j0, j1, rows,
                                     fresh and w == 0)
                copy_rows(rows, G[j0:j1])
        return
    G = view2(out, model.offs, t, d, F)  # Wup, G [d, F]: the units are its rows i
    if masks_of[0] != b:
        for w in range(B):
            active_masks(A.relu[w, b, s:], NO_LITERAL_0, F, M[w])
        masks_of[0] = b
    for v in range(u0, u1):
        i0, i1 = units[v, 1], units[v, 2]
        n = i1 - i0
        room = k * (n + 15) + 7
        buf, nw = windows_scratch(flat, room, F * (n + 15) + 7, group)
        T = aligned_view(buf, nw * room, F, n)  # rows on 64 bytes, as the h rows
        if not fresh:  # go on from G's sums: T = G[i0:i1]^T
            transpose_rows(G[i0:i1], T)
        for w0 in range(0, B, nw):
            w1 = min(w0 + nw, B)
            for w in range(w0, w1):
                aligned_rows(A.h[w, b, s:, i0:i1], buf, (w - w0) * room)
            for j0 in range(0, F, RELU_ROW_BLOCK):
                j1 = min(j0 + RELU_ROW_BLOCK, F)
                for w in range(w0, w1):
                    if j1 < F:  # this window's factor for the next block of rows
                        columns_to_l2(R.d_u[w, b, :k], j1, min(j1 + RELU_ROW_BLOCK, F))
                    h = aligned_view(buf, (w - w0) * room, k, n)
                    active_rows_grad(M[w], R.d_u[w, b, :k], h, 0, n, j0, j1, T[j0:j1],
                                     fresh and w == 0)
        transpose_rows(T, G[i0:i1])


@kernel_entry(allocates=True)
def gradients_from_records(model, A, R, tokens, k, units, u0, u1, out, XT, WG, fresh, gate,
                           target):
    """Speed 3's weight-gradient phase for a batch of windows. Returns False, having done
    nothing, where its gate does not open (spin.gate_opens(gate, target): a barrier's
    arrivals, waited for here; target <= 0: none), else True.

    A, R and tokens hold every window of the batch. For each unit u0..u1-1
    (tensor t, rows r0..r1), adds into `out` each window's sum in window order; a
    window's sum over its scored positions runs in position order from 0.0 (for
    a matrix: a held block of gradient rows, X^T . DY). Units write disjoint
    parts of `out`, so threads may take any units: the bits do not depend on
    who computes what. A matrix's consecutive units share its output gradients in
    panels and its input's columns transposed (XT, their rows only): for each group of
    windows (as many as WG and XT have rows) both are made once, reading the records
    row by row as they lie in memory, then every unit adds that group's windows, so
    each element still gets its windows in order (Wup and Wdown, beside the ReLU: over
    each unit's active positions, relu_weight_grads), two windows a call where two are left
    (panel_matmul_add2: one loop sums both windows' tiles, and G's tile is loaded and
    stored once for the two). (Transposing each unit's columns
    apart, and the panels column by column, had cost 2-3 ms more a step here: the
    records come from far caches, in short strided runs.) fresh: out's units get the
    batch's sums, whatever they held (the first window's sum is stored as 0.0 + S, the
    bits of zeroed G added to, and a small tensor is zeroed just before); else the sums
    are added to what out holds (a pipeline's earlier windows). Zeroing G up front cost
    2.5-3 ms a step here (by the time a unit's rows were summed, the 17 MB memset had
    gone to memory), and zeroing each unit just before its sums 1.3 ms (a memset of its
    rows)."""
    if not gate_opens(gate, target):
        return False
    D = model.dims
    offs = model.offs
    s = D.window - k
    B = tokens.shape[0]
    M = np.empty((B, (k + 63) // 64, D.mlp), np.int64)  # relu_weight_grads' masks ...
    masks_of = np.full(1, -1, np.int64)  # ... of block [0], every column
    # what XT[slot] holds: the input's address and its columns ra, rb (Wq, Wk and Wv of a
    # block share their input, so the two after the first reuse its columns, where the
    # batch is one group of windows, at most WGRAD_WINDOWS, and the same rows come again)
    xt_of = np.full((XT.shape[0], 3), -1, np.int64)
    u = u0
    while u < u1:
        t = units[u, 0]
        ue = u + 1  # this tensor's units in the range: u .. ue-1
        while ue < u1 and units[ue, 0] == t:
            ue += 1
        if relu_side(D, t) != 0:
            c0 = part_starts(model)  # (hslm bench's profile, Model.clock)
            relu_weight_grads(model, A, R, B, t, s, k, units, u, ue, out, WG, fresh, M,
                              masks_of)
            part_ends(model, CLOCK_RELU_MATRICES, c0)
            u = ue
            continue
        operands = weight_grad_operands(model, A, R, NO_LITERAL_0, t, s, k)
        if operands[0] == MATRIX:
            m, n = operands[3], operands[4]
            G = view2(out, offs, t, m, n)
            ra, rb = units[u, 1], units[ue - 1, 2]  # the rows of this tensor's units
            for w0 in range(0, B, WG.shape[0]):
                w1 = min(w0 + WG.shape[0], B)
                c0 = part_starts(model)
                for w in range(w0, w1):
                    _, X, DY, _, _ = weight_grad_operands(model, A, R, w, t, s, k)
                    output_grad_panels(DY, WG[w - w0])
                    held = xt_of[w - w0]
                    if held[0] != X.ctypes.data or held[1] != ra or held[2] != rb:
                        input_columns(X, ra, rb, XT[w - w0])
                        held[0], held[1], held[2] = X.ctypes.data, ra, rb
                part_ends(model, CLOCK_OPERANDS, c0)
                npan = (n + WGRAD_PANEL - 1) // WGRAD_PANEL
                for v in range(u, ue):
                    r0, r1 = units[v, 1], units[v, 2]
                    w = w0
                    while w < w1:  # two windows a call where two are left (the pair tile)
                        pd = WG[w - w0, :npan * k * WGRAD_PANEL].reshape((npan, k, WGRAD_PANEL))
                        xt = XT[w - w0, :(rb - ra) * k].reshape((rb - ra, k))
                        if w + 1 < w1:
                            pd2 = WG[w + 1 - w0, :npan * k * WGRAD_PANEL].reshape(
                                (npan, k, WGRAD_PANEL))
                            xt2 = XT[w + 1 - w0, :(rb - ra) * k].reshape((rb - ra, k))
                            panel_matmul_add2(xt[r0 - ra:r1 - ra], xt2[r0 - ra:r1 - ra], pd, pd2,
                                              n, G[r0:r1], fresh and w == 0)
                            w += 2
                        else:
                            panel_matmul_add(xt[r0 - ra:r1 - ra], pd, n, G[r0:r1],
                                             fresh and w == 0)
                            w += 1
            u = ue
            continue
        for v in range(u, ue):  # a whole tensor a unit
            if fresh:
                view1(out, offs, t)[:] = 0.0
            for w in range(B):
                kind, X, DY, m, n = weight_grad_operands(model, A, R, w, t, s, k)
                if kind == COLUMN_SUM:
                    column_sum_rows(DY, view1(out, offs, t), WG[0])
                else:  # EMBED_ROWS: E[t_p] += dx_0 summed over the window's rows with token t_p
                    E = view2(out, offs, t, m, n)
                    row = WG[0, :n]
                    tok = tokens[w]
                    for r in range(k):
                        seen = False
                        for r2 in range(r):
                            if tok[s + r2] == tok[s + r]:
                                seen = True
                        if seen:
                            continue
                        for i in range(n):
                            row[i] = 0.0
                        for r2 in range(r, k):
                            if tok[s + r2] == tok[s + r]:
                                for i in range(n):
                                    row[i] += DY[r2, i]
                        for i in range(n):
                            E[tok[s + r], i] += row[i]
        u = ue
    return True


# ------------------------------------------------------------ forward only
@kernel_entry(allocates=True)
def windows_loss(windows, k, A, S, first, step, losses):
    """Evaluation, after windows_forward: for windows first, first + step, ..., their mean
    over the last k positions of the loss (losses[w, 0]) and of the plain cross-entropy
    (losses[w, 1]), each summed in position order."""
    L = windows.shape[1] - 1
    row_loss = np.empty(k)
    row_nll = np.empty(k)
    for w in range(first, windows.shape[0], step):
        tokens = windows[w]
        loss_rows(A.logits[w, L - k:L], tokens[L - k + 1:L + 1], 1.0, S.loss_grad[L - k:L],
                  row_loss, row_nll)
        loss_sum = 0.0
        nll_sum = 0.0
        for r in range(k):
            loss_sum += row_loss[r]
            nll_sum += row_nll[r]
        losses[w, 0] = loss_sum / k
        losses[w, 1] = nll_sum / k
