"""Scalars and tables computed at high precision and rounded once to f64.

The fixed tables (positional sin/cos, rotary cos/sin), the attention and head
scales, the learning-rate schedule's cosine and AdamW's bias corrections need
sin, cos and non-integer powers. The C library and numpy compute those with
CPU-dependent code paths (glibc picks FMA or non-FMA variants; numpy has
AVX-512 SIMD paths that round differently), so here they are computed with
Python's `decimal` module (software arithmetic, the same on every machine) at
50 significant digits and converted to the nearest f64 once. The conversion
`float(Decimal)` is correctly rounded, so each value is the f64 nearest to a
50-digit approximation of the exact value: the same bits everywhere.
"""
from __future__ import annotations

from decimal import Context, Decimal
from functools import lru_cache

CTX = Context(prec=50)

# pi to 60 digits (a published constant; 50 are used)
PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494")
PHI = CTX.divide(CTX.add(Decimal(1), CTX.sqrt(Decimal(5))), Decimal(2))


def D(x) -> Decimal:
    """The exact value of an int or a float (a float's binary value, digit for digit)."""
    return Decimal(x)


def sin_cos(x: Decimal):
    """(sin x, cos x) at 50 digits: x reduced into [-pi, pi], then Taylor series."""
    two_pi = CTX.multiply(PI, Decimal(2))
    n = CTX.divide_int(CTX.add(x, PI), two_pi)
    r = CTX.subtract(x, CTX.multiply(n, two_pi))
    if r < -PI:  # floor division rounds toward zero for negative x
        r = CTX.add(r, two_pi)
    r2 = CTX.multiply(r, r)
    s = term = r
    c = cterm = Decimal(1)
    k = 1
    eps = Decimal("1e-60")
    while abs(term) > eps or abs(cterm) > eps:
        cterm = CTX.divide(CTX.multiply(-cterm, r2), Decimal((2 * k - 1) * (2 * k)))
        term = CTX.divide(CTX.multiply(-term, r2), Decimal((2 * k) * (2 * k + 1)))
        c = CTX.add(c, cterm)
        s = CTX.add(s, term)
        k += 1
    return s, c


def cos(x: Decimal) -> Decimal:
    return sin_cos(x)[1]


def power(base: Decimal, exponent: Decimal) -> Decimal:
    """base ** exponent for base > 0, as exp(exponent ln base) at 50 digits."""
    return CTX.exp(CTX.multiply(exponent, CTX.ln(base)))


def to_f64(x: Decimal) -> float:
    """The f64 nearest to x (correctly rounded)."""
    return float(x)


@lru_cache(maxsize=None)
def inverse_power_scale(n: int) -> float:
    """n ** (-phi^-3), the fixed attention (n = head width) and head (n = width) scales."""
    phi_inv3 = CTX.power(PHI, -3)
    return to_f64(power(D(n), -phi_inv3))
