"""A lock between this user's processes on one machine: an exclusive flock on a file in
the temporary folder (the kernel drops it when its holder dies, however it dies). Used
for one parallel compile of a kernel cache at a time (hslm.precompile.CompileLock) and
one tokenization of a text into a token cache at a time (hslm.token_cache.TokenizingLock).
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import time
from pathlib import Path


def lock_path(name: str, key: str = "") -> Path | None:
    """This user's lock file `name` (and key) in the temporary folder,
    `<name>-<uid>[-<key>].lock`; None where no temporary folder is usable (then nothing
    is locked)."""
    try:
        folder = Path(tempfile.gettempdir())
    except OSError:  # (FileNotFoundError: "No usable temporary directory found")
        return None
    return folder / f"{name}-{getattr(os, 'getuid', lambda: 0)()}{'-' + key if key else ''}.lock"


def own_file(path, create: bool = True) -> int | None:
    """A descriptor of path where it is this user's own regular file with no other name
    (made so, 0o600, where nothing is there and create), else None: the temporary
    folder's names are known to every user, who could plant a link there (followed, or a
    hard link's, its target had been written: the holder's note), a FIFO (opening it had
    blocked) or a file of theirs held locked (every first run had waited on it
    forever)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        # (no link: its holder removed it as it let go; take() opens the path again)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_nlink <= 1:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


class UserLock:
    """An exclusive flock on `path`, taken without blocking (take) or polled for (wait),
    with a short note its holder may leave in the file (note, noted). With `removed`, the
    holder deletes the file as it lets go (no file is left per lock ever taken), and a
    taker checks that the file it locked is still the one the path names (a process
    that had opened the file before it was deleted locks a file nobody else sees)."""

    def __init__(self, path: Path, removed: bool = False):
        self.path, self.file, self.removed = Path(path), None, removed
        self.no_flock = False  # the temporary folder's file system has no flock (take())
        self._works = None     # whether flock works there (_flock_works), once tried

    @property
    def held(self) -> bool:
        """Whether this process holds the lock (take() may be True without it: below)."""
        return self.file is not None

    def take(self) -> bool:
        """Hold the lock if it is free (True), else False. An unusable file (not this
        user's own regular file: own_file; a file system without flock; no fcntl): True,
        without holding it (held False): the caller goes on alone, as if no other
        process were there."""
        try:
            import fcntl
        except ImportError:
            return True
        while True:
            fd = own_file(self.path)
            if fd is None:
                return True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process of this user's holds it
                os.close(fd)
                return False
            except OSError:  # (ENOLCK, ENOSYS: a file system without flock)
                os.close(fd)
                self.no_flock = True
                if self.removed:  # (no process can hold it: none would remove it)
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)
                return True
            if not self.removed or self._still_named(fd):
                self.file = os.fdopen(fd, "r+")
                return True
            os.close(fd)  # (its holder deleted it as it let go: the path's new file, then)

    def _still_named(self, fd: int) -> bool:
        try:
            here, named = os.fstat(fd), os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (named.st_dev, named.st_ino)

    def held_elsewhere(self) -> bool | None:
        """Whether another process holds the lock, judged without taking it: a shared
        flock tried on the file (processes that ask at once do not stop each other, and
        the file is neither made nor removed). None where it cannot be told (no flock in
        the temporary folder's file system, a file that is not this user's own)."""
        try:
            import fcntl
        except ImportError:
            return None
        if not self._flock_works():
            return None
        fd = own_file(self.path, create=False)
        if fd is None:
            return None if os.path.lexists(self.path) else False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        finally:
            os.close(fd)  # (closing drops the shared flock)
        return False

    def _flock_works(self) -> bool:
        """Whether flock works beside the lock's file (a file of this process's own tried
        once, and removed)."""
        if self._works is None:
            import fcntl
            probe = self.path.with_name(f"{self.path.name}.{os.getpid()}")
            fd = own_file(probe)
            self._works = False
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._works = True
                except OSError:
                    pass
                finally:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(probe)
        return self._works

    def wait(self, poll: float = 0.1) -> None:
        """Until the lock is free, then hold it (polled: a signal's handler runs at once)."""
        while not self.take():
            time.sleep(poll)

    def noted(self) -> str:
        """The note of the holder (another process's, while it holds the lock), or of a
        holder that ended without clearing it; "" if none."""
        fd = own_file(self.path, create=not self.removed)  # (a file no holder would remove)
        if fd is None:
            return ""
        try:
            return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        except OSError:
            return ""
        finally:
            os.close(fd)

    def note(self, text: str) -> None:
        """Leave text in the file for other processes ("" clears it)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.seek(0)
                self.file.truncate()
                self.file.write(text)
                self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            if self.removed:  # (before letting go: no taker may lock a file still named)
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            self.file.close()  # (closing drops the flock)
            self.file = None
