"""The incremental BPE gives exactly the merges and the token stream of the plain
algorithm (a rescan per merge), kept here as the reference."""
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hslm import bpe
from hslm.data import builtin_text

FIRST_MERGE = 260


def _ref_apply(seq, n, a, b, new):
    w = i = 0
    while i < n:
        if i + 1 < n and seq[i] == a and seq[i + 1] == b:
            seq[w] = new
            i += 2
        else:
            seq[w] = seq[i]
            i += 1
        w += 1
    return w


def ref_learn(data: bytes, vocab: int):
    """The original hslm.data._learn_merges, in plain Python/numpy."""
    seq = list(np.frombuffer(data, np.uint8).astype(np.int64) + 4)
    n = len(seq)
    merges = []
    while len(merges) < vocab - FIRST_MERGE:
        counts = {}
        for i in range(n - 1):
            counts[(seq[i], seq[i + 1])] = counts.get((seq[i], seq[i + 1]), 0) + 1
        best, pair = 1, None
        for k in sorted(counts):  # the first maximum in (first, second) order
            if counts[k] > best:
                best, pair = counts[k], k
        if pair is None:
            break
        n = _ref_apply(seq, n, pair[0], pair[1], FIRST_MERGE + len(merges))
        merges.append(pair)
    return np.array(merges, np.int64).reshape(-1, 2), np.array(seq[:n], np.int64)


def ref_encode(data: bytes, merges):
    seq = list(np.frombuffer(data, np.uint8).astype(np.int64) + 4)
    n = len(seq)
    for m, (a, b) in enumerate(merges):
        n = _ref_apply(seq, n, a, b, FIRST_MERGE + m)
    return np.array(seq[:n], np.int64)


def new_learn(data: bytes, vocab: int, slack=0.25):
    tok = np.frombuffer(data, np.uint8).astype(np.uint16) + 4
    merges, w = bpe.run(tok, vocab, slack=slack)
    return merges, tok[:w].astype(np.int64)


def new_encode(data: bytes, merges, vocab):
    tok = np.frombuffer(data, np.uint8).astype(np.uint16) + 4
    _, w = bpe.run(tok, vocab, merges=merges)
    return tok[:w].astype(np.int64)


def check(data: bytes, vocab=300, slack=0.25):
    rm, rs = ref_learn(data, vocab)
    nm, ns = new_learn(data, vocab, slack)
    assert rm.tolist() == nm.tolist()
    assert rs.tolist() == ns.tolist()
    assert new_encode(data, nm, vocab).tolist() == rs.tolist()
    return nm


SMALL = ["", "a", "aa", "aaa", "aaaa", "aaaaa", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
         "abababab", "ababababa", "aabaabaab", "abcabcabcabc", "ab" "cd" "ab" "cd",
         "xyxyxy xyxy yxyx", "zzzzyzzzzyzzzz", "the cat the hat the bat",
         "ünïcödé ünïcödé 🙂🙂🙂 日本語日本語", "\n\n\n\n  \t  \t\t", "abba" * 17 + "a"]


@pytest.mark.parametrize("text", SMALL)
def test_small_texts_give_the_reference_merges_and_stream(text):
    check(text.encode())


@pytest.mark.parametrize("slack", [0.0, 0.01, 2.0])
def test_pool_compaction_does_not_change_anything(slack):
    data = ("def f(x):\n    return x + 1\n\n" * 40 + "aaaa bbbb abab " * 30).encode()
    check(data, vocab=330, slack=slack)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="ab c\u00e9", max_size=120), st.integers(261, 300))
def test_random_small_alphabet(text, vocab):
    check(text.encode(), vocab)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200).filter(lambda b: True), st.integers(261, 290))
def test_random_bytes(data, vocab):
    check(data, vocab)


def test_encoding_other_text_with_learned_merges():
    merges = new_learn(b"hello world, hello there; aaaa" * 5, 290)[0]
    for other in [b"", b"h", b"hello hello aaaaaaa", "héllo wörld".encode(), b"xyz" * 9]:
        assert new_encode(other, merges, 290).tolist() == ref_encode(other, merges).tolist()


@pytest.mark.slow
def test_builtin_corpus_gives_the_reference_merges():
    """The built-in corpus, vocab 729 (469 merges): the compiled reference (a rescan
    per merge, the algorithm hslm shipped first) against the incremental kernel."""
    data = builtin_text().encode("utf-8")
    seq = np.frombuffer(data, np.uint8).astype(np.int64) + 4
    merges = np.zeros((469, 2), np.int64)
    m, n = _ref_learn_compiled(seq, 729, 469, merges)
    nm, ns = new_learn(data, 729)
    assert m == 469 and np.array_equal(merges, nm)
    assert np.array_equal(seq[:n], ns)
    assert np.array_equal(new_encode(data, nm, 729), ns)


def _ref_learn_compiled(seq, vocab, n_merges, merges):
    from numba import njit
    apply = njit(_ref_apply)

    @njit
    def learn(seq, vocab, n_merges, merges):
        n = seq.shape[0]
        counts = np.zeros((vocab, vocab), np.int64)
        m = 0
        while m < n_merges:
            counts[:, :] = 0
            for i in range(n - 1):
                counts[seq[i], seq[i + 1]] += 1
            best = 1
            ba = bb = -1
            for a in range(vocab):
                for b in range(vocab):
                    if counts[a, b] > best:
                        best = counts[a, b]
                        ba, bb = a, b
            if ba < 0:
                break
            merges[m, 0] = ba
            merges[m, 1] = bb
            n = apply(seq, n, ba, bb, FIRST_MERGE + m)
            m += 1
        return m, n
    return learn(seq, vocab, n_merges, merges)


@pytest.mark.parametrize("slack", [0.0, 0.25])
def test_long_texts_with_multi_byte_gaps_give_the_reference_merges(slack):
    """Positions past 2**21 (4-byte varints), rare pairs with long gaps, and a pool
    that must grow (slack 0, random bytes) against the compiled reference."""
    rng = np.random.default_rng(14)
    text = builtin_text().encode("utf-8")[:1_500_000]
    noise = rng.integers(0, 256, 700_000, dtype=np.uint8).tobytes()
    data = text[:900_000] + noise + text[900_000:] + b"\x00\x01" * 3 + b"zq" * 2
    seq = np.frombuffer(data, np.uint8).astype(np.int64) + 4
    merges = np.zeros((40, 2), np.int64)
    m, n = _ref_learn_compiled(seq, 300, 40, merges)
    info = {}
    tok = np.frombuffer(data, np.uint8).astype(np.uint16) + 4
    nm, w = bpe.run(tok, 300, slack=slack, info=info)
    assert m == 40 and np.array_equal(merges, nm)
    assert np.array_equal(seq[:n], tok[:w])
    assert info["pool_bytes"] > 0


def test_the_position_lists_fit_their_memory_estimate_on_text():
    """The pool of position lists stays within bpe.POOL_BYTES_PER_BYTE per text byte on
    text (the README's 4 bytes a corpus byte: 2 for the ids, under 2 for the lists),
    and memory_needed covers ids and lists."""
    data = builtin_text().encode("utf-8")
    n = len(data)
    for vocab in (300, 729):
        info = {}
        tok = np.frombuffer(data, np.uint8).astype(np.uint16) + 4
        bpe.run(tok, vocab, info=info)
        assert info["pool_bytes"] <= bpe.POOL_BYTES_PER_BYTE * n, (vocab, info, n)
        assert bpe.memory_needed(vocab, n) >= 2 * n + info["pool_bytes"]


# ------------------------------------------------------------ given merges, span by span
def kernel_encode(ids, merges, vocab, monkeypatch):
    """bpe_kernel's forced merges (the whole text at once): the spans' reference."""
    with monkeypatch.context() as m:
        m.setattr(bpe, "RANK_TABLE_MOST", -1)
        tok = ids.copy()
        _, w = bpe.run(tok, vocab, merges=merges)
    return tok[:w]


def spans_on_copy(ids, merges, vocab, span, tail, longest, ctl=None):
    """apply_by_spans on a copy of ids: (its return value, the copy)."""
    tok = ids.copy()
    w = bpe.apply_by_spans(tok, vocab, merges, bpe.rank_table(merges, vocab), span, tail,
                           longest, np.zeros(4, np.int64) if ctl is None else ctl)
    return w, tok


def _ids(data: bytes):
    return np.frombuffer(data, np.uint8).astype(np.uint16) + 4


ADVERSE = {"runs": b"a" * 400 + b"b" + b"a" * 201, "pairs": (b"ab" * 300)[:-1] + b"a" * 5,
           "repeats": (b"abc" * 100 + b"aab" * 50) * 2, "mirrored": b"aaab" * 60 + b"baaa" * 60,
           "indents": b"\n    \n" * 40 + b"  " * 150 + b"def x():\n" * 20}


@pytest.mark.parametrize("data", ADVERSE.values(), ids=ADVERSE.keys())
def test_a_cut_holds_exactly_where_the_two_sides_alone_give_the_whole_texts_tokens(
        data, monkeypatch):
    """At every place q of a text: the tokens of [0, q) alone followed by those of [q, n)
    alone are the text's tokens if and only if _cut_holds(last token of the left, first
    of the right). Both kinds of place occur (the check is not always true: a cut it
    refuses gives other tokens), on texts of runs and repeats, whose pairs overlap."""
    vocab = 300
    merges, _ = bpe.run(_ids(data), vocab)
    rank = bpe.rank_table(merges, vocab)
    whole = kernel_encode(_ids(data), merges, vocab, monkeypatch)
    seen = set()
    for q in range(1, len(data)):
        left = kernel_encode(_ids(data[:q]), merges, vocab, monkeypatch)
        right = kernel_encode(_ids(data[q:]), merges, vocab, monkeypatch)
        same = np.array_equal(np.concatenate([left, right]), whole)
        assert bpe._cut_holds(int(left[-1]), int(right[0]), merges, rank, vocab) == same, q
        seen.add(same)
    assert seen == {True, False}


@pytest.mark.parametrize("span,tail", [(256, 32), (4096, 512), (1 << 16, 1 << 10)])
def test_spans_give_the_whole_texts_tokens_on_the_builtin_corpus(span, tail, monkeypatch):
    """hslm-3's merges (vocabulary 729) applied by spans of a few hundred bytes to the
    default size (about 1,800 to 7 cuts over the 466 KB): the tokens learning made, and
    bpe_kernel's."""
    data = builtin_text().encode("utf-8")
    tok = _ids(data)
    merges, n = bpe.run(tok, 729)
    w, got = spans_on_copy(_ids(data), merges, 729, span, tail, 1 << 20)
    assert w == n and np.array_equal(got[:w], tok[:n])
    assert np.array_equal(kernel_encode(_ids(data), merges, 729, monkeypatch), tok[:n])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([b"ab", b"abc", b"a \n", bytes(range(256))]), st.data())
def test_spans_of_any_size_give_the_whole_texts_tokens_or_the_text_back(alphabet, data):
    """Random texts of a few letters (runs, repeats), merges learned from them or from
    another text, spans, tails and longest spans of any size: the tokens of applying the
    merges to the whole text; or, where a span would grow past the longest (-2), the
    text's ids as they came."""
    draw = data.draw
    text = bytes(draw(st.lists(st.sampled_from(alphabet), max_size=600)))
    if draw(st.booleans()):
        text = text * draw(st.integers(1, 4))
    other = bytes(draw(st.lists(st.sampled_from(alphabet), max_size=300)))
    vocab = draw(st.integers(261, 330))
    merges, _ = bpe.run(_ids(text if draw(st.booleans()) else other), vocab)
    span = draw(st.integers(1, 300))
    tail = draw(st.integers(0, span))
    longest = draw(st.integers(1, 1500))
    w, got = spans_on_copy(_ids(text), merges, vocab, span, tail, longest)
    if w == -2:
        assert np.array_equal(got, _ids(text))
    else:
        assert got[:w].tolist() == ref_encode(text, merges).tolist()


def spy_on_spans(monkeypatch):
    """bpe.apply_by_spans, recording what each call returned."""
    returned, inner = [], bpe.apply_by_spans

    def spy(*args):
        returned.append(inner(*args))
        return returned[-1]
    monkeypatch.setattr(bpe, "apply_by_spans", spy)
    return returned


def test_run_uses_spans_only_for_long_texts_and_small_vocabularies(monkeypatch):
    """bpe.run applies merges by spans to a text of SPANS_FROM bytes or more (here 1 KB),
    by bpe_kernel (compiled already by a run's tokenizer) to a shorter one, and where
    the pair table would pass RANK_TABLE_MOST (here 4 x 300^2 bytes): the same tokens."""
    data = builtin_text().encode("utf-8")[:3000]
    merges, _ = bpe.run(_ids(data), 300)
    returned = spy_on_spans(monkeypatch)
    monkeypatch.setattr(bpe, "SPANS_FROM", 1000)
    for size, table_most, spans in [(3000, 4 * 300 ** 2, True), (999, 4 * 300 ** 2, False),
                                    (3000, 4 * 300 ** 2 - 1, False)]:
        monkeypatch.setattr(bpe, "RANK_TABLE_MOST", table_most)
        tok = _ids(data[:size])
        _, w = bpe.run(tok, 300, merges=merges)
        assert tok[:w].tolist() == ref_encode(data[:size], merges).tolist()
        assert returned == ([w] if spans else []), (size, table_most)
        returned.clear()


def test_run_falls_back_to_the_whole_text_where_no_cut_is_found(monkeypatch):
    """Spans too short to find a cut in (a long run of one byte whose tokens are longer
    than the span): apply_by_spans gives the text back (-2) and bpe.run applies the
    merges by bpe_kernel, the same tokens."""
    data = b"x" * 5000 + b"yx" * 300
    merges, n = bpe.run(_ids(data), 280)
    returned = spy_on_spans(monkeypatch)
    for name, value in [("SPANS_FROM", 0), ("SPAN_BYTES", 4), ("TAIL_BYTES", 1),
                        ("LONGEST_SPAN", 8)]:
        monkeypatch.setattr(bpe, name, value)
    tok = _ids(data)
    _, w = bpe.run(tok, 280, merges=merges)
    assert returned == [-2]
    assert tok[:w].tolist() == ref_encode(data, merges).tolist()


def test_spans_stop_when_asked(monkeypatch):
    """ctl[0] set: apply_by_spans returns -1 at its next span, and bpe.run raises
    KeyboardInterrupt (the way Ctrl-C reaches a kernel running without the GIL)."""
    data = builtin_text().encode("utf-8")
    merges, _ = bpe.run(_ids(data), 300)
    ctl = np.ones(4, np.int64)
    assert spans_on_copy(_ids(data), merges, 300, 1 << 12, 1 << 8, 1 << 20, ctl)[0] == -1
    monkeypatch.setattr(bpe, "SPANS_FROM", 0)
    returned = spy_on_spans(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        bpe.run(_ids(data), 300, merges=merges, ctl=np.ones(4, np.int64))
    assert returned == [-1]


@pytest.mark.parametrize("merges,vocab", [([[4, 4], [260, 261]], 300), ([[4, 3]], 300),
                                          ([[4, 4], [5, 5]], 261), ([[4, 300]], 400)])
def test_run_refuses_merges_its_tables_cannot_index(merges, vocab):
    """A merge of an id not made yet, of a special id, more merges than the vocabulary
    holds: ValueError before any kernel indexes its tables by them (neither checks its
    indices). Control: the same shapes with valid merges encode."""
    tok = _ids(b"aaaa bbbb")
    with pytest.raises(ValueError, match="merges must join"):
        bpe.run(tok, vocab, merges=np.array(merges, np.int64))
    assert bpe.run(_ids(b"aaaa bbbb"), 300, merges=np.array([[4, 4], [5, 260]], np.int64))[1] > 0


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([b"ab", b"abc", b"a \n", bytes(range(256))]), st.data())
def test_parts_encoded_at_once_and_joined_give_the_whole_texts_tokens_or_the_text_back(
        alphabet, data):
    """A text cut into 2-9 parts encoded at once (a thread each, spans of any size) and
    joined by windows of any reach: the tokens of applying the merges to the whole text,
    or (-2, a part or a window with no cut) the text's ids as they came."""
    draw = data.draw
    text = bytes(draw(st.lists(st.sampled_from(alphabet), min_size=2, max_size=900)))
    if draw(st.booleans()):
        text = text * draw(st.integers(1, 4))
    vocab = draw(st.integers(261, 330))
    merges, _ = bpe.run(_ids(text), vocab)
    parts = draw(st.integers(2, min(9, len(text))))
    span = draw(st.integers(1, 300))
    sizes = (span, draw(st.integers(0, span)), draw(st.integers(1, 1500)),
             draw(st.integers(1, 200)))
    tok = _ids(text)
    w = bpe.by_spans(tok, vocab, merges, bpe.rank_table(merges, vocab), parts,
                     np.zeros(4, np.int64), sizes)
    if w == -2:
        assert np.array_equal(tok, _ids(text))
    else:
        assert tok[:w].tolist() == ref_encode(text, merges).tolist()


def test_parts_give_the_whole_texts_tokens_on_the_builtin_corpus(monkeypatch):
    """hslm-3's merges on the built-in corpus through bpe.run with 2 and 7 threads (parts
    of 64 KB at least, windows of 16 bytes each way at first): the tokens learning made.
    Each part was encoded (a spy counts the calls), and the joins held (no fallback)."""
    data = builtin_text().encode("utf-8")
    tok = _ids(data)
    merges, n = bpe.run(tok, 729)
    returned = spy_on_spans(monkeypatch)
    joined, join = [], bpe.join_parts
    monkeypatch.setattr(bpe, "join_parts", lambda *args: joined.append(join(*args)) or joined[-1])
    for name, value in [("SPANS_FROM", 0), ("PART_BYTES_LEAST", 1 << 16), ("JOIN_REACH", 16)]:
        monkeypatch.setattr(bpe, name, value)
    for threads in (2, 7):
        got = _ids(data)
        _, w = bpe.run(got, 729, merges=merges, threads=threads)
        assert w == n and np.array_equal(got[:w], tok[:n])
        assert len(returned) == threads and min(returned) > 0 and joined == [n]
        returned.clear()
        joined.clear()


@pytest.mark.parametrize("stop_first", [True, False])
def test_parts_stop_when_asked(monkeypatch, stop_first):
    """ctl[0] set before the parts start, or while they run (as Ctrl-C does: the caller's
    ctl set once the kernel runs; here each part waits to see it reach its own): bpe.run
    raises KeyboardInterrupt, every part having stopped (each returned -1)."""
    data = builtin_text().encode("utf-8")
    merges, _ = bpe.run(_ids(data), 300)
    monkeypatch.setattr(bpe, "SPANS_FROM", 0)
    monkeypatch.setattr(bpe, "PART_BYTES_LEAST", 1 << 16)
    ctl = np.full(4, int(stop_first), np.int64)
    returned, inner = [], bpe.apply_by_spans

    def part_seeing_the_stop(*args):
        ctl[0] = 1
        for _ in range(500):  # (by_spans passes it on within 0.05 s)
            if args[-1][0]:
                break
            time.sleep(0.01)
        returned.append(inner(*args))
        return returned[-1]
    monkeypatch.setattr(bpe, "apply_by_spans", part_seeing_the_stop)
    with pytest.raises(KeyboardInterrupt):
        bpe.run(_ids(data), 300, merges=merges, ctl=ctl, threads=3)
    assert returned == [-1, -1, -1]


def test_a_window_with_more_tokens_than_it_replaces_is_joined_without_overwriting():
    """Bytes 'xyz' (no merge) then 'abcd' | 'q' in two parts, merges (a, b), (b, c),
    (bc, d): the right part is [bcd]... and the window around the join encodes to
    [ab][c][d], one token more than it replaces, with too few merges before it to make
    room: the result is built aside, not over the right part's tokens still to be read
    (it had lost the 'q' and written 'd' twice; found in review)."""
    A = [ord(ch) + 4 for ch in "abcd"]
    merges = np.array([[A[0], A[1]], [A[1], A[2]], [261, A[3]]], np.int64)
    text = b"xyzabcdq"
    for parts, reach in [(2, 1), (2, 2), (3, 1), (4, 1)]:
        tok = _ids(text)
        w = bpe.by_spans(tok, 263, merges, bpe.rank_table(merges, 263), parts,
                         np.zeros(4, np.int64), (100, 0, 100, reach))
        assert w == -2 and np.array_equal(tok, _ids(text)) and (parts, reach) != (2, 1) or \
            tok[:w].tolist() == ref_encode(text, merges).tolist(), (parts, reach)
