"""Text, the byte-level BPE tokenizer and the train/validation split (spec section 10).

Ids 0-3 are PAD, BOS, EOS, UNK; 4-259 the 256 bytes; 260.. the merges, learned
from the run's text over the whole byte stream (no pre-splitting into words):
each merge joins the most frequent adjacent pair, ties going to the smaller
(first id, second id), while some pair occurs at least twice. Encoding a new
text applies the merges in the order they were learned, so encoding the
training text gives exactly the sequence the training produced.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from pathlib import Path

import numpy as np
from numba import njit

from .errors import HslmError, read_bytes

N_SPECIAL = 4
BYTE0 = N_SPECIAL
FIRST_MERGE = N_SPECIAL + 256
VALID_SHARE = 0.1
MAX_VOCAB = 1 << 20
MAX_PIPE_TEXT = 256 << 20  # bytes read from something that is not a regular file


# The built-in corpus: one fixed text shipped with the package, the same on every Python
# (hslm/corpus/README.md says what it is and under which licence).
BUILTIN_NAME = "python-3.11.7-pydoc-topics"
BUILTIN_FILE = Path(__file__).parent / "corpus" / f"{BUILTIN_NAME}.txt.gz"
BUILTIN_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
BUILTIN_SOURCE = f"built-in {BUILTIN_NAME}"


def builtin_text() -> str:
    """The pydoc topics text of CPython 3.11.7 (sorted keys, joined by blank lines),
    shipped with hslm and checked against its sha256."""
    try:
        raw = gzip.decompress(BUILTIN_FILE.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        raise HslmError(f"the built-in corpus {BUILTIN_FILE} cannot be read: {e}") from None
    if hashlib.sha256(raw).hexdigest() != BUILTIN_SHA256:
        raise HslmError(f"the built-in corpus {BUILTIN_FILE} is damaged (checksum mismatch); "
                        "reinstall hslm")
    return raw.decode("utf-8")


@njit(cache=True)
def _apply_merge(seq, n, a, b, new):
    """Replace non-overlapping (a, b) left to right; returns the new length."""
    w = 0
    i = 0
    while i < n:
        if i + 1 < n and seq[i] == a and seq[i + 1] == b:
            seq[w] = new
            i += 2
        else:
            seq[w] = seq[i]
            i += 1
        w += 1
    return w


@njit(cache=True)
def _learn_merges(seq, vocab, n_merges, merges):
    """Learn up to n_merges merges in place on seq; returns (count, final length)."""
    n = seq.shape[0]
    counts = np.zeros((vocab, vocab), np.int64)
    m = 0
    while m < n_merges:
        counts[:, :] = 0
        for i in range(n - 1):
            counts[seq[i], seq[i + 1]] += 1
        best = 1
        ba = -1
        bb = -1
        for a in range(vocab):  # row-major: the first maximum is the smallest pair
            for b in range(vocab):
                if counts[a, b] > best:
                    best = counts[a, b]
                    ba = a
                    bb = b
        if ba < 0:
            break
        merges[m, 0] = ba
        merges[m, 1] = bb
        n = _apply_merge(seq, n, ba, bb, FIRST_MERGE + m)
        m += 1
    return m, n


@njit(cache=True)
def _learn_one(seq, n, vocab, m, merges, counts):
    """Learn merge m on seq[:n] (as _learn_merges does); returns the new length, or -1
    when no pair occurs twice."""
    counts[:, :] = 0
    for i in range(n - 1):
        counts[seq[i], seq[i + 1]] += 1
    best = 1
    ba = -1
    bb = -1
    for a in range(vocab):  # row-major: the first maximum is the smallest pair
        for b in range(vocab):
            if counts[a, b] > best:
                best = counts[a, b]
                ba = a
                bb = b
    if ba < 0:
        return -1
    merges[m, 0] = ba
    merges[m, 1] = bb
    return _apply_merge(seq, n, ba, bb, FIRST_MERGE + m)


@njit(cache=True)
def _encode(seq, merges):
    n = seq.shape[0]
    for m in range(merges.shape[0]):
        n = _apply_merge(seq, n, merges[m, 0], merges[m, 1], FIRST_MERGE + m)
    return n


class Tokenizer:
    def __init__(self, vocab: int, merges: np.ndarray):
        self.vocab = vocab
        self.merges = np.ascontiguousarray(merges, dtype=np.int64).reshape(-1, 2)
        pieces = [b""] * N_SPECIAL + [bytes([i]) for i in range(256)]
        for a, b in self.merges:
            pieces.append(pieces[a] + pieces[b])
        self.pieces = pieces

    @classmethod
    def train(cls, text: str, vocab: int) -> "Tokenizer":
        if vocab < FIRST_MERGE:
            raise HslmError(f"vocabulary {vocab} is too small for the byte-level tokenizer "
                            f"(needs at least {FIRST_MERGE})")
        seq = _bytes_to_ids(text)
        merges = np.zeros((vocab - FIRST_MERGE, 2), np.int64)
        counts = np.zeros((vocab, vocab), np.int64)
        n = seq.shape[0]
        m = 0
        # One merge per kernel call: the kernels hold the GIL, and Python runs signal
        # handlers (Ctrl-C) between calls, so a long corpus stays interruptible.
        while m < len(merges):
            n = _learn_one(seq, n, vocab, m, merges, counts)
            if n < 0:
                break
            m += 1
        return cls(vocab, merges[:m])

    def encode(self, text: str) -> np.ndarray:
        seq = _bytes_to_ids(text)
        n = seq.shape[0]
        for m in range(self.merges.shape[0]):  # one pass per call: interruptible
            n = _apply_merge(seq, n, self.merges[m, 0], self.merges[m, 1], FIRST_MERGE + m)
        return seq[:n].copy()

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.pieces[int(i)] if 0 <= int(i) < len(self.pieces) else b""
                        for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @property
    def identity(self) -> str:
        """sha256 of the vocabulary size and the merges: the tokenizer's identity."""
        h = hashlib.sha256(f"hslm-bpe/1/{self.vocab}/".encode())
        h.update(self.merges.astype("<i8").tobytes())
        return h.hexdigest()

    def to_json(self) -> str:
        return json.dumps({"format": "hslm-bpe", "version": 1, "vocab": self.vocab,
                           "merges": self.merges.tolist()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> "Tokenizer":
        """A tokenizer from its JSON, every field checked: the merges must only join
        bytes and earlier merges, and fit the vocabulary."""
        from .validate import Invalid, exact_keys, is_int, parse_json
        try:
            obj = parse_json(s, "the tokenizer")
            exact_keys(obj, ("format", "version", "vocab", "merges"), "the tokenizer")
            if obj["format"] != "hslm-bpe" or obj["version"] != 1:
                raise Invalid("not an hslm-bpe version 1 tokenizer")
            vocab, merges = obj["vocab"], obj["merges"]
            if not is_int(vocab) or not FIRST_MERGE <= vocab <= MAX_VOCAB:
                raise Invalid(f"vocab must be an integer from {FIRST_MERGE} to {MAX_VOCAB}")
            if not isinstance(merges, list) or len(merges) > vocab - FIRST_MERGE:
                raise Invalid(f"merges must be a list of at most {vocab - FIRST_MERGE} pairs")
            for m, pair in enumerate(merges):
                if not (isinstance(pair, list) and len(pair) == 2
                        and all(is_int(x) and BYTE0 <= x < FIRST_MERGE + m for x in pair)):
                    raise Invalid(f"merge {m} is {str(pair)[:40]}, not a pair of ids from "
                                  f"{BYTE0} to {FIRST_MERGE + m - 1}")
        except Invalid as e:
            raise HslmError(f"tokenizer is not valid: {e}") from None
        return cls(vocab, np.array(merges, np.int64).reshape(-1, 2))


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _bytes_to_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64) + BYTE0


def read_text(path) -> str:
    """A UTF-8 file's text; its size judged before it is read (24 bytes of token
    buffers per byte of text must fit), and a device or pipe read only up to a bound."""
    import os

    from .validate import available_memory, check_fits, gib
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise HslmError(f"data file not found: {p}") from None
    except OSError as e:
        raise HslmError(f"cannot read data file {p}: {e.strerror}") from None
    import stat as stat_mod
    if stat_mod.S_ISDIR(st.st_mode):
        raise HslmError(f"data file path is a directory: {p}")
    if stat_mod.S_ISREG(st.st_mode):
        check_fits(24 * st.st_size, f"the corpus {p} ({st.st_size:,} bytes)")
        raw = read_bytes(p, "data file")
    else:
        cap = min(MAX_PIPE_TEXT, available_memory() // 24)
        try:
            with open(p, "rb") as f:
                raw = f.read(cap + 1)
        except OSError as e:
            raise HslmError(f"cannot read data file {p}: {e.strerror}") from None
        if len(raw) > cap:
            raise HslmError(f"data file {p} is not a regular file and holds more than "
                            f"{gib(cap)}; pass a regular file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HslmError(f"data file {p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start})") from None


class Corpus:
    """A text's tokens, split: the last 10% of the token stream is validation."""

    def __init__(self, text: str, vocab: int, window: int, source: str, tokenizer=None):
        if not text:
            raise HslmError(f"the corpus is empty ({source})")
        self.source = source
        self.text_sha256 = text_sha256(text)
        self.tokenizer = tokenizer or Tokenizer.train(text, vocab)
        self.tokens = self.tokenizer.encode(text)
        n = len(self.tokens)
        n_valid = int(n * VALID_SHARE)
        self.train = self.tokens[: n - n_valid]
        self.valid = self.tokens[n - n_valid:]
        need_train, need_valid = window + 2, window + 1
        if len(self.train) < need_train or len(self.valid) < need_valid:
            raise HslmError(
                f"the corpus is too short: {n} tokens ({source}); a window of {window} needs "
                f"at least {need_train} training and {need_valid} validation tokens "
                f"(about {need_valid * 10} tokens in all)")

    @classmethod
    def load(cls, data, vocab: int, window: int, expect_sha256=None, tokenizer=None) -> "Corpus":
        """The built-in corpus (data None) or a UTF-8 file; with expect_sha256, the text
        must be the one a checkpoint was trained on. A given tokenizer is used as it is."""
        text, source = (builtin_text(), BUILTIN_SOURCE) if data is None else (
            read_text(data), str(data))
        if expect_sha256 is not None and text_sha256(text) != expect_sha256:
            raise HslmError(f"the training text ({source}) differs from the one the checkpoint "
                            "was trained on; pass the same --data")
        return cls(text, vocab, window, source, tokenizer)

    def draw_windows(self, rng, batch: int, window: int) -> np.ndarray:
        """[batch, window + 1] token windows with uniform start offsets in the training
        split, from an hslm.rng.Stream."""
        starts = rng.integers(batch, len(self.train) - window)
        return np.stack([self.train[s:s + window + 1] for s in starts]).astype(np.int64)

    def validation_windows(self, count: int, window: int) -> np.ndarray:
        """Up to `count` non-overlapping windows spread evenly over the validation split:
        window i * (n - 1) / (c - 1), rounded half up, in integers (no float rounding)."""
        n_win = (len(self.valid) - 1) // window
        c = min(count, n_win)
        if c == 1:
            idx = np.zeros(1, np.int64)
        else:
            idx = np.unique((2 * np.arange(c, dtype=np.int64) * (n_win - 1) + (c - 1))
                            // (2 * (c - 1)))
        return np.stack([self.valid[i * window:i * window + window + 1] for i in idx])
