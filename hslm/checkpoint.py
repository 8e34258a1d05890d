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

__metadata__ (all values strings): format "hslm", format_version "2", kind
("params" or "state"), config (JSON), step, data_sha256 (the checksum of the
data section) and header_sha256. The .bin adds tokenizer (the run's tokenizer
itself, its JSON: vocab and merges). The state adds: params_sha256 (the
data_sha256 of the .bin it belongs to), rng (the data generator's state,
JSON), hyper (the training hyper-parameters, JSON), tokenizer (sha256
identity), text_sha256 and data_source ("built-in <name>" or "--data text", by the
text's sha256: never a path, so that the bytes do not depend on how the text was given).

Integrity (format 2): header_sha256 is the sha256 of the canonical header JSON
(keys sorted, no spaces, no padding) with header_sha256 itself left out of
__metadata__. Since the header holds data_sha256, the two checksums cover every
byte of the file: a reader requires the header bytes to be exactly the
canonical encoding of what they parse to (plus 0-7 spaces of padding), the
header checksum to match, then the data checksum. Any change anywhere is
refused before a single field is believed: as damage, or, in a header whose
checksum was made anew, by the structure check. Between the two checksums
the structure is checked, from the header alone, against what the config
implies: the exact tensor names, order, dtypes, shapes and offsets, the metadata
keys, and every stored value exactly as the CLI checks its flags (so the data's
size is judged before the data is read or hashed).

Files are written atomically: a temporary file in the same folder, flushed and
fsynced, then renamed over the final name, so a reader never sees a half
written checkpoint under its final name.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from .config import Config, canonical_json
from .errors import HslmError, open_regular, refuse_unless_file
from .validate import (MAX_JSON, Invalid, check_fits, check_rng_state, config_from_json, exact_keys,
                       hyper_from_json, is_hex64, parse_json)

FORMAT = "hslm"
FORMAT_VERSION = "2"

# The metadata keys of each kind, exactly (values are checked in _check_meta).
META_COMMON = ("format", "format_version", "kind", "config", "step", "data_sha256",
               "header_sha256")
META_KEYS = {
    "params": META_COMMON + ("tokenizer",),
    "state": META_COMMON + ("params_sha256", "rng", "hyper", "tokenizer", "text_sha256",
                            "data_source"),
}
MAX_HEADER = MAX_JSON


def _canonical(header: dict) -> bytes:
    return canonical_json(header).encode("utf-8")


def encode_parts(tensors, metadata: dict) -> list:
    """tensors: [(name, f64 array)] in data order -> the file's bytes as parts to write
    one after another: its length and header (bytes), then each tensor's bytes as a uint8
    view of the array itself, hashed where it lies. Nothing is copied: saving a model of
    P parameters had built the whole file in memory, tensor by tensor and then joined,
    about 7 x 8P bytes beside the run (a run that fits memory could be killed by its first
    save). The arrays must not change until the parts are written."""
    header = {}
    views = []
    data_hash = hashlib.sha256()
    off = 0
    for name, arr in tensors:
        a = np.ascontiguousarray(arr, dtype="<f8")
        header[name] = {"dtype": "F64", "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        views.append(a.reshape(-1).view(np.uint8))
        data_hash.update(views[-1])
        off += a.nbytes
    meta = dict(metadata)
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, data_sha256=data_hash.hexdigest())
    meta.pop("header_sha256", None)
    header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    header["__metadata__"]["header_sha256"] = hashlib.sha256(_canonical(header)).hexdigest()
    h = _canonical(header)
    h += b" " * (-len(h) % 8)
    return [struct.pack("<Q", len(h)) + h, *views]


def encode(tensors, metadata: dict) -> bytes:
    """The file's bytes in one piece (encode_parts joined)."""
    return b"".join(encode_parts(tensors, metadata))


def check_atomic_target(path: Path, flag: str):
    """Refuse, before any long work, a path that write_atomic could not write later:
    a folder; a FIFO, a device or a socket (the rename would put a file in place of
    the node, /dev/null included); or a name whose folder is missing or refuses a new
    file (the temporary file and the rename need the folder; the file's own mode does
    not matter)."""
    path = Path(path)
    refuse_unless_file(path, flag)
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise HslmError(f"{flag} {path}: {parent} {what}")
    try:
        probe_new_file(parent, f".{path.name}.probe{os.getpid()}")
    except OSError as e:
        raise HslmError(f"{flag} {path}: cannot write in {parent} ({e.strerror or e})") from None


def probe_new_file(folder: Path, name: str):
    """Make the file `name` in folder and remove it, or raise OSError: a real write, as
    os.access says yes to root, and some file systems refuse new files."""
    probe = Path(folder) / name
    os.close(new_file_in(None, str(probe)))
    probe.unlink()


def write_atomic(path: Path, blob, what: str = "checkpoint", make_parent: bool = False,
                 dir_fd=None, finish=None):
    """Write blob (bytes, or an iterable of byte-like parts) to path atomically: a
    temporary file in the same folder, flushed and fsynced, renamed over path, and the
    folder fsynced. A reader never sees a half-written file under path. dir_fd: the
    folder, open (a run's locked folder, FolderLock.dir_fd): written there whatever its
    name has become (path's folder then only names it in messages). finish(f), if given,
    is called with the file open once every part is written, before it is fsynced (a
    header that counts the parts, written over its place at the start)."""
    write_atomic_files([(path, blob)], what, make_parent, dir_fd, finish)


def write_atomic_files(files, what: str = "checkpoint", make_parent: bool = False,
                       dir_fd=None, finish=None):
    """write_atomic for several files of one folder, [(path, blob)], as one: each is
    written whole to its temporary file before any is renamed, so a write that fails
    (a full disk, a second Ctrl-C) leaves every file as it was. (A checkpoint's .bin
    and .state are a pair: the .bin renamed before the .state was written had left a
    new .bin beside the old .state, and neither step could be resumed.)"""
    files = [(Path(path), blob) for path, blob in files]
    path = files[0][0]
    if dir_fd is not None:
        return _write_atomic_in(dir_fd, files, what, finish)
    try:
        if make_parent:
            for folder in (path.parent, *path.parent.parents):
                if folder.exists():  # the nearest one there must be a folder
                    if not folder.is_dir():
                        raise NotADirectoryError(errno.ENOTDIR, f"{folder} is not a folder")
                    break
            make_folders(path.parent)
        folder_fd = open_folder(path.parent)
    except OSError as e:
        raise HslmError(f"cannot write {what} {path}: {e.strerror or e}") from None
    try:
        _write_atomic_in(folder_fd, files, what, finish)
    finally:
        os.close(folder_fd)


def make_writable_folder(folder: Path):
    """mkdir -p folder (make_folders) and write a file in it (probe_new_file), or raise
    OSError: a folder a run is to write in, judged before the run's work."""
    make_folders(folder)
    probe_new_file(folder, f".hslm-write-test-{os.getpid()}")


def first_missing_folder(folder: Path):
    """The topmost of folder and the folders above it that is not there yet (what
    make_folders would make first), or None where folder is there."""
    top = Path(folder)
    if top.exists():
        return None
    while not top.parent.exists():
        top = top.parent
    return top


def remove_empty_folders(folder: Path, top: Path):
    """Remove folder, then each one above it up to top, while each is empty: what a
    failed command made (first_missing_folder) and nothing else has written to."""
    for f in (Path(folder), *Path(folder).parents):
        try:
            os.rmdir(f)  # (only if empty)
        except OSError:
            return
        if f == top:
            return


def make_folders(folder: Path):
    """mkdir -p, each folder made durable where it is named: a file renamed into a new
    folder is only as durable as the folder's own entry in its parent (that parent
    fsynced; a file system that cannot fsync a folder is left as it is)."""
    missing = []
    for f in (Path(folder), *Path(folder).parents):
        if os.path.lexists(f):
            break
        missing.append(f)
    for f in reversed(missing):
        f.mkdir(exist_ok=True)
        try:
            fd = os.open(f.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
    if not missing:
        Path(folder).mkdir(exist_ok=True)  # (there: a folder, or the error mkdir gives)


def open_folder(folder) -> int:
    """A folder opened to name files in (dir_fd): read-only, or where the folder may be
    written and searched but not listed (mode 0733), as a path only (Linux's O_PATH:
    enough for openat, renameat and unlinkat; its fsync fails, which is ignored)."""
    directory = getattr(os, "O_DIRECTORY", 0)
    try:
        return os.open(folder, os.O_RDONLY | directory)
    except PermissionError:
        if not hasattr(os, "O_PATH"):
            raise
        return os.open(folder, os.O_PATH | directory)


def new_file_in(dir_fd, name: str) -> int:
    """A new, empty file `name` in the open folder dir_fd (None: the current folder),
    open for writing. Never through a symbolic link (O_EXCL refuses any name that
    exists: a link planted in a shared folder would have had its target truncated); a
    file of that name, left by an earlier process of the same pid, is removed first."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.open(name, flags, 0o666, dir_fd=dir_fd)


def _write_atomic_in(dir_fd, files, what: str, finish=None):
    """write_atomic_files with every name taken in the open folder dir_fd (finish: as
    write_atomic's, called for each file: write_atomic's one)."""
    tmps = [f".{path.name}.tmp{os.getpid()}" for path, _ in files]
    path = files[0][0]
    try:
        for (path, blob), tmp in zip(files, tmps):
            parts = [blob] if isinstance(blob, (bytes, bytearray, memoryview)) else blob
            fd = new_file_in(dir_fd, tmp)
            with open(fd, "wb") as f:
                for part in parts:
                    f.write(part)
                    del part  # (a part of gigabytes is not held while the next is made)
                if finish is not None:
                    finish(f)
                f.flush()
                os.fsync(f.fileno())
        for (path, _), tmp in zip(files, tmps):
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:  # (a second Ctrl-C mid-write too: no temporary file left)
        for tmp in tmps:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise HslmError(f"cannot write {what} {path}: {e.strerror or e}") from None
        raise
    try:  # make the rename itself durable
        os.fsync(dir_fd)
    except OSError:
        pass


class Checkpoint:
    """A parsed checkpoint whose every byte and field has been checked. head: the file's
    first bytes as written (the header's length and the header); data: its data section,
    a uint8 array (None when read for its header alone: read(keep_data=False))."""

    def __init__(self, path, head: bytes, header: dict, data, data_len: int, config,
                 hyper=None, tokenizer=None):
        self.path = Path(path)
        self.head = head
        self.data = data
        self.size = len(head) + data_len  # the file's bytes
        self.meta = header.pop("__metadata__")
        self.header = header
        self.kind = self.meta["kind"]
        self.step = int(self.meta["step"])
        self.config = config
        self.hyper = hyper  # .state: the training hyper-parameters (a hyper.Hyper)
        self._tokenizer = tokenizer  # .bin: the run's tokenizer, as read()'s check made it

    def names(self):
        return sorted(self.header, key=lambda n: self.header[n]["data_offsets"][0])

    def _values(self) -> np.ndarray:
        """The data as f64 in this machine's byte order: a view of it (a converted copy
        on a big-endian machine)."""
        if self.data is None:
            raise ValueError(f"{self.path} was read for its header alone")
        values = self.data.view("<f8")
        return values if values.dtype.isnative else values.astype(np.float64)

    def tensor(self, name) -> np.ndarray:
        """A tensor's values, a view of the data: writable where read() read it (a resumed
        run's moments are these arrays), and then changing it changes this checkpoint's
        values, which its checksums no longer describe."""
        h = self.header[name]
        a, b = h["data_offsets"]
        return self._values()[a // 8:b // 8].reshape(h["shape"])

    def flat(self) -> np.ndarray:
        """All tensors' data as one f64 vector, in data order: the data itself where read()
        read it (a run's theta, with no second copy of the model; as for tensor(),
        changing it changes this checkpoint's values), a copy of bytes parse() was given."""
        values = self._values()
        return values if values.flags.writeable else values.copy()

    def same_bytes(self, other: "Checkpoint") -> bool:
        """Whether the two files hold the same bytes: the same header holds the same
        data_sha256, which each file's data was verified against."""
        return self.head == other.head

    @property
    def data_sha256(self) -> str:
        return self.meta["data_sha256"]

    def tokenizer(self):
        """The run's tokenizer, carried by a .bin (made and checked when the file was read:
        not made again, which took seconds for a crafted one's 800,000 merges)."""
        if self._tokenizer is None:
            raise ValueError(f"{self.path} carries no tokenizer (a '{self.kind}' file)")
        return self._tokenizer

    def non_finite(self) -> str | None:
        """What the first tensor that holds a NaN or an infinity holds, else None."""
        if np.isfinite(self._values()).all():
            return None
        for name in self.names():
            x = self.tensor(name)
            bad = ~np.isfinite(x)
            if bad.any():
                return f"{int(bad.sum()):,} of {x.size:,} elements of {name} are NaN or infinite"
        return None

    def check_finite(self):
        """HslmError naming the first tensor that holds a NaN or an infinity."""
        found = self.non_finite()
        if found is not None:
            raise HslmError(f"{self.path} holds non-finite values: {found}")


def _damaged(path, why):
    return HslmError(f"{path} is damaged ({why}); the file is corrupt or not an hslm checkpoint")


class OtherModel(HslmError):
    """read(expect_config=...): the file is of another model."""


# The data section is read and hashed in pieces of this size.
READ_CHUNK = 1 << 22


def read(path, expect_kind=None, keep_data=True, expect_config=None) -> Checkpoint:
    """Read, then verify, a checkpoint; any defect is one clear HslmError.

    Nothing in the file is believed until all of it checks out: the header's integrity
    (canonical form, its checksum, the data's size it describes), then the structure
    the header gives (every field, exactly as written: judged before the data, so an
    absurd size costs nothing), then the data's checksum. The data section is read
    straight into one array (or, with keep_data=False, only hashed, a piece at a time:
    a .state read for its hyper-parameters, whose config must be expect_config, so that
    its size is judged before it is hashed), its sha256 taken as it comes, so the
    file's bytes are in memory once (they had been read whole, then copied: three times
    a model's parameters to resume it)."""
    path = Path(path)
    f, size = open_regular(path, "checkpoint")
    with f:
        try:
            head = f.read(8)
            n = _header_length(head, size, path)
            head += f.read(n)
            data_len = size - len(head)
            header = _checked_header(head, n, data_len, path)
            # (the structure, from the header alone, before the data: a header-only read
            # of a file with an absurd data size is refused at once, not hashed for hours)
            cfg, hyper, tok = _checked_structure(path, header, data_len, expect_kind)
            if expect_config is not None and cfg != expect_config:
                raise OtherModel(f"{path} is of another model ({cfg.to_json()})")
            if keep_data:
                check_fits(data_len, f"reading {path} ({size:,} bytes)")
                data = np.empty(data_len, np.uint8)
            else:
                data, piece = None, np.empty(min(data_len, READ_CHUNK), np.uint8)
            digest = hashlib.sha256()
            done = 0
            while done < data_len:
                k = min(READ_CHUNK, data_len - done)
                into = data[done:done + k] if keep_data else piece[:k]
                got = f.readinto(memoryview(into))
                if not got:
                    raise _damaged(path, f"it ended after {len(head) + done:,} of its "
                                         f"{size:,} bytes while it was read")
                digest.update(into[:got])
                done += got
            if f.read(1):
                raise _damaged(path, "it grew while it was read")
        except OSError as e:
            raise HslmError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if digest.hexdigest() != header["__metadata__"].get("data_sha256"):
        raise _damaged(path, "data checksum mismatch")
    return Checkpoint(path, head, header, data, data_len, cfg, hyper, tok)


def parse(raw: bytes, path, expect_kind=None) -> Checkpoint:
    """read() on bytes already in memory; `path` names the file in messages."""
    n = _header_length(raw[:8], len(raw), path)
    header = _checked_header(raw[:8 + n], n, len(raw) - 8 - n, path)
    data = np.frombuffer(raw, np.uint8, offset=8 + n)
    cfg, hyper, tok = _checked_structure(path, header, len(data), expect_kind)
    if hashlib.sha256(data).hexdigest() != header["__metadata__"].get("data_sha256"):
        raise _damaged(path, "data checksum mismatch")
    return Checkpoint(path, raw[:8 + n], header, data, len(data), cfg, hyper, tok)


def _header_length(first: bytes, size: int, path) -> int:
    """The header's length from the file's first 8 bytes, judged against its size."""
    if len(first) < 8:
        raise _damaged(path, f"truncated to {len(first)} bytes")
    (n,) = struct.unpack("<Q", first)
    # (a real length's high bytes are 0: never text)
    text = None if 2 <= n <= size - 8 else _as_text(first)
    if text is not None:
        raise HslmError(f"{path} is not an hslm checkpoint: it begins with text ({text!r}), "
                        "where a checkpoint begins with the length of its header")
    if n < 2:
        raise _damaged(path, f"its header length is {n}: no header")
    if n > size - 8:
        raise _damaged(path, f"its header length {n:,} reaches past the file's end "
                             f"({size:,} bytes)")
    if n > MAX_HEADER:
        raise _damaged(path, f"its header length {n:,} is more than the {MAX_HEADER:,} allowed")
    return n


def _as_text(raw: bytes) -> str | None:
    """These bytes as text, where they are UTF-8 (the last character may be cut off) of
    printable characters, tabs and line ends; else None. (Printable ASCII alone had called
    a UTF-8 text that begins with "é" or a CJK character damaged, its header length 1e19.)"""
    import codecs
    try:  # (a byte order mark first read past, as some editors write one)
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(raw, final=False)
    except UnicodeDecodeError:
        return None
    ok = text and all(c.isprintable() or c in "\t\n\r" for c in text)
    return text if ok else None


def starts_as_checkpoint(head: bytes) -> bool:
    """Whether a file whose first bytes are `head` (9 or more) begins as an hslm
    checkpoint does: a header length a header may have (the file need not hold it: one
    cut short is a damaged checkpoint, not a text), then the header's "{"."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER and head[8:9] == b"{"


def _checked_header(head: bytes, n: int, data_len: int, path) -> dict:
    """The header (head: the file's first 8 + n bytes), its integrity checked: canonical
    form, header_sha256, and the data's size against what it describes."""
    hbytes = head[8:8 + n]
    if len(hbytes) < n:
        raise _damaged(path, "it ended inside its header while it was read")
    try:
        header = parse_json(hbytes, "the header", limit=MAX_HEADER)
    except Invalid as e:
        raise _damaged(path, str(e)) from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise _damaged(path, "the header has no __metadata__ object")
    meta = header["__metadata__"]
    if (meta.get("format") == FORMAT and "header_sha256" not in meta
            and meta.get("format_version") == "1"):
        raise HslmError(f"{path} is an hslm checkpoint of format 1, written by an older hslm "
                        f"whose files carry no header checksum; this version reads format "
                        f"{FORMAT_VERSION} only")
    canon = _canonical(header)
    if hbytes != canon + b" " * (-len(canon) % 8):
        raise _damaged(path, "the header is not in canonical form")
    claimed = meta.get("header_sha256")
    rest = dict(header, __metadata__={k: v for k, v in meta.items() if k != "header_sha256"})
    if not isinstance(claimed, str) or hashlib.sha256(_canonical(rest)).hexdigest() != claimed:
        raise _damaged(path, "header checksum mismatch")
    described = _described_data_bytes(header)  # the header is as written: its sizes hold
    if described is not None and described != data_len:
        what = "truncated" if data_len < described else "longer than written"
        raise _damaged(path, f"{what}: its header describes {described:,} bytes of data, the "
                             f"file holds {data_len:,}")
    return header


def _checked_structure(path, header, data_len, expect_kind):
    """(config, hyper or None, tokenizer or None): the header is as written (its checksum
    holds); now its structure must be exactly what we write, judged from the header and
    the data's size alone, before the data's own checksum is taken."""
    try:
        checked = _check_meta(header["__metadata__"], header, data_len)
    except Invalid as e:
        raise HslmError(f"{path} is not a valid hslm checkpoint: {e}") from None
    kind = header["__metadata__"]["kind"]
    if expect_kind and kind != expect_kind:
        raise HslmError(f"{path} is a '{kind}' file, expected '{expect_kind}'")
    return checked


def _described_data_bytes(header):
    """The end of the last tensor's data_offsets, or None if an entry is malformed
    (_check_tensors words that)."""
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offs = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in offs)):
            return None
        end = max(end, offs[1])
    return end


def _check_meta(meta, header, data_len):
    for k, v in meta.items():
        if not isinstance(v, str):
            raise Invalid(f"metadata {str(k)[:40]!r} is not a string")
    if meta.get("format") != FORMAT:
        raise Invalid(f"format is {meta.get('format', '')[:40]!r}, not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise Invalid(f"unsupported format version {meta.get('format_version', '')[:20]!r}")
    kind = meta.get("kind")
    if kind not in META_KEYS:
        raise Invalid(f"kind is {str(kind)[:40]!r}, not 'params' or 'state'")
    exact_keys(meta, META_KEYS[kind], "metadata")
    step = meta["step"]
    if not (step.isascii() and step.isdigit() and len(step) < 19 and str(int(step)) == step):
        raise Invalid(f"step {step[:40]!r} is not a non-negative integer")
    cfg = config_from_json(meta["config"])
    _check_tensors(header, kind, cfg, data_len)  # sizes first: nothing big is built before
    for k in ("data_sha256", "header_sha256") + (("params_sha256", "tokenizer", "text_sha256")
                                                 if kind == "state" else ()):
        if not is_hex64(meta[k]):
            raise Invalid(f"{k} is not a sha256 hex digest")
    hyper = tok = None
    if kind == "params":
        from .data import Tokenizer
        try:
            tok = Tokenizer.from_json(meta["tokenizer"])
        except HslmError as e:
            raise Invalid(f"tokenizer: {e}") from None
        if tok.to_json() != meta["tokenizer"]:
            raise Invalid("tokenizer is not in canonical form")
        if tok.vocab != cfg.vocab:
            raise Invalid(f"the tokenizer's vocabulary ({tok.vocab}) is not the model's "
                          f"({cfg.vocab})")
    else:
        hyper = hyper_from_json(meta["hyper"], cfg)
        check_rng_state(meta["rng"])
        if len(meta["data_source"]) > 65536:
            raise Invalid("data_source is too long")
    return cfg, hyper, tok


def _check_tensors(header, kind, cfg, data_len):
    """Names, order, dtypes, shapes and offsets exactly as the config implies; the data
    size is judged first (the config's own bounds keep every size sane)."""
    P = cfg.n_params
    expect_len = 8 * P * (1 if kind == "params" else 2)
    if data_len != expect_len:
        raise Invalid(f"the data section is {data_len:,} bytes; config {cfg.to_json()} "
                      f"implies {expect_len:,}")
    if kind == "params":
        layout = [(name, list(shape)) for name, shape, _ in cfg.tensors()]
    else:
        layout = [("adam.m", [P]), ("adam.v", [P])]
    expect, off = {}, 0
    for name, shape in layout:
        size = 8 * int(np.prod(shape, dtype=np.int64))
        expect[name] = {"data_offsets": [off, off + size], "dtype": "F64", "shape": shape}
        off += size
    given = {k: v for k, v in header.items() if k != "__metadata__"}
    if _canonical(given) != _canonical(expect):
        names = [k for k in given]
        if sorted(names) != sorted(expect):
            raise Invalid("the tensor names are not the ones the config implies "
                          f"({len(names)} tensors, expected {len(expect)})")
        for k in expect:
            if _canonical(given[k]) != _canonical(expect[k]):
                raise Invalid(f"tensor {k} is {_canonical(given[k])[:120].decode()}, expected "
                              f"{_canonical(expect[k]).decode()}")


def params_parts(cfg: Config, theta: np.ndarray, step: int, tokenizer) -> list:
    """The .bin of a run as parts (encode_parts); `tokenizer` (a data.Tokenizer) travels
    inside it."""
    offs = cfg.offsets()
    tensors = [(name, theta[offs[t]:offs[t + 1]].reshape(shape))
               for t, (name, shape, _) in enumerate(cfg.tensors())]
    return encode_parts(tensors, {"kind": "params", "config": cfg.to_json(), "step": step,
                                  "tokenizer": tokenizer.to_json()})


def state_parts(cfg: Config, m, v, step: int, params_sha256: str, extra: dict) -> list:
    """The .state of a run as parts (encode_parts)."""
    meta = {"kind": "state", "config": cfg.to_json(), "step": step,
            "params_sha256": params_sha256}
    meta.update(extra)
    return encode_parts([("adam.m", m), ("adam.v", v)], meta)


def params_sha256_of(parts: list) -> str:
    """The data_sha256 of the file whose parts (params_parts) these are."""
    (n,) = struct.unpack("<Q", parts[0][:8])
    return json.loads(parts[0][8:8 + n])["__metadata__"]["data_sha256"]
