"""What a training run tells its user: a progress bar on a terminal, plain lines
elsewhere, and an optional JSON-lines metrics file."""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time


def duration(s: float) -> str:
    """Seconds as a progress line shows them: 7s, 3m05s, 2h07m."""
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """Per-step reporting. On a terminal: one line redrawn in place (steps, loss,
    tok/s, time left). Otherwise: a plain line every `log_every` steps (and at the
    last step). `quiet` prints neither."""

    def __init__(self, first_step: int, last_step: int, quiet=False, log_every=1, stream=None):
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.first, self.last = first_step, last_step
        self.quiet, self.log_every = quiet, max(1, log_every)
        self.start()
        self.bar_shown = False

    def start(self):
        """The steps start now: the time left is judged from the steps' own pace."""
        self.t0 = time.perf_counter()

    def step(self, step, loss, lr, tok_s):
        if self.quiet:
            return
        if self.tty:
            done = step - self.first
            total = max(self.last - self.first, 1)
            elapsed = time.perf_counter() - self.t0
            left = elapsed / done * (total - done) if done else 0.0
            width = max(10, min(30, shutil.get_terminal_size((80, 20)).columns - 70))
            fill = int(width * done / total)
            line = (f"\r[{'#' * fill}{'.' * (width - fill)}] step {step}/{self.last} | "
                    f"loss {loss:.4f} | {tok_s:,.0f} tok/s | {duration(left)} left ")
            self.stream.write(line)
            self.stream.flush()
            self.bar_shown = True
        elif step % self.log_every == 0 or step == self.last:
            self.stream.write(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | "
                              f"{tok_s:8,.0f} tok/s\n")
            self.stream.flush()

    def message(self, text, needed=False):
        """A line that must not be overwritten by the bar. needed: one the user must see
        (where a stopped run saved, the command that resumes it), which goes to stderr too
        where the standard output's reader has gone (`| tee log`, ended by the same
        Ctrl-C: cli.ReaderGone)."""
        if self.bar_shown:
            self.stream.write("\n")
            self.bar_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()
        if needed and getattr(self.stream, "gone", False):
            print(text, file=sys.stderr, flush=True)

    def close(self):
        if self.bar_shown:
            self.stream.write("\n")
            self.stream.flush()
            self.bar_shown = False


class MetricsError(Exception):
    """The metrics file could not be written (the run saves a checkpoint, then stops)."""


TAIL_CHECKED = 1 << 16  # bytes read back from a metrics file's end


def partial_record(path) -> int:
    """The length of the partial record a metrics file ends in (what a run killed while
    writing it leaves: '{' and no newline, after a whole record or nothing), 0 when it
    ends in a newline (or is empty or absent). Any other file not ending in a newline is
    refused: it is not a metrics file, and nothing of it is cut."""
    from .errors import HslmError
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_CHECKED))
            tail = f.read()
    except OSError:  # absent (made by the run), or not readable: appended to as it is
        return 0
    cut = partial_tail(tail, len(tail) == size)
    if cut is None:
        raise HslmError(f"--metrics {path} does not end in a whole line, and is not a "
                        "metrics file cut short; give a metrics file or a new name")
    body = tail[:len(tail) - cut].rstrip()  # (blank lines at the end pass)
    # its last line began before the tail read back: no record is that long
    if len(tail) < size and body and b"\n" not in body:
        raise HslmError(f"--metrics {path} is not a metrics file (its last line is over "
                        f"{TAIL_CHECKED // 1024} KB); give a metrics file or a new name")
    lines = body.split(b"\n")[1 if len(tail) < size else 0:]
    last = lines[-1] if lines and lines[-1].strip() else None
    # a record has a kind (hslm's train and eval; hslm plot passes over others, a user's
    # notes, say); a config's last line has none: appended to, it would be spoilt
    if last is not None and "kind" not in (_record(last) or {}):
        raise HslmError(f"--metrics {path} is not a metrics file (its last line is no record, "
                        "a JSON object with a kind); give a metrics file or a new name")
    return cut


def partial_tail(tail: bytes, whole: bool):
    """partial_record's rule on a file's last bytes (whole: they are the whole file): 0
    where they end in a newline (or are empty), the partial record's length where they end
    in one ('{' and no newline, after a whole record or nothing), else None."""
    if not tail or tail.endswith(b"\n"):
        return 0
    lines = tail.split(b"\n")
    prior = [x for x in lines[:-1] if x.strip()]  # (blank lines pass, as at the end)
    before_ok = _record(prior[-1]) is not None if prior else whole
    return len(lines[-1]) if _torn_record(lines[-1]) and before_ok else None


def _record(line: bytes):
    """line's JSON object, or None (not JSON, another value, or nested thousands deep)."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _torn_record(line: bytes) -> bool:
    """A record a run stopped while writing: '{' and not whole JSON, or one of hslm's
    records whole but for its newline. A whole JSON object of another kind is someone
    else's file (a config, say: json.dump ends in no newline), never cut."""
    if not line.startswith(b"{"):
        return False
    try:
        value = json.loads(line)
    except RecursionError:  # nested thousands deep: no record of hslm's, torn or whole
        return False
    except ValueError:
        return True
    return isinstance(value, dict) and value.get("kind") in ("train", "eval")


def json_number(x):
    """x as JSON has it: null (None) for a float that is not finite, which JSON cannot
    hold (a diverged run's perplexity past the largest double), else x."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


class Metrics:
    """Appends one JSON object per line to a file, each line written whole or not at
    all: a write that fails part way (a full disk) is cut back to the last whole line,
    and a partial last line left by a run that died while writing is cut off when the
    file is opened again (with a warning), so the file always reads back (hslm plot).
    A figure that is not finite is written null (json_number)."""

    def __init__(self, path):
        self.path = path
        self.fd = None
        if path:
            from .errors import HslmError
            cut = partial_record(path)  # (judged before: train.check_metrics_path)
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                if cut:
                    os.ftruncate(self.fd, os.fstat(self.fd).st_size - cut)
            except OSError as e:
                self.close()
                raise HslmError(f"cannot open --metrics {path}: {e.strerror}") from None
            if cut:
                from .errors import warn
                warn(f"--metrics {path} ended in a partial record (a run stopped while "
                     f"writing it): its {cut} bytes removed")

    def write(self, **record):
        if self.fd is None:
            return
        line = (json.dumps({k: json_number(v) for k, v in record.items()}, sort_keys=True)
                + "\n").encode("utf-8")
        end = None
        try:
            end = os.fstat(self.fd).st_size  # (another writer's lines are kept too)
            done = 0
            while done < len(line):
                done += os.write(self.fd, line[done:])
        except OSError as e:
            if end is not None:
                try:
                    os.ftruncate(self.fd, end)  # no half line left behind
                except OSError:
                    pass
            raise MetricsError(f"cannot write --metrics {self.path}: {e.strerror}") from None

    def close(self):
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
