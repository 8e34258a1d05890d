"""Tokenizer, corpus and split."""
import hashlib
import time
from pathlib import Path
import numpy as np

from hslm.rng import Stream
import pytest
from hypothesis import given, settings, strategies as st

from hslm.data import FIRST_MERGE, Corpus, Tokenizer, builtin_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(builtin_text(), 729)


def test_builtin_tokenizer_has_all_merges_and_is_deterministic(tok):
    assert len(tok.merges) == 729 - FIRST_MERGE == 469
    again = Tokenizer.train(builtin_text(), 729)
    assert np.array_equal(tok.merges, again.merges) and tok.identity == again.identity
    assert Tokenizer.from_json(tok.to_json()).identity == tok.identity


def test_ties_go_to_the_smaller_pair():
    t = Tokenizer.train("ab" + "cd" + "ab" + "cd", 261)  # ab and cd both occur twice
    assert tuple(t.merges[0]) == (ord("a") + 4, ord("b") + 4)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(tok, s):
    ids = tok.encode(s)
    assert ids.dtype == np.int64 and (ids < 729).all() and (ids >= 4).all()
    assert tok.decode(ids) == s


def test_split_and_windows():
    c = Corpus.load(None, 729, 27)
    n = len(c.tokens)
    assert len(c.valid) == int(n * 0.1) and len(c.train) + len(c.valid) == n
    assert np.array_equal(np.concatenate([c.train, c.valid]), c.tokens)
    assert c.tokenizer.decode(c.tokens) == builtin_text()
    rng = Stream.seeded("test", 0)
    w = c.draw_windows(rng, 64, 27)
    assert w.shape == (64, 28) and w.max() < 729
    v = c.validation_windows(64, 27)
    assert v.shape == (64, 28)


def test_the_shipped_builtin_tokens_are_what_learning_writes(tmp_path):
    """hslm/corpus holds the built-in text's tokenizer and tokens at the default
    vocabulary, byte for byte what learning them into a token cache writes
    (tools/ship_builtin_tokens.py), so a first default run loads them and compiles
    no tokenizer."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from ship_builtin_tokens import learn_builtin

    from hslm import data
    learned = learn_builtin(tmp_path)
    for path in learned:
        assert (data.BUILTIN_TOKENS / path.name).read_bytes() == path.read_bytes(), path.name
    shipped = sorted(p.name for p in data.BUILTIN_TOKENS.iterdir()
                     if p.suffix in (".json", ".tok"))
    assert shipped == sorted(p.name for p in learned)  # nothing stale beside them


def test_a_first_run_on_the_builtin_text_loads_the_shipped_tokens(tmp_path, monkeypatch):
    """With an empty token cache, the built-in text at the default vocabulary comes from
    the shipped files (no tokenizer learned, no BPE kernel run), the same tokens as
    learned; another vocabulary, or a shipped file that is damaged, is learned."""
    import shutil

    from hslm import bpe, data
    from hslm.config import Config
    shipped = data.BUILTIN_TOKENS
    monkeypatch.setattr(data, "BUILTIN_TOKENS", None)
    learned = Corpus.load(None, Config().vocab, 27, cache_dir=tmp_path / "learned")
    monkeypatch.setattr(data, "BUILTIN_TOKENS", shipped)
    calls = []
    real_run = bpe.run
    monkeypatch.setattr(bpe, "run", lambda *a, **k: calls.append(1) or real_run(*a, **k))
    c = Corpus.load(None, Config().vocab, 27, cache_dir=tmp_path / "empty")
    assert calls == [] and c.tokenizer.identity == learned.tokenizer.identity
    assert np.asarray(c.tokens).tobytes() == np.asarray(learned.tokens).tobytes()
    Corpus.load(None, 263, 27, cache_dir=tmp_path / "other")  # another vocabulary: learned
    assert calls == [1]
    # negative control: a damaged shipped token file is not trusted
    damaged = tmp_path / "shipped"
    shutil.copytree(shipped, damaged)
    tok_file = next(damaged.glob("tokens-*.tok"))
    raw = bytearray(tok_file.read_bytes())
    raw[-1] ^= 1
    tok_file.write_bytes(bytes(raw))
    monkeypatch.setattr(data, "BUILTIN_TOKENS", damaged)
    c = Corpus.load(None, Config().vocab, 27, cache_dir=tmp_path / "empty2")
    assert calls == [1, 1]
    assert np.asarray(c.tokens).tobytes() == np.asarray(learned.tokens).tobytes()


def test_a_vocabulary_the_text_cannot_fill_is_reported(capsys):
    text = "".join(f"line {i}: {i % 7} cats and {i % 5} owls\n" for i in range(200))
    Corpus(text, FIRST_MERGE + 20, 9, "t")  # room for 20 merges: this text fills them
    assert "never occur" not in capsys.readouterr().err
    c = Corpus(text, 5000, 9, "t")
    learned = len(c.tokenizer.merges)
    assert learned < 5000 - FIRST_MERGE
    err = capsys.readouterr().err
    assert f"only {learned:,} of the vocabulary's {5000 - FIRST_MERGE:,} merges" in err
    assert f"token ids {FIRST_MERGE + learned:,}-4,999 never occur" in err


def test_integers_drawn_in_chunks_are_one_draws_values():
    """Stream.integers draws at most rng.CHUNK raw values at a time (a large VSA table
    costs its own bytes, not several int64 copies): the values and the stream after
    are those of the one-draw form it replaced (the minimal prefix of raw draws holding
    `count` accepted ones), with rejections (n = 2^62 + 1 rejects about a quarter) and without."""
    import numpy as np

    from hslm import rng
    from hslm.rng import Stream

    def one_draw(s, count, n):  # the form before chunks, verbatim
        limit = np.uint64(2 ** 64 - (2 ** 64 % n)) if 2 ** 64 % n else None
        out = np.empty(0, np.uint64)
        need = count
        while need > 0:
            x = s.raw(need)
            if limit is not None:
                x = x[x < limit]
            out = np.concatenate([out, x])
            need = count - len(out)
        return (out % np.uint64(n)).astype(np.int64)

    count = 2 * rng.CHUNK + 12345
    for n in (3, 2 ** 62 + 1, 1):
        a, b = Stream.seeded("vsa", 7), Stream.seeded("vsa", 7)
        ref = one_draw(a, count, n)
        got = b.integers(count, n)
        assert got.tobytes() == ref.tobytes() and a.state_json() == b.state_json(), n
        if n <= 128:  # a dtype that holds n - 1: the same values
            assert (Stream.seeded("vsa", 7).integers(count, n, np.int8) == ref).all()
    # control: drawing one value more per chunk than needed would move the stream
    a, b = Stream.seeded("vsa", 7), Stream.seeded("vsa", 7)
    one_draw(a, count, 2 ** 62 + 1)
    b.raw(count + 1)
    assert a.state_json() != b.state_json()


def test_a_short_text_merged_by_rank_gets_the_kernels_tokens():
    """Tokenizer.encode merges a prompt without bpe.run's vocab^2 tables where they would
    be large (_merged_by_rank): the same tokens as the kernel's, on texts of runs and
    repeats (pairs like (a, a) overlapping), at three vocabularies."""
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(["aa", "aaa", "ab", "ba", "the ", "cat ", "zzzz", "\u00e9", "\n"])
                   for _ in range(20000))
    compared = 0
    for vocab in (300, 520, 729):
        t = Tokenizer.train(text, vocab)
        for trial in range(100):
            n = int(rng.integers(0, 300))
            i = int(rng.integers(0, len(text) - n))
            s = text[i:i + n] if trial % 2 else "".join(rng.choice(list("abtz \u00e9\n"), n))
            ids = (np.frombuffer(s.encode(), np.uint8).astype(np.int64) + 4).tolist()
            kernel = t.encode(s).tolist()  # (small tables: the kernel's path)
            assert t._merged_by_rank(ids) == kernel, (vocab, s)
            compared += len(kernel) < len(ids)
    assert compared > 100  # (control: most texts had merges to make)


def test_a_prompt_for_a_large_vocabulary_needs_no_vocab_squared_tables():
    """Encoding a few words for a vocabulary of 8,192 allocated 48 x 8,192^2 bytes (3 GB)
    of merge tables; a prompt goes by rank now, in a few MB."""
    import tracemalloc

    from hslm import bpe
    merges = [[4 + (i % 256), 4 + (i * 7 % 256)] for i in range(8192 - FIRST_MERGE)]
    t = Tokenizer(8192, np.array(merges))
    assert bpe.memory_needed(8192, 40, learn=False) > 3 << 30
    tracemalloc.start()
    ids = t.encode("a prompt of a few words, and some more")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert t.decode(ids) == "a prompt of a few words, and some more" and len(ids) < 39


def test_a_long_prompt_merged_by_rank_gets_the_kernels_tokens_without_tables():
    """A prompt of any length goes by rank where the tables would be large (it had been
    only those up to 4 KB: a longer one for a vocabulary of 32,768 was refused as needing
    48 GB): 200 KB of text, the kernel's tokens at a vocabulary whose tables are small,
    and at 8,192 in a few MB."""
    import tracemalloc

    from hslm import bpe
    rng = np.random.default_rng(1)
    text = "".join(rng.choice(["aa", "aaa", "ab", "the ", "cat ", "zzzz", "\u00e9", "\n"])
                   for _ in range(75000))
    t = Tokenizer.train(text[:50000], 729)
    ids = (np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 4).tolist()
    kernel = t.encode(text).tolist()
    assert len(ids) > 200_000 and t._merged_by_rank(ids) == kernel
    assert len(kernel) < len(ids) / 2  # (control: merges were made)
    big = Tokenizer(32768, np.concatenate([t.merges, [[4 + i % 256, 5 + i % 250]
                                                      for i in range(32768 - 729)]]))
    assert bpe.memory_needed(32768, len(ids), learn=False) > 48 << 30
    tracemalloc.start()
    got = big.encode(text)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 256 << 20, peak
    assert big.decode(got) == text and len(got) < len(ids) / 2


@pytest.mark.parametrize("doubling", [33, 40])
def test_a_tokenizer_whose_pieces_would_not_fit_is_refused(doubling):
    """Merges of a piece with itself double it: 40 of them in a 253 KB file asked for a
    piece of 2^40 bytes when the tokenizer was built."""
    import json

    from hslm.errors import HslmError
    merges = [[4 + 97, 4 + 97]] + [[FIRST_MERGE + m, FIRST_MERGE + m] for m in range(doubling)]
    s = json.dumps({"format": "hslm-bpe", "version": 1, "vocab": 729, "merges": merges})
    with pytest.raises(HslmError, match="tokenizer is not valid: merge .* longer than any text"):
        Tokenizer.from_json(s)
    ok = json.dumps({"format": "hslm-bpe", "version": 1, "vocab": 729, "merges": merges[:20]})
    tok = Tokenizer.from_json(ok)
    assert len(tok.piece(tok.n_ids - 1)) == 1 << 20  # (control: 1 MB is a piece)


def test_a_tokenizer_is_read_without_making_its_pieces():
    """Each piece under 4 GiB, but together 12.5 GiB: a tokenizer of 394 bytes (beside a
    checkpoint, or in one whose checksums were made again) had its pieces made when read,
    14 GB and 70 s for hslm info, eval or sample, which need its identity or a few of its
    pieces. Now a piece is made when decoding first asks for it."""
    import json
    import tracemalloc
    merges = [[4 + 97, 4 + 97]] + [[FIRST_MERGE + m, FIRST_MERGE + m] for m in range(30)]
    top = FIRST_MERGE + 30  # a piece of 2^31 bytes
    merges += [[top, top - 1], [top - 1, top], [top, top - 2]]  # 3, 3 and 2.5 GiB
    s = json.dumps({"format": "hslm-bpe", "version": 1, "vocab": 729, "merges": merges})
    tracemalloc.start()
    t = time.perf_counter()
    tok = Tokenizer.from_json(s)
    tok.identity
    took, peak = time.perf_counter() - t, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20 and took < 5, (peak, took)
    # the pieces decoding asks for (control: what had been made whole before)
    assert tok.decode_bytes([4 + 97, FIRST_MERGE, FIRST_MERGE + 3, 2, 10 ** 9]) == b"a" * 19
    assert len(tok.piece(FIRST_MERGE + 20)) == 1 << 21


def _in_pieces(monkeypatch, large=5000, piece=3000):
    """A text of `large` bytes or more is tokenized in pieces of `piece` bytes (4 GiB and
    1 GiB in hslm: small here, so the path runs in a test)."""
    from hslm import data
    monkeypatch.setattr(data, "LARGE_TEXT", large)
    monkeypatch.setattr(data, "PIECE_BYTES", piece)


def _piecewise_tokens(text: bytes, piece: int, vocab: int):
    """What the definition says (docs/model.md, Data): the merges learned from the first
    piece, each piece encoded by itself, the tokens joined. Written with bpe.run on
    slices, apart from the reading and writing of hslm.data."""
    from hslm import bpe
    parts = [np.frombuffer(text[o:o + piece], np.uint8).astype(np.uint16) + 4
             for o in range(0, len(text), piece)]
    merges, n = bpe.run(parts[0], vocab)
    out = [parts[0][:n]]
    for ids in parts[1:]:
        out.append(ids[:bpe.run(ids, vocab, merges)[1]])
    return merges, np.concatenate(out)


LARGE_TEXT_BYTES = (ROOT / "README.md").read_bytes()[:20000]


def test_a_text_past_4_gib_is_tokenized_in_pieces_learned_from_the_first(tmp_path, monkeypatch):
    """A text of 4 GiB or more had been refused: it is cut into 1 GiB pieces, the merges
    learned from the first, each encoded by itself and written to the token file as it is
    made; the file is memory-mapped and a later run reads it. Two files joined, so a
    piece begins inside the second."""
    from hslm import bpe, data
    from hslm.textsource import TextSource
    _in_pieces(monkeypatch)
    (tmp_path / "a.txt").write_bytes(LARGE_TEXT_BYTES[:9000])
    (tmp_path / "b.txt").write_bytes(LARGE_TEXT_BYTES[9000:])
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    merges, want = _piecewise_tokens(LARGE_TEXT_BYTES[:9000] + b"\n\n" + LARGE_TEXT_BYTES[9000:],
                                     3000, 300)
    cache = tmp_path / "cache"
    c = Corpus(TextSource(files), 300, 9, "t", cache_dir=cache)
    assert np.array_equal(c.tokenizer.merges, merges)
    assert isinstance(c.tokens, np.memmap) and np.array_equal(c.tokens, want)
    assert sorted(f.name[:4] for f in cache.iterdir() if f.suffix != ".json" or
                  f.name.startswith("bpe-")) == ["bpe-", "toke"]
    # the next run maps the cache: nothing learned or encoded
    monkeypatch.setattr(bpe, "run", lambda *a, **k: pytest.fail("tokenized again"))
    again = Corpus(TextSource(files), 300, 9, "t", cache_dir=cache)
    assert np.array_equal(again.tokens, want) and again.text_sha256 == c.text_sha256
    # control: one piece (the text under the bound) is learned and encoded whole
    monkeypatch.undo()
    _in_pieces(monkeypatch, large=len(LARGE_TEXT_BYTES) + 3)
    whole = Corpus(TextSource(files), 300, 9, "t", cache_dir=tmp_path / "whole")
    assert whole.tokenizer.identity != c.tokenizer.identity
    assert not np.array_equal(whole.tokens[:len(want)], want)
    # without a cache folder, and on an MPI rank that writes none (here on another machine
    # than rank 0's: it waits for none): an unnamed temporary file
    _in_pieces(monkeypatch)
    for writer in (True, False):
        monkeypatch.setattr(data.distributed, "is_writer", lambda w=writer: w)
        monkeypatch.setattr(data.distributed, "on_writers_machine", lambda w=writer: w)
        out = tmp_path / f"other{writer}"
        got = Corpus(TextSource(files), 300, 9, "t", cache_dir=None if writer else out)
        assert isinstance(got.tokens, np.memmap) and np.array_equal(got.tokens, want)
        assert not out.exists() or not list(out.glob("*.tok"))


def test_a_large_texts_pieces_are_checked_as_one_text_and_a_failure_leaves_no_file(
        tmp_path, monkeypatch):
    """A character split by a piece's end is one character (the UTF-8 check runs over
    the pieces' bytes as one stream); a bad byte in a later piece is refused with its
    offset, by the hashing pass (before any piece is learned from) and by the reading,
    and a text that is not the one hashed (changed while read) is refused once its last
    piece is read: no token file, no temporary file left. And a file of NUL
    bytes the hashing pass saw is refused before any piece is read."""
    from hslm import data
    from hslm.errors import HslmError
    from hslm.textsource import DataChanged, TextSource
    _in_pieces(monkeypatch)
    text = LARGE_TEXT_BYTES[:2999] + "é".encode() + LARGE_TEXT_BYTES[:5000]  # é at 2999-3000
    f = tmp_path / "t.txt"
    f.write_bytes(text)
    cache = tmp_path / "cache"
    got = Corpus(TextSource([f]), 300, 9, "t", cache_dir=cache)
    assert np.array_equal(got.tokens, _piecewise_tokens(text, 3000, 300)[1])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(text[:7000] + b"\xff" + text[7000:])
    message = f"data file {bad} is not UTF-8 text \\(byte 0xff at offset 7000\\)"
    with monkeypatch.context() as m:  # refused by the hashing pass, before any piece
        m.setattr(TextSource, "read_pieces", lambda *a, **k: pytest.fail("read in pieces"))
        with pytest.raises(HslmError, match=message):
            Corpus(TextSource([bad]), 300, 9, "t", cache_dir=tmp_path / "c2")
    with pytest.raises(HslmError, match=message):  # and by read_pieces where it is reached
        data.corpus_tokens(TextSource([bad]), hashlib.sha256(bad.read_bytes()).hexdigest(),
                           300, cache_dir=tmp_path / "c2")
    assert not (tmp_path / "c2").exists() or list((tmp_path / "c2").iterdir()) == []
    sha = hashlib.sha256(text).hexdigest()
    src = TextSource([f])
    with pytest.raises(DataChanged):
        data.corpus_tokens(src, hashlib.sha256(b"other").hexdigest(), 300,
                           cache_dir=tmp_path / "c3")
    assert not (tmp_path / "c3").exists()  # (the folder made for the cache is removed)
    tokenizer, arr = data.corpus_tokens(src, sha, 300, cache_dir=tmp_path / "c3")  # control
    assert np.array_equal(arr, got.tokens)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"\0" * 6000)
    src = TextSource([nul])
    sha = src.scan()
    monkeypatch.setattr(TextSource, "read_pieces", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(HslmError, match="is 100.0% NUL bytes"):
        data.corpus_tokens(src, sha, 300, cache_dir=tmp_path / "c4")


def test_a_data_folder_refuses_what_is_not_a_regular_file_and_orders_names_by_nfc(tmp_path):
    """A folder's pipes, devices and links to nothing had been dropped without a word
    (the text then short of them): each is refused by name. Names are ordered in their
    composed form, so a folder copied from a system storing them decomposed gives the
    same text: "e" + U+0301 sorted before "f" as it is spelled, after it composed."""
    import os
    from hslm.errors import HslmError
    from hslm.textsource import TextSource
    d = tmp_path / "d"
    d.mkdir()
    (d / "f.txt").write_text("f")
    (d / "e\u0301.txt").write_text("e")  # decomposed
    assert [q.name for q in TextSource(d).files] == ["f.txt", "e\u0301.txt"]
    assert sorted(["f.txt", "e\u0301.txt"])[0] == "e\u0301.txt"  # control: as spelled
    for make, what in ((lambda q: q.symlink_to(tmp_path / "missing"), "a link to nothing"),
                       (lambda q: os.mkfifo(q), "not a regular file")):
        make(d / "odd")
        with pytest.raises(HslmError, match=f"odd is {what}"):
            TextSource(d)
        (d / "odd").unlink()
    assert len(TextSource(d).files) == 2  # control: without it


def test_a_data_file_swapped_for_a_pipe_after_listing_is_refused_not_waited_on(tmp_path):
    """The text's files are opened as regular files only: a name swapped for a FIFO
    between listing and reading had been opened for reading and waited on forever."""
    import os
    import signal
    from hslm.errors import HslmError
    from hslm.textsource import TextSource
    f = tmp_path / "a.txt"
    f.write_text("some text " * 100)
    src = TextSource(f)
    assert b"".join(c for c, _, _ in src.chunks()).startswith(b"some text")  # control
    f.unlink()
    os.mkfifo(f)
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("waited")))
    signal.alarm(20)
    try:
        with pytest.raises(HslmError, match="not a regular file"):
            list(src.chunks())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_a_token_cache_folder_that_is_a_data_folder_is_refused(tmp_path):
    """--cache-dir (or HSLM_CACHE_DIR) naming the --data folder: the next run read the
    cache's own files as text ("the data changed while it was read"): refused at once."""
    from hslm.errors import HslmError
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text(builtin_text()[:20000])
    with pytest.raises(HslmError, match="is the --data folder"):
        Corpus.load(d, 300, 9, cache_dir=d)
    with pytest.raises(HslmError, match="is the --data folder"):
        Corpus.load([d / "a.txt", d], 300, 9, cache_dir=tmp_path / "d" / ".." / "d")
    Corpus.load(d, 300, 9, cache_dir=tmp_path / "cache")  # control: a folder of its own
    assert [p.name for p in d.iterdir()] == ["a.txt"]


def test_a_large_texts_first_piece_shows_its_reading_and_the_later_ones_do_not(tmp_path,
                                                                               monkeypatch):
    """The first piece of a text in pieces is read (1 GiB: seconds) before its merges are
    learned: a progress line says so, drawn in place on a terminal, and closed before the
    learning's line. The later pieces are read while others are encoded: nothing is
    drawn over the encoding's line then. Control: the reading's progress reaches past the
    first piece (the adapter's bound is what keeps it off the screen)."""
    import io
    import sys

    from hslm import data
    from hslm.textsource import TextSource

    class Tty(io.StringIO):
        def isatty(self):
            return True
    _in_pieces(monkeypatch)
    monkeypatch.setattr(data, "SHOW_FROM", 0)
    screen = Tty()
    monkeypatch.setattr(sys, "stderr", screen)
    (tmp_path / "t.txt").write_bytes(LARGE_TEXT_BYTES)
    seen = []
    update = data._FirstPieceProgress.update
    monkeypatch.setattr(data._FirstPieceProgress, "update",
                        lambda self, done: seen.append(done) or update(self, done))
    Corpus(TextSource([tmp_path / "t.txt"]), 300, 9, "t", cache_dir=tmp_path / "c")
    k = -(-len(LARGE_TEXT_BYTES) // 3000)
    lines = screen.getvalue().replace("\r", "\n").splitlines()
    reading = [i for i, ln in enumerate(lines) if ln.startswith(f"piece 1 of {k}: reading")]
    learning = [i for i, ln in enumerate(lines) if ln.startswith(f"piece 1 of {k}: learning")]
    assert reading and learning and max(reading) < min(learning), lines
    assert " in " in lines[max(reading)], lines  # (its closing line)
    assert max(seen) > 3000  # control: the later pieces' reading reported too
