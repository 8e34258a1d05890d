"""Random numbers that are the same on every machine and every numpy version.

numpy's `Generator` methods (uniform, integers, choice, ...) may change their
streams between numpy versions; only the bit generators' raw output is frozen
(NEP 19). So hslm takes PCG64's raw 64-bit words (`random_raw`) and converts
them itself:

* a uniform double in [0, 1): (x >> 11) * 2^-53 (53 random bits, exact);
* an integer in [0, n): x mod n, where words x >= 2^64 - (2^64 mod n) are
  rejected (no bias); a draw of `count` integers takes `count` words, then as
  many more as were rejected, until `count` are accepted;
* a stream is seeded from sha256("hslm/<label>/<seed>"): its first 16 bytes
  give PCG64's 128-bit state, the next 16 its increment (made odd).

Labels: "init" (parameters), "windows" (the training windows), "vsa" (the VSA
token table, seed 0x48534C4D, independent of --seed), "sample" (hslm sample).
"""
from __future__ import annotations

import hashlib

import numpy as np

from .config import canonical_json
from .errors import HslmError

TWO_M53 = 2.0 ** -53  # exact
CHUNK = 1 << 20  # raw draws at a time in integers()


class Stream:
    """A PCG64 bit generator and the project's own conversions of its raw words."""

    def __init__(self, bit_generator: np.random.PCG64):
        self.bg = bit_generator

    @classmethod
    def seeded(cls, label: str, seed: int) -> "Stream":
        h = hashlib.sha256(f"hslm/{label}/{int(seed)}".encode()).digest()
        bg = np.random.PCG64()
        bg.state = {"bit_generator": "PCG64",
                    "state": {"state": int.from_bytes(h[:16], "little"),
                              "inc": int.from_bytes(h[16:], "little") | 1},
                    "has_uint32": 0, "uinteger": 0}
        return cls(bg)

    def raw(self, count: int) -> np.ndarray:
        return np.asarray(self.bg.random_raw(count), dtype=np.uint64)

    def uniform(self, count: int) -> np.ndarray:
        """count doubles uniform in [0, 1)."""
        return (self.raw(count) >> np.uint64(11)).astype(np.float64) * TWO_M53

    def integers(self, count: int, n: int, dtype=np.int64) -> np.ndarray:
        """count integers uniform in [0, n), 1 <= n <= 2^63, as dtype (it must hold n - 1):
        each raw draw at or above the largest multiple of n is rejected, the rest taken
        mod n, in order. Drawn in chunks of at most CHUNK, never more than still needed,
        so the draws consumed and the values are those of one draw of `count` (the
        minimal prefix of the stream holding `count` accepted draws), and a large table
        (the VSA's: vocab x vsa_dim) costs its own bytes, not several int64 copies."""
        if not 1 <= n <= 2 ** 63:
            raise ValueError(f"integers: bound {n} out of range")
        limit = np.uint64(2 ** 64 - (2 ** 64 % n)) if 2 ** 64 % n else None
        out = np.empty(count, dtype)
        done = 0
        while done < count:
            x = self.raw(min(count - done, CHUNK))
            if limit is not None:
                x = x[x < limit]
            out[done:done + len(x)] = x % np.uint64(n)
            done += len(x)
        return out

    # ------------------------------------------------------------ state
    def state_json(self) -> str:
        return canonical_json(self.bg.state)

    @classmethod
    def from_state_json(cls, s: str) -> "Stream":
        """A stream from state_json's text (checked by validate.check_rng_state); anything
        else is an HslmError."""
        from .validate import Invalid, check_rng_state
        try:
            st = check_rng_state(s)
        except Invalid as e:
            raise HslmError(f"the random generator state in the checkpoint is not valid: {e}") \
                from None
        bg = np.random.PCG64()
        bg.state = st
        return cls(bg)
