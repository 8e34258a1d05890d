"""This core's f64 arithmetic peaks, measured rather than derived from a clock.

A nominal peak (GHz x flops per cycle) trusts the clock /proc/cpuinfo reports, and
cores rarely run at it: on the 2-core Xeon of the README it says 2.60 GHz, while
512-bit FMAs ran at 3.4 GHz and scalar code faster still, so a share of the nominal
peak overstated how close a kernel came by a third. Here a loop of independent
multiply-adds, written in LLVM IR and compiled for the CPU and features Numba
compiles for (so an AVX2 build measures AVX2), runs long enough to settle the clock:

* FMA: acc = fmuladd(acc, x, c), the ternary kernels' operation (fused where the
  core has FMA, as in the kernels);
* multiply + add: acc = acc + x_i * c, unfused, the weight gradient's operation (two
  FMA-pipe slots on Intel cores; full rate on cores with separate add pipes): as in
  its tile, x_i is loaded (broadcast) each iteration and only the add waits on acc.
  (acc = acc * x + c, the loop before, put a multiply and an add on each chain, and
  measured 47.5-53.9 GFLOP/s on a core whose weight-gradient tile ran at 55.)

Each uses 12 independent vector accumulators, enough to cover the latency of the
pipes of every x86 core these machines have, except the unfused loop built 4-wide (16
registers, AVX2), which uses UNFUSED_ACCUMULATORS_16 (`accumulators`). Its chains each
have a multiplicand of their own; 12 of each spilled to 32-byte stack slots that LLVM
does not align, so the reading depended on where the caller's stack lay (on one AMD
Zen 4, 2026-12-04: 41.0-41.3 GFLOP/s in one process, 52.7-53.1 in another). Seven
chains and their multiplicands fill the 16 registers with the broadcast and the
product, and nothing spills (52.5-53.1).
"""
from __future__ import annotations

import ctypes
import functools
import time

ACCUMULATORS = 12
UNFUSED_ACCUMULATORS_16 = 7  # the unfused loop's, built for 16 vector registers


def accumulators(lanes: int, fused: bool) -> int:
    """The loop's independent chains: ACCUMULATORS, or for the unfused loop built 4-wide
    (16 registers) UNFUSED_ACCUMULATORS_16, which leaves nothing to spill."""
    return ACCUMULATORS if fused or lanes >= 8 else UNFUSED_ACCUMULATORS_16


XS = 64  # the unfused loop's multiplicands, loaded in turn (an L1-resident array)


def _loop_ir(lanes: int, fused: bool) -> str:
    """double @peak(i64 n, double x, double c, double* xs): n iterations of
    accumulators(lanes, fused) vector multiply-adds; returns a sum of the accumulators
    (so none is dead code)."""
    chains = accumulators(lanes, fused)
    vt = f"<{lanes} x double>"
    splat = [f"  %{v}0 = insertelement {vt} undef, double %{v}s, i32 0\n"
             f"  %{v} = shufflevector {vt} %{v}0, {vt} undef, <{lanes} x i32> zeroinitializer"
             for v in "xc"]
    # distinct starting values, or LLVM would merge identical accumulators into one
    inits = [f"  %init{k} = fadd {vt} %x, <"
             + ", ".join(f"double {1.0 + 0.001 * (k * lanes + j)}" for j in range(lanes)) + ">"
             for k in range(chains)]
    phis = [f"  %a{k} = phi {vt} [ %init{k}, %entry ], [ %b{k}, %loop ]"
            for k in range(chains)]
    if fused:
        ops = [f"  %b{k} = call {vt} @llvm.fmuladd.v{lanes}f64({vt} %a{k}, {vt} %x, {vt} %c)"
               for k in range(chains)]
    else:  # a product off the chain, then the add on it: acc_k += xs[i mod XS] * c_k
        ops = [f"  %slot = and i64 %i, {XS - 1}", "  %xp = getelementptr double, double* %xv, "
               "i64 %slot", "  %xl = load double, double* %xp",
               f"  %xi0 = insertelement {vt} undef, double %xl, i32 0",
               f"  %xi = shufflevector {vt} %xi0, {vt} undef, <{lanes} x i32> zeroinitializer"]
        ops += [f"  %p{k} = fmul {vt} %xi, %init{k}\n  %b{k} = fadd {vt} %a{k}, %p{k}"
                for k in range(chains)]
    sums = [f"  %s1 = fadd {vt} %b0, %b1"] + [f"  %s{k} = fadd {vt} %s{k - 1}, %b{k}"
                                              for k in range(2, chains)]
    return "\n".join([
        f"declare {vt} @llvm.fmuladd.v{lanes}f64({vt}, {vt}, {vt})",
        "define double @peak(i64 %n, double %xs, double %cs, double* %xv) {",
        "entry:", *splat, *inits, "  br label %loop",
        "loop:", *phis, "  %i = phi i64 [ 0, %entry ], [ %inext, %loop ]", *ops,
        "  %inext = add i64 %i, 1", "  %done = icmp eq i64 %inext, %n",
        "  br i1 %done, label %exit, label %loop",
        "exit:", *sums, f"  %e = extractelement {vt} %s{chains - 1}, i32 0",
        "  ret double %e", "}"])


def compiled_ir(ir_text: str, name: str, prototype):
    """(engine, function): function `name` of the LLVM IR module ir_text, compiled by
    llvmlite for Numba's target machine (so an AVX2 build measures AVX2) and callable
    through ctypes as `prototype` (a ctypes.CFUNCTYPE, which releases the GIL). Keep the
    engine alive as long as the function: the function pointer dies with it. (Also
    hslm/cores.py's probe.)"""
    import llvmlite.binding as llvm
    from numba.core import config

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(ir_text)
    mod.verify()
    cpu = config.CPU_NAME or llvm.get_host_cpu_name()
    features = (config.CPU_FEATURES if config.CPU_FEATURES is not None
                else llvm.get_host_cpu_features().flatten())
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features,
                                                                opt=3)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    return engine, prototype(engine.get_function_address(name))


@functools.lru_cache(maxsize=None)
def _compiled(lanes: int, fused: bool):
    """The loop compiled (compiled_ir), with its engine; once a process (the bench samples
    the peaks again after each round)."""
    return compiled_ir(_loop_ir(lanes, fused), "peak",
                       ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int64, ctypes.c_double,
                                        ctypes.c_double, ctypes.c_void_p))


def _iterations(fn, xs, seconds: float) -> int:
    """Iterations of the loop that take about `seconds` (after runs that settle the clock)."""
    n = 1 << 16
    while True:  # grow n until one run takes a tenth of the time wanted
        t = time.perf_counter()
        fn(n, 0.9999999, 1e-9, ctypes.addressof(xs))
        dt = time.perf_counter() - t
        if dt > seconds / 10 or n > 1 << 34:
            break
        n *= 4
    return max(int(n * seconds / max(dt, 1e-9)), 1)


def _rate(fn, xs, n: int, lanes: int, chains: int) -> float:
    """GFLOP/s of one run of n iterations (2 flops per lane and chain each)."""
    t = time.perf_counter()
    fn(n, 0.9999999, 1e-9, ctypes.addressof(xs))
    return 2.0 * lanes * chains * n / (time.perf_counter() - t) / 1e9


# Each rate is the best of ROUNDS runs, the two loops taking turns: a neighbour busy for a
# moment (these machines are shared) then costs one run of one loop, not a whole rate (run
# after run, the unfused rate here once measured 6.8 GFLOP/s and 14.6 a minute later).
ROUNDS = 4


def measured_peaks(seconds: float = 0.1):
    """{"fma": GFLOP/s, "mul_add": GFLOP/s, "lanes": doubles per vector} of one core,
    for the vector width Numba's kernels use here (hslm.micro.wide_vectors: 8, else 4),
    or None where the loop cannot be built (an llvmlite without MCJIT, say). Each loop
    runs ROUNDS times for about `seconds`, in turns after one run that settles the clock."""
    from .micro import wide_vectors

    lanes = 8 if wide_vectors() else 4
    xs = (ctypes.c_double * XS)(*[1e-9 * (1 + j / XS) for j in range(XS)])
    try:
        loops = {name: _compiled(lanes, fused) for name, fused in (("fma", True),
                                                                  ("mul_add", False))}
        sizes = {name: _iterations(fn, xs, seconds) for name, (_, fn) in loops.items()}
        for name, (_, fn) in loops.items():
            fn(sizes[name], 0.9999999, 1e-9, ctypes.addressof(xs))
        rates = {name: 0.0 for name in loops}
        for _ in range(ROUNDS):
            for name, (_, fn) in loops.items():
                rates[name] = max(rates[name], _rate(fn, xs, sizes[name], lanes,
                                                        accumulators(lanes, name == "fma")))
    except Exception:  # noqa: BLE001 - any failure: the bench falls back to the nominal peak
        return None
    return {**rates, "lanes": lanes}
