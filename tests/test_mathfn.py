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


def test_exp_and_log_are_as_accurate_as_the_readme_says():
    """The README: at most 0.882 ulp for exp on [-50, 0] (the softmax's range), 0.871 on
    [-745, 709] (normal results here), 0.654 for log on [1, 6561] (log-sum-exp's), 0.743
    over all positive doubles: each bound holds on a sample against 60 digits. The
    control: the same results moved one ulp up break every bound."""
    rng = np.random.default_rng(12)
    cases = [(exp_array, REF.exp, rng.uniform(-50.0, 0.0, 1500), 0.882),
             (exp_array, REF.exp, rng.uniform(-700.0, 709.0, 800), 0.871),
             (log_array, REF.ln, rng.uniform(1.0, 6561.0, 1500), 0.654),
             (log_array, REF.ln, np.ldexp(rng.uniform(1.0, 2.0, 800),
                                          rng.integers(-1020, 1020, 800)), 0.743)]
    for fn, ref, xs, bound in cases:
        assert worst(fn, ref, xs) <= bound, (fn.__name__, xs.min(), xs.max())

        def one_ulp_up(x, out, fn=fn):
            return np.nextafter(fn(x, out), np.inf)
        assert worst(one_ulp_up, ref, xs) > bound


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


def sin_cos_reference(x: Decimal, ctx: Context, pi: Decimal):
    """sin and cos by their Taylor series at ctx's precision, after reducing x by a
    multiple of 2 pi: written apart from precise.sin_cos."""
    tiny = ctx.power(Decimal(10), -ctx.prec - 5)
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


def machin_pi(ctx: Context) -> Decimal:
    """pi = 16 arctan(1/5) - 4 arctan(1/239), at ctx's precision."""
    tiny = ctx.power(Decimal(10), -ctx.prec - 5)

    def arctan_inv(n):  # sum (-1)^k / ((2k + 1) n^(2k + 1))
        total, term, k = Decimal(0), ctx.divide(Decimal(1), Decimal(n)), 0
        while term > tiny:
            part = ctx.divide(term, Decimal(2 * k + 1))
            total = ctx.add(total, part) if k % 2 == 0 else ctx.subtract(total, part)
            term = ctx.divide(term, Decimal(n * n))
            k += 1
        return total
    return ctx.subtract(ctx.multiply(Decimal(16), arctan_inv(5)),
                        ctx.multiply(Decimal(4), arctan_inv(239)))


def test_values_rounded_once_are_the_nearest_doubles():
    """precise's 50 digits decide every bit: hslm-3's positional and rotary tables, the
    attention and head scales, the schedule's cosine and AdamW's bias corrections are
    the doubles nearest to the exact values, by a reference at 90 digits computed its own
    way (pi by Machin's formula, its own series). The control: the reference with pi to
    a double's 17 digits gives other bits for a large argument."""
    from hslm.config import PRESETS
    from hslm.optim import BETA1, BETA2, bias_corrections, learning_rate
    from hslm.tables import positional_table, rotary_tables
    ctx = Context(prec=90)
    pi = machin_pi(ctx)
    phi = ctx.divide(ctx.add(Decimal(1), ctx.sqrt(Decimal(5))), Decimal(2))
    cfg = PRESETS["hslm-3"]
    d, L, dh = cfg.width, cfg.window, cfg.head_width
    P = positional_table(cfg)
    for i in range(0, d, 2):
        f = ctx.multiply(ctx.power(phi, ctx.divide(Decimal(-i), Decimal(d))),
                         ctx.divide(Decimal(3), pi))
        for p in range(L):
            s, c = sin_cos_reference(ctx.multiply(Decimal(p), f), ctx, pi)
            assert P[p, i] == float(s) and (i + 1 >= d or P[p, i + 1] == float(c)), (p, i)
    cos, sin = rotary_tables(cfg)
    for c in range(dh // 2):
        rate = ctx.power(phi, ctx.divide(Decimal(-2 * c), Decimal(dh)))
        for p in range(L):
            s, co = sin_cos_reference(ctx.multiply(Decimal(p), rate), ctx, pi)
            assert (sin[p, c], cos[p, c]) == (float(s), float(co)), (p, c)
    phi_inv3 = ctx.power(phi, -3)
    for n in (2, 5, 9, 27, 81, 243, 729):
        assert precise.inverse_power_scale(n) == float(ctx.power(Decimal(n), -phi_inv3)), n
    for step in (1, 2, 99, 100, 101, 5000, 9999, 10000, 20000):  # warm-up 100, decay 10000
        share = Decimal("0.1")
        if step <= 100:
            want = ctx.divide(ctx.multiply(Decimal(1e-3), Decimal(step)), Decimal(100))
        else:
            progress = min(ctx.divide(Decimal(step - 100), Decimal(9900)), Decimal(1))
            cos_t = sin_cos_reference(ctx.multiply(pi, progress), ctx, pi)[1]
            share = ctx.add(share, ctx.multiply(Decimal("0.45"), ctx.add(Decimal(1), cos_t)))
            want = ctx.multiply(Decimal(1e-3), share)
        assert learning_rate(step, 1e-3, 100, 10000) == float(want), step
    for step in (1, 2, 10, 1000, 100000):
        assert bias_corrections(step) == tuple(
            float(ctx.subtract(Decimal(1), ctx.power(Decimal(b), step))) for b in (BETA1, BETA2))
    x = Decimal(1234.5)
    rough = sin_cos_reference(x, ctx, Decimal(math.pi))[0]
    assert float(rough) != float(sin_cos_reference(x, ctx, pi)[0]) == precise.to_f64(
        precise.sin_cos(x)[0])


def test_tables_by_rotation_hold_the_doubles_of_each_angles_series():
    """The positional and rotary tables are made by rotation (precise.sin_cos_multiples:
    sin_cos(f) once, then p f as f added p times, at 60 digits), a twentieth of the cost
    of sin_cos(p f) for every angle. Every preset's tables hold the doubles of sin_cos(p f)
    at 50 digits, the way they were made before, bit for bit. The control: rotations
    from f's sine and cosine rounded to doubles give other bits."""
    from hslm.config import PRESETS
    from hslm.tables import positional_table, rotary_tables
    ctx = precise.CTX

    def by_series(f, L):
        return [tuple(map(precise.to_f64, precise.sin_cos(ctx.multiply(Decimal(p), f))))
                for p in range(L)]

    def frequency(i, d):
        return ctx.multiply(precise.power(precise.PHI, ctx.divide(Decimal(-i), Decimal(d))),
                            ctx.divide(Decimal(3), precise.PI))

    seen = set()
    for name, cfg in PRESETS.items():
        d, L, dh = cfg.width, cfg.window, cfg.head_width
        if (d, L, dh) in seen:
            continue
        seen.add((d, L, dh))
        P = positional_table(cfg)
        for i in range(0, d, 2):
            for p, (s, c) in enumerate(by_series(frequency(i, d), L)):
                assert P[p, i] == s and (i + 1 >= d or P[p, i + 1] == c), (name, p, i)
        cos, sin = rotary_tables(cfg)
        for c in range(dh // 2):
            rate = precise.power(precise.PHI, ctx.divide(Decimal(-2 * c), Decimal(dh)))
            assert [(sin[p, c], cos[p, c]) for p in range(L)] == by_series(rate, L), (name, c)
    # the control: hslm-3's positional table from rotations by doubles
    cfg = PRESETS["hslm-3"]
    P = positional_table(cfg)
    rough = 0
    for i in range(0, cfg.width, 2):
        f = float(frequency(i, cfg.width))
        by_doubles = precise.rotations(Decimal(math.sin(f)), Decimal(math.cos(f)), cfg.window)
        rough += sum(precise.to_f64(s) != P[p, i] for p, (s, _) in enumerate(by_doubles))
    assert rough > 0


def test_perplexity_and_grad_norm_in_the_metrics_do_not_depend_on_the_c_library_or_numpy():
    """The metrics file keeps every digit of a validation perplexity and a gradient norm.
    perplexity is exp(loss) correctly rounded, not the C library's exp (glibc's FMA
    variant rounded exp(1.0757432886048393) to ...7353 where the exact value rounds to
    ...735: about one loss in 1,400 differed from its non-FMA variant); grad_norm adds
    the tensors' squared norms in tensor order, not numpy's pairwise order."""
    from types import SimpleNamespace

    from hslm.train import Run, perplexity
    losses = [1.0757432886048393] + (0.5 + 8.5 * ((_I[:3000] * 0.6180339887498949) % 1.0)).tolist()
    for loss in losses:
        exact = REF.exp(Decimal(loss))
        assert perplexity(loss) == float(exact), loss
    # control: the comparison sees one ulp
    assert math.nextafter(float(REF.exp(Decimal(losses[0]))), math.inf) != perplexity(losses[0])
    norms = np.array([(i * 0.7548776662466927) % 1.0 * 10.0 ** (i % 7 - 3) for i in range(40)])
    ordered = 0.0
    for x in norms.tolist():
        ordered += x * x
    assert Run.grad_norm(SimpleNamespace(norms=norms)) == math.sqrt(ordered)
    # control: numpy's pairwise sum takes another order, and here rounds differently
    assert float(np.sqrt(np.sum(norms ** 2))) != math.sqrt(ordered)
