"""hslm's own exp and log (hslm/mathfn.py) and the values rounded once from 50 digits
(hslm/precise.py): as accurate as the README says, checked against references of their
own at higher precision, and pinned to the bit."""
import hashlib
import math
from decimal import Context, Decimal

import numpy as np

from hslm import precise
from hslm.mathfn import exp_array, log_array

REF = Context(prec=60)  # the reference: decimal's exp and ln are correctly rounded

# sha256 of exp over EXP_GRID and log over LOG_GRID, as float64 bytes (hslm 0.2's bits)
GOLDEN_EXP = "eee633cfab1fa1aa82524ceb9c16d4572b24c2c719bbb406c617cabe49304f55"
GOLDEN_LOG = "a9c0de059c1763a21e670e23614e42ce8ecdb04854482960f3bb5ee87b406e28"
# grids made with basic operations only (numpy's linspace and geomspace may change, and
# its power takes SIMD paths that round by machine): the same doubles everywhere
_I = np.arange(20001)
EXP_GRID = -745.0 + _I * 0.0727
LOG_GRID = np.ldexp(1.0 + (_I % 997) / 997.0, _I // 10 - 1000)


def ulp_error(got: float, exact: Decimal) -> float:
    """|got - exact| in ulps of the exact value's binade."""
    f = float(exact)
    ulp = math.ulp(f) if abs(exact) >= abs(Decimal(f)) else math.ulp(math.nextafter(f, 0.0))
    return float(abs(Decimal(got) - exact) / Decimal(ulp))


def worst(fn, ref, xs):
    got = fn(xs, np.empty_like(xs))
    return max(ulp_error(g, ref(Decimal(x))) for x, g in zip(xs.tolist(), got.tolist()))


def test_exp_and_log_are_within_one_ulp():
    """The README: at most 0.882 ulp for exp on [-50, 0] (the softmax's range), 0.871 on
    [-745, 709] (normal results here), 0.654 for log on [1, 6561] (log-sum-exp's), 0.743
    over all positive doubles. A few thousand arguments each, against 60 digits; the
    control: float32's exp, rounded to float64, is far outside."""
    rng = np.random.default_rng(12)
    cases = [(exp_array, REF.exp, rng.uniform(-50.0, 0.0, 1500)),
             (exp_array, REF.exp, rng.uniform(-700.0, 709.0, 800)),
             (log_array, REF.ln, rng.uniform(1.0, 6561.0, 1500)),
             (log_array, REF.ln, np.ldexp(rng.uniform(1.0, 2.0, 800),
                                          rng.integers(-1020, 1020, 800)))]
    for fn, ref, xs in cases:
        assert worst(fn, ref, xs) < 1.0, (fn.__name__, xs.min(), xs.max())
    xs = cases[0][2][:200]
    assert worst(lambda x, out: np.exp(x.astype(np.float32)).astype(np.float64), REF.exp,
                 xs) > 1e6


def test_exp_and_log_special_values():
    exp_in = np.array([0.0, -0.0, 1.0, -1e-300, 709.78, 710.0, -746.0, np.inf, -np.inf, np.nan])
    got = exp_array(exp_in, np.empty_like(exp_in))
    assert got[0] == 1.0 and got[1] == 1.0 and ulp_error(got[2], REF.exp(Decimal(1))) < 1.0
    assert got[3] == 1.0 and math.isfinite(got[4]) and got[5] == np.inf and got[6] == 0.0
    assert got[7] == np.inf and got[8] == 0.0 and np.isnan(got[9])
    log_in = np.array([1.0, 2.0, 0.0, -1.0, np.inf, np.nan, 5e-324])
    got = log_array(log_in, np.empty_like(log_in))
    assert got[0] == 0.0 and ulp_error(got[1], REF.ln(Decimal(2))) < 1.0
    assert got[2] == -np.inf and np.isnan(got[3]) and got[4] == np.inf and np.isnan(got[5])
    assert ulp_error(got[6], REF.ln(Decimal(5e-324))) < 1.0  # the smallest subnormal


def test_exp_and_log_bits_are_pinned():
    """A change to mathfn that moves any result over these grids moves a digest (and so,
    almost surely, a checkpoint byte). The control: the C library's exp and log, mostly
    correctly rounded where these are not always, give other digests."""
    e = exp_array(EXP_GRID, np.empty_like(EXP_GRID))
    g = log_array(LOG_GRID, np.empty_like(LOG_GRID))
    assert hashlib.sha256(e.tobytes()).hexdigest() == GOLDEN_EXP
    assert hashlib.sha256(g.tobytes()).hexdigest() == GOLDEN_LOG
    c_exp = np.array([math.exp(x) for x in EXP_GRID.tolist()])
    c_log = np.array([math.log(x) for x in LOG_GRID.tolist()])
    assert hashlib.sha256(c_exp.tobytes()).hexdigest() != GOLDEN_EXP
    assert hashlib.sha256(c_log.tobytes()).hexdigest() != GOLDEN_LOG


def sin_cos_reference(x: Decimal, ctx: Context, pi=None):
    """sin and cos by their Taylor series at ctx's precision, after reducing x by a
    multiple of 2 pi (pi by Machin's formula): written apart from precise.sin_cos."""
    tiny = ctx.power(Decimal(10), -ctx.prec - 5)

    def arctan_inv(n):  # arctan(1/n) = sum (-1)^k / ((2k + 1) n^(2k + 1))
        total, term, k = Decimal(0), ctx.divide(Decimal(1), Decimal(n)), 0
        while term > tiny:
            part = ctx.divide(term, Decimal(2 * k + 1))
            total = ctx.add(total, part) if k % 2 == 0 else ctx.subtract(total, part)
            term = ctx.divide(term, Decimal(n * n))
            k += 1
        return total
    if pi is None:
        pi = ctx.multiply(Decimal(4), ctx.subtract(ctx.multiply(Decimal(4), arctan_inv(5)),
                                                   arctan_inv(239)))
    two_pi = ctx.multiply(pi, Decimal(2))
    r = ctx.subtract(x, ctx.multiply(ctx.to_integral_value(ctx.divide(x, two_pi)), two_pi))
    s, c, term, k = Decimal(0), Decimal(0), Decimal(1), 0
    while abs(term) > tiny:  # term = r^k / k!
        if k % 4 == 0:
            c = ctx.add(c, term)
        elif k % 4 == 1:
            s = ctx.add(s, term)
        elif k % 4 == 2:
            c = ctx.subtract(c, term)
        else:
            s = ctx.subtract(s, term)
        k += 1
        term = ctx.divide(ctx.multiply(term, r), Decimal(k))
    return s, c


def test_values_rounded_once_are_the_nearest_doubles():
    """precise's 50 digits decide every bit: its sin, cos and powers, rounded to f64, are
    the f64 nearest the exact values (a reference at 90 digits, computed its own way)
    for the arguments the tables and schedule use. The control: the reference with pi
    to a double's 17 digits gives other bits for a large argument."""
    ctx = Context(prec=90)
    args = [Decimal(p) * Decimal(f) for p in (1, 7, 26, 80) for f in
            (1.0, 0.9549296585513721, 0.31830988618379067, 2.5e-3)]
    args += [Decimal(x) for x in (0.5, 3.0, 100.0, 1234.5)]
    for x in args:
        s, c = precise.sin_cos(x)
        rs, rc = sin_cos_reference(x, ctx)
        assert (precise.to_f64(s), precise.to_f64(c)) == (float(rs), float(rc)), x
    for n in (2, 5, 9, 27, 81, 243, 729):
        exact = ctx.power(Decimal(n), -ctx.power(ctx.divide(ctx.add(1, ctx.sqrt(Decimal(5))), 2),
                                                 -3))
        assert precise.inverse_power_scale(n) == float(exact), n
    x = Decimal(1234.5)
    assert sin_cos_reference(x, ctx, pi=Decimal(math.pi))[0] != sin_cos_reference(x, ctx)[0]
    assert float(sin_cos_reference(x, ctx, pi=Decimal(math.pi))[0]) != precise.to_f64(
        precise.sin_cos(x)[0])
