"""Text, the byte-level BPE tokenizer and the train/validation split (spec section 10).

Ids 0-3 are PAD, BOS, EOS, UNK; 4-259 the 256 bytes; 260.. the merges, learned
from the run's text over the whole byte stream (no pre-splitting into words):
each merge joins the most frequent adjacent pair, ties going to the smaller
(first id, second id), while some pair occurs at least twice. Encoding a new
text applies the merges in the order they were learned, so encoding the
training text gives exactly the sequence the training produced.
"""
from __future__ import annotations

import collections
import concurrent.futures
import gzip
import hashlib
import heapq
import json
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from . import bpe, distributed, token_cache
from .checkpoint import (first_missing_folder, make_writable_folder, probe_new_file,
                         remove_empty_folders)
from .errors import HslmError, one_line, warn
from .validate import available_memory, check_fits, gib
from .textsource import SHOW_FROM, DataChanged, Phase, TextSource, run_interruptible

N_SPECIAL = 4
BYTE0 = N_SPECIAL
FIRST_MERGE = N_SPECIAL + 256
VALID_SHARE = 0.1
MAX_VOCAB = 1 << 20
# A text of LARGE_TEXT bytes or more (past bpe.run's 32-bit positions) is tokenized in
# pieces of PIECE_BYTES, the merges learned from the first (_large_corpus_tokens); a
# smaller text is one piece. Both are part of the tokens' definition (docs/model.md).
LARGE_TEXT = 2 ** 32 - 1
PIECE_BYTES = 1 << 30


# The built-in corpus: one fixed text shipped with the package, the same on every Python
# (hslm/corpus/README.md says what it is and under which licence).
BUILTIN_NAME = "python-3.11.7-pydoc-topics"
BUILTIN_FILE = Path(__file__).parent / "corpus" / f"{BUILTIN_NAME}.txt.gz"
BUILTIN_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
BUILTIN_SOURCE = f"built-in {BUILTIN_NAME}"
# Its tokenizer and tokens at the default vocabulary, as the token cache writes them
# (tools/ship_builtin_tokens.py makes them; a test checks they are what learning gives):
# a first run on the built-in text then compiles no tokenizer (7-9 s on the README's Xeon).
BUILTIN_TOKENS = Path(__file__).parent / "corpus"


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


# A prompt is merged without bpe.run's tables where those would take more than
# SHORT_TEXT_TABLES bytes (a vocabulary over 1,182) and more than merging by rank, whose
# Python lists and heap take about 113 bytes a byte of text (measured: 128 with room).
SHORT_TEXT_TABLES = 64 << 20
BY_RANK_BYTES_PER_BYTE = 128


class Tokenizer:
    def __init__(self, vocab: int, merges: np.ndarray, lengths=None):
        self.vocab = vocab
        self.merges = np.ascontiguousarray(merges, dtype=np.int64).reshape(-1, 2)
        self.n_ids = FIRST_MERGE + len(self.merges)  # the ids with a piece (drawable)
        # each id's bytes, made as decoding first needs them: a checkpoint's tokenizer is
        # read by commands that decode nothing (info, diff, eval, a tokenizer.json's
        # identity), and a crafted one's pieces, though each under 4 GiB, had added up to
        # 14 GB there
        self._pieces = {i: b"" for i in range(N_SPECIAL)}
        self._pieces.update((BYTE0 + i, bytes([i])) for i in range(256))
        self._lengths = lengths  # each id's piece's length (from_json's, or _length's)
        self._kept = 0  # bytes of the pieces made and kept (KEPT_TOTAL)
        self._ranks = None  # {pair: merge}, made when a short text needs it (encode)

    KEPT_PIECE = 1 << 16  # pieces up to this long are kept once made (a real one's are),
    KEPT_TOTAL = 1 << 28  # up to this many bytes of them in all

    def piece(self, i) -> bytes:
        """The bytes of token id i (b"" for a special id or one past the merges). The short
        pieces it is made of are made and kept first (while KEPT_TOTAL lasts); a long one
        (only a crafted tokenizer's) is unfolded down to them each time it is asked for,
        its size judged first: kept, a few had held all the memory there was."""
        i = int(i)
        if not 0 <= i < self.n_ids:
            return b""
        got = self._pieces.get(i)
        if got is not None:
            return got
        size = self._length(i)
        if size > self.KEPT_PIECE:
            check_fits(size, f"token {i}'s bytes ({size:,})")
        todo, visited = [i], set()
        while todo:  # its merges, parts first (a loop: a chain is as deep as the vocabulary)
            j = todo[-1]
            if j in self._pieces or j in visited:
                todo.pop()
                continue
            a, b = (int(x) for x in self.merges[j - FIRST_MERGE])
            parts = [x for x in (a, b) if x not in self._pieces and x not in visited]
            if parts:
                todo += parts
                continue
            todo.pop()
            visited.add(j)
            n = self._length(j)
            if n <= self.KEPT_PIECE and self._kept + n <= self.KEPT_TOTAL:
                self._pieces[j] = self._unfolded(a) + self._unfolded(b)
                self._kept += n
        return self._unfolded(i)

    def _unfolded(self, i: int) -> bytes:
        """Token i's bytes, its merges unfolded down to the pieces kept."""
        got = self._pieces.get(i)
        if got is not None:
            return got
        out, todo = bytearray(), [i]
        while todo:
            j = todo.pop()
            made = self._pieces.get(j)
            if made is None:
                a, b = self.merges[j - FIRST_MERGE]
                todo += (int(b), int(a))  # a first
            else:
                out += made
        return bytes(out)

    def _length(self, i: int) -> int:
        """The length of token i's piece, from the merges alone (all made at first use; as
        from_json makes them, which stops at the first too long: a crafted chain of merges
        doubles for ever)."""
        if self._lengths is None:
            length = [0] * N_SPECIAL + [1] * 256
            for a, b in self.merges.tolist():
                length.append(length[a] + length[b])
            self._lengths = length
        return self._lengths[i]

    @classmethod
    def train(cls, text: str, vocab: int) -> "Tokenizer":
        check_vocab(vocab)
        merges, _ = bpe.run(_bytes_to_ids(text, vocab), vocab)
        return cls(vocab, merges)

    def encode(self, text: str) -> np.ndarray:
        seq = _bytes_to_ids(text, self.vocab)
        need = bpe.memory_needed(self.vocab, seq.shape[0], learn=False)
        by_rank = BY_RANK_BYTES_PER_BYTE * seq.shape[0]
        if need > SHORT_TEXT_TABLES and by_rank < need:
            check_fits(by_rank, f"encoding {seq.shape[0]:,} bytes by merge rank")
            return np.array(self._merged_by_rank(seq.tolist()), np.int64)
        check_fits(need, f"encoding {seq.shape[0]:,} bytes with a vocabulary of {self.vocab:,}")
        _, n = bpe.run(seq, self.vocab, merges=self.merges)
        return seq[:n].astype(np.int64)

    def _merged_by_rank(self, ids: list) -> list:
        """bpe.run's merges applied to a prompt without its vocab^2 tables (48 vocab^2
        bytes: 3 GB at a vocabulary of 8,192, for a prompt of a few words): the merge of
        lowest rank among the adjacent pairs, at each of its places from left to right,
        until no pair has one. The same tokens as merge after merge in rank order, since
        a merge makes only pairs of higher rank (their ids are larger than any that an
        earlier merge joins). A heap of (rank, place) over a linked list of the tokens:
        n log n for a prompt of n bytes (scanning the whole text once per merge took
        minutes for 100 KB); an entry whose pair has changed since is passed over."""
        if self._ranks is None:
            self._ranks = {(int(a), int(b)): m for m, (a, b) in enumerate(self.merges)}
        ranks = self._ranks
        n = len(ids)
        ids = list(ids)
        nxt = list(range(1, n + 1))  # n: none
        prv = list(range(-1, n - 1))
        heap = [(ranks[p], i) for i, p in enumerate(zip(ids, ids[1:])) if p in ranks]
        heapq.heapify(heap)
        while heap:
            m, i = heapq.heappop(heap)
            j = nxt[i]
            if ids[i] < 0 or j >= n or ranks.get((ids[i], ids[j])) != m:
                continue  # i was merged away, or its pair is not the one this entry saw
            ids[i] = FIRST_MERGE + m  # i and j become one token, at i
            ids[j] = -1
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
                r = ranks.get((ids[i], ids[nxt[i]]))
                if r is not None:
                    heapq.heappush(heap, (r, i))
            if prv[i] >= 0:
                r = ranks.get((ids[prv[i]], ids[i]))
                if r is not None:
                    heapq.heappush(heap, (r, prv[i]))
        return [t for t in ids if t >= 0]

    def decode_bytes(self, ids) -> bytes:
        return b"".join(map(self.piece, ids))

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
            first = {}  # pair -> its merge: learning never merges a pair twice (its two
            # ids never meet again), and encoders that take either merge differ
            for m, pair in enumerate(merges):
                if not (isinstance(pair, list) and len(pair) == 2
                        and all(is_int(x) and BYTE0 <= x < FIRST_MERGE + m for x in pair)):
                    raise Invalid(f"merge {m} is {str(pair)[:40]}, not a pair of ids from "
                                  f"{BYTE0} to {FIRST_MERGE + m - 1}")
                m0 = first.setdefault(tuple(pair), m)
                if m0 != m:
                    raise Invalid(f"merge {m} repeats merge {m0}'s pair {pair}")
            # each merge's piece is as long as its two parts: 40 merges of a piece with
            # itself make one of 2^40 bytes (a file of 253 KB asked for terabytes)
            length = [0] * N_SPECIAL + [1] * 256
            for a, b in merges:
                length.append(length[a] + length[b])
                if length[-1] >= 1 << 32:
                    raise Invalid(f"merge {len(length) - FIRST_MERGE - 1} makes a piece of "
                                  f"{length[-1]:,} bytes, longer than any text hslm learns from")
        except Invalid as e:
            raise HslmError(f"tokenizer is not valid: {e}") from None
        return cls(vocab, np.array(merges, np.int64).reshape(-1, 2), length)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _bytes_to_ids(text: str, vocab: int) -> np.ndarray:
    raw = np.frombuffer(text.encode("utf-8"), np.uint8)
    return np.add(raw, BYTE0, dtype=bpe.ids_dtype(vocab))


def check_vocab(vocab):
    if vocab < FIRST_MERGE:
        raise HslmError(f"vocabulary {vocab} is too small for the byte-level tokenizer "
                        f"(needs at least {FIRST_MERGE})")


def same_file(a, b) -> bool:
    """Whether a and b name the same file or folder (False where either is not there:
    a cache folder not made yet, say)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_cache_apart(data, cache_dir):
    """A token cache folder that is a --data folder would have its own files read as text
    by the next run (which then found "the data changed while it was read", as its text
    memo was rewritten): refused (check_apart_from_text)."""
    check_apart_from_text(data, cache_dir, "token cache folder", "--cache-dir (or HSLM_CACHE_DIR)")


def check_apart_from_text(data, folder, what: str, flag: str):
    """A folder a run writes in (`what`: its output or token cache folder; `flag` names
    it) that is a --data folder: refused, since the next run would read what this one
    writes there as its text. (A folder inside a --data folder is not read.)"""
    if folder is None:
        return
    for p in [data] if isinstance(data, (str, os.PathLike)) else data:
        if Path(p).is_dir() and same_file(p, folder):
            raise HslmError(f"the {what} {folder} is the --data folder {p}, whose files are "
                            f"read as text (the next run would read what this one writes "
                            f"there): give another {flag}")


def corpus_tokens(src: TextSource, sha: str, vocab: int, tokenizer=None, cache_dir=None,
                  check=None):
    """(tokenizer, token stream) for a scanned text: from the token cache when it holds
    them, else learned (tokenizer None) or encoded, and then cached. The stream is
    memory-mapped when it is read from a cache, or written to one. check(n, tokenizer),
    where given, judges the tokens made before they are cached (Corpus: a text too short
    is refused before its cache folder is made). This user's processes on the machine
    that miss the same cache at once (runs started together, an MPI run's ranks) make
    the tokens one at a time (token_cache.TokenizingLock): the first writes the cache,
    with every core, and the others, waiting meanwhile, read it. Under MPI rank 0 alone
    writes; the other ranks of its machine wait for it (_wait_for_rank_0)."""
    def cached():
        return _cached_tokens(src, sha, vocab, tokenizer, cache_dir)
    found = cached()
    if found[1] is not None:
        return found
    # (a cache no process can write: each makes its own tokens at once, none waits)
    beside = (cache_dir is not None and distributed.on_writers_machine()
              and _may_make_a_file_in(cache_dir))
    lock = token_cache.TokenizingLock.for_text(
        cache_dir, sha, vocab, tokenizer.identity if tokenizer else "") if beside else None
    try:
        if lock is not None:
            if distributed.is_writer():
                _take_saying_for_whom(lock, cache_dir)
                found = cached()  # (written by the process it waited for, or just before)
            else:
                found = _wait_for_rank_0(lock, cached)
            if found[1] is not None:
                return found
        from .precompile import available_cores
        held = lock is not None and lock.held
        if held:
            lock.note(str(os.getpid()))
        # (under MPI, one core a rank: the ranks share the machine, unless the others wait)
        cores = available_cores() if held or distributed.current() is None else 1
        writes = cache_dir is not None and distributed.is_writer()
        return _made_tokens(src, sha, vocab, found[0], cache_dir if writes else None, check,
                            cores)
    finally:
        if lock is not None:
            lock.release()


def _may_make_a_file_in(folder) -> bool:
    """Whether a file can be made in folder or, where it is not there yet, in the nearest
    folder above it (where it would be made)."""
    try:
        top = first_missing_folder(folder)
        probe_new_file(Path(folder) if top is None else top.parent,
                       f".hslm-write-test-{os.getpid()}")
    except OSError:
        return False
    return True


RANK_0_ARRIVES = 10.0  # seconds (MPI) the other ranks of rank 0's machine wait for it to lock


def _wait_for_rank_0(lock, cached):
    """On an MPI rank of rank 0's machine other than 0, which never holds the text's lock
    (rank 0 alone writes): cached() once the cache holds the tokens, else once the lock,
    held (normally by rank 0 making them), is let go, or where none takes it within
    RANK_0_ARRIVES seconds (the ranks come together; a rank 0 that failed never comes,
    and the run ends once this rank is ready too), or where it cannot be told whether
    the lock is held (the rank then makes its own tokens)."""
    deadline = time.monotonic() + RANK_0_ARRIVES
    was_held = False
    while True:
        held = lock.held_elsewhere()
        if held is None:
            return cached()
        if held:
            was_held = True
        elif was_held or time.monotonic() > deadline:
            return cached()
        found = cached()
        if found[1] is not None:
            return found
        time.sleep(0.1)


def _take_saying_for_whom(lock, cache_dir):
    """lock.wait(), saying once (after a second, when still waiting) for which process."""
    said = False
    t0 = time.monotonic()
    while not lock.take():
        if not said and time.monotonic() - t0 > 1.0:
            said = True
            pid = lock.noted()
            print(f"waiting for another hslm run{f' (process {pid})' if pid.isdigit() else ''}"
                  f", which is tokenizing this text into the token cache "
                  f"{one_line(str(cache_dir))}; its tokens are read from there then",
                  file=sys.stderr, flush=True)
        time.sleep(0.1)


def _cached_tokens(src: TextSource, sha: str, vocab: int, tokenizer, cache_dir):
    """(tokenizer, tokens) from the cache folder, else from the built-in corpus's default
    tokens shipped with hslm (read only: a machine's first default run then has no
    tokenizer to compile); tokens None where neither holds them (the tokenizer, then, the
    one given, or one learned before from this text for this vocabulary, or None)."""
    folders = [f for f in (cache_dir, BUILTIN_TOKENS) if f is not None]
    for folder in folders:
        if tokenizer is not None:
            break
        found = token_cache.read_tokenizer(token_cache.tokenizer_path(folder, sha, vocab), sha)
        if found is not None:  # a damaged or foreign file is a miss: learned again
            try:
                t = Tokenizer.from_json(found[0])
            except HslmError:
                t = None
            if t is not None and t.vocab == vocab and t.identity == found[1]:
                tokenizer = t
    for folder in folders if tokenizer is not None else ():
        arr = token_cache.open_tokens(token_cache.tokens_path(folder, sha, tokenizer.identity),
                                      sha, tokenizer.identity, tokenizer.vocab)
        if arr is not None:
            src.check_nul_files()  # (as reading it would have; scanned, or remembered as read)
            return tokenizer, arr
    return tokenizer, None


def _made_tokens(src: TextSource, sha: str, vocab: int, tokenizer, cache_dir, check,
                 cores: int):
    """corpus_tokens' work on a miss: the text read and tokenized (learned where the
    tokenizer is None) on `cores` cores, and cached where cache_dir is given."""
    if tokenizer is None:
        check_vocab(vocab)
    large = src.size >= LARGE_TEXT
    piece = PIECE_BYTES if large else src.size
    check_fits(bpe.memory_needed(vocab, piece, learn=tokenizer is None),
               f"{'learning' if tokenizer is None else 'applying'} a tokenizer of vocabulary "
               f"{vocab:,} on {piece:,} bytes of text")
    show = src.size >= SHOW_FROM
    if large:
        return _large_corpus_tokens(src, sha, vocab, tokenizer, cache_dir, check, show, cores)
    ph = Phase("reading and checking the text", src.size, show=show)
    ids = src.read_ids(bpe.ids_dtype(vocab), BYTE0, ph, expect_sha256=sha)
    ph.close()
    learn = tokenizer is None
    tokenizer, n = _tokenize(ids, vocab, tokenizer, "learning the tokenizer" if learn
                             else "encoding", show, cores)
    if check is not None:
        check(n, tokenizer)
    if cache_dir is None:
        return tokenizer, ids[:n].copy()
    path = token_cache.tokens_path(cache_dir, sha, tokenizer.identity)
    try:
        token_cache.write_tokens(path, ids[:n], sha, tokenizer.identity)
        if learn:
            token_cache.write_tokenizer(token_cache.tokenizer_path(cache_dir, sha, vocab), sha,
                                        tokenizer.to_json(), tokenizer.identity)
    except HslmError as e:  # the cache is an optimisation: a read-only folder must not stop us
        warn(f"{e}; going on without the token cache")
        return tokenizer, ids[:n].copy()
    arr = token_cache.open_tokens(path, sha, tokenizer.identity, tokenizer.vocab)
    if arr is None:  # (a folder whose files cannot be memory-mapped, say)
        warn(f"the token cache {path} cannot be read back; going on without it")
        return tokenizer, ids[:n].copy()
    return tokenizer, arr


def _tokenize(ids, vocab: int, tokenizer, what: str, show: bool, cores: int):
    """(tokenizer, n): the merges learned from ids (tokenizer None) or the tokenizer's
    applied to them, in place, on up to `cores` cores (encoding runs in parts at once;
    learning is one pass): ids[:n] are then the tokens. Ctrl-C stops it promptly."""
    ctl = np.zeros(4, np.int64)
    learn = tokenizer is None
    total = vocab - FIRST_MERGE if learn else len(tokenizer.merges)
    ph = Phase(what, total, "merges", show=show)
    merges, n = run_interruptible(
        lambda: bpe.run(ids, vocab, None if learn else tokenizer.merges, ctl=ctl,
                        threads=cores), ctl,
        lambda: ph.update(int(ctl[1])))
    # (the merges made: learning makes fewer than asked where the text repeats no pair;
    # Corpus's warning, or its error, says so)
    ph.close(f" ({ids.shape[0] / 1e6:,.1f} MB -> {n:,} tokens)", done=len(merges))
    return (Tokenizer(vocab, merges) if learn else tokenizer), n


def _encoded_pieces(pieces, vocab: int, tokenizer, k: int, show: bool, cores: int):
    """The tokens of each of `pieces` (the second to the k-th of a large text), encoded by
    the tokenizer and yielded in order. The pieces are independent, so as many are
    encoded at once, each in a thread of its own (the kernel runs without the GIL), as
    `cores` and the memory allow, with the next piece read while they run; one at a
    time where the memory holds no more than one (read once the last is written).
    Ctrl-C stops every one within a fraction of a second."""
    per_piece = bpe.memory_needed(vocab, PIECE_BYTES, learn=False)  # (its ids included)
    ahead = PIECE_BYTES * np.dtype(bpe.ids_dtype(vocab)).itemsize  # the piece read meanwhile
    workers = max(1, min(cores, k - 1, (available_memory() - ahead) // per_piece))
    total = (k - 1) * len(tokenizer.merges)
    ph = Phase(f"encoding pieces 2 to {k}" + (f", {workers} at a time" if workers > 1 else ""),
               total, "merges", show=show)
    ctls, running = [], collections.deque()

    threads = max(1, cores // workers)

    def encode(ids, ctl):  # (the cores the pieces at once leave: a piece's parts at once)
        return ids[:bpe.run(ids, vocab, tokenizer.merges, ctl=ctl, threads=threads)[1]]

    def oldest():  # (waited on in short turns, so that Ctrl-C reaches this thread)
        while True:
            try:
                tokens = running[0].result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                ph.update(sum(int(c[1]) for c in ctls))
                continue
            running.popleft()
            return tokens

    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hslm-bpe")
    try:
        for ids in pieces:
            if len(running) == workers:
                yield oldest()
            ctls.append(np.zeros(4, np.int64))
            running.append(pool.submit(encode, ids, ctls[-1]))
            del ids
            if workers == 1:  # (no piece read ahead: written before the next is read)
                yield oldest()
        while running:
            yield oldest()
    except BaseException:
        for ctl in ctls:  # every kernel stops at its next check
            ctl[0] = 1
        raise
    finally:
        pool.shutdown(wait=True)
    ph.close(done=total)


def _large_corpus_tokens(src: TextSource, sha: str, vocab: int, tokenizer, cache_dir, check,
                         show: bool, cores: int):
    """corpus_tokens for a text of LARGE_TEXT bytes or more, whose ids are more than the
    tokenizer's 32-bit positions reach (and than memory holds, at some size): it is cut
    into pieces of PIECE_BYTES (the last shorter), the merges are learned from the first
    piece alone, and each piece is encoded by itself (no token spans two pieces; several
    at once: _encoded_pieces), their tokens written to the token file in order as they
    come, which is then memory-mapped (and check(n, tokenizer) asked of them). Without a
    token cache folder (cache_dir None) the tokens go to an unnamed temporary file
    instead. A cache folder that cannot be written is an error here, as
    the tokens have nowhere else to go: judged before the first piece is learned from
    (and the temporary file opened), and the folders made for the cache are removed
    again if the tokens fail."""
    # (a file of NUL bytes the hashing pass saw is refused now, not after hours of pieces;
    # a small text judges it after its UTF-8, so that UTF-16 reads "not UTF-8 text")
    src.check_nul_files()
    why = f"a text of {src.size:,} bytes, tokenized in pieces, is trained from its token cache"
    if cache_dir is None:
        return _tokens_in_pieces(src, sha, vocab, tokenizer, token_cache.open_spool(), check,
                                 show, why, cores)
    top = first_missing_folder(cache_dir)
    try:
        try:
            if os.path.lexists(cache_dir) and not os.path.isdir(cache_dir):
                raise NotADirectoryError(0, "not a folder")
            make_writable_folder(cache_dir)
        except OSError as e:
            raise HslmError(f"cannot write the token cache in {cache_dir}: {e.strerror or e}; "
                            f"{why}: give a --cache-dir where it can be written") from None
        return _tokens_in_pieces(src, sha, vocab, tokenizer, Path(cache_dir), check, show, why,
                                 cores)
    except BaseException:
        if top is not None:  # (only folders still empty: another run's are kept)
            remove_empty_folders(Path(cache_dir), top)
        raise


DISK_ROOM_SLACK = 0.9  # the share of the estimate that must be free (pieces differ a little)


def _check_disk_room(into, estimate: float, why: str):
    """Refuse, once the first piece's tokens are counted, a disk without room for the
    token file they let estimate (its tokens a byte times the text's bytes): it would
    fail hours later, at the piece that fills it. Only where the estimate exceeds the
    room by more than the pieces' likely difference, so a text that fits is not refused;
    one that does not, but passes, fails at its write as before."""
    try:
        st = os.statvfs(into) if isinstance(into, Path) else os.fstatvfs(into.fileno())
    except (OSError, AttributeError):  # (no statvfs on this system: the write will tell)
        return
    free = st.f_bavail * st.f_frsize
    if free < DISK_ROOM_SLACK * estimate:
        where = into if isinstance(into, Path) else "the temporary folder"
        raise HslmError(f"the text's token file needs about {gib(estimate)} (as its first "
                        f"piece's tokens go), but {where} has {gib(free)} free; {why}: give "
                        "a --cache-dir with room for it")


class _FirstPieceProgress:
    """read_pieces' progress, drawn for the first piece alone: the later pieces are read
    while others are encoded, whose line is the one on screen then."""

    def __init__(self, phase: Phase):
        self.phase = phase

    def update(self, done: int):
        if done <= self.phase.total:
            self.phase.update(done)


def _tokens_in_pieces(src, sha, vocab, tokenizer, into, check, show, why, cores):
    """_large_corpus_tokens' work, into the token cache folder `into` or, where `into` is
    an open spool file (token_cache.open_spool), that file, on up to `cores` cores."""
    k = -(-src.size // PIECE_BYTES)
    item = np.dtype(bpe.ids_dtype(vocab)).itemsize
    reading = Phase(f"piece 1 of {k}: reading and checking", PIECE_BYTES, show=show)
    pieces = src.read_pieces(bpe.ids_dtype(vocab), BYTE0, PIECE_BYTES,
                             _FirstPieceProgress(reading), expect_sha256=sha)
    learn = tokenizer is None
    first = [next(pieces)]
    reading.close()
    tokenizer, n = _tokenize(first[0], vocab, tokenizer, f"piece 1 of {k}: " + (
        "learning the tokenizer" if learn else "encoding"), show, cores)
    _check_disk_room(into, n / first[0].shape[0] * src.size * item, why)
    text_failed = []  # (an error of the text's own, raised through the writer as it is)

    def tokens():
        try:
            yield first.pop()[:n]
            yield from _encoded_pieces(pieces, vocab, tokenizer, k, show, cores)
        except Exception:
            text_failed.append(True)
            raise

    parts = tokens()
    try:
        if not isinstance(into, Path):
            arr = token_cache.spool_tokens(into, parts, item, sha, tokenizer.identity)
        else:
            path = token_cache.tokens_path(into, sha, tokenizer.identity)
            try:
                token_cache.write_token_parts(path, parts, item, sha, tokenizer.identity)
                if learn:
                    token_cache.write_tokenizer(token_cache.tokenizer_path(into, sha, vocab),
                                                sha, tokenizer.to_json(), tokenizer.identity)
            except HslmError as e:
                if text_failed:
                    raise
                raise HslmError(f"{e}; {why}: give a --cache-dir with room for it") from None
            arr = token_cache.open_tokens(path, sha, tokenizer.identity, tokenizer.vocab)
            if arr is None:
                raise HslmError(f"the token cache {path} cannot be read back (a folder whose "
                                "files cannot be memory-mapped?); give another --cache-dir")
    finally:  # (a write that failed leaves it unfinished: its pieces' threads stop, joined)
        parts.close()
        if not isinstance(into, Path):
            into.close()  # (the mapped array keeps the file while it lives)
    if check is not None:
        check(arr.shape[0], tokenizer)
    return tokenizer, arr


REHASH_ENV = "HSLM_REHASH"   # set to 1: hash the text in full, whatever is remembered
SETTLE_NS = 2_000_000_000    # a file changed this recently is not trusted by its stat


def hash_text(src: TextSource, cache_dir=None, rehash=False):
    """(the text's sha256, whether it was remembered, the stat key to remember it by or
    None): remembered in the cache folder by its files' stat key when they are unchanged
    since it was computed, else read in full (and to be remembered, once the text has been
    read and checked, when every file had been left alone for SETTLE_NS before the
    hashing began: a file written again within the same timestamp tick could otherwise
    keep its key, the "racy" case git's index guards against in the same way). rehash:
    read in full whatever is remembered."""
    key = src.stat_key() if cache_dir is not None else None
    if key is not None and not rehash and os.environ.get(REHASH_ENV, "") in ("", "0"):
        sha = token_cache.recall_text_sha256(cache_dir, key)
        if sha is not None:
            return sha, True, None
    started = time.time_ns()
    large = src.size >= LARGE_TEXT  # (checked as UTF-8 now, not a piece at a time later)
    ph = Phase("hashing and checking the text" if large else "hashing the text", src.size,
               show=src.size >= SHOW_FROM)
    sha = src.scan(ph, utf8=large)
    ph.close()
    settled = (key is not None and distributed.is_writer() and src.stat_key() == key
               and all(max(f[2], f[3]) < started - SETTLE_NS for f in key))
    return sha, False, key if settled else None


def check_split(n: int, window: int, size: int, source: str, tokenizer) -> None:
    """Refuse n tokens (of size bytes, by tokenizer) too few for Corpus's split: the last
    10% for validation, each part at least a window and its targets."""
    n_valid = int(n * VALID_SHARE)
    need_train, need_valid = window + 2, window + 1
    if n - n_valid < need_train or n_valid < need_valid:
        raise HslmError(
            f"the corpus is too short: {n:,} token{'s' if n != 1 else ''} from "
            f"{size:,} byte{'s' if size != 1 else ''} ({source}), "
            f"{n - n_valid:,} for training and "
            f"{n_valid:,} for validation; a window of {window} needs at least "
            f"{need_train} and {need_valid} (about {need_valid * 10} tokens in all)"
            + (f"; its bytes would do, but the tokenizer's {len(tokenizer.merges):,} "
               f"merges took this text to few tokens: a model with a smaller vocabulary "
               f"(at least {FIRST_MERGE}) merges less"
               if size >= need_valid * 10 and len(tokenizer.merges) else ""))


class Corpus:
    """A text's tokens, split: the last 10% of the token stream is validation."""

    def __init__(self, text, vocab: int, window: int, source: str, tokenizer=None,
                 cache_dir=None, expect_sha256=None):
        """text: a str or a TextSource (files streamed, never held whole)."""
        src = text if isinstance(text, TextSource) else TextSource(text=text, label=source)
        if src.size == 0:
            raise HslmError(f"the corpus is empty ({source})")
        self.source = source

        def check(n, tok):  # (before the tokens are cached, and again for cached ones)
            check_split(n, window, src.size, source, tok)
        for rehash in (False, True):
            self.text_sha256, recalled, memo = hash_text(src, cache_dir, rehash)
            try:
                if expect_sha256 is not None and self.text_sha256 != expect_sha256:
                    if recalled:  # maybe of other bytes: hashed in full (below)
                        raise DataChanged("the remembered sha256 is not the checkpoint's")
                    raise HslmError(f"the training text ({source}) differs from the one the "
                                    "checkpoint was trained on; " + (
                                        "that was the built-in text: leave out --data"
                                        if expect_sha256 == BUILTIN_SHA256 else
                                        "pass the same --data"))
                self.tokenizer, self.tokens = corpus_tokens(src, self.text_sha256, vocab,
                                                            tokenizer, cache_dir, check)
                if memo is not None:  # (a text refused, or one that failed its checks, is
                    # not remembered: a run that failed on it leaves no cache folder made)
                    token_cache.remember_text_sha256(cache_dir, memo, self.text_sha256)
                break
            except DataChanged:
                if rehash or cache_dir is None:
                    raise
                # the sha256 remembered for the files' stat key named other bytes (a file
                # rewritten with its key kept): forgotten, and the text hashed in full
                token_cache.forget_text_sha256(cache_dir, src.stat_key())
        n = len(self.tokens)
        check(n, self.tokenizer)
        n_valid = int(n * VALID_SHARE)
        self.train = self.tokens[: n - n_valid]
        self.valid = self.tokens[n - n_valid:]
        learned, room = len(self.tokenizer.merges), vocab - FIRST_MERGE
        # (only for a tokenizer made from this text: a run's own, given, may come from another)
        if tokenizer is None and learned < room and distributed.is_writer():
            import sys
            print(f"warning: the text gave only {learned:,} of the vocabulary's {room:,} merges; "
                  f"token ids {FIRST_MERGE + learned:,}-{vocab - 1:,} never occur (a smaller "
                  "vocabulary or more text would use them)", file=sys.stderr)

    @classmethod
    def load(cls, data, vocab: int, window: int, expect_sha256=None, tokenizer=None,
             cache_dir=None) -> "Corpus":
        """The built-in corpus (data None or empty) or UTF-8 files (a path, a folder, or a
        list of them: joined by a blank line); with expect_sha256, the text must be the
        one a checkpoint was trained on. A given tokenizer is used as it is. With a
        cache_dir, the tokens are cached there and memory-mapped."""
        if data is None or (isinstance(data, (list, tuple)) and not data):
            src = TextSource(text=builtin_text(), label=BUILTIN_SOURCE)
        else:
            src = TextSource(data)
            check_cache_apart(data, cache_dir)
        return cls(src, vocab, window, src.label, tokenizer, cache_dir, expect_sha256)

    def draw_windows(self, rng, batch: int, window: int) -> np.ndarray:
        """[batch, window + 1] token windows with uniform start offsets in the training
        split, from an hslm.rng.Stream."""
        starts = rng.integers(batch, len(self.train) - window)
        return _windows_at(self.train, starts, window, self.tokenizer.vocab)

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
        check_fits(3 * 8 * len(idx) * (window + 1), f"{len(idx):,} validation windows")
        return _windows_at(self.valid, idx * window, window, self.tokenizer.vocab)


def _windows_at(tokens, starts, window: int, vocab: int) -> np.ndarray:
    """[len(starts), window + 1] int64 windows of tokens from each start, gathered by one
    index (a list of one view per window had taken about 1 KB a window: 4.4 GB for the
    3.5 million windows of a large text's validation split, in no estimate). Each id is
    below vocab: a token cache is memory-mapped, checked when opened, and a file another
    program rewrote in place since had given the kernels ids past the embedding (a crash)."""
    starts = np.asarray(starts, np.int64)
    windows = tokens[starts[:, None] + np.arange(window + 1)].astype(np.int64)
    if windows.size and int(windows.max()) >= vocab:
        raise HslmError(f"the text's tokens changed during the run: id {int(windows.max())} "
                        f"is past the vocabulary's {vocab} (its token cache file rewritten in "
                        "place by another program?)")
    return windows
