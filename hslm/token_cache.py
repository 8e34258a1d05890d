"""The encoded corpus on disk, written once and memory-mapped afterwards.

`tokens-<text sha256[:16]>-<tokenizer identity[:16]>.tok`: a 128-byte header then
the token ids (little-endian uint16, or uint32 for vocabularies above 65,535):

    0   8  magic b"HSLMTOK1"
    8   8  item size in bytes (2 or 4), little-endian
    16  8  number of tokens
    24 32  sha256 of the text (raw)
    56 32  tokenizer identity (raw)
    88 32  sha256 of the token bytes that follow
    120 8  zero

Written atomically (temporary file, fsync, rename); a file whose header or checksum
does not match is ignored (and replaced). `bpe-<text sha256[:16]>-<vocab>.json`
remembers the tokenizer learned from a text, so a new run on the same text and
vocabulary skips learning it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .checkpoint import write_atomic

MAGIC = b"HSLMTOK1"
HEADER = 128
ENV = "HSLM_CACHE_DIR"


def cache_dir(flag=None, default=None):
    """--cache-dir, else $HSLM_CACHE_DIR, else the default (the run's folder)."""
    d = flag or os.environ.get(ENV) or default
    return Path(d) if d else None


def tokens_path(folder: Path, text_sha256: str, identity: str) -> Path:
    return Path(folder) / f"tokens-{text_sha256[:16]}-{identity[:16]}.tok"


def tokenizer_path(folder: Path, text_sha256: str, vocab: int) -> Path:
    return Path(folder) / f"bpe-{text_sha256[:16]}-{vocab}.json"


def _sha_of(arr: np.ndarray) -> bytes:
    h = hashlib.sha256()
    flat = arr.reshape(-1)
    step = (16 << 20) // max(flat.itemsize, 1)
    for o in range(0, flat.shape[0], step):
        h.update(memoryview(np.ascontiguousarray(flat[o:o + step])).cast("B"))
    return h.digest()


def _write(path: Path, parts):
    write_atomic(path, parts, what="the token cache", make_parent=True)


def write_tokens(path: Path, tokens: np.ndarray, text_sha256: str, identity: str):
    dt = np.dtype(tokens.dtype).newbyteorder("<")
    tokens = np.ascontiguousarray(tokens, dtype=dt)
    header = (MAGIC + int(dt.itemsize).to_bytes(8, "little")
              + int(tokens.shape[0]).to_bytes(8, "little") + bytes.fromhex(text_sha256)
              + bytes.fromhex(identity) + _sha_of(tokens))
    header += b"\0" * (HEADER - len(header))
    _write(path, [header, memoryview(tokens).cast("B")])


def open_tokens(path: Path, text_sha256: str, identity: str):
    """The memory-mapped tokens, or None when the file is missing or not the one
    asked for (wrong header, truncated, or its checksum does not match)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            h = f.read(HEADER)
        size = path.stat().st_size
    except OSError:
        return None
    if len(h) != HEADER or h[:8] != MAGIC:
        return None
    item = int.from_bytes(h[8:16], "little")
    n = int.from_bytes(h[16:24], "little")
    if item not in (2, 4) or size != HEADER + n * item:
        return None
    if h[24:56] != bytes.fromhex(text_sha256) or h[56:88] != bytes.fromhex(identity):
        return None
    if n == 0:
        return np.zeros(0, "<u2" if item == 2 else "<u4")
    arr = np.memmap(path, dtype="<u2" if item == 2 else "<u4", mode="r", offset=HEADER,
                    shape=(n,))
    if _sha_of(arr) != h[88:120]:
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
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        if (obj.get("version") != TOKENIZER_CACHE_VERSION
                or obj.get("text_sha256") != text_sha256 or not isinstance(obj["identity"], str)):
            return None
        return json.dumps(obj["tokenizer"], separators=(",", ":")), obj["identity"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
