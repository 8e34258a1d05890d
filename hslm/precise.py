"""Scalars and tables computed at high precision and rounded once to f64.

The fixed tables (positional sin/cos, rotary cos/sin), the attention and head
scales, the learning-rate schedule's cosine and AdamW's bias corrections need
sin, cos and non-integer powers. The C library and numpy compute those with
CPU-dependent code paths (glibc picks FMA or non-FMA variants; numpy has
AVX-512 SIMD paths that round differently), so here they are computed with
Python's `decimal` module (software arithmetic, the same on every machine) at
50 significant digits (the tables' angles by rotation at 60: sin_cos_multiples) and
converted to the nearest f64 once. The conversion `float(Decimal)` is correctly
rounded, so each value is the f64 nearest to a 50-digit approximation of the exact
value: the same bits everywhere.
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


def sin_cos(x: Decimal, ctx: Context = CTX):
    """(sin x, cos x) at ctx's digits (50, or ROTATION_CTX's 60): x reduced into
    [-pi, pi], then Taylor series."""
    two_pi = ctx.multiply(PI, Decimal(2))
    n = ctx.divide_int(ctx.add(x, PI), two_pi)
    r = ctx.subtract(x, ctx.multiply(n, two_pi))
    if r < -PI:  # floor division rounds toward zero for negative x
        r = ctx.add(r, two_pi)
    r2 = ctx.multiply(r, r)
    s = term = r
    c = cterm = Decimal(1)
    k = 1
    eps = Decimal("1e-60")
    while abs(term) > eps or abs(cterm) > eps:
        cterm = ctx.divide(ctx.multiply(-cterm, r2), Decimal((2 * k - 1) * (2 * k)))
        term = ctx.divide(ctx.multiply(-term, r2), Decimal((2 * k) * (2 * k + 1)))
        c = ctx.add(c, cterm)
        s = ctx.add(s, term)
        k += 1
    return s, c


# The tables' angles p f for p = 0, 1, ... by rotation, at 60 digits: each rotation adds
# a few units of the 60th digit, so a table's values stay within about 1e-57 of those
# of sin_cos(p f) at 50 digits (itself within about 1e-49 of the exact values), far
# inside the 17 digits a double keeps: the same nearest doubles (tests/test_mathfn.py
# checks them against a 90-digit reference of its own, and every preset's tables
# against sin_cos(p f)'s), at a twentieth of the cost (hslm-3's 4,374 sin_cos took 0.8 s
# of every run's start on a 2-core first-generation AMD Zen).
ROTATION_CTX = Context(prec=60)


def sin_cos_multiples(f: Decimal, n: int):
    """[(sin p f, cos p f) for p = 0 .. n-1] by rotation: sin_cos(f) once, then
    rotations by f at 60 digits."""
    return rotations(*sin_cos(f, ROTATION_CTX), n)


def rotations(s1: Decimal, c1: Decimal, n: int):
    """[(s_p, c_p) for p = 0 .. n-1] from (s_0, c_0) = (0, 1) by
    (s, c) -> (s c1 + c s1, c c1 - s s1) at ROTATION_CTX's 60 digits."""
    ctx = ROTATION_CTX
    s, c = Decimal(0), Decimal(1)
    out = []
    for _ in range(n):
        out.append((s, c))
        s, c = (ctx.add(ctx.multiply(s, c1), ctx.multiply(c, s1)),
                ctx.subtract(ctx.multiply(c, c1), ctx.multiply(s, s1)))
    return out


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
