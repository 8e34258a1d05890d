"""A training text that is never held whole in a Python string: one or more UTF-8
files (or the built-in corpus), streamed in chunks when hashed, checked and read
into the tokenizer's id array; with a progress line and a prompt Ctrl-C."""
from __future__ import annotations

import codecs
import hashlib
import os
import stat
import sys
import threading
import time
import unicodedata
from pathlib import Path

import numpy as np

from .errors import HslmError, open_regular, warn
from .progress import duration

CHUNK = 16 << 20
SEP = b"\n\n"               # files are joined as the built-in corpus's topics are
SHOW_FROM = 4 << 20          # smaller texts are read without any progress output


def _files_of(p: Path):
    """A --data path's files: the path itself, or a folder's regular files (not hidden:
    no leading dot) in the order of their names in Unicode's composed form (NFC), so a
    folder copied from a system that stores names decomposed (macOS's HFS+) gives the
    same text. Anything else in the folder is refused by name: a pipe, a device, a link
    to nothing (data not fetched, a disk not mounted) would otherwise leave the text
    short without a word; a subfolder is left out with a warning."""
    if p.is_dir():
        files, folders = [], []
        try:
            entries = [q for q in p.iterdir() if not q.name.startswith(".")]
        except OSError as e:
            raise HslmError(f"cannot read data folder {p}: {e.strerror or e}") from None
        for q in entries:
            try:
                mode = q.stat().st_mode  # (through links)
            except FileNotFoundError:
                raise HslmError(f"data folder {p}: {q.name} is a link to nothing; only its "
                                "regular files are read") from None
            except OSError as e:
                raise HslmError(f"data folder {p}: cannot read {q.name}: {e.strerror or e}"
                                ) from None
            if stat.S_ISREG(mode):
                files.append(q)
            elif stat.S_ISDIR(mode):
                folders.append(q.name)
            else:
                raise HslmError(f"data folder {p}: {q.name} is not a regular file (a pipe, "
                                "socket or device); only its regular files are read")
        files.sort(key=lambda q: (unicodedata.normalize("NFC", q.name), q.name))
        folders.sort()
        shown = ", ".join(folders[:3]) + (", ..." if len(folders) > 3 else "")
        if not files:
            raise HslmError(f"data folder {p} has no files"
                            + (f" (only folders, which are not read: {shown})" if folders else ""))
        if folders:  # one level only, as the README says: say what is left out
            from . import distributed
            if distributed.is_writer():
                warn(f"data folder {p}: {len(folders)} folder(s) in it are not read "
                     f"({shown}); give any that holds text as --data too")
        return files
    return [p]


class DataChanged(HslmError):
    """The text's bytes changed while hslm read them (or are not those a hash named)."""


class FileCheck:
    """One file's checks as its chunks pass: its UTF-8 (where asked: the bytes of a
    character split between chunks carried to the next) and its NUL bytes, for the one
    rule on them (check_nuls): a file of which an eighth or more is NUL bytes is UTF-8
    only to the letter, UTF-16 without a byte order mark (every other byte NUL for Latin
    text) or binary data, which had been trained on without a word."""

    def __init__(self, file, utf8: bool):
        self.file, self.utf8, self.carry = file, utf8, b""
        self.count, self.first, self.size = 0, -1, 0

    def add(self, b: bytes, off: int):
        """The file's chunk b, at offset off. (A search for a first NUL first: in a text
        with none, as most are, it runs at memory speed, where counting took 0.8 s a GB,
        60% on the hashing pass's time.)"""
        if self.utf8:
            self._decode(b, off, False)
        first = b.find(0)
        if first >= 0:
            self.count += b.count(0)
            self.first = off + first if self.first < 0 else self.first
        self.size = off + len(b)

    def end(self):
        """The file's last chunk has passed: a character left unfinished is not UTF-8."""
        if self.utf8:
            self._decode(b"", self.size, True)

    def _decode(self, b: bytes, off: int, final: bool):
        data = self.carry + b
        start = off - len(self.carry)
        try:
            _, used = codecs.utf_8_decode(data, "strict", final)
        except UnicodeDecodeError as e:
            raise HslmError(f"data file {self.file} is not UTF-8 text (byte "
                            f"0x{data[e.start]:02x} at offset {start + e.start})") from None
        self.carry = data[used:]

    def too_many_nuls(self) -> bool:
        return self.count > 0 and self.count * 8 >= self.size

    def check_nuls(self):
        if self.too_many_nuls():
            raise HslmError(f"data file {self.file} is {self.count / self.size:.1%} NUL bytes "
                            f"(the first at offset {self.first}): UTF-16 text or binary data, "
                            "not UTF-8 text")


class _FileChecks:
    """The FileCheck of each file in turn as the text's chunks pass (add); ended(check) is
    called with each file's once its last chunk has passed and its UTF-8 is judged."""

    def __init__(self, utf8: bool, ended):
        self.utf8, self.ended, self.cur = utf8, ended, None

    def add(self, b: bytes, f, off: int):
        if f is None:  # (the separator between files)
            return
        if self.cur is None or self.cur.file is not f:
            self.close()
            self.cur = FileCheck(f, self.utf8)
        self.cur.add(b, off)

    def close(self):
        if self.cur is not None:
            self.cur.end()
            self.ended(self.cur)
            self.cur = None


class TextSource:
    """The bytes of the built-in text (`text` given) or of files joined by SEP."""

    def __init__(self, paths=None, text: str | None = None, label: str | None = None):
        self.nul_file = None  # scan's first file of too many NUL bytes (check_nul_files)
        if text is not None:
            self.blob = text.encode("utf-8")
            self.files = []
            self.size = len(self.blob)
            self.label = label or "text"
            return
        self.blob = None
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        files = []
        for p in paths:
            files.extend(_files_of(Path(p)))
        self.files = []
        size = 0
        for f in files:
            try:
                st = f.stat()
            except FileNotFoundError:
                raise HslmError(f"data file not found: {f}") from None
            except OSError as e:
                raise HslmError(f"cannot read data file {f}: {e.strerror}") from None
            if not f.is_file():
                raise HslmError(f"data file {f} is not a regular file")
            self.files.append(f)
            size += st.st_size
        size += len(SEP) * max(len(self.files) - 1, 0)
        self.size = size
        self.label = label or (str(paths[0]) if len(paths) == 1 else
                               f"{len(self.files)} files ({', '.join(map(str, paths))})")

    def stat_key(self):
        """Per file, in order: [path, size, mtime_ns, ctime_ns, inode, device], what a
        remembered sha256 of the text is keyed by (as git's index and make judge a file
        unchanged); None for a text held in memory."""
        if self.blob is not None:
            return None
        key = []
        for f in self.files:
            try:
                st = f.stat()
            except OSError as e:
                raise HslmError(f"cannot read data file {f}: {e.strerror}") from None
            key.append([str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                        st.st_ino, st.st_dev])
        return key

    def _open(self, f):
        """f opened for reading, refused if it is no longer a regular file (a name swapped
        for a pipe since it was listed would wait for a writer forever)."""
        return open_regular(f, "data file")[0]

    def chunks(self, progress=None):
        """(bytes, file or None, offset of the chunk in that file), in order."""
        if self.blob is not None:
            for o in range(0, max(len(self.blob), 1), CHUNK):
                yield self.blob[o:o + CHUNK], None, o
                if progress:
                    progress.update(min(o + CHUNK, len(self.blob)))
            return
        done = 0
        for i, f in enumerate(self.files):
            if i:
                yield SEP, None, 0
                done += len(SEP)
            with self._open(f) as fh:
                off = 0
                while True:
                    try:
                        b = fh.read(CHUNK)
                    except OSError as e:
                        raise HslmError(f"cannot read data file {f}: {e.strerror}") from None
                    if not b:
                        break
                    yield b, f, off
                    off += len(b)
                    done += len(b)
                    if progress:
                        progress.update(done)

    def scan(self, progress=None, utf8=False) -> str:
        """sha256 of the joined bytes (checking that the files did not change size), noting
        the first file an eighth or more NUL bytes, for check_nul_files; with utf8, also
        refusing a file that is not UTF-8 text, as read_pieces does (a text of gigabytes
        read in pieces would otherwise be refused only when its bad byte's piece came,
        after the pieces before it had been learned from and encoded)."""
        h = hashlib.sha256()
        total = 0
        files = _FileChecks(utf8, self._note)
        for b, f, off in self.chunks(progress):
            h.update(b)
            total += len(b)
            files.add(b, f, off)
        files.close()
        if total != self.size:
            raise HslmError(f"the data changed while it was read ({self.label})")
        return h.hexdigest()

    def _note(self, check):
        if self.nul_file is None and check.too_many_nuls():
            self.nul_file = check

    def check_nul_files(self):
        """For a text whose tokens a cache holds (not read again: read_ids makes this check
        as it reads): refuse it as read_ids would where scan saw a file of too many NUL
        bytes. The same bytes split into other files (a NUL file and a text, or the two in
        one file) had been refused or trained on as the cache held them or not. (Not
        UTF-8 needs no such check: a cache is only made of a text that is, and so is
        each of its files, joined by ASCII.)"""
        if self.nul_file is not None:
            self.nul_file.check_nuls()

    def read_ids(self, dtype, offset_by: int, progress=None, expect_sha256=None) -> np.ndarray:
        """The joined bytes as ids (byte + offset_by) in a fresh array of dtype, with
        read_pieces' checks."""
        whole = list(self.read_pieces(dtype, offset_by, max(self.size, 1), progress,
                                      expect_sha256))
        return whole[0] if whole else np.empty(0, dtype)

    def read_pieces(self, dtype, offset_by: int, piece: int, progress=None,
                    expect_sha256=None):
        """The joined bytes as ids (byte + offset_by) of dtype, `piece` bytes at a time
        (the last piece shorter), each in a fresh array. Checks that every file is UTF-8
        text (else an error naming the file and the offset of the first bad byte) and not
        an eighth or more NUL bytes (FileCheck), and, given expect_sha256 (the text's hash
        taken before, or remembered), that these are the bytes it was taken of: a file
        rewritten in between at the same size would otherwise be trained on under the
        other text's name. The last checks come once the last piece has been taken: only
        a caller that exhausts the generator has had them. (A text whose tokens a cache
        holds is not read here: check_nul_files.)"""
        out = np.empty(min(piece, self.size), dtype)
        pos = filled = 0
        files = _FileChecks(True, FileCheck.check_nuls)
        h = hashlib.sha256() if expect_sha256 is not None else None
        for b, f, off in self.chunks(progress):
            if h is not None:
                h.update(b)
            if pos + len(b) > self.size:
                raise HslmError(f"the data changed while it was read ({self.label})")
            files.add(b, f, off)
            raw = np.frombuffer(b, np.uint8)
            while raw.shape[0]:
                take = min(raw.shape[0], out.shape[0] - filled)
                np.add(raw[:take], offset_by, out=out[filled:filled + take], casting="unsafe")
                raw, filled, pos = raw[take:], filled + take, pos + take
                if filled == out.shape[0]:
                    yield out
                    filled = 0
                    out = np.empty(min(piece, self.size - pos), dtype) if pos < self.size \
                        else out
        files.close()
        if pos != self.size or (h is not None and h.hexdigest() != expect_sha256):
            raise DataChanged(f"the data changed while it was read ({self.label})")


def _mb(n):
    return f"{n / 1e6:,.1f} MB"


class Phase:
    """One line of progress for a phase over `total` units: redrawn in place on a
    terminal (done, rate, time left), a plain line at the end otherwise. Silent
    when `show` is False."""

    def __init__(self, what: str, total: int, unit="bytes", show=True, stream=None):
        from .distributed import is_writer
        self.stream = stream or sys.stderr
        self.show = show and is_writer()  # (MPI: rank 0 alone, as for every line of a run's)
        self.tty = self.show and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.what, self.total, self.unit = what, max(total, 1), unit
        self.t0 = self.last = time.perf_counter()
        self.done = 0

    def _fmt(self, n):
        return _mb(n) if self.unit == "bytes" else f"{n:,} {self.unit}"

    def update(self, done):
        self.done = done
        if not self.tty:
            return
        now = time.perf_counter()
        if now - self.last < 0.2 and done < self.total:
            return
        self.last = now
        el = now - self.t0
        rate = done / el if el > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else 0.0
        r = f"{rate / 1e6:,.1f} MB/s" if self.unit == "bytes" else f"{rate:,.1f} {self.unit}/s"
        self.stream.write(f"\r{self.what}: {self._fmt(done)} / {self._fmt(self.total)} | {r} | "
                          f"{duration(left)} left   ")
        self.stream.flush()

    def close(self, note="", done=None):
        """The phase's last line: `done` units (all of them unless given) and note."""
        if not self.show:
            return
        el = time.perf_counter() - self.t0
        line = f"{self.what}: {self._fmt(self.total if done is None else done)} in {el:.1f}s{note}"
        if self.tty:
            self.stream.write("\r" + line + " " * 20 + "\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run_interruptible(fn, ctl, poll=None, interval=0.1):
    """Runs fn() (a nogil kernel watching ctl[0]) in a worker thread; calls poll()
    every `interval` s. Ctrl-C sets ctl[0] and waits for the kernel to notice."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="hslm-bpe")
    t.start()
    try:
        while t.is_alive():
            t.join(interval)
            if poll:
                poll()
    except KeyboardInterrupt:
        ctl[0] = 1
        t.join()
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]
