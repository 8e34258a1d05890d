"""Checkpoint files: safetensors containers written by our own deterministic code.

Layout of both files (little-endian), which any safetensors, numpy or PyTorch
reader can load:

    u64          N, the header's length in bytes
    N bytes      JSON header, keys sorted, no spaces, padded with spaces to a
                 multiple of 8 so that the data section is 8-byte aligned:
                 {"__metadata__": {...strings...},
                  "<tensor>": {"dtype": "F64", "shape": [...], "data_offsets": [a, b]}, ...}
    data         the tensors' f64 bytes, back to back, in header-offset order

ckpt_<step>.bin holds the parameters, one tensor per spec tensor in parameter
order, so its data section is exactly the flat parameter vector.
ckpt_<step>.state holds AdamW's first and second moments ("adam.m", "adam.v",
flat, parameter order).

__metadata__ (all values strings): format "hslm", format_version "1", kind
("params" or "state"), config (JSON), step, data_sha256 (the checksum of the
data section). The state adds: params_sha256 (the data_sha256 of the .bin it
belongs to), rng (the data generator's state, JSON), hyper (the training
hyper-parameters, JSON), tokenizer (sha256 identity), text_sha256 and
data_source ("built-in <name>" or "--data text": never a path, so that the bytes do
not depend on how a path was spelled).

Files are written atomically: a temporary file in the same folder, flushed and
fsynced, then renamed over the final name, so a reader never sees a half
written checkpoint under its final name.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from .config import Config
from .errors import HslmError, read_bytes

FORMAT = "hslm"
FORMAT_VERSION = "1"


def encode(tensors, metadata: dict) -> bytes:
    """tensors: [(name, f64 array)] in data order -> the file's bytes."""
    header = {}
    chunks = []
    off = 0
    for name, arr in tensors:
        a = np.ascontiguousarray(arr, dtype="<f8")
        header[name] = {"dtype": "F64", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        chunks.append(a.tobytes())
        off += a.nbytes
    data = b"".join(chunks)
    meta = dict(metadata)
    meta.update(format=FORMAT, format_version=FORMAT_VERSION,
                data_sha256=hashlib.sha256(data).hexdigest())
    header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def write_atomic(path: Path, blob: bytes):
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise HslmError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class Checkpoint:
    """A parsed, checksum-verified checkpoint file."""

    def __init__(self, path, raw: bytes, header: dict, data_start: int):
        self.path = Path(path)
        self.raw = raw
        self.meta = header.pop("__metadata__")
        self.header = header
        self.data_start = data_start
        self.kind = self.meta.get("kind")
        self.step = int(self.meta["step"])
        self.config = Config.from_json(self.meta["config"])

    def names(self):
        return sorted(self.header, key=lambda n: self.header[n]["data_offsets"][0])

    def tensor(self, name) -> np.ndarray:
        h = self.header[name]
        a, b = h["data_offsets"]
        arr = np.frombuffer(self.raw, "<f8", count=(b - a) // 8, offset=self.data_start + a)
        return arr.reshape(h["shape"])

    def flat(self) -> np.ndarray:
        """All tensors' data as one f64 vector, in data order (a copy)."""
        return np.frombuffer(self.raw, "<f8", offset=self.data_start).astype(np.float64)

    @property
    def data_sha256(self) -> str:
        return self.meta["data_sha256"]


def read(path, expect_kind=None) -> Checkpoint:
    """Parse and verify a checkpoint; any defect is one clear HslmError."""
    path = Path(path)
    raw = read_bytes(path, "checkpoint")
    bad = f"{path} is not a valid hslm checkpoint"
    if len(raw) < 8:
        raise HslmError(f"{bad}: file is truncated ({len(raw)} bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8 or n > 100_000_000:
        raise HslmError(f"{bad}: header length {n} exceeds the file ({len(raw)} bytes); "
                        "truncated or corrupt")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
        meta = header["__metadata__"]
        if meta.get("format") != FORMAT:
            raise ValueError("not an hslm file")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported format version {meta.get('format_version')}")
        end = 0
        for name, h in header.items():
            if name == "__metadata__":
                continue
            if h["dtype"] != "F64":
                raise ValueError(f"tensor {name} has dtype {h['dtype']}")
            a, b = h["data_offsets"]
            if b - a != 8 * int(np.prod(h["shape"], dtype=np.int64)):
                raise ValueError(f"tensor {name} has inconsistent offsets")
            end = max(end, b)
        int(meta["step"])
        Config.from_json(meta["config"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise HslmError(f"{bad}: damaged header ({e})") from None
    data = raw[8 + n:]
    if len(data) != end:
        raise HslmError(f"{bad}: data section is {len(data)} bytes, header says {end}; "
                        "truncated or corrupt")
    if hashlib.sha256(data).hexdigest() != meta["data_sha256"]:
        raise HslmError(f"{path}: checksum mismatch, the file is corrupt")
    ck = Checkpoint(path, raw, header, 8 + n)
    if expect_kind and ck.kind != expect_kind:
        raise HslmError(f"{path} is a '{ck.kind}' file, expected '{expect_kind}'")
    return ck


def params_blob(cfg: Config, theta: np.ndarray, step: int) -> bytes:
    offs = cfg.offsets()
    tensors = [(name, theta[offs[t]:offs[t + 1]].reshape(shape))
               for t, (name, shape, _) in enumerate(cfg.tensors())]
    return encode(tensors, {"kind": "params", "config": cfg.to_json(), "step": step})


def state_blob(cfg: Config, m, v, step: int, params_sha256: str, extra: dict) -> bytes:
    meta = {"kind": "state", "config": cfg.to_json(), "step": step,
            "params_sha256": params_sha256}
    meta.update(extra)
    return encode([("adam.m", m), ("adam.v", v)], meta)


def params_sha256_of(blob: bytes) -> str:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n])["__metadata__"]["data_sha256"]
