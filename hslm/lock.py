"""One writer per output folder: a training run holds an exclusive lock on
OUT/.hslm.lock for as long as it runs.

The lock is flock(2) on an open file, so the kernel drops it when the holder
exits, however it exits (kill -9 included): a lock left by a dead process never
blocks. The file holds the holder's PID, for the message a second run prints.

The lock file must be a regular file (or not exist yet): a FIFO, device, socket,
folder or symbolic link (dangling or not) at its name is refused in one line, before
it is opened; it is opened without following a link and non-blocking (a FIFO opened
for writing would wait for a reader), and judged again once open.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import HslmError, node_kind

LOCK_NAME = ".hslm.lock"


class FolderLock:
    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self.fd = None
        self.dir_fd = None  # the folder locked: the run's checkpoints are written through it

    def acquire(self):
        from .checkpoint import open_folder
        try:
            self.dir_fd = open_folder(self.path.parent)
        except OSError as e:
            raise HslmError(f"cannot open the folder {self.path.parent}: "
                            f"{e.strerror or e}") from None
        try:
            self.fd = self._lock_in(self.dir_fd)
        except BaseException:
            os.close(self.dir_fd)
            self.dir_fd = None
            raise
        return self

    def _lock_in(self, dir_fd):
        """The lock file inside the folder opened as dir_fd (so that the folder locked is
        the one held, whatever its name does meanwhile), locked and holding our pid."""
        import fcntl
        try:  # judged before opening: opening a device can itself do something
            self._refuse_unless_regular(os.lstat(LOCK_NAME, dir_fd=dir_fd).st_mode)
        except FileNotFoundError:
            pass  # created below
        except OSError as e:
            raise HslmError(f"cannot use the lock file {self.path}: {e.strerror or e}") from None
        flags = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_NONBLOCK", 0))
        try:
            fd = os.open(LOCK_NAME, flags, 0o644, dir_fd=dir_fd)
        except OSError as e:
            raise HslmError(f"cannot create the lock file {self.path}: {e.strerror or e}") from None
        try:  # again on what was opened: the name may have changed since lstat
            self._refuse_unless_regular(os.fstat(fd).st_mode)
        except OSError as e:
            os.close(fd)
            raise HslmError(f"cannot use the lock file {self.path}: {e.strerror or e}") from None
        except HslmError:
            os.close(fd)
            raise
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
            raise HslmError(f"cannot lock {self.path}: {e.strerror or e}") from None
        try:  # the file locked must still be the one at the name: its holder may have
            # removed it (its pid could not be written) while we waited to lock it
            current = os.path.samestat(os.fstat(fd), os.lstat(LOCK_NAME, dir_fd=dir_fd))
        except OSError:
            current = False
        if not current:
            os.close(fd)
            raise HslmError(f"another hslm run is starting in {self.path.parent} (its lock "
                            "file was replaced while this run took it); wait for it to finish "
                            "or choose another --out")
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:  # a full disk, say: the lock is dropped with the file closed,
            # and the file, held by us and holding no pid, removed (its folder may be one
            # this run made, to be removed if empty)
            try:
                os.unlink(LOCK_NAME, dir_fd=dir_fd)
            except OSError:
                pass
            os.close(fd)
            raise HslmError(f"cannot write the lock file {self.path}: {e.strerror or e}") from None
        return fd

    def _refuse_unless_regular(self, mode):
        if not stat.S_ISREG(mode):
            raise HslmError(f"the lock file {self.path} is {node_kind(mode)}, not a regular file; "
                            "remove it or choose another --out")

    def check(self):
        """None while this path still leads to the lock file held; else what happened:
        "moved" (the folder held, still this run's, is under another name or none: the
        name may be another folder, which another run may lock) or "unlocked" (the lock
        file held was removed: another run may lock the folder itself)."""
        if self.fd is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        # the file held read after its name: a removal between the two reads then says
        # "unlocked" (or nothing yet), never "moved" for a folder that is where it was
        held = os.fstat(self.fd)
        if st is not None and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            return None
        return "unlocked" if held.st_nlink == 0 else "moved"

    def holds(self, folder) -> bool:
        """Whether folder (a name) is the folder this lock holds, now."""
        if self.dir_fd is None:
            return False
        try:
            return os.path.samestat(os.stat(folder), os.fstat(self.dir_fd))
        except OSError:
            return False

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def _read_pid(fd):
    try:
        s = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(s) if s.isdigit() else None
