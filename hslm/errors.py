"""The one exception the CLI turns into a one-line error and a non-zero exit."""
from pathlib import Path


class HslmError(Exception):
    pass


def read_bytes(path, what: str) -> bytes:
    """A file's bytes, or an HslmError naming `what` the file is ("checkpoint", ...)."""
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise HslmError(f"{what} not found: {p}") from None
    except IsADirectoryError:
        raise HslmError(f"{what} path is a directory: {p}") from None
    except OSError as e:
        raise HslmError(f"cannot read {what} {p}: {e.strerror}") from None
