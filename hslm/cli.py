"""The `hslm` command: train, diff, info, bench."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from . import distributed
from .errors import HslmError
from .speeds import DEFAULT_SPEED, SPEEDS, speed_help

BYTE_OPTIONS = ("batch", "loss_positions", "lr", "warmup", "decay_steps", "weight_decay", "seed",
                "eval_windows")


def token_cache_dir(flag, default):
    from .token_cache import cache_dir
    return cache_dir(flag, default)


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hslm")
def cli():
    """hslm: a Numba CPU trainer for ternary HSLM language models."""


@cli.command()
@click.option("--model", default="hslm-3", show_default=True,
              help="A preset (see `hslm info`) or a JSON file of config fields.")
@click.option("--data", type=click.Path(path_type=Path), multiple=True,
              help="UTF-8 text file or folder to train on; repeat for several (joined by a "
                   "blank line, a folder's files in sorted order) [default: the built-in pydoc "
                   "topics].")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Folder for the token cache [default: $HSLM_CACHE_DIR, else OUT].")
@click.option("--steps", type=int, default=10, show_default=True,
              help="Train until this step (counted from the start of the run).")
@click.option("--batch", type=int, default=8, show_default=True, help="Windows per step.")
@click.option("--loss-positions", "-k", type=int, default=None,
              help="Scored positions k at the end of each window [default: the window, 27].")
@click.option("--lr", type=float, default=1e-3, show_default=True, help="Peak learning rate.")
@click.option("--warmup", type=int, default=100, show_default=True, help="Linear warm-up steps.")
@click.option("--decay-steps", type=int, default=10000, show_default=True,
              help="Step at which the cosine decay reaches 10% of the peak.")
@click.option("--weight-decay", type=float, default=0.01, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--speed", type=click.Choice([str(n) for n in SPEEDS]), default=str(DEFAULT_SPEED),
              show_default=True, help=speed_help())
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="Threads for the windows of a step [default: the cores available].")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Checkpoint folder [default: ckpt, or the resumed checkpoint's folder].")
@click.option("--save-every", type=click.IntRange(0), default=0, show_default=True,
              help="Also save every N steps (0: only at the end).")
@click.option("--eval-windows", type=int, default=64, show_default=True,
              help="Validation windows for the final validation loss.")
@click.option("--resume", type=click.Path(path_type=Path), default=None,
              help="Continue from DIR/ckpt_N.state (and the ckpt_N.bin beside it).")
@click.option("--eval-every", type=click.IntRange(0), default=0, show_default=True,
              help="Validation loss every N steps (0: only at the end).")
@click.option("--metrics", type=click.Path(path_type=Path), default=None,
              help="Append one JSON object per step and per evaluation to this file.")
@click.option("--log-every", type=click.IntRange(1), default=1, show_default=True,
              help="A plain progress line every N steps (when stdout is not a terminal).")
@click.option("--quiet", "-q", is_flag=True, help="No per-step output.")
@click.pass_context
def train(ctx, model, data, cache_dir, steps, batch, loss_positions, lr, warmup, decay_steps, weight_decay,
          seed, speed, threads, out, save_every, eval_windows, resume, eval_every, metrics,
          log_every, quiet):
    """Train a model; writes OUT/ckpt_<step>.bin and OUT/ckpt_<step>.state."""
    from .speeds import SPEED_NAMES
    speed = int(speed)
    from .train import (Hyper, Run, check_fits, check_hyper, check_metrics_path, check_out_dir,
                        load_corpus, memory_estimate, prepare_out_dir, resolve_config,
                        save_tokenizer)

    given = {n for n in ctx.params
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE}
    threads = threads or default_threads()
    quiet = quiet or not distributed.is_writer()  # MPI: rank 0 alone prints and writes
    # Every flag and path is judged before anything is created.
    if resume is not None:
        out = out or resume.parent
        check_out_dir(out)
        check_metrics_path(metrics, out)
        cfg_flag = resolve_config(model) if "model" in given else None
        flags = dict(batch=batch, loss_positions=loss_positions, lr=lr, warmup=warmup,
                     decay_steps=decay_steps, weight_decay=weight_decay, seed=seed,
                     eval_windows=eval_windows)

        def corpus_for(cfg, hyper, text_sha256, tokenizer):
            if cfg_flag is not None and cfg_flag != cfg:
                raise HslmError(f"config mismatch: --model {model} differs from the checkpoint's "
                                "configuration")
            for n in BYTE_OPTIONS:
                if n in given and flags[n] != getattr(hyper, n):
                    raise HslmError(f"config mismatch: --{n.replace('_', '-')} {flags[n]} differs "
                                    f"from the checkpoint's {getattr(hyper, n)}")
            return load_corpus(data, cfg, text_sha256, tokenizer, token_cache_dir(cache_dir, out))

        run = Run.resume(resume, corpus_for, plain=SPEEDS[speed].plain_layouts, threads=threads,
                         speed=speed)
        if steps <= run.step:
            raise HslmError(f"{resume} is already at step {run.step}; pass --steps above it")
    else:
        cfg = resolve_config(model)
        k = cfg.window if loss_positions is None else loss_positions
        hyper = Hyper(batch=batch, loss_positions=k, lr=lr, warmup=warmup,
                      decay_steps=decay_steps, weight_decay=weight_decay, seed=seed,
                      eval_windows=eval_windows)
        check_hyper(cfg, hyper)
        if steps < 1:
            raise HslmError(f"--steps must be at least 1, got {steps}")
        out = out or Path("ckpt")
        check_out_dir(out)
        check_metrics_path(metrics, out)
        check_fits(memory_estimate(cfg, batch, threads, speed),
                   f"--model {model} with --batch {batch} on {threads} thread(s)")
        corpus = load_corpus(data, cfg, cache_dir=token_cache_dir(cache_dir, out))
        run = Run.fresh(cfg, hyper, corpus, plain=SPEEDS[speed].plain_layouts)

    # one writer per folder, held until the run ends (MPI: rank 0 is the writer)
    lock = prepare_out_dir(out) if distributed.is_writer() else distributed.NO_LOCK
    try:
        cfg, h = run.cfg, run.hyper
        if distributed.is_writer():
            save_tokenizer(out, run.corpus.tokenizer)
        if not quiet:
            click.echo(f"model {cfg.n_params:,} parameters | data {run.corpus.source}: "
                       f"{len(run.corpus.train):,} train / {len(run.corpus.valid):,} valid "
                       "tokens | "
                       f"speed {speed} ({SPEED_NAMES[speed]}) | threads {threads} | "
                       f"batch {h.batch} x {cfg.window} | k {h.loss_positions}")

        def resume_command(state_path):
            import shlex
            cmd = f"hslm train --resume {shlex.quote(str(state_path))} --steps {steps}"
            for d in data:
                cmd += f" --data {shlex.quote(str(d))}"
            if metrics is not None:
                cmd += f" --metrics {shlex.quote(str(metrics))}"
            return cmd

        distributed.start()  # MPI: every rank is ready (else the first error is reported once)
        run_loop(run, out, steps, speed, threads, save_every, eval_every,
                 metrics if distributed.is_writer() else None, log_every, quiet, resume_command)
    finally:
        lock.release()


def run_loop(run, out, steps, speed, threads, save_every, eval_every, metrics_path, log_every,
             quiet, resume_command=None):
    """The step loop: progress, metrics, checkpoints, and a clean stop on SIGINT/SIGTERM.

    Nothing non-finite is ever saved: a NaN or infinite loss, gradient or parameter
    stops the run with an error before the next checkpoint."""
    import math
    import signal

    from .progress import Metrics, MetricsError, Progress
    from .step import StepRunner

    resume_command = resume_command or (
        lambda s: f"hslm train --resume {s} --steps {steps}")
    cfg, h = run.cfg, run.hyper
    metrics = Metrics(metrics_path)
    progress = Progress(run.step, steps, quiet=quiet, log_every=log_every)
    stop = StopRequest()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    runner = StepRunner(cfg, speed, threads, world=distributed.current())
    first = last = None

    def evaluate():
        v = run.validation_loss(runner)
        if not math.isfinite(v):
            raise HslmError(f"step {run.step}: the validation loss is {v}")
        metrics.write(kind="eval", step=run.step, valid_loss=v, perplexity=math.exp(v))
        return v

    try:
        try:
            while run.step < steps:
                t0 = time.perf_counter()
                loss = run.train_step(runner)
                dt = time.perf_counter() - t0
                run.check_finite(loss)
                first = loss if first is None else first
                last = loss
                tok_s = h.batch * cfg.window / dt
                progress.step(run.step, loss, run.lr_at(run.step), tok_s)
                if metrics.f is not None:
                    metrics.write(kind="train", step=run.step, loss=loss, lr=run.lr_at(run.step),
                                  grad_norm=float(np.sqrt(np.sum(run.norms ** 2))), tok_s=tok_s,
                                  ternary_zero_share=run.ternary_zero_share())
                # MPI: the ranks agree on a stop and compare parameters (hslm/distributed.py)
                stop.signum = distributed.after_step(run, stop.signum, steps, save_every)
                if stop.signum is not None:
                    b, s = run.save(out)
                    progress.message(f"{signal.Signals(stop.signum).name}: stopped after step "
                                     f"{run.step}; saved {b} and {s}")
                    progress.message(f"resume with: {resume_command(s)}")
                    sys.exit(128 + stop.signum)
                if eval_every and run.step % eval_every == 0 and run.step < steps:
                    v = evaluate()
                    progress.message(f"step {run.step}: valid {v:.4f} (perplexity "
                                     f"{math.exp(v):.1f})")
                if save_every and run.step % save_every == 0 and run.step < steps:
                    run.save(out)
            b, s = run.save(out)
            progress.close()
            if not quiet:
                click.echo(f"saved {b} and {s}")
            valid = evaluate()
            distributed.summary(click.echo)  # MPI: bytes sent per rank per step
        except MetricsError as e:  # the run itself is fine: keep it, then stop
            b, s = run.save(out)
            raise HslmError(f"{e}; stopped after step {run.step} and saved {s} (resume with: "
                            f"{resume_command(s)})") from None
    finally:
        progress.close()
        runner.close()
        metrics.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo(f"first {first:.4f}, last {last:.4f}, valid {valid:.4f}")


class StopRequest:
    """Signal handler: the first SIGINT/SIGTERM asks the loop to stop after the
    current step (with a checkpoint); a second one stops at once."""

    def __init__(self):
        self.signum = None

    def __call__(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        if distributed.is_writer():  # MPI: rank 0 alone prints
            click.echo(f"\n{signal_name(signum)}: finishing the current step, then saving "
                       "(again to stop at once)", err=True)


def signal_name(signum):
    import signal
    return signal.Signals(signum).name


@cli.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.pass_context
def diff(ctx, a, b):
    """Compare two checkpoints (.bin or .state): exit 0 if byte-identical, else 1."""
    from .inspect import diff_checkpoints
    same, lines = diff_checkpoints(a, b)
    for line in lines:
        click.echo(line)
    ctx.exit(0 if same else 1)


@cli.command()
@click.argument("file", required=False)
def info(file):
    """Describe a checkpoint (config, step, checksum, ternary shares), a model config
    (a preset name or a JSON file), or, with no argument, list the presets."""
    from .config import PRESETS
    if file is None or file in PRESETS or file.endswith(".json"):
        from .train import resolve_config
        configs = [(n, resolve_config(n)) for n in (list(PRESETS) if file is None else [file])]
        click.echo(f"{'model':12s} {'parameters':>12s}  vocab width heads x head_width mlp "
                   "blocks window vsa_dim")
        for name, c in configs:
            click.echo(f"{name:12s} {c.n_params:>12,}  {c.vocab:5d} {c.width:5d} {c.heads:5d} x "
                       f"{c.head_width:<10d} {c.mlp:4d} {c.blocks:6d} {c.window:6d} "
                       f"{c.vsa_dim:7d}")
        return
    from .inspect import describe
    for line in describe(Path(file)):
        click.echo(line)


@cli.command(name="eval")
@click.argument("ckpt_path", metavar="CKPT", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), multiple=True,
              help="The text (files or folders, as for train) whose validation split to score "
                   "[default: the built-in corpus].")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Folder for the token cache [default: $HSLM_CACHE_DIR, else CKPT's folder].")
@click.option("--windows", type=click.IntRange(1), default=64, show_default=True)
@click.option("--loss-positions", "-k", type=int, default=None,
              help="Scored positions [default: the run's, or the window].")
@click.option("--threads", type=click.IntRange(1, 1024), default=None)
def eval_cmd(ckpt_path, data, cache_dir, windows, loss_positions, threads):
    """Validation loss and perplexity of a checkpoint (.bin).

    The text is encoded with the run's own tokenizer, which the .bin carries."""
    import math

    from .data import Corpus
    from .step import StepRunner
    from .train import load_for_inference

    threads = threads or default_threads()
    if loss_positions is not None and loss_positions < 1:
        raise HslmError(f"--loss-positions must be at least 1, got {loss_positions}")
    cfg, state, tok, hyper = load_for_inference(ckpt_path, threads)
    k = loss_positions if loss_positions is not None else (
        hyper.loss_positions if hyper else cfg.window)
    if not 1 <= k <= cfg.window:
        raise HslmError(f"--loss-positions must be between 1 and the window ({cfg.window}), "
                        f"got {k}")
    corpus = Corpus.load(data, cfg.vocab, cfg.window, tokenizer=tok,  # the run's tokenizer
                         cache_dir=token_cache_dir(cache_dir, ckpt_path.parent))
    runner = StepRunner(cfg, DEFAULT_SPEED, threads)
    try:
        w = corpus.validation_windows(windows, cfg.window)
        v = runner.loss(state.kernel_model(), state.tables.vsa, w, k)
    finally:
        runner.close()
    click.echo(f"valid loss {v:.4f}, perplexity {math.exp(v):.2f} ({len(w)} windows of "
               f"{cfg.window}, last {k} scored; uniform baseline {math.log(cfg.vocab):.4f})")


@cli.command()
@click.argument("ckpt_path", metavar="CKPT", type=click.Path(path_type=Path))
@click.option("--prompt", default="", help="Text to continue.")
@click.option("--tokens", "n_tokens", type=click.IntRange(1), default=100, show_default=True)
@click.option("--temperature", type=float, default=0.8, show_default=True,
              help="0 takes the most likely token.")
@click.option("--top-k", type=click.IntRange(0), default=40, show_default=True,
              help="Sample among the k most likely tokens (0: all).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--data", type=click.Path(path_type=Path), default=None, hidden=True,
              help="Ignored: the checkpoint carries its tokenizer.")
def sample(ckpt_path, prompt, n_tokens, temperature, top_k, seed, data):
    """Continue a prompt with a trained model (reproducible for a seed)."""
    import math

    from .sample import sample as sample_ids
    from .step import Worker
    from .train import load_for_inference
    from .validate import MIN_TEMPERATURE

    if not math.isfinite(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise HslmError(f"--temperature must be 0 (greedy) or a finite number of at least "
                        f"{MIN_TEMPERATURE:g}, got {temperature}")
    if seed < 0:
        raise HslmError(f"--seed must be at least 0, got {seed}")
    cfg, state, tok, _ = load_for_inference(ckpt_path)
    ids = sample_ids(Worker(cfg, DEFAULT_SPEED), state.kernel_model(), state.tables.vsa, tok.encode(prompt),
                     n_tokens, temperature, top_k, seed, cfg.window)
    click.echo(prompt + tok.decode(ids))


@cli.command()
@click.argument("metrics_file", metavar="METRICS", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("loss.png"),
              show_default=True)
def plot(metrics_file, output):
    """Training and validation loss against step, from a --metrics file."""
    from .plot import plot_metrics
    plot_metrics(metrics_file, output)
    click.echo(f"wrote {output}")


def _int_list(s, name):
    try:
        vals = [int(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise HslmError(f"{name} takes a comma-separated list of integers, got {s!r}") from None
    if not vals:
        raise HslmError(f"{name} is empty")
    return vals


@cli.command()
@click.option("--model", default="hslm-3", show_default=True)
@click.option("--data", type=click.Path(path_type=Path), multiple=True)
@click.option("--speeds", default=",".join(map(str, SPEEDS)), show_default=True, help="Speeds to compare.")
@click.option("--threads", default="1", show_default=True, help="Thread counts, e.g. 1,2.")
@click.option("--steps", type=int, default=2, show_default=True, help="Timed steps per run.")
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--loss-positions", "-k", type=int, default=None)
@click.option("--torch/--no-torch", "with_torch", default=True, show_default=True,
              help="Also time the PyTorch baseline (f64 and f32, one thread) if installed.")
@click.option("--profile/--no-profile", default=True, show_default=True,
              help="Per-phase profile of a speed-3 step.")
def bench(model, data, speeds, threads, steps, batch, loss_positions, with_torch, profile):
    """Train the same seeded steps at each speed side by side; report tok/s and ratios."""
    from .bench import (bench_speed, flops_per_token, machine_peak_gflops_per_core,
                        profile_layerwise, threading_description, torch_baseline)
    from .speeds import SPEED_NAMES
    from .train import Hyper, check_hyper, load_corpus, resolve_config

    cfg = resolve_config(model)
    speeds = _int_list(speeds, "--speeds")
    threads = _int_list(threads, "--threads")
    if any(s not in SPEED_NAMES for s in speeds):
        raise HslmError(f"--speeds must be among {','.join(map(str, SPEEDS))}, got {speeds}")
    if any(t < 1 for t in threads) or steps < 1:
        raise HslmError("--threads and --steps must be at least 1")
    k = cfg.window if loss_positions is None else loss_positions
    hyper = Hyper(batch=batch, loss_positions=k, seed=1729)
    check_hyper(cfg, hyper)
    corpus = load_corpus(data, cfg)
    peak, peak_desc = machine_peak_gflops_per_core()
    fpt = flops_per_token(cfg, k)
    click.echo(f"hslm bench: {model} ({cfg.n_params:,} parameters), batch {batch} x "
               f"{cfg.window}, k {k}, {steps} timed steps per run, seed 1729")
    click.echo(f"machine: {peak_desc}: f64 peak {peak:.1f} GFLOP/s per core "
               f"({peak / 2:.1f} without FMA, which bit-exact kernels cannot use)")
    click.echo(f"threads: {threading_description(threads)}")
    click.echo(f"FLOPs per token: {fpt / 1e6:.2f} M (2 per multiply-add of the ternary "
               f"matrices: forward, input gradient and weight gradient at scored positions)")
    results = []
    for t in threads:
        for s in speeds:
            r = bench_speed(cfg, hyper, corpus, s, t, steps)
            results.append(r)
            click.echo(f"  ran speed {s} on {t} thread(s): {r['tok_s']:.1f} tok/s", err=True)
    slowest = min(r["tok_s"] for r in results)
    base = {r["speed"]: r["tok_s"] for r in results if r["threads"] == threads[0]}
    click.echo(f"{'speed':>5} {'name':>10} {'threads':>7} {'tok/s':>10} {'x slowest':>9} "
               f"{'GFLOP/s':>8} {'% peak':>7} {'par. eff.':>9}")
    for r in results:
        gf = r["tok_s"] * fpt / 1e9
        eff = r["tok_s"] / (r["threads"] / threads[0] * base[r["speed"]])
        click.echo(f"{r['speed']:>5} {SPEED_NAMES[r['speed']]:>10} {r['threads']:>7} "
                   f"{r['tok_s']:>10.1f} {r['tok_s'] / slowest:>9.2f} {gf:>8.2f} "
                   f"{100 * gf / (peak * r['threads']):>6.1f}% {100 * eff:>8.1f}%")
    digests = {r["digest"] for r in results}
    losses = {tuple(r["losses"]) for r in results}
    if len(digests) == 1 and len(losses) == 1:
        click.echo(f"checkpoints after {steps} steps: byte-identical across all runs "
                   f"(sha256 {next(iter(digests))[:16]}...), losses identical")
    else:
        click.echo(f"CHECKPOINTS DIFFER: {len(digests)} distinct digests across runs")
    if with_torch:
        try:
            import torch
        except ImportError:
            click.echo("PyTorch baseline: torch not installed (pip install torch==2.13.0)")
        else:
            ours = max((r for r in results if r["threads"] == 1), key=lambda r: r["tok_s"],
                       default=None)
            tt = {dt: torch_baseline(cfg, hyper, corpus, dt, steps) for dt in ("f64", "f32")}
            line = (f"PyTorch {torch.__version__} baseline, one thread, windows batched: "
                    f"f64 {tt['f64']:.1f} tok/s, f32 {tt['f32']:.1f} tok/s")
            if ours:
                line += (f"; speed {ours['speed']} is {ours['tok_s'] / tt['f64']:.2f}x torch f64, "
                         f"{ours['tok_s'] / tt['f32']:.2f}x torch f32")
            click.echo(line)
    if profile:
        rows = profile_layerwise(cfg, hyper, corpus)
        total = sum(ms for _, ms in rows)
        click.echo(f"speed-3 step profile, one thread ({total:.1f} ms per step of {batch} windows):")
        for name, ms in rows:
            click.echo(f"  {name:46s} {ms:8.1f} ms {100 * ms / total:5.1f}%")
    if len(digests) != 1:
        sys.exit(1)


def main(argv=None):
    """Entry point: every error is one line on stderr and a non-zero exit."""
    try:
        if distributed.init() is not None:  # launched by MPI with P > 1 (hslm/distributed.py)
            distributed.run_main(cli, argv)
        rv = cli.main(args=argv, prog_name="hslm", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.UsageError as e:
        msg = e.format_message().replace("\n", " ")
        click.echo(f"error: {msg}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except HslmError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
