"""The one exception the CLI turns into a one-line error and a non-zero exit."""
import re
import signal
from contextlib import contextmanager
from pathlib import Path


class HslmError(Exception):
    pass


class Terminated(KeyboardInterrupt):
    """SIGTERM before a run's own handler is in (while its text is read): stops at once,
    as Ctrl-C does then, tidying up on the way out; the CLI exits 128 + signum (143;
    129 for a SIGHUP while the step's kernels compile: hslm.train.StopRequest)."""

    def __init__(self, signum: int = 15):
        super().__init__(signum)
        self.signum = signum


# SIGHUP, where there is one: a closed terminal (an ssh session dropped)
HANGUP = getattr(signal, "SIGHUP", None)
# the signals that stop a run as SIGTERM does (Ctrl-C is Python's KeyboardInterrupt)
TERMINATING = (signal.SIGTERM,) + ((HANGUP,) if HANGUP else ())


def raise_terminated(signum, frame):
    import hslm
    if signum == HANGUP and hslm._the_hslm_command():
        # a closed terminal sends two: the second must not end the command's tidying up
        # (a program calling hslm keeps its own handler: train_run puts it back)
        signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signum)


def stop_word(signum: int) -> str:
    """What `error: ...` says of a run ended by a signal before anything was saved."""
    return {signal.SIGINT: "interrupted", HANGUP: "hung up"}.get(signum, "terminated")


# Interrupts that C code dropped: an exception raised in a signal handler while Python
# runs inside a ctypes callback (Numba loading a cached kernel calls back into Python)
# ends the callback alone; ctypes reports it through sys.unraisablehook ("Exception
# ignored ...", with a traceback) and the program goes on as if no signal had come.
_dropped = []


@contextmanager
def keeping_dropped_interrupts():
    """The hslm command's sys.unraisablehook meanwhile: an interrupt C code dropped is
    kept, to be raised where it cannot be dropped (raise_dropped_interrupt); anything
    else goes to the hook before."""
    import sys
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _dropped.append(unraisable.exc_value)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:  # (else quiet_after_interrupt took over)
            sys.unraisablehook = previous


def quiet_after_interrupt():
    """The hslm command, ending for an interrupt (its one line said): what the interrupt
    left half-built (an LLVM object of Numba's, when it landed inside a compile or a
    cache load) is not reported as the process ends, as Python would ("Exception ignored
    in: ... __del__", with a traceback)."""
    import sys
    sys.unraisablehook = lambda unraisable: None


def take_dropped_interrupt():
    """The first interrupt a C callback dropped since the last call, or None. (Where one
    landed inside Numba's compile, Numba then fails on what it left half-built: a
    RuntimeError "no compiled object yet", which the CLI reports as the interrupt.)"""
    if not _dropped:
        return None
    e = _dropped[0]
    _dropped.clear()
    return e.with_traceback(None)


def raise_dropped_interrupt():
    """Raise the first interrupt a C callback dropped since the last call, if any."""
    e = take_dropped_interrupt()
    if e is not None:
        raise e


# a message's control characters (a file name holding a newline, say) as escapes, so that
# an error stays one line: C0 and C1 (U+009B is a terminal's CSI, U+0085 a new line), the
# line and paragraph separators, and the marks that turn text's direction (a name shown
# reversed); other characters as they are (a name's bytes that are not UTF-8 included:
# cli.guard_streams). (distributed.collapsed_line is MPI's own rule.)
_CONTROLS = {c: repr(chr(c))[1:-1]
             for c in [*range(32), *range(127, 160), 0x061C, 0x200E, 0x200F, 0x2028, 0x2029,
                       *range(0x202A, 0x202F), *range(0x2066, 0x206A)] if c != 9}


# lone surrogates that stand for no byte (a report's JSON "\ud800"): no stream can write
# them, so as escapes too (surrogateescape's \udc80-\udcff, a name's bytes, are kept)
_UNWRITABLE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def one_line(message: str) -> str:
    return _UNWRITABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", message.translate(_CONTROLS))


def warn(message: str):
    """A warning: one line on stderr (a path's newlines and escapes as one_line's); under
    MPI, rank 0's alone (the ranks run the same command on the same files)."""
    import sys

    from . import distributed
    if distributed.is_writer():
        print(f"warning: {one_line(message)}", file=sys.stderr, flush=True)


def machine_error_line(e: BaseException) -> str | None:
    """The one line (without "error: ") of an error of the machine's, not hslm's: a path
    the checks did not foresee (a name too long, a folder that may not be searched), a
    run-time package not installed, memory that ran out though sizes are judged first;
    None for any other (a bug, shown as one). One process and MPI's ranks report them
    alike, exit status 2 (under MPI they had read "OSError: [Errno 36] ...", status 1)."""
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename is not None else ""
        return f"{where}{e.strerror or e}"
    if isinstance(e, MemoryError):
        return "out of memory (try a smaller --batch, model or corpus, or fewer --threads)"
    if isinstance(e, ModuleNotFoundError):  # numba, imported by the command
        from . import missing_package_line
        line = missing_package_line(e)
        return None if line is None else line.removeprefix("error: ")
    return None


def stopped_by(e: BaseException) -> int:
    """The signal of an interrupt the CLI caught (click wraps it in an Abort): a
    Terminated's, else SIGINT's."""
    for x in (e, e.__cause__):
        if isinstance(x, Terminated):
            return x.signum
    return signal.SIGINT


def node_kind(mode) -> str:
    """What a file system node that is not a regular file is, for messages ("a FIFO")."""
    import stat
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "something else"


def refuse_unless_file(path, flag: str):
    """Refuse a name that leads (through links) to a folder, a FIFO, a device or a socket
    where a file is to be written: a FIFO would block the first write, a device swallow
    it, and a rename would put a file in place of the node (/dev/null included). Returns
    the mode of what is there, or None for a new name."""
    import os
    import stat
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None  # a new name (or a dangling link, replaced)
    except OSError as e:
        raise HslmError(f"{flag} {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise HslmError(f"{flag} {path} is a folder; give a file name")
    if not stat.S_ISREG(mode):
        raise HslmError(f"{flag} {path} is {node_kind(mode)}, not a regular file; give a "
                        "file name")
    return mode


def open_regular(path, what: str, limit: int | None = None):
    """(file, size): a regular file opened for reading (binary), or an HslmError naming
    `what` the file is ("checkpoint", ...). A device, FIFO or socket is refused before a
    byte is read: /dev/zero would fill memory and a FIFO would wait for a writer (opened
    non-blocking, so a FIFO with no writer does not hang the open either); so is a file
    of more than `limit` bytes (a --model of 3 GB was read whole, 15 s, before its size
    was judged)."""
    import os
    import stat
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise HslmError(f"{what} not found: {p}") from None
    except IsADirectoryError:
        raise HslmError(f"{what} path is a directory: {p}") from None
    except OSError as e:
        raise HslmError(f"cannot read {what} {p}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise HslmError(f"cannot read {what} {p}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise HslmError(f"{what} path is a directory: {p}")
        raise HslmError(f"{what} {p} is not a regular file")
    if limit is not None and st.st_size > limit:
        os.close(fd)
        raise HslmError(f"{what} {p} is {st.st_size:,} bytes, more than the {limit:,} allowed")
    return os.fdopen(fd, "rb"), st.st_size


def read_bytes(path, what: str, limit: int | None = None) -> bytes:
    """A regular file's bytes (open_regular: the same refusals), or an HslmError."""
    f, _ = open_regular(path, what, limit)
    with f:
        try:
            return f.read()
        except OSError as e:
            raise HslmError(f"cannot read {what} {path}: {e.strerror}") from None
