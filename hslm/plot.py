"""`hslm plot`: training and validation loss against step, from a metrics file."""
from __future__ import annotations

import json
import math
import warnings

from .errors import HslmError, read_bytes


MAX_STEP = 2 ** 63 - 1  # (hslm train's --steps at most)


def read_metrics(path, warn=None):
    """(train, valid): the [(step, loss)] of a metrics file, one point a step. A partial
    last record (a run killed while writing it: progress.partial_record) is left out, with
    a warning (warn, a callable taking its text: errors.warn), as the next run appending
    would cut it."""
    from .progress import TAIL_CHECKED, partial_tail
    train, valid = [], []
    raw = read_bytes(path, "metrics file", limit=1 << 30)
    tail = raw[-TAIL_CHECKED:]  # (the bytes read: a live run may be writing on)
    cut = partial_tail(tail, len(tail) == len(raw)) or 0
    try:
        text = str(memoryview(raw)[:len(raw) - cut], "utf-8")
    except UnicodeDecodeError as e:
        raise HslmError(f"metrics file {path} is not UTF-8 text (offset {e.start})") from None
    del raw
    if cut and warn is not None:
        warn(f"{path} ends in a partial record (a run stopped while writing it): "
             f"its {cut} bytes left out")
    for n, line in enumerate(_lines(text), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except RecursionError:
            raise HslmError(f"{path}:{n} is not a metrics record (JSON nested too deep)") from None
        except json.JSONDecodeError:
            raise HslmError(f"{path}:{n} is not a metrics record (not JSON)") from None
        except ValueError:  # (Python's int limit, sys.get_int_max_str_digits: 4,300 digits)
            raise HslmError(f"{path}:{n} is not a metrics record (a number of more digits "
                            "than Python reads)") from None
        try:
            if not isinstance(r, dict):
                raise ValueError("not a JSON object")
            if r.get("kind") == "train":
                train.append(_point(r, "loss"))
            elif r.get("kind") == "eval":
                valid.append(_point(r, "valid_loss"))
        except KeyError as e:
            raise HslmError(f"{path}:{n} is not a metrics record (no {e.args[0]!r} field)"
                            ) from None
        except ValueError as e:
            raise HslmError(f"{path}:{n} is not a metrics record ({e})") from None
    if not train and not valid:
        raise HslmError(f"{path} holds no training or validation records")
    # a run killed after its last checkpoint and resumed appends the steps since again
    # (with the same values: the bytes do not change): one point a step
    return _one_run(train, "loss", path), _one_run(valid, "validation loss", path)


def _lines(text: str):
    """text's lines, one at a time: a list of them all had taken 26 times a file of short
    lines' size (150 MB of `{}` lines: 3.9 GB)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end + 1


def _one_run(points, what: str, path):
    """[(step, loss)], one point a step. A step written twice with other values is two
    runs' records in one file (a new run given another's --metrics): refused, or the plot
    had joined them into one curve."""
    seen = {}
    for step, loss in points:
        before = seen.setdefault(step, loss)
        if before != loss and not (math.isnan(before) and math.isnan(loss)):
            raise HslmError(f"{path} holds more than one run's records: step {step}'s {what} "
                            f"is {before:.6g} in one and {loss:.6g} in another (a resumed run "
                            "repeats a step with the same value); give each run its own "
                            "--metrics file")
    return sorted(seen.items())


def _point(record, key):
    """(step, loss) of a record as hslm train writes it: the step an integer, the loss a
    number (NaN or infinite where training diverged); else a ValueError."""
    step, loss = record["step"], record[key]
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP):
        raise ValueError(f"its step, {_short(step)}, is not a whole number from 0 to 2^63 - 1")
    if not isinstance(loss, (int, float)) or isinstance(loss, bool):
        raise ValueError(f"its {key}, {_short(loss)}, is not a number")
    try:
        return step, float(loss)
    except OverflowError:  # an integer past a double's range
        raise ValueError(f"its {key}, {_short(loss)}, is past a double's range") from None


def _short(value) -> str:
    """A record's value as JSON, cut to 40 characters for an error line."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_output(output):
    """Refuse, before anything is drawn, an -o the image cannot be written to
    (checkpoint.check_atomic_target: a folder, a FIFO, a device, a socket, or a name
    whose folder is missing or refuses a new file)."""
    from pathlib import Path

    from .checkpoint import check_atomic_target
    check_atomic_target(Path(output), "-o")


def plot_metrics(path, output, warn=None):
    import io
    from pathlib import Path

    from .checkpoint import write_atomic
    from .data import same_file
    train, valid = read_metrics(path, warn)
    check_output(output)
    if same_file(path, output):  # (the image had replaced the records)
        raise HslmError(f"-o {output} is the metrics file {path}; give the image another name")
    try:
        import matplotlib
    except ImportError:
        raise HslmError("hslm plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    ext = Path(output).suffix.lower().lstrip(".")
    if ext not in kinds:
        raise HslmError(f"-o {output}: the name must end in one of "
                        f"{', '.join('.' + k for k in kinds)} (it decides the image format)")

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    # drawn in memory, then written atomically (a temporary file in the same folder,
    # renamed onto the name): a failed or interrupted write leaves no half an image
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():  # (numpy's, inside matplotlib, on values of 1e308)
            warnings.simplefilter("ignore", RuntimeWarning)
            if train:
                ax.plot(*zip(*train), label="training loss", lw=1)
            if valid:
                ax.plot(*zip(*valid), "o-", label="validation loss", lw=1.5)
            ax.set_xlabel("step")
            ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
            ax.set_ylabel("loss (nats)")
            ax.grid(color="0.9")  # (as alpha 0.3 looked; PostScript has no transparency)
            ax.legend(framealpha=1)
            fig.tight_layout()
            fig.savefig(buf, format=ext)
    # .pgf without LaTeX, say; and values matplotlib cannot lay out (losses of +-1e308:
    # its ticks' ValueError, OverflowError, or an UnboundLocalError inside its ticker)
    except (OSError, RuntimeError, ArithmeticError, ValueError, NameError) as e:
        msg = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise HslmError(f"cannot draw {output} as .{ext}: {msg}") from None
    finally:
        plt.close(fig)
    write_atomic(Path(output), buf.getbuffer(), what="plot")
