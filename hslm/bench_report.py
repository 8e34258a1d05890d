"""Bench reports (`hslm bench --json`): printed, read back and compared, with no kernels
loaded, so `hslm bench-compare` runs anywhere in a moment."""
from __future__ import annotations

from .errors import HslmError
from .machine_load import describe as describe_load


# The weight gradients' parts hslm bench's profile times (a report's weight_grads_ms)
RELU_MATRICES = "W_up and W_down"
DENSE_OPERANDS = "the dense matrices' operands"
# The profile's phases whose matrix products and other parts it times apart (a report's
# products_ms and parts_ms), and what is left of each once they are
FORWARD = "forward"
BACKWARD = "backward through the layers' inputs"
PRODUCTS = "of which its ternary matrix products"
REST_OF = {FORWARD: "the rest (residuals, bias, ReLU, embedding)",
           BACKWARD: "the rest (residuals, ReLU's mask, scales)"}


def _samples(report) -> str:
    """How the FMA peak was measured, where it was measured more than once (reports since
    2026-12-06): the best of the samples, and the lowest where it was well below (a
    neighbour on a shared machine)."""
    samples = report.get("peak_samples_gflops") or []
    if len(samples) < 2:
        return ""
    low = min(samples)
    return (f" (the best of {len(samples)} measurements, before the runs and after each "
            "timed round" + (f"; the lowest {low:.1f}" if low < 0.9 * max(samples) else "")
            + ")")


def format_report(report):
    """The report as the lines `hslm bench` prints."""
    from .speeds import SPEED_NAMES
    peak = report["peak_gflops_per_core"]
    version = f"{_version(report)}, " if report.get("hslm") else ""
    rounds = (f" in {report['rounds']} interleaved rounds (tok/s: their median)"
              if report.get("rounds", 1) > 1 else "")
    steps = f"{report['steps']} timed step{'s' if report['steps'] != 1 else ''}"
    out = [f"hslm bench: {steps} per run{rounds}, seed {report['seed']}; "
           f"{version}Python {report['python']}, numpy {report['numpy']}, numba "
           f"{report['numba']}" + (f"; {report['date']}" if report.get("date") else ""),
           f"machine: {report['machine']}: nominal f64 peak "
           f"{report.get('nominal_peak_gflops_per_core', peak):.1f} GFLOP/s per core",
           (f"f64 peak of one core, measured ({report['vector_lanes']}-wide vectors, "
            f"hslm/peak.py): FMA {peak:.1f} GFLOP/s{_samples(report)}, multiply + add "
            f"(unfused) {report['unfused_peak_gflops_per_core']:.1f} GFLOP/s; '% peak' is of "
            "the measured FMA peak" if report.get("peak_measured")
            else "f64 peak not measured here: '% peak' is of the nominal peak"),
           "FLOPs per token: 2 per multiply-add of the ternary matrices (forward, input "
           "gradient, weight gradient at scored positions)"]
    if report.get("load"):
        out.append(f"beside the bench ({report['load']['wall_s']:.0f} s, Linux's /proc/stat): "
                   f"{describe_load(report['load'])}; a busy machine's figures read low")
    for e in report["models"]:
        out.append(f"model {e['model']} ({e['params']:,} parameters, window {e['window']}, "
                   f"k {e['k']}, {e['flops_per_token'] / 1e6:.2f} MFLOP per token)")
        out.append(f"{'batch':>5} {'speed':>5} {'name':>10} {'threads':>7} {'tok/s':>10} "
                   f"{'x slowest':>9} {'GFLOP/s':>8} {'% peak':>7} {'par. eff.':>9} "
                   f"{'MiB':>7} {'ckpt MB':>8}")
        rows = e["rows"]
        for r in rows:
            same = [x for x in rows if x["batch"] == r["batch"]]
            slowest = min(x["tok_s"] for x in same)
            # parallel efficiency: against the same speed's run on one thread, where the
            # bench had one ("-" where not: against its fewest threads, two threads' own row
            # read 100% whatever they scaled)
            base = next((x for x in same if x["speed"] == r["speed"] and x["threads"] == 1),
                        None)
            eff = (f"{100 * r['tok_s'] / (r['threads'] * base['tok_s']):>8.1f}%" if base
                   else f"{'-':>9}")
            out.append(f"{r['batch']:>5} {r['speed']:>5} {SPEED_NAMES[r['speed']]:>10} "
                       f"{r['threads']:>7} {r['tok_s']:>10.1f} {r['tok_s'] / slowest:>9.2f} "
                       f"{r['gflops']:>8.2f} {100 * r['peak_share']:>6.1f}% {eff} "
                       f"{r['memory_bytes'] / 2 ** 20:>7.0f} {r['checkpoint_bytes'] / 1e6:>8.1f}")
        out += _rounds_apart(rows)
        for g in e["groups"]:
            out.append(f"batch {g['batch']}: " + (
                f"checkpoints byte-identical across all runs (sha256 {g['digest'][:16]}...), "
                "losses identical" if g["identical"] else "CHECKPOINTS DIFFER across runs"))
        t = e.get("torch")
        if t:
            line = f"PyTorch {t['version']} baseline, one thread, windows batched"
            if "ours" in t:
                line += (f", batch {rows[0]['batch']}, timed in {t['rounds']} rounds interleaved "
                         f"with speed 3 on one thread (medians): speed 3 {t['ours']:.1f} tok/s,")
            else:  # reports before the rounds: PyTorch timed after the rows
                line += ":"
            line += f" f64 {t['f64']:.1f} tok/s, f32 {t['f32']:.1f} tok/s"
            ratios = torch_ratios(e)
            if ratios:
                line += (f"; speed 3 is {ratios[0]:.2f}x torch f64, {ratios[1]:.2f}x torch "
                         "f32" + (" (the medians of the rounds' ratios)" if "ratio_f64" in t
                                  else ""))
            out.append(line)
        elif "torch" in e:
            out.append("PyTorch baseline: torch not installed (pip install torch==2.13.0)")
        if e.get("profile_ms"):
            total = sum(ms for _, ms in e["profile_ms"])
            bw = report.get("optimiser_stream_gbs")
            # the optimiser's arithmetic bound, ns a parameter (reports since 6bcace7+)
            ns = report.get("optimiser_arithmetic_ns")
            unfused = report.get("unfused_peak_gflops_per_core", peak / 2)
            stream = (f"one pass over the optimiser's arrays ({bw:.1f} GB/s: read g, "
                      "theta, m, v, write theta, m, v)")
            out.append(f"speed-3 step profile, one thread ({total:.1f} ms per step of "
                       f"{rows[0]['batch']} windows, the phases' medians summed); each phase "
                       "against what it can reach: "
                       f"the f64 FMA peak ({peak:.1f} GFLOP/s) for the ternary matrix phases, "
                       f"the multiply + add peak ({unfused:.1f} GFLOP/s) for the weight "
                       f"gradients (their products are not exact, so they are not fused), "
                       + (f"the longer of {stream} and its arithmetic (AdamW's loop on arrays "
                          f"in cache: {ns:.2f} ns a parameter)" if ns else stream)
                       + " for the optimiser:")
            for name, ms in e["profile_ms"]:
                line = f"  {name:46s} {ms:8.1f} ms {100 * ms / total:5.1f}%"
                work = e.get("phase_work", {}).get(name)
                if work and ms > 0:
                    amount, unit = work
                    rate = amount / (ms / 1e3) / 1e9
                    ceiling = {"FLOP": peak, "unfused FLOP": unfused}.get(unit, bw)
                    label = "GB/s" if unit == "B" else "GFLOP/s"
                    share = rate / ceiling
                    if unit == "B" and ns:  # the longer of the pass and the arithmetic
                        share = _optimiser_bound_ms(report, e, amount) / ms
                    line += f"  {rate:6.1f} {label:7s} {100 * share:5.1f}% of its ceiling"
                    if unit == "B" and share > 1:  # (its bound is a pass from far memory)
                        line += (" (above it: its arrays were in cache, as a small model's "
                                 "stay, or the pass was timed slow)")
                out.append(line)
                products = (e.get("products_ms") or {}).get(name)
                if products is not None and work and products > 0:  # (reports since 0.2.0+)
                    rate = work[0] / (products / 1e3) / 1e9
                    out.append(f"    {PRODUCTS:44s} "
                               f"{products:8.1f} ms{'':7s}  {rate:6.1f} GFLOP/s "
                               f"{100 * rate / peak:5.1f}% of the FMA peak")
                    parts = (e.get("parts_ms") or {}).get(name)  # (reports since 2026-12-05)
                    if parts:
                        out.extend(f"    {label:44s} {part_ms:8.1f} ms" for label, part_ms in parts)
                        rest = ms - products - sum(part_ms for _, part_ms in parts)
                        out.append(f"    {REST_OF[name]:44s} {max(rest, 0.0):8.1f} ms")
                    else:
                        out.append(f"    {'the rest (attention, norms, rotary, others)':44s} "
                                   f"{max(ms - products, 0.0):8.1f} ms")
                split = e.get("weight_grads_ms") or {}
                if name.startswith("weight gradients") and len(split) == 2 and work:
                    relu_ms, ops_ms = split[RELU_MATRICES], split[DENSE_OPERANDS]
                    relu_flop = e.get("relu_matrices_flop", 0.0)
                    rest = max(ms - relu_ms - ops_ms, 0.0)
                    # W_up and W_down's rate of the products they sum (the active ones)
                    summed = relu_flop * e.get("relu_active", 1.0)
                    for label, part_ms, flop, of in (
                            (f"of which {RELU_MATRICES}", relu_ms, summed,
                             " (their active products)"),
                            (f"{DENSE_OPERANDS} (copies)", ops_ms, 0.0, ""),
                            ("the dense matrices' tiles, the rest", rest, work[0] - relu_flop,
                             "")):
                        line = f"    {label:44s} {part_ms:8.1f} ms"
                        if flop > 0 and part_ms > 0:
                            rate = flop / (part_ms / 1e3) / 1e9
                            line += (f"{'':7s}  {rate:6.1f} GFLOP/s {100 * rate / unfused:5.1f}% "
                                     f"of the unfused peak{of}")
                        out.append(line)
            out += _step_at_ceilings(report, e, total)
            if e.get("relu_active") is not None:
                out.append(f"  (the MLP's ReLU units were active at {100 * e['relu_active']:.1f}% "
                           "of the scored positions; the weight gradients of Wdown and Wup skip "
                           "the products with the zeros, with the same bits"
                           + ("; so do the forward's Wdown and the backward's Wup^T products, "
                              "whose inputs are the ReLU's output and its gradient"
                              if e.get("relu_inputs_skipped") else "")
                           + "; the rates count every product"
                           + (", but for the line of W_up and W_down alone"
                              if e.get("weight_grads_ms") else "") + ")")
    return out


def _rounds_apart(rows):
    """Lines for the runs on several threads that measured how far apart their cores were
    (reports since 2026-12-05; none where no probe could run, as with one CPU): each
    round's tok/s with the round trip before and after it, and (reports since 11:20 UTC
    that day) the FMA loop's pace on every CPU at once before and after it."""
    def ns(x):
        return "-" if x is None else f"{x:.0f}"

    def pace(x):
        return "-" if x is None else f"{x:.2f}"

    def probed(pairs, n):
        return (pairs and len(pairs) == n and any(x is not None for pair in pairs
                                                  for x in pair))
    out, shared = [], False
    for r in rows:
        n = len(r.get("per_round", []))
        trips = r.get("round_trip_ns") or []
        if not probed(trips, n):
            continue
        paces = r.get("fma_together") or []  # (reports since 2026-12-05 11:20 UTC)
        paces = paces if probed(paces, n) else [None] * n
        shared = shared or paces[0] is not None
        out.append(f"  batch {r['batch']}, speed {r['speed']} on {r['threads']} threads: "
                   + ", ".join(f"{tok:.1f} tok/s ({ns(a)} / {ns(b)} ns"
                               + ("" if p is None else f"; {pace(p[0])} / {pace(p[1])}")
                               + ")" for tok, (a, b), p
                               in zip(r["per_round"], r["round_trip_ns"], paces)))
    if out:
        out.insert(0, "round by round, with how far apart the cores were (a cache line's round "
                      "trip between the farthest CPUs, just before / after the round; "
                      "hslm/cores.py)" + (
                          "; and the FMA loop's pace on every CPU at once, the slowest's share "
                          "of one CPU's alone (about 0.5: CPUs sharing a core's pipes, with "
                          "each other or a neighbour)" if shared else "") + ":")
    return out


def _apart_ns(row):
    """How far apart a multi-thread row's cores were: the median over its rounds of the
    larger of the round trips before and after (None where not measured)."""
    import statistics
    worst = [max(x for x in pair if x is not None) for pair in row.get("round_trip_ns") or []
             if any(x is not None for x in pair)]
    return statistics.median(worst) if worst else None


def _version(report) -> str:
    """"hslm 0.2.0 (commit)" of a report that records its version."""
    return f"hslm {report['hslm']}" + (f" ({report['commit']})" if report.get("commit") else "")


def source_commit():
    """The git commit of the hslm source this runs from ("+" if it has uncommitted
    changes), or None outside a git checkout."""
    import subprocess
    from pathlib import Path
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip()[:12] + ("+" if dirty.stdout.strip() else "")


MAX_REPORT = 64 << 20  # bytes of a bench report (a large one is under 1 MB)


def load_report(path) -> dict:
    """A report `hslm bench --json` wrote, or an HslmError saying why it is not one."""
    import json
    from .errors import read_bytes
    try:
        report = json.loads(read_bytes(path, "bench report", limit=MAX_REPORT))
    except RecursionError:  # '[' * 100000: json recurses once a level
        raise HslmError(f"{path}: not a JSON bench report (nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise HslmError(f"{path}: not a JSON bench report ({e})") from None
    if not (isinstance(report, dict) and isinstance(report.get("models"), list)
            and "steps" in report and all(isinstance(e, dict) and "rows" in e
                                          for e in report["models"])):
        raise HslmError(f"{path}: not an hslm bench report (no models and rows)")
    if not any(e["rows"] for e in report["models"]):
        raise HslmError(f"{path}: not an hslm bench report (no run in it)")
    for e in report["models"]:  # older reports' parts under today's labels, to compare
        try:
            e["parts_ms"] = {phase: [[PARTS_RENAMED.get(label, label), ms] for label, ms in items]
                             for phase, items in e["parts_ms"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            pass  # (none, or malformed: judged where they are read)
    return report


# the profile's parts renamed in 4da4f4c (2026-12-05): what reports before it call them
PARTS_RENAMED = {
    "the norms (the blocks' and the head's)": "the norms (the blocks' and head's)",
    "attention's gradient (panels, rotary)": "attention's gradient, rotary's, its panels",
    "through the norms (the blocks' and head's)": "the norms' gradient (the blocks' and head's)",
}


def machine_of(report):
    """What says which machine and build a report is of: its machine line up to the
    flops a cycle ("AMD EPYC, 2.60 GHz": the CPU's name and stated clock), and the
    vector width it was built for. (How a version counts the flops a cycle is not the
    machine: 0.2.0 before ea5a639 counted 32 on AMD Zen 4, since then 16.)"""
    line = report.get("machine")
    return (line.split(" x ")[0] if isinstance(line, str) else line,
            report.get("vector_lanes"))


def same_machine(a, b) -> bool:
    """Whether reports a and b are of one machine and build: machine_of, the cores'
    vendor, family, model and stepping where both reports name them (reports since
    2026-12-04), else measured FMA peaks within 1.5x of each other (the 8-wide builds of
    a Zen 4 and a Zen 5 have the same name, stated clock and width, and peaks 2x apart;
    their AVX2 builds' peaks are 1.08x apart, so older reports of those two are not told
    apart)."""
    if machine_of(a) != machine_of(b):
        return False
    if a.get("cpu") and b.get("cpu"):
        return a["cpu"] == b["cpu"]
    pa, pb = a.get("peak_gflops_per_core"), b.get("peak_gflops_per_core")
    if isinstance(pa, (int, float)) and isinstance(pb, (int, float)) and pa > 0 and pb > 0:
        return max(pa / pb, pb / pa) <= 1.5
    return True


def compare_reports(named) -> list:
    """(lines, differ) comparing bench reports [(name, report)], each against the first:
    tok/s of every row they share, the PyTorch ratios, the profile's phases, and whether
    runs of the same model, batch, steps, seed, k and text ended with the same checkpoint
    bytes (differ: some did not, in any two reports or within one:
    _bytes_beyond_the_first)."""
    (base_name, base), rest = named[0], named[1:]
    differ = False

    def describe(name, r):
        version = _version(r) if r.get("hslm") else "hslm (version not recorded)"
        steps = f"{r['steps']} step{'s' if r['steps'] != 1 else ''}"
        return (f"{name}: {version}, {r.get('date', 'date not recorded')}, {steps}; "
                f"{r.get('machine', '?')}; Python {r.get('python', '?')}, numpy "
                f"{r.get('numpy', '?')}, numba {r.get('numba', '?')}"
                + (f"; beside it {describe_load(r['load'])}" if r.get("load") else ""))

    out = [f"comparing {len(named)} bench reports, each against the first ({base_name}):",
           "  " + describe(base_name, base)] + ["  " + describe(n, r) for n, r in rest]
    if any(not same_machine(r, base) for _, r in rest):
        out.append("  (the machines differ: the ratios below compare machines, not versions)")
    for name, r in rest:
        out.append(f"{name} against {base_name}:")
        for e in r["models"]:
            b = next((x for x in base["models"] if x["model"] == e["model"]), None)
            if b is None:
                out.append(f"  model {e['model']}: not in {base_name}")
                continue
            out.append(f"  model {e['model']}")
            key = lambda row: (row["batch"], row["speed"], row["threads"])  # noqa: E731
            before = {key(x): x for x in b["rows"]}
            if not any(key(row) in before for row in e["rows"]):
                out.append("    no run in common (other batches, speeds or thread counts)")
            for row in e["rows"]:
                old = before.get(key(row))
                if old is None:
                    continue
                apart = [_apart_ns(x) for x in (old, row)]
                out.append(f"    batch {row['batch']:>3} speed {row['speed']} threads "
                           f"{row['threads']:>2}: {old['tok_s']:9.1f} -> {row['tok_s']:9.1f} "
                           f"tok/s  {row['tok_s'] / old['tok_s']:5.2f}x" + (
                               "  (cores " + " -> ".join("-" if a is None else f"{a:.0f}"
                                                        for a in apart) + " ns apart)"
                               if apart != [None, None] else ""))
            lines, bytes_differ = _compare_bytes(base, b, r, e)
            out += lines
            differ |= bytes_differ
            rb, re_ = torch_ratios(b), torch_ratios(e)
            if rb and re_:
                out.append("    against PyTorch, one thread: " + ", ".join(
                    f"{x:.2f}x -> {y:.2f}x torch {dt}"
                    for x, y, dt in zip(rb, re_, ("f64", "f32"))))
            pb, pe = dict(b.get("profile_ms") or []), e.get("profile_ms") or []
            if pb and pe:
                out.append("    speed-3 profile, ms per step:")
                for phase, ms in pe:
                    if phase in pb:
                        out.append(_compared(f"      {phase:46s}", pb[phase], ms))
                        for label, ms_b, ms_e in _timed_parts(b, e, phase):
                            out.append(_compared(f"        {label:44s}", ms_b, ms_e))
                tot_b, tot_e = sum(pb.values()), sum(ms for _, ms in pe)
                out.append(f"      {'step':46s} {tot_b:7.1f} -> {tot_e:7.1f}  "
                           f"{tot_e / tot_b:5.2f}x")
    lines, bytes_differ = _bytes_beyond_the_first(named)
    return out + lines, differ or bytes_differ


def _bytes_beyond_the_first(named):
    """(lines, differ): what the comparisons against the first report do not see. A
    report whose own runs of a batch ended with other bytes (`identical` false: hslm bench
    said CHECKPOINTS DIFFER and exited 1), and two later reports whose runs of the same
    model, batch, steps, seed, k and text ended with other bytes, where the first report
    has no run comparable with them (nothing else compares them). Nothing where all
    agree."""
    out, differ, seen = [], False, []
    for i, (name, r) in enumerate(named):
        for e in r["models"]:
            for g in e.get("groups", []):
                if not g["identical"]:
                    differ = True
                    out.append(f"{name}: model {e['model']} batch {g['batch']}: CHECKPOINTS "
                               "DIFFER across its own runs")
                if i == 0 or any(  # (compared with the first already: _compare_bytes)
                        x["model"] == e["model"] and y["batch"] == g["batch"]
                        and not _other_runs(named[0][1], x, r, e)
                        for x in named[0][1]["models"] for y in x.get("groups", [])):
                    continue
                other = next((x for x in seen if x[2]["model"] == e["model"]
                              and x[3]["batch"] == g["batch"]
                              and not _other_runs(x[1], x[2], r, e)), None)
                if other is None:
                    seen.append((name, r, e, g))
                elif other[3]["digest"] != g["digest"]:
                    differ = True
                    out.append(f"{name} against {other[0]}: model {e['model']} batch "
                               f"{g['batch']}: CHECKPOINTS DIFFER (sha256 "
                               f"{other[3]['digest'][:16]}... -> {g['digest'][:16]}...)")
    return out, differ


def _step_at_ceilings(report, e, total):
    """The profile's last line: how long a step would take, and what share of the FMA peak
    it would reach, with every matrix product at its ceiling (the ternary products at the
    FMA peak, the weight gradients at the unfused one, W_up's and W_down's over their
    active products only) and the optimiser at its bound; then with the step's other
    parts (attention, norms, the loss, the operands' copies, the VSA stream, Python) as
    timed. What item 2 of issue 12 asks of a core (60%) against what it allows. Products
    that skip their inputs' zeros (relu_inputs_skipped) are charged in full, so there the
    shares read a little low; the weight gradients' own other work (zeroing small
    tensors, the bias and embedding sums) is not among the parts "as timed", so that
    share reads a little high. [] for older reports, without the parts it needs."""
    peak = report["peak_gflops_per_core"]
    unfused = report.get("unfused_peak_gflops_per_core")
    work, products = e.get("phase_work") or {}, e.get("products_ms") or {}
    split = e.get("weight_grads_ms") or {}
    phases = dict(e["profile_ms"])
    wg = next((name for name in phases if name.startswith("weight gradients")), None)
    opt = next((name for name, (_, unit) in work.items() if unit == "B"), None)
    optimiser = _optimiser_bound_ms(report, e, work[opt][0]) if opt else None
    if (not (unfused and wg in work and optimiser and len(split) == 2
             and "relu_matrices_flop" in e)
            or any(name not in products or name not in work for name in (FORWARD, BACKWARD))):
        return []
    relu_flop, active = e["relu_matrices_flop"], e.get("relu_active", 1.0)
    bound = ((work[FORWARD][0] + work[BACKWARD][0]) / peak
             + (work[wg][0] - relu_flop * (1.0 - active)) / unfused) / 1e6 + optimiser  # ms
    other = max(total - sum(phases[name] for name in (FORWARD, BACKWARD, wg, opt))
                + sum(phases[name] - products[name] for name in (FORWARD, BACKWARD))
                + split[DENSE_OPERANDS], 0.0)
    flop = sum(amount for amount, unit in work.values() if unit != "B")

    def share(ms):
        return 100 * flop / (ms / 1e3) / 1e9 / peak

    return [(f"  a step at the ceilings (every matrix product at its peak, W_up's and "
             f"W_down's over their active products, the optimiser at its bound): {bound:.1f} "
             f"ms, {share(bound):.1f}% of the FMA peak as counted above; with the step's "
             f"other parts as timed (attention, norms, the loss, the operands' copies, the "
             f"VSA stream, Python: {other:.1f} ms) {bound + other:.1f} ms, "
             f"{share(bound + other):.1f}%")]


def _optimiser_bound_ms(report, e, nbytes):
    """The optimiser's bound, ms a step: the longer of one pass over its arrays (nbytes at
    the measured stream rate) and AdamW's arithmetic (ns a parameter, measured); None where
    the report has not both (older reports)."""
    bw, ns = report.get("optimiser_stream_gbs"), report.get("optimiser_arithmetic_ns")
    if not (bw and ns):
        return None
    return max(nbytes / bw / 1e6, e["params"] * ns / 1e6)


def _compared(head, ms_b, ms_e):
    """A line of bench-compare's profile: a time in both reports and their ratio."""
    return f"{head} {ms_b:7.1f} -> {ms_e:7.1f}  " + (f"{ms_e / ms_b:5.2f}x" if ms_b > 0 else "")


def _timed_parts(b, e, phase):
    """[(label, ms in b, ms in e)]: the parts of a profiled phase that both reports timed
    by the cycle counter (products_ms, weight_grads_ms, parts_ms; older reports have
    fewer)."""
    out = []
    pb, pe = b.get("products_ms") or {}, e.get("products_ms") or {}
    if phase in pb and phase in pe:
        out.append((PRODUCTS, pb[phase], pe[phase]))
    if phase.startswith("weight gradients"):
        wb, we = b.get("weight_grads_ms") or {}, e.get("weight_grads_ms") or {}
        out.extend((label, wb[label], we[label]) for label in we if label in wb)
    parts_b = dict((b.get("parts_ms") or {}).get(phase) or [])
    out.extend((label, parts_b[label], ms) for label, ms in
               (e.get("parts_ms") or {}).get(phase) or [] if label in parts_b)
    return out


def torch_ratios(entry):
    """(speed 3 / torch f64, speed 3 / torch f32) of a report's model entry, or None."""
    t = entry.get("torch")
    if not t:
        return None
    if "ratio_f64" in t:
        return t["ratio_f64"], t["ratio_f32"]
    rows = entry["rows"]  # reports before the interleaved rounds
    ours = max((x["tok_s"] for x in rows if x["threads"] == 1
                and x["batch"] == rows[0]["batch"]), default=None)
    return (ours / t["f64"], ours / t["f32"]) if ours else None


def _other_runs(base, b, r, e):
    """What makes two reports' runs of a model (reports base and r, their entries b and e)
    other runs, whose bytes are not to be compared: [] where they are the same run."""
    texts = b.get("text_sha256"), e.get("text_sha256")  # (not in reports before 1cceec6)
    # the same name, another model (a config file changed between the runs): its config,
    # or in reports without one, its size
    configs = b.get("config"), e.get("config")
    same_model = (configs[0] == configs[1] if None not in configs else
                  all(b.get(f) == e.get(f) for f in ("params", "window", "flops_per_token")))
    return [what for what, same in (
        ("model", same_model),
        ("steps", base["steps"] == r["steps"]), ("seed", base.get("seed") == r.get("seed")),
        ("rounds", base.get("rounds", 0) == r.get("rounds", 0)),  # (each adds a step)
        ("k", b.get("k") == e.get("k")), ("text", None in texts or texts[0] == texts[1]))
        if not same]


def _compare_bytes(base, b, r, e):
    """(lines, differ): whether two reports' runs of a model ended with the same checkpoint
    bytes, batch by batch (comparable only with the same steps, seed, k and text)."""
    others = _other_runs(base, b, r, e)
    same_run = not others
    out, differ = [], False
    groups = {g["batch"]: g for g in b.get("groups", [])}
    for g in e.get("groups", []):
        old = groups.get(g["batch"])
        if old is None:
            continue
        if not same_run:
            work = ("; k changes the work per token: the tok/s are not like for like"
                    if "k" in others else "")
            out.append(f"    batch {g['batch']}: checkpoints not comparable (other "
                       f"{', '.join(others)}{work})")
        elif old["digest"] == g["digest"]:
            out.append(f"    batch {g['batch']}: the same checkpoint bytes in both "
                       f"(sha256 {g['digest'][:16]}...)")
        else:
            differ = True
            out.append(f"    batch {g['batch']}: CHECKPOINTS DIFFER (sha256 {old['digest'][:16]}"
                       f"... -> {g['digest'][:16]}...)")
    return out, differ


def all_identical(report) -> bool:
    return all(g["identical"] for e in report["models"] for g in e["groups"])
