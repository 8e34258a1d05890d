"""The token cache, texts made of several files, streaming checks, Ctrl-C."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hslm import bpe, textsource, token_cache
from hslm.data import Corpus
from hslm.errors import HslmError
from hslm.rng import Stream
from tests.helpers import ROOT, running

TEXT = ("def f(x):\n    return x * 2  # ünïcode\n\n" * 300
        + "class A:\n    pass\n" * 200)


def test_cached_tokens_are_the_same_and_are_used(tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    plain = Corpus.load(tmp_path / "t.txt", 300, 27)
    cached = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path / "c")
    assert np.array_equal(plain.tokens, cached.tokens)
    assert np.array_equal(plain.train, cached.train) and np.array_equal(plain.valid, cached.valid)
    assert plain.tokenizer.identity == cached.tokenizer.identity
    assert plain.text_sha256 == hashlib.sha256(TEXT.encode()).hexdigest()
    files = sorted(p.name for p in (tmp_path / "c").iterdir()
                   if p.name != token_cache.TEXT_SHA_MEMO)   # remembered once the file settles
    assert files == [f"bpe-{plain.text_sha256[:16]}-300.json",
                     f"tokens-{plain.text_sha256[:16]}-{plain.tokenizer.identity[:16]}.tok"]

    def no_bpe(*a, **k):
        raise AssertionError("the tokens should come from the cache")
    monkeypatch.setattr(bpe, "run", no_bpe)
    again = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path / "c")
    assert isinstance(again.tokens, np.memmap)
    assert np.array_equal(again.tokens, plain.tokens)
    assert again.tokenizer.identity == plain.tokenizer.identity
    rng = Stream.seeded("test", 3)
    assert np.array_equal(again.draw_windows(Stream.seeded("test", 3), 4, 27),
                          plain.draw_windows(rng, 4, 27))
    v = again.validation_windows(8, 27)
    assert v.dtype == np.int64 and np.array_equal(v, plain.validation_windows(8, 27))


def test_a_damaged_cache_is_not_used(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    good = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    path = token_cache.tokens_path(tmp_path, good.text_sha256, good.tokenizer.identity)
    expect = np.array(good.tokens)
    del good
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert token_cache.open_tokens(path, hashlib.sha256(TEXT.encode()).hexdigest(),
                                   "0" * 64, 300) is None
    again = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    assert np.array_equal(again.tokens, expect)
    path.write_bytes(path.read_bytes()[:200])  # truncated
    again = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    assert np.array_equal(again.tokens, expect)


def test_a_cache_rewritten_in_place_during_a_run_is_an_error_not_a_crash(tmp_path):
    """A token cache is memory-mapped and checked when opened; another program writing ids
    past the vocabulary into the file in place afterwards (not hslm's way: it writes a
    new file and renames it) had given the kernels ids past the embedding: a segmentation
    fault mid-run. Drawing windows now says so in one line. Control: the windows before."""
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    corpus = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    assert isinstance(corpus.tokens, np.memmap)
    before = corpus.draw_windows(Stream.seeded("test", 3), 4, 27)
    assert corpus.validation_windows(8, 27).max() < 300 and before.max() < 300
    path = token_cache.tokens_path(tmp_path, corpus.text_sha256, corpus.tokenizer.identity)
    other = np.memmap(path, dtype=corpus.tokens.dtype, mode="r+",
                      offset=path.stat().st_size - corpus.tokens.nbytes)
    other[:] = 299 + 7  # (the other program's ids)
    other.flush()
    for draw in (lambda: corpus.draw_windows(Stream.seeded("test", 3), 4, 27),
                 lambda: corpus.validation_windows(8, 27)):
        with pytest.raises(HslmError, match="the text's tokens changed during the run: id 306 "
                                            "is past the vocabulary's 300"):
            draw()


def test_a_nul_file_is_refused_whatever_the_cache_holds(tmp_path):
    """The same bytes as files [1,000 NULs, a text] (the first refused: all NULs) or as
    one file (5% NULs: a text with a few, accepted): once the one file's tokens were
    cached, the two files hit that cache, were not read, and trained. The hashing pass
    judges the files too. Control: the one file, again from the cache."""
    nul, text, both = tmp_path / "nul.txt", tmp_path / "text.txt", tmp_path / "both.txt"
    nul.write_bytes(b"\0" * 1000)
    text.write_text(TEXT, encoding="utf-8")
    both.write_bytes(nul.read_bytes() + b"\n\n" + text.read_bytes())
    cache = tmp_path / "cache"
    refused = "data file .*nul.txt is 100.0% NUL bytes"
    with pytest.raises(HslmError, match=refused):  # a miss: refused as its text is read
        Corpus.load([nul, text], 300, 27, cache_dir=cache)
    first = Corpus.load(both, 300, 27, cache_dir=cache)
    again = Corpus.load(both, 300, 27, cache_dir=cache)
    assert isinstance(again.tokens, np.memmap) and np.array_equal(again.tokens, first.tokens)
    with pytest.raises(HslmError, match=refused):  # a hit: the same verdict
        Corpus.load([nul, text], 300, 27, cache_dir=cache)


def test_several_files_and_folders_are_joined_by_a_blank_line(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    parts = [TEXT[:3000], TEXT[3000:5000], TEXT[5000:]]
    for name, p in zip(["b.txt", "a.txt", "c.txt"], [parts[1], parts[0], parts[2]]):
        (d / name).write_text(p, encoding="utf-8")
    joined = "\n\n".join(parts)
    one = tmp_path / "one.txt"
    one.write_text(joined, encoding="utf-8")
    ref = Corpus.load(one, 300, 27)
    for data in [d, [d / "a.txt", d / "b.txt", d / "c.txt"], (d,)]:
        c = Corpus.load(data, 300, 27)
        assert c.text_sha256 == ref.text_sha256 == hashlib.sha256(joined.encode()).hexdigest()
        assert np.array_equal(c.tokens, ref.tokens)


def test_non_utf8_names_the_file_and_offset_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(textsource, "CHUNK", 7)
    (tmp_path / "a.txt").write_text("hello", encoding="utf-8")
    bad = tmp_path / "b.txt"
    bad.write_bytes("ok é ok".encode() * 3 + b"\xff rest")
    with pytest.raises(HslmError, match=r"b.txt is not UTF-8 text \(byte 0xff at offset 24\)"):
        Corpus.load([tmp_path / "a.txt", bad], 300, 27)
    cut = tmp_path / "c.txt"
    cut.write_bytes(b"abcdef" + "é".encode()[:1])  # a sequence cut short at the end
    with pytest.raises(HslmError, match=r"c.txt is not UTF-8 text \(byte 0xc3 at offset 6\)"):
        Corpus.load(cut, 300, 27)
    # a multi-byte character split between two chunks is fine
    ok = tmp_path / "d.txt"
    ok.write_bytes(("abcdeé" * 200).encode())
    src = textsource.TextSource(ok)
    assert src.scan() == hashlib.sha256(ok.read_bytes()).hexdigest()
    assert np.array_equal(src.read_ids(np.uint16, 4),
                          np.frombuffer(ok.read_bytes(), np.uint8).astype(np.uint16) + 4)


def test_special_files_and_empty_folders_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(HslmError, match="has no files"):
        Corpus.load(tmp_path / "empty", 300, 27)
    if os.path.exists("/dev/zero"):
        with pytest.raises(HslmError, match="not a regular file"):
            Corpus.load("/dev/zero", 300, 27)


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated"),
                                           (signal.SIGHUP, 129, "hung up")])
def test_ctrl_c_while_learning_the_tokenizer_stops_at_once(tmp_path, sig, code, word):
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9)))
             for _ in range(3000)]
    text = " ".join(rng.choice(words, 30_000_000 // 6)) + "\n"
    (tmp_path / "big.txt").write_text(text)
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", "--data",
                          str(tmp_path / "big.txt"), "--out", str(tmp_path / "o"), "--steps", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    with running(p, timeout=600):
        while True:  # wait until learning has begun
            line = p.stderr.readline()
            assert line, "no progress line"
            if line.startswith("reading and checking the text"):
                break
        time.sleep(0.3)
        t0 = time.perf_counter()
        p.send_signal(sig)
        rc = p.wait(timeout=30)
        waited = time.perf_counter() - t0
        rest = p.stderr.read()
    assert rc == code, rest
    assert waited < 5, waited  # (about 0.5 s idle; learning this text takes far longer)
    assert "Traceback" not in rest and f"error: {word}" in rest
    assert not (tmp_path / "o").exists()  # the folder this run made is gone again


def varied_text(n_words=6000):
    rng = np.random.default_rng(7)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 8)))
             for _ in range(500)]
    return " ".join(words[i] for i in rng.integers(0, 500, n_words))


def test_a_damaged_or_foreign_remembered_tokenizer_is_learned_again(tmp_path):
    (tmp_path / "t.txt").write_text(varied_text())
    first = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "c")
    [remembered] = list((tmp_path / "c").glob("bpe-*.json"))
    for token in list((tmp_path / "c").glob("tokens-*")):
        token.unlink()
    obj = json.loads(remembered.read_text())
    obj["tokenizer"]["merges"] = [[5, 6]]  # valid JSON, other merges, identity kept
    remembered.write_text(json.dumps(obj))
    again = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "c")
    assert again.tokenizer.identity == first.tokenizer.identity
    remembered.write_text('{"version": "hslm-bpe-cache/1", "tokenizer": [')  # not JSON
    assert Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "c").tokenizer.identity \
        == first.tokenizer.identity


def test_a_cache_folder_that_cannot_be_written_is_a_warning(tmp_path, capfd):
    (tmp_path / "t.txt").write_text(varied_text())
    c = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=Path("/proc/hslm-not-writable"))
    assert len(c.tokens) > 0
    assert "going on without the token cache" in capfd.readouterr().err


def test_a_tokenizer_too_large_to_learn_is_refused_in_one_line(tmp_path):
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"vocab": 200000, "width": 27, "heads": 3, "head_width": 9,
                                 "mlp": 81, "blocks": 1, "window": 9, "vsa_dim": 108}))
    p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", "--model", str(model),
                        "--steps", "1", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("error: ") and "tokenizer of vocabulary 200,000" in p.stderr


def test_learning_says_the_merges_it_made(tmp_path, capsys):
    """A text that repeats no pair after a few merges: the line said the merges asked
    for ("469 merges" for a text of one letter, which allows 21), where the error that
    followed said 21. It says the merges made. Control: a text that allows all the merges
    asked reads as before."""
    import random
    one_letter = tmp_path / "a.txt"
    one_letter.write_bytes(b"a" * textsource.SHOW_FROM)
    varied = tmp_path / "v.txt"
    varied.write_text("".join(random.Random(0).choices("abcdefghij ", k=textsource.SHOW_FROM)))
    lines = []
    for path in (one_letter, varied):
        try:
            Corpus.load(path, 300, 9)
        except HslmError as e:
            assert "too short" in str(e) and path == one_letter
        lines += [x for x in capsys.readouterr().err.splitlines()
                  if x.startswith("learning the tokenizer: ")]
    assert len(lines) == 2, lines
    made = int(lines[0].split(": ")[1].split()[0])
    assert 0 < made < 40 and lines[0].endswith(" MB -> 2 tokens)"), lines[0]
    assert lines[1].startswith("learning the tokenizer: 40 merges in ")


def test_a_flipped_byte_or_an_old_format_token_file_is_rewritten(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    good = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    path = token_cache.tokens_path(tmp_path, good.text_sha256, good.tokenizer.identity)
    original = path.read_bytes()
    del good
    sha = hashlib.sha256(TEXT.encode()).hexdigest()
    identity = original[56:88].hex()
    assert token_cache.open_tokens(path, sha, identity, 300) is not None
    for where in [token_cache.HEADER, (token_cache.HEADER + len(original)) // 2, len(original) - 1]:
        for bit in (1, 0x80):
            raw = bytearray(original)
            raw[where] ^= bit
            path.write_bytes(bytes(raw))
            assert token_cache.open_tokens(path, sha, identity, 300) is None, (where, bit)
            Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
            assert path.read_bytes() == original   # written again, whole
    old = bytearray(original)
    old[:8] = b"HSLMTOK1"                          # the previous format: ignored, rewritten
    path.write_bytes(bytes(old))
    assert token_cache.open_tokens(path, sha, identity, 300) is None
    Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    assert path.read_bytes() == original


def test_a_token_file_with_an_id_past_the_vocabulary_is_a_miss(tmp_path):
    """The checksum catches damage, not a forged file: a token file with a valid header
    and checksum but an id past the vocabulary had been used, and the kernels indexed the
    embedding with it (hslm eval: a segmentation fault). It is a miss: the text encoded
    again and the file rewritten. Control: the file as written is used."""
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    good = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    sha, identity = good.text_sha256, good.tokenizer.identity
    path = token_cache.tokens_path(tmp_path, sha, identity)
    tokens = np.array(good.tokens)
    del good
    assert token_cache.open_tokens(path, sha, identity, 300) is not None
    forged = tokens.copy()
    forged[-1] = 300
    token_cache.write_tokens(path, forged, sha, identity)
    assert token_cache.open_tokens(path, sha, identity, 300) is None
    again = Corpus.load(tmp_path / "t.txt", 300, 27, cache_dir=tmp_path)
    assert np.array_equal(again.tokens, tokens)
    del again
    assert np.array_equal(token_cache.open_tokens(path, sha, identity, 300), tokens)


def test_the_checksum_sees_every_byte_and_the_length():
    base = np.arange(1000, dtype=np.uint16)
    seen = {token_cache.checksum(base)}
    for n in (999, 998, 996, 960):                   # tails of every length, zeros appended
        seen.add(token_cache.checksum(base[:n]))
    seen.add(token_cache.checksum(np.concatenate([base, np.zeros(4, np.uint16)])))
    for i in (0, 7, 31, 32, 500, 999):
        flipped = base.copy()
        flipped[i] ^= 1 << (i % 16)
        seen.add(token_cache.checksum(flipped))
    assert len(seen) == 12 and all(len(c) == 32 for c in seen)


def test_the_checksum_fed_in_parts_is_the_checksum_of_the_whole():
    """A large text's token file is checksummed as its pieces' tokens come (Checksum):
    parts of any length, 64-byte blocks split across them, give the whole's checksum,
    and `each` sees every element once, in order. The control: a part left out."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 65535, 50_000, dtype=np.uint16)
    want = token_cache.checksum(base)
    for cuts in ([0, 50_000], [0, 1, 32, 33, 50_000], [0, 31, 31, 12_345, 49_999, 50_000],
                 [0] + sorted(rng.integers(0, 50_000, 9).tolist()) + [50_000]):
        c, seen = token_cache.Checksum(), []
        for a, b in zip(cuts, cuts[1:]):
            c.update(base[a:b], seen.append)
        assert c.digest() == want, cuts
        assert np.array_equal(np.concatenate(seen), base)
    c = token_cache.Checksum()
    c.update(base[:100])
    c.update(base[101:])
    assert c.digest() != want


def test_a_large_text_whose_cache_cannot_be_written_is_one_line_saying_why(tmp_path,
                                                                          monkeypatch):
    """A small text goes on without its token cache (a warning); a text of 4 GiB or more
    is trained from its token file, so a cache that cannot be written is an error that
    says so, before the first piece is learned from (as is a temporary file that cannot
    be made, without a cache folder), and leaves nothing."""
    import tempfile

    from hslm import data
    from hslm.textsource import TextSource
    monkeypatch.setattr(data, "LARGE_TEXT", 5000)
    monkeypatch.setattr(data, "PIECE_BYTES", 3000)
    (tmp_path / "t.txt").write_text(varied_text())
    with monkeypatch.context() as m:  # (judged before the first piece is learned from)
        m.setattr(bpe, "run", lambda *a, **k: pytest.fail("learned before the refusal"))
        with pytest.raises(HslmError, match="cannot write the token cache in /proc/hslm-not-"
                                            "writable: .*; a text of .* bytes, tokenized in "
                                            "pieces, is trained from its token cache: give a "
                                            "--cache-dir where it can be written"):
            Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=Path("/proc/hslm-not-writable"))
        (tmp_path / "a-file").write_text("")
        with pytest.raises(HslmError, match="cannot write the token cache in .*a-file: not a "
                                            "folder; a text of"):
            Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "a-file")
        with pytest.raises(HslmError, match="cannot write the text's tokens to a temporary "
                                            "file in /proc/hslm-no-tmp: "):
            m.setattr(tempfile, "tempdir", "/proc/hslm-no-tmp")  # (no cache folder)
            Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=None)
    c = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "c")  # the control
    assert isinstance(c.tokens, np.memmap)
    # a run that fails removes the folders it made for the cache, and only those
    (tmp_path / "kept").mkdir()
    with pytest.raises(HslmError, match="the data changed"):
        data.corpus_tokens(TextSource([tmp_path / "t.txt"]), "0" * 64, 300,
                           cache_dir=tmp_path / "kept" / "a" / "b")
    assert [p.name for p in tmp_path.joinpath("kept").iterdir()] == []


def test_a_large_text_whose_cache_fills_the_disk_stops_its_encoding_threads(tmp_path,
                                                                          monkeypatch):
    """The pieces after the first are encoded several at once (here 3 threads); a write
    that fails part-way (a full disk) stops them and ends their threads before the error
    reaches the user, and the tokens come in order when it does not (the control)."""
    import threading

    from hslm import data, precompile
    monkeypatch.setattr(data, "LARGE_TEXT", 5000)
    monkeypatch.setattr(data, "PIECE_BYTES", 3000)
    monkeypatch.setattr(precompile, "available_cores", lambda: 3)
    (tmp_path / "t.txt").write_text(varied_text())
    whole = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "c")
    real = token_cache._write

    def full_disk(path, parts, finish=None):
        for i, _ in enumerate(parts):
            if i == 3:
                raise HslmError(f"cannot write the token cache {path}: No space left on device")
    monkeypatch.setattr(token_cache, "_write", full_disk)
    with pytest.raises(HslmError, match="No space left on device; a text of") as raised:
        Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "d")
    # (while the error is held, as the CLI holds it to print it: the threads were stopped
    # by the write's failure, not by the error's frames being freed)
    assert not [t for t in threading.enumerate() if t.name.startswith("hslm-bpe")], raised
    monkeypatch.setattr(token_cache, "_write", real)
    again = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "e")
    assert np.array_equal(again.tokens, whole.tokens) and len(whole.tokens) > 0


def test_a_large_text_whose_tokens_cannot_fit_the_disk_is_refused_after_its_first_piece(
        tmp_path, monkeypatch):
    """The first piece's tokens say how large the token file will be: a disk without
    room for it is refused then, not hours later at the piece that fills it (in the cache
    folder, and in the temporary folder without one). The control: room enough."""
    import os
    from collections import namedtuple

    from hslm import data
    monkeypatch.setattr(data, "LARGE_TEXT", 5000)
    monkeypatch.setattr(data, "PIECE_BYTES", 3000)
    (tmp_path / "t.txt").write_text(varied_text())
    fs = namedtuple("fs", "f_bavail f_frsize")
    for blocks, cache in [(2, tmp_path / "c"), (2, None), (1000, tmp_path / "d")]:
        monkeypatch.setattr(os, "statvfs", lambda path: fs(blocks, 4096))
        monkeypatch.setattr(os, "fstatvfs", lambda fd: fs(blocks, 4096))
        if blocks == 2:
            with pytest.raises(HslmError, match=r"the text's token file needs about 0.0 GiB "
                               r"\(as its first piece's tokens go\), but .* has 0.0 GiB "
                               "free; a text of"):
                Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=cache)
        else:
            assert isinstance(Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=cache).tokens,
                              np.memmap)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("cores", [1, 2])
def test_one_piece_at_a_time_reads_none_ahead(tmp_path, monkeypatch, cores):
    """Where one piece is encoded at a time (memory for one, or an MPI rank), the next is
    read only once the last is written: reading it ahead had held a third piece's ids
    beyond the memory judged. With two at a time, one is read ahead (the control)."""
    from hslm import data, precompile, textsource
    monkeypatch.setattr(data, "LARGE_TEXT", 5000)
    monkeypatch.setattr(data, "PIECE_BYTES", 3000)
    monkeypatch.setattr(precompile, "available_cores", lambda: cores)
    (tmp_path / "t.txt").write_text(varied_text(2000))
    log, read_pieces = [], textsource.TextSource.read_pieces

    def logged_reads(*a, **k):
        for ids in read_pieces(*a, **k):
            log.append("read")
            yield ids

    def logged_writes(path, parts, finish=None):
        for _ in parts if Path(path).suffix == ".tok" else ():
            log.append("written")
    monkeypatch.setattr(textsource.TextSource, "read_pieces", logged_reads)
    monkeypatch.setattr(token_cache, "_write", logged_writes)
    with pytest.raises(HslmError, match="cannot be read back"):  # (nothing was written)
        Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "c")
    pieces = log.count("read")
    assert pieces > 3 and log.count("written") == pieces + 1  # (the header's room first)
    reads_in_a_row = max(len(run.split()) for run in " ".join(log).split("written"))
    assert reads_in_a_row == (1 if cores == 1 else 3), log  # (3: two encoded, one read)


def test_the_text_sha256_is_remembered_by_stat_and_rehashed_when_it_changes(tmp_path,
                                                                             monkeypatch):
    from hslm import data
    monkeypatch.setattr(data, "SETTLE_NS", 0)   # files just written count as settled
    monkeypatch.delenv(data.REHASH_ENV, raising=False)
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    first = Corpus.load(f, 300, 27, cache_dir=tmp_path / "c")
    assert (tmp_path / "c" / token_cache.TEXT_SHA_MEMO).exists()
    scans = []
    real_scan = textsource.TextSource.scan
    monkeypatch.setattr(textsource.TextSource, "scan",
                        lambda self, progress=None, utf8=False: scans.append(1)
                        or real_scan(self, progress, utf8))
    again = Corpus.load(f, 300, 27, cache_dir=tmp_path / "c")
    assert scans == [] and again.text_sha256 == first.text_sha256
    monkeypatch.setenv(data.REHASH_ENV, "1")                  # forced: hashed in full
    assert Corpus.load(f, 300, 27, cache_dir=tmp_path / "c").text_sha256 == first.text_sha256
    assert scans == [1]
    monkeypatch.delenv(data.REHASH_ENV)
    changed = TEXT.replace("return", "RETURN")                 # the same size, other bytes
    assert len(changed.encode()) == len(TEXT.encode())
    st = f.stat()
    f.write_text(changed, encoding="utf-8")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = Corpus.load(f, 300, 27, cache_dir=tmp_path / "c")
    assert scans == [1, 1] and third.text_sha256 == hashlib.sha256(changed.encode()).hexdigest()
    with pytest.raises(HslmError, match="differs from the one the checkpoint was trained on; "
                       "pass the same --data$"):
        Corpus.load(f, 300, 27, cache_dir=tmp_path / "c", expect_sha256=first.text_sha256)


def test_a_text_changed_just_now_is_not_remembered(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")       # mtime now: within SETTLE_NS of the hashing
    Corpus.load(f, 300, 27, cache_dir=tmp_path / "c")
    assert not (tmp_path / "c" / token_cache.TEXT_SHA_MEMO).exists()
    (tmp_path / "c" / token_cache.TEXT_SHA_MEMO).write_text("{not json")   # damaged: ignored
    assert Corpus.load(f, 300, 27, cache_dir=tmp_path / "c").text_sha256 \
        == hashlib.sha256(TEXT.encode()).hexdigest()


def test_a_remembered_text_sha256_that_is_not_one_is_ignored(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    key = textsource.TextSource(f).stat_key()
    token_cache.remember_text_sha256(tmp_path / "c", key, "zz" * 32)   # not hex
    assert token_cache.recall_text_sha256(tmp_path / "c", key) is None
    c = Corpus.load(f, 300, 27, cache_dir=tmp_path / "c")
    assert c.text_sha256 == hashlib.sha256(TEXT.encode()).hexdigest()


def test_a_damaged_remembered_text_sha256_is_a_miss_not_another_texts_name(tmp_path,
                                                                           monkeypatch):
    """One character changed in text-sha256.json (a hex digit of the sha256): the run
    recorded that false sha256 as its text's and cached its tokens under it. Each entry
    now carries its own checksum: damaged, it is a miss, and the text is hashed."""
    from hslm import data
    monkeypatch.setattr(data, "SETTLE_NS", 0)
    monkeypatch.delenv(data.REHASH_ENV, raising=False)
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    true = hashlib.sha256(TEXT.encode()).hexdigest()
    assert Corpus.load(f, 300, 27, cache_dir=tmp_path / "c").text_sha256 == true
    memo = tmp_path / "c" / token_cache.TEXT_SHA_MEMO
    good = memo.read_text()
    key = textsource.TextSource(f).stat_key()
    assert token_cache.recall_text_sha256(tmp_path / "c", key) == true
    flipped = "f" if true[0] != "f" else "e"
    memo.write_text(good.replace(f'"sha256":"{true}', f'"sha256":"{flipped}{true[1:]}'))
    assert memo.read_text() != good
    assert token_cache.recall_text_sha256(tmp_path / "c", key) is None
    assert Corpus.load(f, 300, 27, cache_dir=tmp_path / "c").text_sha256 == true
    # the control: the same damage with the entry's checksum made to match is believed
    obj = json.loads(memo.read_text())
    e = obj["entries"][0]
    e["sha256"] = flipped + true[1:]
    e["check"] = token_cache.memo_check(e["files"], e["sha256"])
    memo.write_text(json.dumps(obj))
    assert token_cache.recall_text_sha256(tmp_path / "c", key) == flipped + true[1:]


def test_a_text_rewritten_between_its_hash_and_its_reading_is_refused(tmp_path, monkeypatch):
    """The text is hashed, then read again to be tokenized: a file rewritten in between at
    the same size was trained on under the first text's sha256. The bytes read are now
    hashed too and must be the ones named."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    other = TEXT.replace("return", "RETURN")
    real_scan = textsource.TextSource.scan

    def scan_then_rewrite(self, progress=None, utf8=False):
        sha = real_scan(self, progress, utf8)
        f.write_text(other, encoding="utf-8")  # after the hash, before the tokenizer reads
        return sha

    monkeypatch.setattr(textsource.TextSource, "scan", scan_then_rewrite)
    with pytest.raises(HslmError, match="the data changed while it was read"):
        Corpus.load(f, 300, 27)
    src = textsource.TextSource(f)  # the check itself, and its control
    assert src.read_ids(np.uint16, 4, expect_sha256=hashlib.sha256(other.encode()).hexdigest()
                        ).size == len(other.encode())
    with pytest.raises(HslmError, match="the data changed while it was read"):
        src.read_ids(np.uint16, 4, expect_sha256=hashlib.sha256(TEXT.encode()).hexdigest())


def test_a_remembered_sha256_of_other_bytes_is_forgotten_and_the_text_hashed_again(tmp_path,
                                                                                   monkeypatch):
    """A file rewritten with its stat key kept (forged timestamps) keeps its remembered
    sha256, which the bytes read to tokenize it no longer match: that refused every run
    from then on ("the data changed while it was read"). The entry is now forgotten and
    the text hashed in full, once."""
    from hslm import data
    monkeypatch.delenv(data.REHASH_ENV, raising=False)
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    key = textsource.TextSource(f).stat_key()
    stale = hashlib.sha256(b"the text as it was").hexdigest()
    token_cache.remember_text_sha256(tmp_path / "c", key, stale)
    assert token_cache.recall_text_sha256(tmp_path / "c", key) == stale
    c = Corpus.load(f, 300, 27, cache_dir=tmp_path / "c")
    assert c.text_sha256 == hashlib.sha256(TEXT.encode()).hexdigest()
    assert token_cache.recall_text_sha256(tmp_path / "c", key) != stale
    # the control: neither forgotten nor hashed again, the stale entry refuses the run
    token_cache.remember_text_sha256(tmp_path / "c2", key, stale)
    real_hash = data.hash_text
    monkeypatch.setattr(data, "hash_text", lambda src, cache_dir=None, rehash=False:
                        real_hash(src, cache_dir, False))
    monkeypatch.setattr(token_cache, "forget_text_sha256", lambda folder, key: None)
    with pytest.raises(HslmError, match="the data changed while it was read"):
        Corpus.load(f, 300, 27, cache_dir=tmp_path / "c2")


def test_a_resume_whose_remembered_sha256_is_of_other_bytes_hashes_the_text_again(
        tmp_path, monkeypatch):
    """The same on resume, where the text's sha256 must be the checkpoint's: a remembered
    sha256 of other bytes (the file rewritten with its stat key kept) had refused the resume
    at once ("the training text ... differs"), the text not read. It is forgotten and the
    text hashed in full, once. Control: a text that does differ is refused, hashed once."""
    from hslm import data
    monkeypatch.delenv(data.REHASH_ENV, raising=False)
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    real = hashlib.sha256(TEXT.encode()).hexdigest()
    key = textsource.TextSource(f).stat_key()
    stale = hashlib.sha256(b"the text as it was").hexdigest()
    token_cache.remember_text_sha256(tmp_path / "c", key, stale)
    c = Corpus.load(f, 300, 27, cache_dir=tmp_path / "c", expect_sha256=real)
    assert c.text_sha256 == real and token_cache.recall_text_sha256(tmp_path / "c", key) != stale
    scans = []
    real_scan = textsource.TextSource.scan
    monkeypatch.setattr(textsource.TextSource, "scan",
                        lambda self, ph, utf8=False: scans.append(1) or real_scan(self, ph, utf8))
    with pytest.raises(HslmError, match="differs from the one the checkpoint was trained on"):
        Corpus.load(f, 300, 27, cache_dir=tmp_path / "c3", expect_sha256=stale)
    assert len(scans) == 1


def test_the_checksum_compiles_once_for_every_kind_of_input():
    """checksum hands its kernel read-only views, so one compiled signature serves a memory-
    mapped (read-only) token file, a writable array being written and the zero-padded tail
    (a first run compiled it twice before). The control: to Numba a read-only array is
    another type, another compile."""
    from numba import typeof

    from hslm.token_cache import _lanes, checksum
    writable = np.arange(1000, dtype=np.uint16)
    read_only = writable.copy()
    read_only.flags.writeable = False
    assert typeof(writable) != typeof(read_only)
    assert checksum(writable) == checksum(read_only)
    assert len(_lanes.signatures) == 1, _lanes.signatures


def test_a_fifo_or_a_device_under_a_cache_files_name_is_a_miss(tmp_path):
    """A shared cache folder (HSLM_CACHE_DIR=/tmp): a FIFO named text-sha256.json hung
    the run forever, and a link to /dev/zero under a cache file's name filled memory.
    Each is a miss now; the same names as regular files are read (the control)."""
    import threading
    sha = hashlib.sha256(b"x").hexdigest()
    fifo_dir, dev_dir = tmp_path / "fifo", tmp_path / "dev"
    for d in (fifo_dir, dev_dir):
        d.mkdir()
    names = [token_cache.TEXT_SHA_MEMO, "bpe.json", "tokens.tok"]
    for n in names:
        os.mkfifo(fifo_dir / n)
        os.symlink("/dev/zero", dev_dir / n)
    results = []

    def look(d):
        results.append((token_cache._memo_entries(d),
                        token_cache.read_tokenizer(d / "bpe.json", sha),
                        token_cache.open_tokens(d / "tokens.tok", sha, sha, 300)))

    for d in (fifo_dir, dev_dir):
        t = threading.Thread(target=look, args=(d,), daemon=True)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), f"hung on {d}"
    assert results == [([], None, None)] * 2
    token_cache.remember_text_sha256(tmp_path, [["a", 1]], sha)  # the control
    assert token_cache.recall_text_sha256(tmp_path, [["a", 1]]) == sha


def test_a_cache_folder_whose_files_cannot_be_mapped_is_a_warning(tmp_path, monkeypatch,
                                                                   capsys):
    """A --cache-dir on a file system that refuses to memory-map (some FUSE mounts:
    ENODEV) had failed every run with `error: No such device`, naming no file, its
    tokens cached and then not read back. It is now a warning, and the run goes on with
    the tokens it made, the same ones. Control: mapped, they are a memmap."""
    import errno
    (tmp_path / "t.txt").write_text(varied_text())
    mapped = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "ok")
    memmap = np.memmap  # (numpy's own, patched below: token_cache.np is numpy)
    assert isinstance(mapped.tokens, memmap)

    def refused(*args, **kwargs):
        raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
    monkeypatch.setattr(token_cache.np, "memmap", refused)
    capsys.readouterr()
    for _ in range(2):  # (and again, with its cache file there)
        c = Corpus.load(tmp_path / "t.txt", 300, 9, cache_dir=tmp_path / "fuse")
        assert not isinstance(c.tokens, memmap)
        assert np.array_equal(c.tokens, mapped.tokens)
        err = capsys.readouterr().err
        assert "warning: the token cache " in err and "cannot be read back; going on without it" \
            in err, err
    # hslm info of such a file reads it instead (it had said "error: No such device")
    from hslm.inspect import describe_tokens
    [tokens] = (tmp_path / "fuse").glob("tokens-*.tok")
    lines = describe_tokens(tokens)
    assert f"tokens    {len(mapped.tokens):,} of 2 bytes" in lines and "checksum  ok" in lines


def _own_temporary_folder(tmp_path, monkeypatch):
    """The locks' files in the test's folder, not the machine's temporary folder (one
    left by a failing test would stay there)."""
    import tempfile
    (tmp_path / "tmp").mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def test_a_process_missing_a_cache_another_is_writing_waits_and_reads_it(tmp_path, monkeypatch,
                                                                           capsys):
    """Processes that miss the same text's token cache at once (runs started together, an
    MPI run's ranks) make the tokens one at a time: one that finds another holding the
    text's TokenizingLock says for which process it waits, and then reads the cache that
    process wrote rather than making the tokens again (with the memory and cores that
    takes). The lock's file is gone once it is let go. Control: where the lock cannot be
    held (a file system without flock), the process makes the tokens itself."""
    import threading

    from hslm import data, userlock
    from hslm.textsource import TextSource
    _own_temporary_folder(tmp_path, monkeypatch)
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    sha = hashlib.sha256(TEXT.encode()).hexdigest()
    cache = tmp_path / "cache"
    made, calls = data._made_tokens, []
    monkeypatch.setattr(data, "_made_tokens", lambda *a: calls.append(a) or made(*a))

    def in_a_thread():  # (the lock is a flock: another open file of this process's waits too)
        got = {}
        t = threading.Thread(target=lambda: got.update(
            out=data.corpus_tokens(TextSource([tmp_path / "t.txt"]), sha, 300,
                                   cache_dir=cache)))
        t.start()
        return t, got

    other = token_cache.TokenizingLock.for_text(cache, sha, 300)
    assert other.take() and other.held
    try:
        other.note("4321")
        t, got = in_a_thread()
        time.sleep(1.6)
        assert t.is_alive() and not calls  # waiting, nothing made
        want = made(TextSource([tmp_path / "t.txt"]), sha, 300, None, cache, None, 1)  # its work
    finally:
        other.release()
    t.join(60)
    assert not calls, "the tokens were made again"
    tokenizer, tokens = got["out"]
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, want[1])
    assert tokenizer.identity == want[0].identity
    err = capsys.readouterr().err
    assert "waiting for another hslm run (process 4321), which is tokenizing this text " \
           f"into the token cache {cache}" in err, err
    assert not other.path.exists()
    # control: a lock that cannot be held; the tokens are made here, the other holding it
    for f in cache.iterdir():
        f.unlink()
    assert other.take() and other.held
    try:
        monkeypatch.setattr(userlock.UserLock, "take", lambda self: True)
        t, got = in_a_thread()
        t.join(60)
    finally:
        other.release()
    assert len(calls) == 1 and np.array_equal(got["out"][1], want[1])
    # the cache written between the first look and the lock taken at once: read, not made
    for f in cache.iterdir():
        f.unlink()
    monkeypatch.undo()
    _own_temporary_folder(tmp_path / "again", monkeypatch)
    monkeypatch.setattr(data, "_made_tokens", lambda *a: calls.append(a) or made(*a))
    take = userlock.UserLock.take
    monkeypatch.setattr(userlock.UserLock, "take", lambda self: made(
        TextSource([tmp_path / "t.txt"]), sha, 300, None, cache, None, 1) and take(self))
    t, got = in_a_thread()
    t.join(60)
    assert len(calls) == 1 and np.array_equal(got["out"][1], want[1])
    assert isinstance(got["out"][1], np.memmap)


@pytest.mark.parametrize("case", ["the cache cannot be written", "another tokenizer's",
                                  "the control"])
def test_a_process_does_not_wait_for_tokens_it_would_not_read(tmp_path, monkeypatch, capsys,
                                                                case):
    """No process waits for one whose tokens it could not read: where the cache folder
    cannot be written (here a file; each process makes its own tokens at once, as before),
    or where the other makes another tokenizer's tokens (a run resumed, whose tokenizer is
    given, writes no merges for a new run to read). Control: the same holder, learning
    into a folder that can be written, is waited for."""
    import threading

    from hslm import data
    from hslm.textsource import TextSource
    _own_temporary_folder(tmp_path, monkeypatch)
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    sha = hashlib.sha256(TEXT.encode()).hexdigest()
    cache = tmp_path / "cache"
    if case == "the cache cannot be written":
        cache.write_text("a file")
    other = token_cache.TokenizingLock.for_text(
        cache, sha, 300, "0" * 64 if case == "another tokenizer's" else "")
    got = {}
    assert other.take() and other.held
    try:
        t = threading.Thread(target=lambda: got.update(out=data.corpus_tokens(
            TextSource([tmp_path / "t.txt"]), sha, 300, cache_dir=cache)))
        t.start()
        t.join(1.5 if case == "the control" else 60)  # (done while the other holds it)
        assert t.is_alive() == (case == "the control")
    finally:
        other.release()
    t.join(60)
    assert got["out"][1].shape[0] > 0
    assert ("waiting for" in capsys.readouterr().err) == (case == "the control")


@pytest.mark.parametrize("case", ["rank 0 came and went", "rank 0 holds it", "a dead holder",
                                  "rank 0 never came"])
def test_mpi_ranks_beside_rank_0_wait_for_its_tokens_and_never_write(tmp_path, monkeypatch,
                                                                       case):
    """Under MPI rank 0 alone writes the token cache; the other ranks of its machine that
    miss it wait for rank 0 and read the tokens it wrote. They never hold the text's
    lock, and judge whether rank 0 does by the lock itself, not by the note in its file
    (a holder killed leaves that), and without taking it (waiters that had taken it for
    an instant to see had seen each other as rank 0). Rank 0 may have come and gone
    before they look (a short text): the cache is looked at as they wait. A rank 0 that
    never comes (it failed) is waited for RANK_0_ARRIVES seconds, and the rank then
    makes its own tokens and writes none."""
    import threading

    from hslm import data, distributed
    from hslm.textsource import TextSource
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    sha = hashlib.sha256(TEXT.encode()).hexdigest()
    cache = tmp_path / "cache"
    made, calls = data._made_tokens, []
    monkeypatch.setattr(data, "_made_tokens", lambda *a: calls.append(a[-1]) or made(*a))
    monkeypatch.setattr(distributed, "is_writer", lambda: False)  # (an MPI rank but 0)
    monkeypatch.setattr(distributed, "current", lambda: "a World")
    # (rank 0 coming and going is seen long before the wait for it ends)
    monkeypatch.setattr(data, "RANK_0_ARRIVES", 30.0 if case.endswith("went") else 1.5)
    _own_temporary_folder(tmp_path, monkeypatch)
    rank_0 = token_cache.TokenizingLock.for_text(cache, sha, 300)
    got = {}
    try:
        if case == "a dead holder":
            rank_0.path.write_text("4321")  # its note, and no flock
        if case == "rank 0 holds it":
            assert rank_0.take() and rank_0.held
            rank_0.note("4321")
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: got.update(out=data.corpus_tokens(
            TextSource([tmp_path / "t.txt"]), sha, 300, cache_dir=cache)))
        t.start()
        if case in ("rank 0 came and went", "rank 0 holds it"):
            time.sleep(0.5 if case.endswith("went") else 2.5)
            assert t.is_alive() and not calls  # (2.5 s: past RANK_0_ARRIVES, while it holds)
            made(TextSource([tmp_path / "t.txt"]), sha, 300, None, cache, None, 1)
            if case.endswith("went"):
                t.join(20)
                assert not t.is_alive()  # found as it waited
    finally:
        rank_0.release()
    t.join(60)
    took = time.monotonic() - t0
    tokens = got["out"][1]
    if case in ("a dead holder", "rank 0 never came"):
        assert calls == [1] and not isinstance(tokens, np.memmap)  # its own, one core
        assert 1.5 <= took < 20 and not cache.exists()  # (written by none)
    else:
        assert not calls and isinstance(tokens, np.memmap)
    # (a dead holder's file stays for the next holder to remove: a waiter removes none)
    assert rank_0.path.exists() == (case == "a dead holder")


def test_whether_a_lock_is_held_is_told_without_taking_it(tmp_path, monkeypatch):
    """held_elsewhere: processes asking at once do not see each other (a shared flock),
    and make or remove no file; a holder is seen. None where flock fails there.
    Control: take() as the test, while another asks, fails (what waiters had done)."""
    import fcntl

    from hslm import userlock
    path = tmp_path / "t.lock"
    asking = userlock.UserLock(path, removed=True)
    assert asking.held_elsewhere() is False and not path.exists()
    holder = userlock.UserLock(path, removed=True)
    assert holder.take() and holder.held
    assert asking.held_elsewhere() is True
    holder.release()
    assert asking.held_elsewhere() is False and not path.exists()
    path.write_text("")  # (a file there, and another process asking this instant)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    assert asking.held_elsewhere() is False
    assert not userlock.UserLock(path, removed=True).take()  # control
    os.close(fd)
    monkeypatch.setattr(fcntl, "flock", lambda *a: (_ for _ in ()).throw(OSError(37, "no")))
    assert userlock.UserLock(path, removed=True).held_elsewhere() is None


def test_a_lock_file_planted_as_a_hard_link_is_not_written(tmp_path):
    """The temporary folder's lock names are known to every user: one planted as a hard
    link to a file had had that file truncated and given the holder's pid. Such a lock is
    not used (the process goes on alone, holding nothing). Control: the file alone."""
    from hslm import userlock
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.link(victim, tmp_path / "planted.lock")
    lock = userlock.UserLock(tmp_path / "planted.lock", removed=True)
    assert lock.take() and not lock.held
    lock.note("4321")
    lock.release()
    assert victim.read_text() == "precious\n"
    os.unlink(tmp_path / "planted.lock")
    lock = userlock.UserLock(victim, removed=True)  # (control: one name, its own)
    assert lock.take() and lock.held
    lock.note("4321")
    assert victim.read_text() == "4321"
    lock.release()


def test_a_removed_lock_is_never_held_through_a_file_its_path_no_longer_names(tmp_path,
                                                                              monkeypatch):
    """A lock whose holder deletes its file as it lets go (TokenizingLock): a process that
    had opened that file before it was deleted gets its flock, but on a file nobody else
    sees, so take() opens the path again. Control: a lock that does not expect its file
    deleted (CompileLock's kind, which keeps it) takes the flock it gets."""
    from hslm import userlock
    for checks in (True, False):
        path = tmp_path / f"l{checks}.lock"
        holder = userlock.UserLock(path, removed=True)
        assert holder.take() and holder.held
        assert not userlock.UserLock(path, removed=True).take()  # held by the other
        stale = os.open(path, os.O_RDWR)  # opened before the holder deleted the file
        holder.release()
        assert not path.exists()
        opened = [stale]
        real = userlock.own_file
        monkeypatch.setattr(userlock, "own_file",
                            lambda p, create=True: opened.pop() if opened else real(p, create))
        lock = userlock.UserLock(path, removed=checks)
        assert lock.take() and lock.held
        named = path.exists() and os.fstat(lock.file.fileno()).st_ino == os.stat(path).st_ino
        assert named == checks, "the lock is held through a file the path does not name"
        if checks:
            assert not userlock.UserLock(path, removed=True).take()  # truly held
        lock.release()
        monkeypatch.undo()
