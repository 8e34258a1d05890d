"""One writer per output folder: a training run holds an exclusive lock on
OUT/.hslm.lock for as long as it runs.

The lock is flock(2) on an open file, so the kernel drops it when the holder
exits, however it exits (kill -9 included): a lock left by a dead process never
blocks. The file holds the holder's PID, for the message a second run prints.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import HslmError

LOCK_NAME = ".hslm.lock"


class FolderLock:
    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self.fd = None

    def acquire(self):
        import fcntl
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise HslmError(f"cannot create the lock file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"process {holder}" if holder else "another process"
            raise HslmError(f"another hslm run ({who}) is writing to {self.path.parent}; "
                            "wait for it to finish or choose another --out") from None
        except OSError as e:  # a file system without flock: say so rather than run unguarded
            os.close(fd)
            raise HslmError(f"cannot lock {self.path}: {e.strerror}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _read_pid(fd):
    try:
        s = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(s) if s.isdigit() else None
