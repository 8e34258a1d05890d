"""hslm: a Numba CPU trainer for ternary HSLM language models."""
__version__ = "0.1.0"
