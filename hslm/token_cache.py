"""The encoded corpus on disk, written once and memory-mapped afterwards.

`tokens-<text sha256[:16]>-<tokenizer identity[:16]>.tok`: a 128-byte header then
the token ids (little-endian uint16, or uint32 for vocabularies above 65,535):

    0   8  magic b"HSLMTOK2"
    8   8  item size in bytes (2 or 4), little-endian
    16  8  number of tokens
    24 32  sha256 of the text (raw)
    56 32  tokenizer identity (raw)
    88 32  checksum of the token bytes that follow (`checksum`, four little-endian u64)
    120 8  zero

Written atomically (temporary file, fsync, rename); a file whose header or checksum
does not match is ignored (and replaced), and so is a file of an older format
(HSLMTOK1 carried a sha256 of the tokens). The checksum is not cryptographic: it
guards against damage (a flipped bit, a truncated or half-written file), not
against someone forging a file, and it runs near memory bandwidth where sha256 took
most of a cached start on a large corpus. `bpe-<text sha256[:16]>-<vocab>.json`
remembers the tokenizer learned from a text, so a new run on the same text and
vocabulary skips learning it. `text-sha256.json` remembers the text's sha256 keyed
by its files' stat (see `recall_text_sha256`). Processes of this user's on one
machine that need a text's tokens at once make them one at a time (TokenizingLock).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from numba import njit

from .checkpoint import write_atomic
from .errors import HslmError, open_regular, read_bytes
from .userlock import UserLock, lock_path
from .validate import MAX_JSON

MAGIC = b"HSLMTOK2"
HEADER = 128
ENV = "HSLM_CACHE_DIR"


def cache_dir(flag=None, default=None):
    """--cache-dir, else $HSLM_CACHE_DIR, else the default (the run's folder)."""
    d = flag or os.environ.get(ENV) or default
    return Path(d) if d else None


class TokenizingLock(UserLock):
    """Which process makes a text's tokens for a cache folder now, among this user's on
    the machine (an MPI run's ranks, runs started together): the others wait, then read
    them from the cache (hslm.data.corpus_tokens), rather than each making them at once
    with the memory and the cores that takes. A UserLock on a file in the temporary folder
    named after the folder, the text, the vocabulary and the tokenizer (its identity, or
    none where it is to be learned: a run resumed does not write the merges a new run
    would read; so a new run that finds merges learned before, and a resumed run given
    the same, may make the same tokens at once); its holder notes its pid there, and
    removes the file as it lets go."""

    @classmethod
    def for_text(cls, folder, text_sha256: str, vocab: int,
                 identity: str = "") -> "TokenizingLock | None":
        """The lock (None without a temporary folder: each process then goes on alone)."""
        where = os.path.realpath(folder)  # (one name, however the folder is named)
        key = hashlib.sha256(f"{where}\0{text_sha256}\0{vocab}\0{identity}".encode(
            "utf-8", "surrogateescape")).hexdigest()[:16]
        path = lock_path("hslm-tokens", key)
        return None if path is None else cls(path, removed=True)


def tokens_path(folder: Path, text_sha256: str, identity: str) -> Path:
    return Path(folder) / f"tokens-{text_sha256[:16]}-{identity[:16]}.tok"


def tokenizer_path(folder: Path, text_sha256: str, vocab: int) -> Path:
    return Path(folder) / f"bpe-{text_sha256[:16]}-{vocab}.json"


# xxHash64's primes; each lane is an xxHash64-style accumulator (multiply, rotate,
# multiply), eight of them side by side so the multiplies overlap.
_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_LANES = 8


@njit(cache=True, nogil=True, inline="always")
def _round(acc, word):
    acc = acc + word * _P2
    acc = (acc << np.uint64(31)) | (acc >> np.uint64(33))
    return acc * _P1


@njit(cache=True, nogil=True)
def _lanes(words, acc):
    """Folds words (uint64, a multiple of 8 long) into the eight lanes acc, in place."""
    a0, a1, a2, a3 = acc[0], acc[1], acc[2], acc[3]
    a4, a5, a6, a7 = acc[4], acc[5], acc[6], acc[7]
    for i in range(0, words.shape[0], _LANES):
        a0 = _round(a0, words[i])
        a1 = _round(a1, words[i + 1])
        a2 = _round(a2, words[i + 2])
        a3 = _round(a3, words[i + 3])
        a4 = _round(a4, words[i + 4])
        a5 = _round(a5, words[i + 5])
        a6 = _round(a6, words[i + 6])
        a7 = _round(a7, words[i + 7])
    acc[0], acc[1], acc[2], acc[3] = a0, a1, a2, a3
    acc[4], acc[5], acc[6], acc[7] = a4, a5, a6, a7


def _mix(x: int) -> int:
    """xxHash64's final avalanche, on a Python int."""
    m = (1 << 64) - 1
    x ^= x >> 33
    x = (x * int(_P2)) & m
    x ^= x >> 29
    x = (x * int(_P3)) & m
    return x ^ (x >> 32)


def _read_only(words: np.ndarray) -> np.ndarray:
    """A read-only view of words: _lanes then has one Numba signature for the memory-mapped
    file, its zero-padded tail and the tokens being written (a writable array is another
    type, another compile: 0.6 s of a first run's corpus load on a 2-core first-generation
    Zen)."""
    view = words.view()
    view.flags.writeable = False
    return view


CHECKSUM_CHUNK = 1 << 20  # bytes (a multiple of 64) folded a call, then seen by `each`


class Checksum:
    """The token file's checksum, fed in parts (update) as the bytes come: eight 64-bit
    lanes over the 64-byte blocks of all the bytes given, the tail zero-padded to a
    block, folded in pairs with the length (digest). How the bytes are split into parts
    changes nothing."""

    def __init__(self):
        self.acc = np.array([int(_P1) * (i + 1) & ((1 << 64) - 1) for i in range(_LANES)],
                            np.uint64)
        self.n = 0
        self.carry = np.zeros(0, np.uint8)  # the bytes given past the last whole block

    def update(self, arr: np.ndarray, each=None):
        """Fold in a contiguous array's bytes. each(part), if given, sees its elements a
        chunk at a time as they are folded, while they are in cache (open_tokens' bound on
        the ids: one pass over a file of gigabytes, not two)."""
        flat = arr.reshape(-1)
        step = max(CHECKSUM_CHUNK // flat.itemsize, 1)
        for e0 in range(0, flat.shape[0], step):
            part = flat[e0:e0 + step]
            self._fold(part.view(np.uint8))
            if each is not None:
                each(part)

    def _fold(self, raw: np.ndarray):
        self.n += raw.shape[0]
        if self.carry.shape[0]:  # complete the block the last bytes began
            lead = min(64 - self.carry.shape[0], raw.shape[0])
            self.carry, raw = np.concatenate([self.carry, raw[:lead]]), raw[lead:]
            if self.carry.shape[0] < 64:
                return
            _lanes(_read_only(self.carry.view(np.uint64)), self.acc)
        body = raw.shape[0] // 64 * 64
        if body:
            blocks = raw[:body]
            if blocks.ctypes.data % 8:  # (after a carry: uint64 loads want 8-byte alignment)
                blocks = blocks.copy()
            _lanes(_read_only(blocks.view(np.uint64)), self.acc)
        self.carry = raw[body:].copy()

    def digest(self) -> bytes:
        tail = np.zeros(64, np.uint8)
        tail[:self.carry.shape[0]] = self.carry
        acc = self.acc.copy()
        _lanes(_read_only(tail.view(np.uint64)), acc)
        out = b""
        for i in range(0, _LANES, 2):
            out += _mix(int(acc[i]) ^ ((int(acc[i + 1]) * int(_P3) + self.n)
                                       & ((1 << 64) - 1))).to_bytes(8, "little")
        return out


def checksum(arr: np.ndarray, each=None) -> bytes:
    """32 bytes from the bytes of a contiguous array (Checksum); each: as Checksum.update's."""
    c = Checksum()
    c.update(arr, each)
    return c.digest()


def _write(path: Path, parts, finish=None):
    write_atomic(path, parts, what="the token cache", make_parent=True, finish=finish)


def write_tokens(path: Path, tokens: np.ndarray, text_sha256: str, identity: str):
    write_token_parts(path, [tokens], tokens.dtype.itemsize, text_sha256, identity)


def write_token_parts(path: Path, parts, item: int, text_sha256: str, identity: str):
    """A token file of the ids of `parts` (an iterable of id arrays, item bytes an id),
    one after another, written atomically as they come (the header last, over its place:
    the ids are counted and checksummed as they pass): a text too large to hold as ids
    is written a piece at a time. A failure, or an error raised by `parts`, leaves no
    file."""
    body, finish, _ = _token_file(parts, item, text_sha256, identity)
    _write(path, body, finish)


def open_spool(folder=None):
    """An unnamed temporary file for spool_tokens, in `folder` (default: the system's
    temporary folder), opened before the work whose tokens it will hold."""
    try:
        return tempfile.TemporaryFile(dir=folder)
    except OSError as e:
        raise HslmError(f"cannot write the text's tokens to a temporary file in "
                        f"{folder or tempfile.gettempdir()}: {e.strerror or e}") from None


def spool_tokens(spool, parts, item: int, text_sha256: str, identity: str):
    """The ids of `parts` (as write_token_parts') written to `spool` (open_spool's) and
    memory-mapped: the tokens of a text too large to hold in memory where no token cache
    is written (an MPI rank that writes no cache; a run with no cache folder). The file
    goes when the array does."""
    body, finish, count = _token_file(parts, item, text_sha256, identity)
    try:
        with spool as f:
            for part in body:
                f.write(part)
                del part  # (as write_atomic: not held while the next part is made)
            finish(f)
            f.flush()
            dtype = "<u2" if item == 2 else "<u4"
            return (np.memmap(f, dtype=dtype, mode="r", offset=HEADER, shape=(count[0],))
                    if count[0] else np.zeros(0, dtype))
    except OSError as e:
        raise HslmError(f"cannot write the text's tokens to a temporary file: "
                        f"{e.strerror or e}") from None


def _token_file(parts, item: int, text_sha256: str, identity: str):
    """(the file's parts, finish(f), [ids counted]) for write_atomic: a header's room,
    then each array's ids as little-endian bytes; finish writes the header over its room
    once the ids have been counted and checksummed."""
    if item not in (2, 4):
        raise ValueError(f"token ids are 2 or 4 bytes, not {item}")
    dtype = np.dtype("<u2" if item == 2 else "<u4")
    check, count = Checksum(), [0]

    def body():
        yield bytes(HEADER)
        for ids in parts:
            ids = np.ascontiguousarray(ids, dtype=dtype)
            check.update(ids)
            count[0] += ids.shape[0]
            yield memoryview(ids.reshape(-1).view(np.uint8))
            del ids  # (not held while the next part is made: a piece is gigabytes)

    def finish(f):
        header = (MAGIC + int(item).to_bytes(8, "little") + int(count[0]).to_bytes(8, "little")
                  + bytes.fromhex(text_sha256) + bytes.fromhex(identity) + check.digest())
        f.seek(0)
        f.write(header + b"\0" * (HEADER - len(header)))

    return body(), finish, count


def read_header(path: Path):
    """A token file's header, where its bytes describe the file whole: (bytes an id,
    ids, the text's sha256, the tokenizer's identity, the ids' checksum), the digests as
    bytes; else None (missing, not a token file, torn). (A FIFO or a device under its
    name in a shared folder: None, errors.open_regular.)"""
    try:
        f, size = open_regular(Path(path), "token file")
        with f:
            h = f.read(HEADER)
    except (HslmError, OSError):
        return None
    if len(h) != HEADER or h[:8] != MAGIC:
        return None
    item, n = int.from_bytes(h[8:16], "little"), int.from_bytes(h[16:24], "little")
    if item not in (2, 4) or size != HEADER + n * item:
        return None
    return item, n, h[24:56], h[56:88], h[88:120]


def map_tokens(path: Path, item: int, n: int) -> np.ndarray:
    """The n ids of a token file (read_header's), memory-mapped; an OSError where the
    file system cannot map them (some FUSE mounts: ENODEV)."""
    dtype = "<u2" if item == 2 else "<u4"
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER, shape=(n,)) if n \
        else np.zeros(0, dtype)


def open_tokens(path: Path, text_sha256: str, identity: str, vocab: int):
    """The memory-mapped tokens, or None when the file is missing, cannot be mapped, or
    is not the one asked for (wrong header, truncated, or its checksum does not match),
    or holds an id of `vocab` or more: the checksum catches damage, not a forged file,
    and the kernels index the embedding by these ids (a forged file's had crashed hslm
    eval)."""
    header = read_header(path)
    if header is None:
        return None
    item, n, text, tokenizer, digest = header
    if text != bytes.fromhex(text_sha256) or tokenizer != bytes.fromhex(identity):
        return None
    try:  # (a folder whose files cannot be mapped: a miss)
        arr = map_tokens(path, item, n)
    except OSError:
        return None
    if n == 0:
        return arr
    largest = [0]
    if checksum(arr, lambda part: largest.append(int(part.max()))) != digest \
            or max(largest) >= vocab:
        return None
    return arr


TOKENIZER_CACHE_VERSION = "hslm-bpe-cache/1"  # bump when the BPE rules change


def write_tokenizer(path: Path, text_sha256: str, tokenizer_json: str, identity: str):
    """Remember the tokenizer learned from a text, with its identity (a checksum of the
    merges) and the version of the learning rules."""
    obj = {"version": TOKENIZER_CACHE_VERSION, "text_sha256": text_sha256,
           "identity": identity, "tokenizer": json.loads(tokenizer_json)}
    _write(path, [json.dumps(obj, separators=(",", ":")).encode("utf-8")])


def read_tokenizer(path: Path, text_sha256: str):
    """(tokenizer JSON, identity) remembered for this text, or None when there is none or it
    is from other rules; the caller checks the identity against the merges it parses."""
    try:
        obj = json.loads(read_bytes(path, "tokenizer cache", MAX_JSON + 4096).decode("utf-8"))
        if (obj.get("version") != TOKENIZER_CACHE_VERSION
                or obj.get("text_sha256") != text_sha256 or not isinstance(obj["identity"], str)):
            return None
        return json.dumps(obj["tokenizer"], separators=(",", ":")), obj["identity"]
    except (HslmError, OSError, ValueError, KeyError, TypeError, AttributeError,
            RecursionError):
        return None


TEXT_SHA_MEMO = "text-sha256.json"
TEXT_SHA_MEMO_VERSION = "hslm-text-sha256/2"  # /2: each entry checked (memo_check)
TEXT_SHA_MEMO_ENTRIES = 16   # texts remembered per folder, the most recent first


def _is_sha256(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def memo_check(files, sha256: str) -> str:
    """An entry's own checksum: a damaged character anywhere in it (a sha256 that another
    text has, a file's key) makes the entry a miss, never a wrong text's name."""
    body = json.dumps({"files": files, "sha256": sha256}, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _memo_entries(folder: Path):
    try:
        memo = read_bytes(Path(folder) / TEXT_SHA_MEMO, "text memo", 256 << 20)
        obj = json.loads(memo.decode("utf-8"))
        if obj.get("version") != TEXT_SHA_MEMO_VERSION or not isinstance(obj["entries"], list):
            return []
        return [e for e in obj["entries"] if isinstance(e, dict) and _is_sha256(e.get("sha256"))
                and isinstance(e.get("files"), list)
                and e.get("check") == memo_check(e["files"], e["sha256"])]
    except (HslmError, OSError, ValueError, KeyError, TypeError, AttributeError,
            RecursionError):
        return []


def recall_text_sha256(folder: Path, key):
    """The sha256 remembered for a text whose files' stat key (TextSource.stat_key) is
    exactly `key`, or None. Trusting it skips reading the text: a file rewritten with
    the same size while keeping its mtime, ctime, inode and device (forged timestamps)
    would go unnoticed; $HSLM_REHASH=1 (or deleting the file) forces a full hash."""
    for e in _memo_entries(folder):
        if e["files"] == key:
            return e["sha256"]
    return None


def forget_text_sha256(folder: Path, key):
    """Forget what is remembered under this stat key (it named other bytes)."""
    entries = _memo_entries(folder)
    kept = [e for e in entries if e["files"] != key]
    if len(kept) < len(entries):
        _write_memo(folder, kept)


def remember_text_sha256(folder: Path, key, sha256: str):
    """Remember the text's sha256 under its stat key (the memo is only an optimisation)."""
    entries = [e for e in _memo_entries(folder) if e["files"] != key]
    _write_memo(folder, [{"files": key, "sha256": sha256, "check": memo_check(key, sha256)}]
                + entries[:TEXT_SHA_MEMO_ENTRIES - 1])


def _write_memo(folder: Path, entries):
    """The memo's file, written atomically (a failure to write is ignored)."""
    obj = {"version": TEXT_SHA_MEMO_VERSION, "entries": entries}
    try:
        _write(Path(folder) / TEXT_SHA_MEMO, [json.dumps(obj, separators=(",", ":")).encode("utf-8")])
    except HslmError:
        pass
