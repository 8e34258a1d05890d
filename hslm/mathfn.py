"""exp and log built from IEEE-754 basic operations, so that no C library decides a byte.

`math.exp` and `math.log` reach the C library, which picks a variant by CPU
features (glibc has FMA and non-FMA code paths that round differently), and
numpy's ufuncs take other SIMD paths on AVX-512 machines. Every value that
reaches a checkpoint must come from + - * / and sqrt (correctly rounded on
every machine) in a fixed order, so the kernels call these instead.

The algorithms are the classic ones of Sun's fdlibm (`e_exp.c`, and `e_log.c`
in the single-formula form FreeBSD and musl use), written here with exact
power-of-two scaling through the bit pattern instead of C's word access:

* exp(x) = 2^k exp(r), x = k ln2 + r, |r| <= ln2 / 2, with ln2 split into a
  head whose product with k is exact and a tail; exp(r) from a degree-5
  Remez polynomial R(r^2) as 1 + r + r c / (2 - c).
* log(x) = k ln2 + log(1 + f), x = 2^k (1 + f), sqrt(2)/2 <= 1 + f < sqrt(2);
  log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)), s = f / (2 + f), R degree 7.

Both are within 1 ulp (fdlibm's bound); `tools/mathfn_accuracy.py` measures
them against a correctly rounded reference (Python's `decimal`) and the README
gives the figures. Numba compiles these without fastmath, so nothing is
contracted into an FMA or reassociated: the bits are the same on every CPU.
"""
from __future__ import annotations

import math
import struct

import numpy as np
from numba import njit


def _from_bits(u: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", u))[0]


# ln 2 split so that k * LN2_HI is exact for |k| < 2^11 (LN2_HI has 32 trailing zero bits)
LN2_HI = _from_bits(0x3FE62E42FEE00000)  # 6.93147180369123816490e-01
LN2_LO = _from_bits(0x3DEA39EF35793C76)  # 1.90821492927058770002e-10
INV_LN2 = _from_bits(0x3FF71547652B82FE)  # 1.44269504088896338700e+00

P1 = _from_bits(0x3FC555555555553E)  # 1.66666666666666019037e-01
P2 = _from_bits(0xBF66C16C16BEBD93)  # -2.77777777770155933842e-03
P3 = _from_bits(0x3F11566AAF25DE2C)  # 6.61375632143793436117e-05
P4 = _from_bits(0xBEBBBD41C5D26BF1)  # -1.65339022054652515390e-06
P5 = _from_bits(0x3E66376972BEA4D0)  # 4.13813679705723846039e-08

# log: 1 + f is kept in [0x3fe6a09e00000000, 2 x that) ~ [sqrt(2)/2, sqrt(2))
LOG_SPLIT = _from_bits(0x3FE6A09E00000000)  # 0.70710676908493042
TWO54 = 18014398509481984.0  # 2^54: scales a subnormal up to a normal number
LG1 = _from_bits(0x3FE5555555555593)  # 6.666666666666735130e-01
LG2 = _from_bits(0x3FD999999997FA04)  # 3.999999999940941908e-01
LG3 = _from_bits(0x3FD2492494229359)  # 2.857142874366239149e-01
LG4 = _from_bits(0x3FCC71C51D8E78AF)  # 2.222219843214978396e-01
LG5 = _from_bits(0x3FC7466496CB03DE)  # 1.818357216161805012e-01
LG6 = _from_bits(0x3FC39A09D078C69F)  # 1.531383769920937332e-01
LG7 = _from_bits(0x3FC2F112DF3E5244)  # 1.479819860511658591e-01

ROUND_SHIFT = 6755399441055744.0  # 1.5 * 2^52: x + it rounds x to an integer in the low bits
ROUND_SHIFT_BITS = np.uint64(0x4338000000000000)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _pow2(k):
    """2^k for -1022 <= k <= 1023, exactly, from its bit pattern."""
    return np.uint64((k + 1023) << 52).view(np.float64)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _exponent_and_fraction(x):
    """For a positive normal x: (e, m) with x = m 2^e and m in [1, 2), exactly."""
    bits = np.float64(x).view(np.uint64)
    e = np.int64(bits >> np.uint64(52)) - 1023
    m = np.uint64((bits & np.uint64(0x000FFFFFFFFFFFFF)) | np.uint64(0x3FF0000000000000))
    return e, m.view(np.float64)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def exp(x):
    """e^x within 1 ulp, from basic operations only (fdlibm's method; the only branches
    are the two clamps, which compile to selects)."""
    # clamp: below -746 the result rounds to 0, above 710 it is +inf (NaN stays NaN)
    xc = x
    if xc < -746.0:
        xc = -746.0
    if xc > 710.0:
        xc = 710.0
    # k = round(x / ln2), by the 1.5 * 2^52 trick: kd holds k in its low bits
    kd = xc * INV_LN2 + ROUND_SHIFT
    kf = kd - ROUND_SHIFT  # exact
    hi = xc - kf * LN2_HI  # kf * LN2_HI is exact
    lo = kf * LN2_LO
    r = hi - lo  # |r| <= ln2 / 2 (plus a rounding)
    t = r * r
    c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))))
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)  # exp(r), in [0.70, 1.42]
    # y 2^k in two exact steps, so that a subnormal result is rounded once, at the end
    k = np.int64(np.float64(kd).view(np.uint64) - ROUND_SHIFT_BITS)
    k1 = k >> 1
    return (y * _pow2(k1)) * _pow2(k - k1)


@njit(cache=True, nogil=True, error_model="numpy")
def log(x):
    """Natural logarithm within 1 ulp, from basic operations only (fdlibm's method)."""
    if x != x:
        return x + x  # NaN
    if x <= 0.0:
        return -math.inf if x == 0.0 else math.nan
    if x == math.inf:
        return x
    k = 0
    if x < 2.2250738585072014e-308:  # subnormal: scale into the normal range
        x *= TWO54
        k = -54
    e, m = _exponent_and_fraction(x)  # x = m 2^e, m in [1, 2)
    k += e
    if m >= 2.0 * LOG_SPLIT:  # bring 1 + f into [sqrt(2)/2, sqrt(2)): m / 2 is exact
        m = 0.5 * m
        k += 1
    f = m - 1.0  # exact
    hfsq = 0.5 * f * f
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (LG2 + w * (LG4 + w * LG6))
    t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)))
    r = t2 + t1
    dk = float(k)
    return (((s * (hfsq + r) + dk * LN2_LO) - hfsq) + f) + dk * LN2_HI


@njit(cache=True, nogil=True, error_model="numpy")
def exp_array(xs, out):
    for i in range(xs.shape[0]):
        out[i] = exp(xs[i])
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def log_array(xs, out):
    for i in range(xs.shape[0]):
        out[i] = log(xs[i])
    return out
