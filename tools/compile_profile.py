"""Where a first run's compile time goes, kernel by kernel.

    python tools/compile_profile.py [--jobs JOB,JOB...] [--top N] [--asm MODULE.KERNEL ...]
                                    [--passes]
    python tools/compile_profile.py --first-run

Runs hslm's compile jobs (hslm/precompile.py; by default the default run's, in their
order) one after another in this one process, with an empty kernel cache of its own (a
temporary NUMBA_CACHE_DIR), and prints each job's time, then each kernel's: its own
compile time (what its callees took, compiled inside it, left out), the part of that in
LLVM (optimising and making machine code; Numba's typing and lowering are the rest), and
how many times it was compiled. Numba's events (numba:compile, numba:llvm_lock) give the
times, so nothing in hslm changes to be measured.

--asm names kernels (hslm.windows.windows_backward ...) whose machine code to count once
the jobs have compiled them: instructions and vector instructions of each function in it
(the callees are linked into it). A change meant to shorten the compile should leave these
as they were; where they move, bench the speed (docs/performance-history.md, 2026-12-03
11:00: leaving out Numba's per-function pass saved 7% of the compile and lost vector code).

--passes adds where the time goes by pass: Numba's compiler passes (type inference,
lowering to LLVM IR, the inlining of kernel_part ...) by their own time, the compiles
nested in them and LLVM taken out; and LLVM's, summed by name over every module (LLVM's
own pass timers: InstCombine, SROA, instruction selection ...). LLVM's timers make the
compile itself a little slower.

Process time in one process: a first run compiles the same jobs in one process per core at
once, each somewhat slower than alone. LLVM gets the hslm command's options
(hslm.LLVM_OPTIONS).

--first-run runs the default first run (`hslm train --speed 3 --steps 1`, an empty kernel
cache, the jobs shared among processes as hslm shares them) and prints when each job ran
in which process (from what HSLM_COMPILE_LOG collects, hslm/precompile.py), and how long
each process waited with nothing it could take: where the order of the jobs
(hslm.precompile.JOBS) leaves a core idle.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VECTOR_REGISTER = re.compile(r"%[xyz]mm\d")


def default_jobs() -> list[str]:
    """The jobs of `hslm train --speed 3` (the default run), in their order; the tokenizer's
    is left out, as a first run on the built-in text compiles no tokenizer."""
    from hslm.precompile import jobs_for
    return [j for j in jobs_for([3]) if j != "tokenizer"]


class KernelTimes:
    """Numba's compile and LLVM events, summed per kernel (own time: callees left out)."""

    def __init__(self):
        from numba.core import event
        self.rows = {}  # name: [compiles, own seconds, own LLVM seconds]
        self.stack = []  # [name, start, callees' seconds, LLVM seconds] per compile under way
        self.llvm_depth, self.llvm_start = 0, 0.0
        times = self

        class Compiles(event.Listener):
            def on_start(self, ev):
                d = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
                f = getattr(d, "py_func", None)
                name = f"{f.__module__}.{f.__qualname__}" if f is not None else "?"
                times.stack.append([name, time.process_time(), 0.0, 0.0])

            def on_end(self, ev):
                name, start, callees, llvm = times.stack.pop()
                total = time.process_time() - start
                row = times.rows.setdefault(name, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += total - callees
                row[2] += llvm
                if times.stack:
                    times.stack[-1][2] += total

        class Llvm(event.Listener):  # (the lock is taken again inside itself: outermost only)
            def on_start(self, ev):
                times.llvm_depth += 1
                if times.llvm_depth == 1:
                    times.llvm_start = time.process_time()

            def on_end(self, ev):
                times.llvm_depth -= 1
                if times.llvm_depth == 0 and times.stack:
                    times.stack[-1][3] += time.process_time() - times.llvm_start

        event.register("numba:compile", Compiles())
        event.register("numba:llvm_lock", Llvm())


class PassTimes:
    """Numba's compiler passes (numba:run_pass events), each pass's own time summed over
    every function compiled: the compiles nested in a pass (its callees', typed inside it)
    and LLVM's work taken out, so that the rows add up to the Python side of the compile."""

    def __init__(self):
        from numba.core import event
        self.rows = {}  # pass: own seconds
        self.stack = []  # [pass name or None, start, nested seconds] per event under way
        self.llvm_depth = 0
        times = self

        class Frames(event.Listener):
            def __init__(self, kind):
                self.kind = kind

            def on_start(self, ev):
                if self.kind == "llvm":
                    times.llvm_depth += 1
                    if times.llvm_depth > 1:  # (the lock is taken again inside itself)
                        return
                name = ev.data["name"].split(" [")[0] if self.kind == "pass" else None
                times.stack.append([name, time.process_time(), 0.0])

            def on_end(self, ev):
                if self.kind == "llvm":
                    times.llvm_depth -= 1
                    if times.llvm_depth > 0:
                        return
                name, start, nested = times.stack.pop()
                total = time.process_time() - start
                if name is not None:
                    times.rows[name] = times.rows.get(name, 0.0) + total - nested
                if times.stack:
                    times.stack[-1][2] += total

        event.register("numba:compile", Frames("compile"))
        event.register("numba:run_pass", Frames("pass"))
        event.register("numba:llvm_lock", Frames("llvm"))


LLVM_TIME = re.compile(r"([\d.]+) \(\s*[\d.]+%\)")


def llvm_pass_times(report: str) -> dict:
    """LLVM's pass timing report (llvmlite's report_and_reset_timings) summed by pass name
    (a pass run on many modules or functions is one row): each row's last column, its
    wall time (LLVM leaves out the columns that are all zero, never that one)."""
    rows = {}
    for line in report.splitlines():
        times = LLVM_TIME.findall(line)
        if not times:
            continue
        name = re.sub(r" #\d+$", "", line[line.rindex("%)") + 2:].strip())
        if name and name != "Total":
            rows[name] = rows.get(name, 0.0) + float(times[-1])
    return rows


def machine_code_counts(kernel) -> list[tuple[str, int, int]]:
    """(function, instructions, vector instructions) of each function in each compiled
    signature of kernel (a Numba dispatcher compiled in this process)."""
    out = []
    for sig in kernel.signatures:
        counts, name = {}, None
        for line in kernel.inspect_asm(sig).splitlines():
            if line and not line[0].isspace() and line.endswith(":") and not line.startswith("."):
                name = line[:-1]
            elif name and line.startswith("\t") and not line.startswith("\t."):
                n, v = counts.get(name, (0, 0))
                counts[name] = (n + 1, v + bool(VECTOR_REGISTER.search(line)))
        out += [(f, n, v) for f, (n, v) in counts.items()]
    return out


def kernel_named(spec: str):
    """The Numba dispatcher MODULE.KERNEL (hslm.windows.windows_backward), or exit."""
    import importlib
    module, _, name = spec.rpartition(".")
    try:
        kernel = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        kernel = None
    if not hasattr(kernel, "inspect_asm"):
        sys.exit(f"compile_profile: no kernel {spec!r} (a Numba kernel, as "
                 "hslm.windows.windows_backward)")
    return kernel


def profile(jobs, top: int, asm, passes: bool = False) -> None:
    sys.path.insert(0, str(ROOT))
    import hslm  # (hslm before Numba: it sets Numba's target)
    hslm.set_llvm_options()  # as in the hslm command and its compile helpers
    import llvmlite
    import numba
    from hslm import precompile
    from hslm.micro import cpu_info
    jobs = jobs or default_jobs()
    unknown = [j for j in jobs if j not in precompile.JOBS]
    if unknown:
        sys.exit(f"compile_profile: no compile job {unknown[0]!r} (jobs: "
                 f"{', '.join(precompile.JOBS)})")
    kernels = {spec: kernel_named(spec) for spec in asm}  # (a bad name before any compile)
    info = cpu_info()
    core = " ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if k in info)
    print(f"machine: {info.get('model name', platform.processor() or '?')} ({core}); Python "
          f"{platform.python_version()}, numba {numba.__version__}, llvmlite "
          f"{llvmlite.__version__}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    times = KernelTimes()
    pass_times = PassTimes() if passes else None
    import llvmlite.binding as ll
    timing_llvm = passes and hasattr(ll, "set_time_passes")
    if timing_llvm:
        ll.set_time_passes(True)
    print("compile jobs one after another in one process, empty kernel cache (process time):")
    total = 0.0
    for job in jobs:
        start = time.process_time()
        precompile._run_job(job, 729)
        took = time.process_time() - start
        total += took
        print(f"  {job:22s} {took:6.1f} s")
    print(f"  {'all':22s} {total:6.1f} s")
    llvm_report = ll.report_and_reset_timings() if timing_llvm else ""
    if timing_llvm:
        ll.set_time_passes(False)
    rows = sorted(times.rows.items(), key=lambda kv: -kv[1][1])
    llvm = sum(r[2] for _, r in rows)
    print(f"kernels by their own compile time (callees left out); LLVM {llvm:.1f} s of it in all:")
    print(f"  {'own s':>7s} {'LLVM s':>7s} {'compiles':>8s}  kernel")
    for name, (n, own, own_llvm) in rows[:top]:
        print(f"  {own:7.2f} {own_llvm:7.2f} {n:8d}  {name}")
    if len(rows) > top:
        rest = rows[top:]
        print(f"  {sum(r[1] for _, r in rest):7.2f} {sum(r[2] for _, r in rest):7.2f} "
              f"{sum(r[0] for _, r in rest):8d}  ({len(rest)} more)")
    if pass_times is not None:
        print("Numba's passes by their own time (the compiles inside them and LLVM taken out):")
        for name, own in sorted(pass_times.rows.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {own:7.2f}  {name}")
        rows = llvm_pass_times(llvm_report)
        if rows:
            print(f"LLVM's passes, summed by name ({sum(rows.values()):.1f} s in all):")
            for name, sec in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
                print(f"  {sec:7.2f}  {name}")
    for spec, kernel in kernels.items():
        counts = machine_code_counts(kernel)
        if not counts:
            sys.exit(f"compile_profile: {spec} was not compiled by these jobs")
        print(f"machine code of {spec} (instructions, of them vector):")
        for f, n, v in sorted(counts, key=lambda c: -c[1]):
            print(f"  {n:7d} {v:6d}  {f[:100]}")


def job_timeline(log: str) -> list[tuple[str, int, float, float]]:
    """(job, process id, start, end) of each job a parallel compile finished, in seconds
    from the first one's start, by start: from the lines `HSLM_COMPILE_LOG` collects
    ("JOB: ok PID START END", hslm/precompile.py; a job not done reads "JOB: -")."""
    rows = []
    for line in log.splitlines():
        job, _, marker = line.rpartition(": ")
        fields = marker.split()
        if job and len(fields) == 4:
            rows.append((job, int(fields[1]), float(fields[2]), float(fields[3])))
    t0 = min((row[2] for row in rows), default=0.0)
    return sorted(((j, p, b - t0, e - t0) for j, p, b, e in rows), key=lambda row: row[2])


def print_timeline(rows) -> None:
    """Each job's process and span; then each process's jobs' time and its waits, up to the
    last job's end."""
    if not rows:
        print("no compile jobs ran (the kernels were in the cache already?)")
        return
    end = max(row[3] for row in rows)
    print("the first run's compile jobs (s from the first one's start):")
    for job, pid, began, ended in rows:
        print(f"  {job:22s} process {pid:<8d} {began:6.2f} -> {ended:6.2f}  "
              f"({ended - began:5.2f} s)")
    for pid in sorted({row[1] for row in rows}):
        mine = [row for row in rows if row[1] == pid]
        busy = sum(row[3] - row[2] for row in mine)
        print(f"  process {pid}: {len(mine)} jobs, {busy:5.2f} s; waiting or done "
              f"{end - busy:5.2f} s of the {end:5.2f} s")


def first_run(cache: str) -> None:
    """The default first run (`hslm train`, its kernel cache empty); its jobs' timeline."""
    with tempfile.TemporaryDirectory(prefix="hslm-first-run-") as out:
        log = Path(out) / "compile.log"
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "HSLM_COMPILE_LOG": str(log)}
        p = subprocess.run([sys.executable, str(ROOT / "cli.py"), "train", "--speed", "3",
                            "--steps", "1", "--seed", "1729", "--out", str(Path(out) / "run")],
                           env=env, capture_output=True, text=True)  # (this checkout's hslm)
        if p.returncode != 0:
            sys.exit(f"compile_profile: the first run failed: {p.stderr.strip()[-500:]}")
        said = [line for line in p.stderr.splitlines() + p.stdout.splitlines()
                if line.startswith(("compiling kernels", "compiled in"))]
        print("\n".join(said))
        print_timeline(job_timeline(log.read_text() if log.exists() else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="", help="comma-separated compile jobs "
                    "(default: those of hslm train --speed 3)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    ap.add_argument("--asm", nargs="*", default=[], metavar="MODULE.KERNEL",
                    help="kernels whose machine code to count")
    ap.add_argument("--passes", action="store_true",
                    help="also time Numba's compiler passes and LLVM's passes")
    ap.add_argument("--first-run", action="store_true",
                    help="run a first run (hslm train --speed 3 --steps 1) and print when "
                    "each of its compile jobs ran, in which process")
    args = ap.parse_args(argv)
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    if "numba" in sys.modules:
        sys.exit("compile_profile: run it as a script (Numba must not be imported yet: "
                 "the kernel cache is set before it is)")
    with tempfile.TemporaryDirectory(prefix="hslm-compile-profile-") as cache:
        os.environ["NUMBA_CACHE_DIR"] = cache
        if args.first_run:
            first_run(cache)
        else:
            profile(jobs, args.top, args.asm, args.passes)


if __name__ == "__main__":
    main()
