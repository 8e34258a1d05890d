"""The one exception the CLI turns into a one-line error and a non-zero exit."""


class HslmError(Exception):
    pass
