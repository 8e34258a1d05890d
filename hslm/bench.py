"""`hslm bench`: the speeds side by side in one process, as ratios, plus PyTorch.

Every speed trains the same seeded steps from the same start (after compiling),
so the checkpoints they end with must be byte-identical; the benchmark checks it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import platform
import time

import numpy as np
from numba import njit

from . import __version__
from . import checkpoint as ckpt
from .bench_report import BACKWARD, DENSE_OPERANDS, FORWARD, RELU_MATRICES, source_commit
from .config import Config
from .cores import farthest_round_trip_ns, fma_together
from .machine_load import load_between, snapshot
from .peak import measured_peaks
from .rng import Stream
from .layers import (CLOCK_BWD_ATTENTION, CLOCK_BWD_NORMS, CLOCK_BWD_PRODUCTS, CLOCK_FWD_ATTENTION,
                     CLOCK_FWD_NORMS, CLOCK_FWD_PRODUCTS, CLOCK_LOSS, CLOCK_OPERANDS,
                     CLOCK_RELU_MATRICES, CLOCK_SLOTS, CYCLES)
from .micro import (amd_family, cpu_info, half_width_avx2, half_width_avx512,
                    skips_relu_zeros)
from .speeds import DEFAULT_SPEED, SPEEDS
from .step import StepRunner, warm_up
from .train import Run

TABLE_ROUNDS = 3  # interleaved rounds of the table's runs (time_in_rounds)
TORCH_ROUNDS = 5  # interleaved rounds of speed 3 against PyTorch (versus_torch)
PROFILE_STEPS = 7  # steps of the speed-3 profile, each phase their median


def machine_peak_gflops_per_core():
    """Nominal f64 peak of one core: GHz x flops/cycle (2 FMA pipes x the lanes they
    hold: half a vector's on AMD Zen 4 for 512 bits and on Zen and Zen+ for 256), from
    the clock /proc/cpuinfo states, which cores rarely run at (hslm.peak measures the
    real peak; this is the fallback and the figure quoted beside it).

    Returns (gflops, description)."""
    info = cpu_info()
    flags = " " + info.get("flags", "") + " "
    model = info.get("model name") or platform.processor()
    from .micro import wide_vectors
    lanes = 8 if " avx512f " in flags else (4 if " avx2 " in flags else 2)
    if lanes == 8 and not wide_vectors():  # built for 256-bit vectors (an AVX2 target)
        lanes = 4
    halves = (lanes == 8 and half_width_avx512(info)) or (lanes == 4 and half_width_avx2(info))
    pipe_lanes = lanes // 2 if halves else lanes
    fma = 2 if (" fma " in flags or " avx512f " in flags) else 1
    flops_per_cycle = 2 * pipe_lanes * fma
    ghz = float(info.get("cpu MHz", 2000.0)) / 1000.0
    pipes = "2 FMA pipes" if fma > 1 else "no FMA"
    if halves:
        pipes += f" of {pipe_lanes} lanes, a {64 * lanes}-bit operation in two halves"
    return ghz * flops_per_cycle, (f"{model or 'cpu'}, {ghz:.2f} GHz x {flops_per_cycle} f64 "
                                   f"flops/cycle ({lanes}-wide as built, {pipes})")


def separate_add_pipes() -> bool:
    """Whether the core runs a vector multiply and a vector add in the same cycle on
    pipes of their own (AMD Zen: two FMA/multiply and two add pipes), so that an
    unfused multiply-add costs no more than an FMA. Intel cores run both on the
    FMA pipes: there it takes two of them."""
    return amd_family(cpu_info()) >= 0x17


def cpu_identity() -> str:
    """The core's vendor, family, model and stepping ("AuthenticAMD family 19h model 11h
    stepping 1"): what tells apart machines whose names and stated clocks agree (the
    Zen 4 and Zen 5 of these sessions are both "AMD EPYC, 2.60 GHz")."""
    info = cpu_info()
    try:
        family, model = int(info.get("cpu family", "")), int(info.get("model", ""))
    except ValueError:
        return info.get("vendor_id", "")
    return (f"{info.get('vendor_id', '')} family {family:x}h model {model:x}h stepping "
            f"{info.get('stepping', '?')}")


def checkpoint_digest(run: Run):
    """(sha256, size) of the .bin and .state bytes the run would write now."""
    p = ckpt.params_parts(run.cfg, run.state.theta, run.step, run.corpus.tokenizer)
    s = ckpt.state_parts(run.cfg, run.m, run.v, run.step, ckpt.params_sha256_of(p),
                         {"rng": run.rng.state_json()})
    digest = hashlib.sha256()
    for part in p + s:
        digest.update(part)
    return digest.hexdigest(), sum(len(part) for part in p + s)


def start_run(cfg, hyper, corpus, speed, threads):
    """A run set up for timing at one speed and thread count: its kernels loaded, one
    untimed step taken (the first touch of every buffer), and the numpy memory it holds
    measured (tracemalloc traces only what this run allocates)."""
    import tracemalloc

    tracemalloc.start()
    try:
        run = Run.fresh(cfg, hyper, corpus, plain=SPEEDS[speed].plain_layouts)
        runner = StepRunner(cfg, speed, threads)
        try:
            warm_up(runner, run)  # compile / load the kernels, changing nothing
            losses = [run.train_step(runner)]
        except BaseException:
            runner.close()
            raise
        memory = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {**timed_share(f"speed {speed} on {threads} thread(s)",
                          lambda: run.train_step(runner)),
            "rest": runner.rest,
            "speed": speed, "threads": threads, "batch": hyper.batch, "run": run,
            "runner": runner, "losses": losses, "memory_bytes": memory}


def timed_share(label, step):
    """What time_in_rounds needs of a contender: a label, step() that trains one step
    (and returns its loss, or None), and where its figures go."""
    return {"label": label, "step": step, "losses": [], "per_round": [], "seconds": 0.0}


def time_in_rounds(entries, steps, rounds, tokens_per_step, progress=None,
                   round_trip=farthest_round_trip_ns, sharing=fma_together, after_round=None):
    """Train every entry (timed_share) `steps` timed steps, in `rounds` rounds: each round
    gives each entry in turn (a rotating order) one untimed step, then its share of the
    timed steps, so that a slow spell of a shared machine falls on all alike and none is
    timed on caches the others left cold (with 2 timed steps a round and no untimed one,
    speed 3 measured 28% below its own run against PyTorch). An entry's tok/s is the
    median of its rounds'. An entry on several threads also gets, for each round, the
    cores' round trip (round_trip(): hslm/cores.py) just before its timed steps and just
    after, in round_trip_ns: where a hypervisor moves the CPUs between dies, it says
    which rounds ran on one; and whether the CPUs had a core's arithmetic each just
    before and just after (sharing(): hslm/cores.py's fma_together), in fma_together:
    where they were one core's two hardware threads, or a neighbour's thread ran on a
    CPU's core, it says which rounds had half a core. after_round(): called after each
    round (PeakSamples.sample)."""
    done = 0
    for r in range(rounds):
        n = (steps - done) // (rounds - r)
        for e in entries[r % len(entries):] + entries[:r % len(entries)]:
            e["losses"].append(e["step"]())
            apart = e.get("threads", 1) > 1 and round_trip is not None
            shared = e.get("threads", 1) > 1 and sharing is not None
            before = round_trip() if apart else None
            pace = sharing() if shared else None
            t0 = time.perf_counter()
            for _ in range(n):
                e["losses"].append(e["step"]())
            dt = time.perf_counter() - t0
            if e.get("rest"):  # (its threads do not spin into the next entry's round)
                e["rest"]()
            if apart:
                e.setdefault("round_trip_ns", []).append([before, round_trip()])
            if shared:
                e.setdefault("fma_together", []).append([pace, sharing()])
            e["seconds"] += dt
            e["per_round"].append(n * tokens_per_step / dt)
            if progress:
                progress(f"round {r + 1} of {rounds}: {e['label']}, "
                         f"{e['per_round'][-1]:.1f} tok/s")
        done += n
        if after_round is not None:
            after_round()
    for e in entries:
        e["tok_s"] = float(np.median(e["per_round"]))


def finish_run(e):
    """The run's row: its checkpoint's digest and size; its runner closed."""
    e["runner"].close()
    digest, size = checkpoint_digest(e.pop("run"))
    for key in ("runner", "step", "label", "rest"):
        e.pop(key, None)
    return {**e, "digest": digest, "checkpoint_bytes": size}


TORCH_BATCHES = 8  # the distinct batches PyTorch's trainer takes in turn


def torch_trainer(cfg, hyper, corpus, dtype_name, steps):
    """The same model and objective in PyTorch, one thread, windows batched: a function
    step() that trains the next step (forward, autograd backward, per-tensor clipping and
    AdamW), `steps` times, after one untimed step."""
    import torch

    from .oracle_torch import vsa_stream, window_losses
    from .params import init_params
    from .tables import vsa_table

    torch.set_num_threads(1)
    dtype = {"f64": torch.float64, "f32": torch.float32}[dtype_name]
    theta = init_params(cfg, hyper.seed)
    offs = cfg.offsets()
    params = {name: torch.tensor(theta[offs[t]:offs[t + 1]].reshape(shape), dtype=dtype,
                                 requires_grad=True)
              for t, (name, shape, _) in enumerate(cfg.tensors())}
    decay = [p for (n, _, k), p in zip(cfg.tensors(), params.values()) if k == "ternary"]
    other = [p for (n, _, k), p in zip(cfg.tensors(), params.values()) if k != "ternary"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hyper.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=hyper.lr)
    table = vsa_table(cfg)
    rng = Stream.seeded("bench", 0)
    # a few batches, taken in turn: one a step had grown with --steps (each batch's VSA
    # streams, made in Python, 0.4 MB and 0.1 s for hslm-3's; 25 GB at 10,000 steps)
    batches = [corpus.draw_windows(rng, hyper.batch, cfg.window)
               for _ in range(min(steps + 1, TORCH_BATCHES))]
    vsas = [np.stack([vsa_stream(cfg, table, w) for w in b]) for b in batches]

    taken = [0]

    def step():
        i = taken[0] % len(batches)
        taken[0] += 1
        loss, _, _ = window_losses(cfg, params, batches[i], vsas[i], hyper.loss_positions,
                                   dtype=dtype)
        opt.zero_grad()
        loss.backward()
        for p in params.values():
            torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()

    step()  # warm-up
    return step


def torch_memory_estimate(cfg, batch: int) -> int:
    """Bytes versus_torch holds at once, roughly: its own speed-3 run, and PyTorch's f64
    and f32 trainers (parameters, gradients, AdamW's moments, the straight-through copies:
    about 60 and 30 bytes a parameter, measured for a model of 51 million) with their
    autograd records (taken as three times a speed-3 run's records of the batch)."""
    from .validate import memory_estimate
    ours = memory_estimate(cfg, batch, 1, 3)
    records = ours - memory_estimate(cfg, 0, 1, 3)
    return ours + 90 * cfg.n_params + 3 * records


def versus_torch(cfg, hyper, corpus, steps, rounds=TORCH_ROUNDS):
    """Speed 3 on one thread against PyTorch f64 and f32, in `rounds` interleaved rounds
    (time_in_rounds), so that a slow spell of a shared machine falls on all three alike.
    Returns the median tok/s of each over the rounds and the median of the rounds'
    ratios."""
    import torch

    ours = start_run(cfg, hyper, corpus, 3, 1)
    try:
        total = steps + rounds  # each round's share: an untimed step, then timed ones
        entries = [ours] + [timed_share(f"PyTorch {dt}",
                                        torch_trainer(cfg, hyper, corpus, dt, total))
                            for dt in ("f64", "f32")]
        time_in_rounds(entries, steps, rounds, hyper.batch * cfg.window)
    finally:
        ours["runner"].close()
    tok = dict(zip(("speed 3", "f64", "f32"), (e["per_round"] for e in entries)))
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {"version": torch.__version__, "rounds": rounds, "ours": med(tok["speed 3"]),
            "f64": med(tok["f64"]), "f32": med(tok["f32"]),
            "ratio_f64": med([a / b for a, b in zip(tok["speed 3"], tok["f64"])]),
            "ratio_f32": med([a / b for a, b in zip(tok["speed 3"], tok["f32"])]),
            "per_round": tok}


# The forward's and the backward's parts besides their matrix products that the profile
# times (Model.clock's slots), as its report names them (parts_ms, reports since
# 2026-12-05 15:50 UTC)
PHASE_PARTS = {
    FORWARD: [("attention (rotary, panels, scores, outputs)", CLOCK_FWD_ATTENTION),
              ("the norms (the blocks' and head's)", CLOCK_FWD_NORMS)],
    BACKWARD: [("the loss and its gradient (cross-entropy)", CLOCK_LOSS),
               ("attention's gradient, rotary's, its panels", CLOCK_BWD_ATTENTION),
               ("the norms' gradient (the blocks' and head's)", CLOCK_BWD_NORMS)],
}


# Everything the profile reads from the clock: its key in a step's timings, its slot
TIMED_SLOTS = [("forward products", CLOCK_FWD_PRODUCTS), ("backward products", CLOCK_BWD_PRODUCTS),
               ("relu matrices", CLOCK_RELU_MATRICES), ("operands", CLOCK_OPERANDS)] + [
    part for phase_parts in PHASE_PARTS.values() for part in phase_parts]


def profile_layerwise(cfg, hyper, corpus, steps=PROFILE_STEPS):
    """Per-phase milliseconds of a speed-3 step on one thread: [(phase, ms)], each the
    median over `steps` steps (or calls), which a slow spell of a shared machine moves
    less than a mean; the share of the MLP's ReLU units active at the last step's
    scored positions (the products at the others, 0.0, are skipped); and, timed inside
    the step by the cycle counter ({} where the machine has none), in ms: the forward's
    and the backward's matrix products, the weight gradients' W_up and W_down and dense
    operands, and the forward's and the backward's other parts ({phase: [(part, ms)]}:
    attention, the norms, the loss; PHASE_PARTS)."""
    from .vsa import vsa_window

    run = Run.fresh(cfg, hyper, corpus, plain=False)
    runner = StepRunner(cfg, DEFAULT_SPEED, 1)
    # the same kernels, given a clock of CLOCK_SLOTS (Model.clock), count cycles: the
    # forward's and the backward's matrix products and other parts apart from the rest of
    # those phases, the weight gradients' W_up and W_down and the dense matrices' operands
    hz = cycles_per_second()
    clock = run.state.clock = np.zeros(CLOCK_SLOTS)
    try:
        run.train_step(runner)  # warm
        per_step = []
        for _ in range(steps):
            runner.timings = {}
            clock[:] = 0.0
            t0 = time.perf_counter()
            run.train_step(runner)
            x = {"step": time.perf_counter() - t0, **runner.timings}
            if hz:
                for key, slot in TIMED_SLOTS:
                    x[key] = clock[slot] / hz
            # what this step spent outside its timed phases (the medians of the phases
            # need not add up to the median step: that difference could read negative)
            x["other"] = x["step"] - sum(x[key] for key in (
                "forward", "backward", "weight gradients", "optimiser"))
            per_step.append(x)
        med = {key: float(np.median([x[key] for x in per_step])) for key in per_step[0]}
        t_wg = med["weight gradients"]
        w = runner.workers[0]
        windows = corpus.draw_windows(Stream.seeded("bench", 0), hyper.batch, cfg.window)

        def timed(f):
            f()
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                f()
                times.append(time.perf_counter() - t)
            return float(np.median(times))

        t_vsa = timed(lambda: [vsa_window(run.tables.vsa, x, cfg.blocks, cfg.width, w.vsa)
                               for x in windows])
        # the forward (with its VSA stream, timed alone above), the backward and the
        # optimiser are timed inside the step: there their operands come from farther away
        # than when a phase runs alone, back to back (the forward alone ran 1-3 ms faster)
        t_fwd, t_bwd = med["forward"] - t_vsa, med["backward"]
        rows = [("VSA stream", t_vsa), (FORWARD, t_fwd), (BACKWARD, t_bwd),
                (WEIGHT_GRADIENTS, t_wg),
                ("optimiser + requantise", med["optimiser"])]
        rows.append(("other (drawing windows, Python)", med["other"]))
        relu = runner.acts_b.relu[:, :, cfg.window - hyper.loss_positions:]
        active = float(np.count_nonzero(relu > 0.0) / relu.size)
    finally:
        runner.close()
    products = ({FORWARD: 1e3 * med["forward products"],
                 BACKWARD: 1e3 * med["backward products"]} if hz else {})
    parts = ({phase: [(label, 1e3 * med[label]) for label, _ in phase_parts]
              for phase, phase_parts in PHASE_PARTS.items()} if hz else {})
    weight_grads = ({RELU_MATRICES: 1e3 * med["relu matrices"],
                     DENSE_OPERANDS: 1e3 * med["operands"]} if hz else {})
    return [(name, 1e3 * t) for name, t in rows], active, products, weight_grads, parts


@njit(cache=True, nogil=True)
def _cycles():
    return CYCLES()


def cycles_per_second() -> float:
    """The rate of the cycle counter the profile reads (CYCLES), against perf_counter over
    0.1 s; 0.0 where the machine has no such counter (the profile then has no split)."""
    c0, t0 = _cycles(), time.perf_counter()
    while time.perf_counter() - t0 < 0.1:
        pass
    c1, t1 = _cycles(), time.perf_counter()
    return (c1 - c0) / (t1 - t0) if c1 > c0 else 0.0


WEIGHT_GRADIENTS = "weight gradients (all windows; zeroing G)"


def relu_matrix_flops(cfg, hyper) -> float:
    """FLOPs of the weight gradients of the matrices beside the ReLU (W_up, W_down) per
    step, every product counted (2 per multiply-add, at the scored positions), as the
    phase's own rate counts them; they sum only the active positions' products."""
    from .layers import relu_side
    dims = cfg.dims()
    macs = sum(int(np.prod(shape)) for t, (_, shape, _) in enumerate(cfg.tensors())
               if relu_side(dims, t) != 0)
    return 2.0 * macs * hyper.batch * hyper.loss_positions


def phase_work(cfg, hyper):
    """What each profiled phase must do per step: {phase: (amount, unit)}. The matrix
    phases in FLOPs (2 per multiply-add; the forward over all positions, the backward and
    the weight gradients over the scored ones; "unfused FLOP" for the weight gradients,
    whose products are not exact, so they multiply and add without FMA), the optimiser
    in the bytes it must move at least (AdamW reads the gradient, theta, m and v and
    writes theta, m and v; requantisation writes two int8 panel layouts of the ternary
    matrices, reading theta where AdamW has just left it, in cache: counting that read
    from memory too had put the optimiser's GB/s 13.8% high for hslm-3)."""
    macs = cfg.matrix_macs_per_position()
    tokens = hyper.batch * cfg.window
    scored = hyper.batch * hyper.loss_positions
    P = cfg.n_params
    ternary = sum(int(np.prod(s)) for _, s, kind in cfg.tensors() if kind == "ternary")
    return {FORWARD: (2.0 * cfg.forward_macs(tokens, scored), "FLOP"),
            BACKWARD: (2.0 * macs * scored, "FLOP"),
            WEIGHT_GRADIENTS: (2.0 * macs * scored, "unfused FLOP"),
            "optimiser + requantise": (7.0 * 8 * P + 2 * 1 * ternary, "B")}


@njit(cache=True, nogil=True, error_model="numpy")
def _optimiser_traffic(g, w, m, v):
    """The optimiser's memory traffic with none of its arithmetic: g, w, m and v read,
    w, m and v written, once each, in one pass."""
    for i in range(g.shape[0]):
        x = g[i]
        w[i] = w[i] + x
        m[i] = m[i] + x
        v[i] = v[i] + x


def optimiser_stream_gbs(n: int) -> float:
    """What the optimiser's phase can reach on this core: bytes per second of
    _optimiser_traffic over four arrays of n doubles (the model's own size), each run
    after 256 MB of other writes, as in a step, where a whole forward and backward
    come between two optimiser passes; best of 5. (A 64 MB copy, used before, ran
    slower than AdamW itself once its sums stopped stalling it.)"""
    g, w, m, v = (np.zeros(n) for _ in range(4))
    other = np.zeros(32 << 20)
    _optimiser_traffic(g, w, m, v)
    best = float("inf")
    for _ in range(5):
        other += 1.0
        t = time.perf_counter()
        _optimiser_traffic(g, w, m, v)
        best = min(best, time.perf_counter() - t)
    return 7 * 8 * n / best / 1e9


def optimiser_arithmetic_ns(n: int = 4096, reps: int = 200) -> float:
    """The optimiser's other bound on this core: nanoseconds per parameter of AdamW's own
    loop (hslm/adam_loop.py, through hslm.optim.adamw_step) over arrays in L2 (8,192
    parameters: 4 arrays of 64 KB), so that it waits on no memory. It is AdamW's time on
    two tensors of n parameters less its time on one, over n: what the second tensor's
    update adds, the loop alone. (The first tensor's norm is summed alone before its
    update, a serial chain of additions the model's other tensors hide in the loop:
    timing a single tensor counted it, about 1 ns a parameter more on AMD Zen 4.) The
    two are timed alternately and their medians taken."""
    from .optim import adamw_step
    rng = np.random.default_rng(0)

    def arrays(sizes):
        total = sum(sizes)
        offs = np.array([0, *np.cumsum(sizes)], np.int64)
        return (rng.standard_normal(total) * 0.1, rng.standard_normal(total) * 1e-3,
                np.zeros(total), np.full(total, 1e-6), offs, np.ones(len(sizes), np.bool_),
                *[np.zeros(len(sizes)) for _ in range(3)])

    one, two = arrays([n]), arrays([n, n])
    times = ([], [])
    for i in range(reps + 1):
        for a, out in ((one, times[0]), (two, times[1])):
            theta, grad, m, v, offs, decay, s0, s1, s2 = a
            t = time.perf_counter()
            adamw_step(theta, grad, m, v, offs, decay, 0.1, 0.001, 1e-3, 0.1, s0, s1, s2,
                       0, len(decay))
            if i:  # (the first call of each: loading, first touches)
                out.append(time.perf_counter() - t)
    return max(float(np.median(times[1]) - np.median(times[0])), 0.0) / n * 1e9


def flops_per_token(cfg: Config, k: int) -> float:
    return cfg.flops_per_token(k / cfg.window)


# ---------------------------------------------------------------- the report
class PeakSamples:
    """The core's measured f64 peaks (hslm/peak.py), measured before the runs and again
    after each timed round: each peak is the best of its samples. Measured once, a
    neighbour busy for that second had set the peak of a whole report: on a shared Xeon
    27.5 GFLOP/s, where the rounds that followed ran at a pace that needs 38.6, so the
    step read 84% of its peak and the ternary products 123%. A slow spell during a round
    now reads low, never high."""

    def __init__(self):
        self.samples = []
        self.sample()

    def sample(self):
        m = measured_peaks()
        if m is not None:
            self.samples.append(m)

    def best(self, name: str) -> float:
        return max(m[name] for m in self.samples)


def run_bench(models, speeds, threads, batches, steps, k_flag, data, with_torch, profile,
              progress=None, cache_dir=None):
    """Every (model, batch, threads, speed) side by side in one process, the runs of a
    batch timed in interleaved rounds (time_in_rounds), plus PyTorch and a speed-3
    profile: a report dict (machine, versions, rows, ratios)."""
    import sys

    import numba

    from .train import load_corpus, resolve_config
    from .validate import bench_hyper, check_bench_plan, check_fits

    rounds = min(TABLE_ROUNDS, steps)
    load_before = snapshot()
    nominal, peak_desc = machine_peak_gflops_per_core()
    peaks = PeakSamples()
    peak_measured = bool(peaks.samples)
    report = {"machine": peak_desc, "cpu": cpu_identity(), "nominal_peak_gflops_per_core": nominal,
              "peak_measured": peak_measured,
              "vector_lanes": peaks.samples[0]["lanes"] if peak_measured else None,
              "python": sys.version.split()[0], "numpy": np.__version__,
              "numba": numba.__version__, "hslm": __version__, "commit": source_commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "steps": steps, "rounds": rounds, "seed": 1729, "models": []}
    plan = [(name, cfg, cfg.window if k_flag is None else k_flag)
            for name, cfg in ((n, resolve_config(n)) for n in models)]
    combos = [(s, t) for t in threads for s in speeds]
    # every model's and batch's checks before anything is timed (the CLI's before it compiles)
    check_bench_plan([(name, cfg) for name, cfg, _ in plan], speeds, threads, batches, k_flag)
    for name, cfg, k in plan:
        if with_torch and importlib.util.find_spec("torch") is not None:  # (after the runs)
            check_fits(torch_memory_estimate(cfg, batches[0]),
                       f"bench's PyTorch baseline for --model {name} --batch {batches[0]} "
                       "(--no-torch leaves it out)")
    for name, cfg, k in plan:
        corpus = None
        entry = {"model": name, "config": cfg.to_json(), "params": cfg.n_params, "k": k,
                 "window": cfg.window, "flops_per_token": flops_per_token(cfg, k), "rows": [],
                 "groups": []}
        for batch in batches:
            hyper = bench_hyper(cfg, batch, k)
            if corpus is None:
                corpus = load_corpus(data, cfg, cache_dir=cache_dir)
                entry["text_sha256"] = corpus.text_sha256
            runs = []
            try:
                for s, t in combos:
                    runs.append(start_run(cfg, hyper, corpus, s, t))
                    if progress:
                        progress(f"set up {name} batch {batch} speed {s} on {t} thread(s)")
                time_in_rounds(runs, steps, rounds, batch * cfg.window, progress,
                               after_round=peaks.sample)
            except BaseException:
                for e in runs:
                    e["runner"].close()
                raise
            digests, losses = set(), set()
            for e in runs:
                r = finish_run(e)
                r["gflops"] = r["tok_s"] * entry["flops_per_token"] / 1e9
                entry["rows"].append(r)
                digests.add(r["digest"])
                losses.add(tuple(r["losses"]))
                if progress:
                    progress(f"ran {name} batch {batch} speed {r['speed']} on {r['threads']} "
                             f"thread(s): {r['tok_s']:.1f} tok/s")
            entry["groups"].append({"batch": batch, "identical": len(digests) == 1
                                    and len(losses) == 1, "digest": sorted(digests)[0]})
        if with_torch:
            try:
                import torch  # noqa: F401 - only whether it is installed
            except ImportError:
                entry["torch"] = None
            else:
                hyper = bench_hyper(cfg, batches[0], k)
                entry["torch"] = versus_torch(cfg, hyper, corpus, max(steps, TORCH_ROUNDS))
        if profile and name == models[0]:
            hyper = bench_hyper(cfg, batches[0], k)
            (entry["profile_ms"], entry["relu_active"], entry["products_ms"],
             entry["weight_grads_ms"], entry["parts_ms"]) = profile_layerwise(cfg, hyper, corpus)
            entry["phase_work"] = phase_work(cfg, hyper)
            entry["relu_matrices_flop"] = relu_matrix_flops(cfg, hyper)
            entry["relu_inputs_skipped"] = skips_relu_zeros()  # (reports since 2026-12-05)
            report["optimiser_stream_gbs"] = optimiser_stream_gbs(cfg.n_params)
            report["optimiser_arithmetic_ns"] = optimiser_arithmetic_ns()
        report["models"].append(entry)
    report["load"] = load_between(load_before, snapshot())  # (reports since 2026-12-05)
    if peak_measured:  # the best of the samples (reports since 2026-12-06 list them)
        peak, unfused = peaks.best("fma"), peaks.best("mul_add")
        report["peak_samples_gflops"] = [m["fma"] for m in peaks.samples]
    else:  # the nominal peak, and half of it unfused where adds share pipes
        peak, unfused = nominal, nominal if separate_add_pipes() else nominal / 2
    report["peak_gflops_per_core"], report["unfused_peak_gflops_per_core"] = peak, unfused
    for e in report["models"]:
        for r in e["rows"]:
            r["peak_share"] = r["gflops"] / (peak * r["threads"])
    return report
