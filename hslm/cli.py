"""The `hslm` command: train, eval, sample, diff, info, plot, bench. It parses and prints;
the work is in the modules it calls (the run itself: hslm/train.py)."""
from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import io
import json
import os
import select
import sys
from pathlib import Path

import click

from . import _the_hslm_command, distributed, end_of_start_up
from .errors import (HslmError, keeping_dropped_interrupts, machine_error_line, one_line,
                     quiet_after_interrupt, raise_dropped_interrupt, stop_word, stopped_by,
                     take_dropped_interrupt)
from .speeds import DEFAULT_SPEED, SPEEDS, speed_help


class PathArg(click.Path):
    """A file or folder name; an empty one is refused (Path("") is the current folder,
    so `--out ""` would have written there). A file's name (file=True) ending in a slash
    is refused too: Path drops the slash, so `--json results/` had written a file named
    results, and `--json a.json/` replaced a.json."""

    def __init__(self, file: bool = False):
        super().__init__(path_type=Path)
        self.file = file

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path; give a file or folder name", param, ctx)
        from .validate import ends_as_folder, file_named_as_folder
        if self.file and isinstance(value, str) and ends_as_folder(value):
            self.fail(f"{value} ends as a folder's name does (a slash, . or ..); give a file "
                      "name", param, ctx)
        problem = file_named_as_folder(value) if isinstance(value, str) else None
        if problem is not None:  # (a file's name given where a file or a folder may be)
            self.fail(problem, param, ctx)
        return super().convert(value, param, ctx)


def not_empty(ctx, param, value):
    """A callback refusing an empty name (a model, a checkpoint or config path)."""
    values = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, str) and not v.strip() for v in values):
        raise click.BadParameter("an empty name; give a preset or a file", ctx, param)
    return value


MAX_THREADS = 1024  # --threads of train, eval and bench


def token_cache_dir(flag, default):
    from .token_cache import cache_dir
    return cache_dir(flag, default)


def default_threads() -> int:
    from .precompile import available_cores
    return available_cores()


class _Group(click.Group):
    """click.Group whose commands' interrupts come out as click.Abort, their cause kept
    (SIGTERM's Terminated: stopped_by): click's main prints an empty line before the
    Abort it makes of a KeyboardInterrupt, so a stop before step 1 printed two lines,
    where the README says one."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise click.Abort() from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hslm")
def cli():
    """hslm: a Numba CPU trainer for ternary HSLM language models."""


def hyper_options(f):
    """The training hyper-parameters as options, from the one table (hslm/hyper.py)."""
    from .hyper import HYPER_PARAMS
    for p in reversed(HYPER_PARAMS):
        f = click.option(p.flag, *(["-k"] if p.name == "loss_positions" else []), type=p.type,
                         default=p.default, show_default=p.default is not None, help=p.help,
                         callback=_plain_zero if p.type is float else None)(f)
    return f


def _plain_zero(ctx, param, value):
    """A float flag's -0.0 as 0.0: the same run, so the same .state (--weight-decay -0
    had stored -0.0, and its .state differed from --weight-decay 0's)."""
    return value + 0.0 if value is not None else value


def data_options(f, cache_default="the output or checkpoint folder"):
    f = click.option("--cache-dir", type=PathArg(), default=None,
                     help=f"Folder for the token cache [default: $HSLM_CACHE_DIR, else "
                          f"{cache_default}].")(f)
    return click.option("--data", type=PathArg(), multiple=True,
                        help="UTF-8 text file or folder; repeat for several (joined by a blank "
                             "line, a folder's files by name) [default: the built-in "
                             "corpus].")(f)


def threads_option(f):
    return click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                        help="Threads [default: the cores available].")(f)


@cli.command()
@click.option("--model", default="hslm-3", show_default=True, callback=not_empty,
              help="A preset (see `hslm info`) or a JSON file of config fields.")
@data_options
@click.option("--steps", type=int, default=10, show_default=True,
              help="Train until this step (counted from the start of the run).")
@hyper_options
@click.option("--speed", type=click.Choice([str(n) for n in SPEEDS]), default=str(DEFAULT_SPEED),
              show_default=True, help=speed_help())
@threads_option
@click.option("--out", type=PathArg(), default=None,
              help="Checkpoint folder [default: ckpt, or the resumed checkpoint's folder].")
@click.option("--save-every", type=click.IntRange(0), default=0, show_default=True,
              help="Also save every N steps (0: only at the end).")
@click.option("--resume", type=PathArg(file=True), default=None,
              help="Continue from DIR/ckpt_N.state (and the ckpt_N.bin beside it).")
@click.option("--eval-every", type=click.IntRange(0), default=0, show_default=True,
              help="Validation loss every N steps (0: only at the end).")
@click.option("--metrics", type=PathArg(file=True), default=None,
              help="Append one JSON object per step and per evaluation to this file.")
@click.option("--log-every", type=click.IntRange(1), default=1, show_default=True,
              help="A plain progress line every N steps (when stdout is not a terminal).")
@click.option("--quiet", "-q", is_flag=True, help="No per-step output.")
@click.pass_context
def train(ctx, **opts):
    """Train a model; writes OUT/ckpt_<step>.bin and OUT/ckpt_<step>.state."""
    from .hyper import HYPER_NAMES
    from .train import TrainOptions, train_run

    given = {n for n in ctx.params
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE}
    o = TrainOptions(
        model=opts["model"], data=opts["data"], cache_dir=opts["cache_dir"], steps=opts["steps"],
        hyper={n: opts[n] for n in HYPER_NAMES}, given=given, speed=int(opts["speed"]),
        threads=opts["threads"] or default_threads(), out=opts["out"],
        save_every=opts["save_every"], resume=opts["resume"], eval_every=opts["eval_every"],
        metrics=opts["metrics"], log_every=opts["log_every"], quiet=opts["quiet"])
    first, last, valid = train_run(o, echo=click.echo)
    click.echo(f"first {first:.4f}, last {last:.4f}, valid {valid:.4f}")


@cli.command()
@click.argument("a", type=PathArg(file=True))
@click.argument("b", type=PathArg(file=True))
@click.pass_context
def diff(ctx, a, b):
    """Compare two checkpoints (.bin or .state): exit 0 if byte-identical, 1 if they
    differ, 2 if they cannot be compared."""
    from .inspect import diff_checkpoints
    need_stdout("diff", required=False)
    same, lines = diff_checkpoints(a, b)
    for line in lines:
        click.echo(line)
    ctx.exit(0 if same else 1)


@cli.command()
@click.argument("file", required=False, callback=not_empty)
def info(file):
    """Describe a checkpoint (config, step, checksum, ternary shares), a model config
    (a preset name or a JSON file), a run's tokenizer.json or token cache file, or, with
    no argument, list the presets."""
    need_stdout("info")
    from .config import PRESETS
    if file is not None:
        from .validate import check_file_not_named_as_folder
        check_file_not_named_as_folder(file)
    kind = _file_kind(file) if file is not None and file not in PRESETS else None
    if kind in ("tokenizer", "tokens"):
        from .inspect import describe_tokenizer, describe_tokens
        for line in (describe_tokenizer if kind == "tokenizer" else describe_tokens)(file):
            click.echo(line)
        return
    if file is None or file in PRESETS or kind == "json" or (kind != "checkpoint"
                                                             and file.endswith(".json")):
        from .train import resolve_config
        configs = [(n, resolve_config(n)) for n in (list(PRESETS) if file is None else [file])]
        w = max(12, *(len(n) for n, _ in configs))  # a JSON config's path may be long
        click.echo(f"{'model':{w}s} {'parameters':>12s}  vocab width heads x head_width mlp "
                   "blocks window vsa_dim")
        from .data import FIRST_MERGE
        for name, c in configs:
            note = ("  (kernel tests only: a vocabulary below the byte-level tokenizer's "
                    f"{FIRST_MERGE})" if c.vocab < FIRST_MERGE else "")
            click.echo(f"{name:{w}s} {c.n_params:>12,}  {c.vocab:5d} {c.width:5d} {c.heads:5d} x "
                       f"{c.head_width:<10d} {c.mlp:4d} {c.blocks:6d} {c.window:6d} "
                       f"{c.vsa_dim:7d}{note}")
        return
    if not os.path.lexists(file) and os.sep not in file and not Path(file).suffix:  # a name
        raise HslmError(f"{file}: not a preset ({', '.join(PRESETS)}), a JSON config or a "
                        "checkpoint")
    from .inspect import describe
    for line in describe(Path(file)):
        click.echo(line)


def _file_kind(path):
    """What `hslm info FILE` is given, by its first bytes whatever its name: "checkpoint"
    (`info ck.json` had been read as a model config, and refused as train's --model),
    "tokens" (a token cache's file), "tokenizer" (JSON that names hslm's BPE format: a
    run's tokenizer.json, or a cache's bpe-*.json; both had been refused as model
    configs), "json" (a model config: `{` first, whatever its name, as --model takes it),
    else "other", or None where it cannot be opened as a regular file (left to the
    checks of what its name says, and their message)."""
    from .checkpoint import starts_as_checkpoint
    from .errors import open_regular
    from .token_cache import MAGIC
    try:
        f, _ = open_regular(Path(path), "file")
    except HslmError:
        return None
    with f:
        head = f.read(4096)
    if starts_as_checkpoint(head):
        return "checkpoint"
    if head.startswith(MAGIC):
        return "tokens"
    # (a byte order mark first: as --model reads it)
    if head.removeprefix(codecs.BOM_UTF8).lstrip()[:1] != b"{":
        return "other"
    return "tokenizer" if _names_hslm_bpe(path) else "json"


def _names_hslm_bpe(path) -> bool:
    """Whether the JSON object in path is a tokenizer of hslm's, whatever the order of its
    keys (a tokenizer.json saved again by another tool): format "hslm-bpe", or a token
    cache's version "hslm-bpe-cache/N"."""
    from .errors import read_bytes
    from .validate import MAX_JSON
    try:
        obj = json.loads(read_bytes(path, "file", MAX_JSON + 4096).decode("utf-8-sig"))
    except (HslmError, OSError, ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and (obj.get("format") == "hslm-bpe" or str(
        obj.get("version", "")).startswith("hslm-bpe-cache/"))


@cli.command(name="eval")
@click.argument("ckpt_path", metavar="CKPT", type=PathArg(file=True))
@click.option("--data", type=PathArg(), multiple=True,
              help="The text (files or folders, as for train) whose validation split to score "
                   "[default: the built-in corpus].")
@click.option("--cache-dir", type=PathArg(), default=None,
              help="Folder for the token cache [default: $HSLM_CACHE_DIR, else CKPT's folder].")
@click.option("--eval-windows", type=click.IntRange(1), default=None,
              help="Validation windows to score, at most as many as the validation split "
                   "holds [default: the run's, or 64].")
@click.option("--loss-positions", "-k", type=int, default=None,
              help="Scored positions [default: the run's, or the window].")
@threads_option
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object, the loss exactly (the shortest decimal that reads "
                   "back as the same double, as the metrics file keeps it), instead of the "
                   "line.")
def eval_cmd(ckpt_path, data, cache_dir, eval_windows, loss_positions, threads, as_json):
    """Validation loss, cross-entropy and perplexity of a checkpoint (.bin, or a .state
    beside its .bin).

    The loss is the training objective (cross-entropy with label smoothing 0.1); the
    cross-entropy is the plain one, -log p of the next token in nats, and the perplexity
    its exp.

    The text is encoded with the run's own tokenizer, which the .bin carries."""
    import math

    from .data import Corpus
    from .step import StepRunner
    from .train import load_for_inference, perplexity, short_figure, tidy_cache_dir

    need_stdout("eval")
    threads = threads or default_threads()
    trained_on = {}
    cfg, state, tok, hyper = load_for_inference(ckpt_path, threads, trained_on=trained_on)
    # the run's own (its .state's) unless given: on its text, the run's validation loss
    k = loss_positions if loss_positions is not None else (
        hyper.loss_positions if hyper else cfg.window)
    eval_windows = eval_windows or (hyper.eval_windows if hyper else 64)
    if not 1 <= k <= cfg.window:
        raise HslmError(f"--loss-positions must be between 1 and the window ({cfg.window}), "
                        f"got {k}")
    cache = token_cache_dir(cache_dir, ckpt_path.parent)
    tidy_cache_dir(cache)  # (a torn cache write's file, as big as the tokens, as train does)
    corpus = Corpus.load(data, cfg.vocab, cfg.window, tokenizer=tok,  # the run's tokenizer
                         cache_dir=cache)
    if trained_on.get("sha256") not in (None, corpus.text_sha256):
        if distributed.is_writer():  # (MPI: every rank scores alike; rank 0 says so)
            click.echo(one_line(
                f"note: scoring the built-in text; {ckpt_path} was trained on another (pass "
                "its --data to score that)" if not data else
                f"note: scoring another text than {ckpt_path} was trained on (its .state "
                "records the text's sha256)"), err=True)
    runner = StepRunner(cfg, DEFAULT_SPEED, threads)
    try:
        w = corpus.validation_windows(eval_windows, cfg.window)
        v, ce = runner.loss(state.kernel_model(), state.tables.vsa, w, k)
    finally:
        runner.close()
    ppl = perplexity(ce)
    if as_json:  # (null for a figure that is not finite, as the metrics file has it)
        from .progress import json_number
        click.echo(json.dumps({
            "checkpoint": str(ckpt_path), "valid_loss": json_number(v),
            "cross_entropy": json_number(ce), "perplexity": json_number(ppl), "windows": len(w),
            "window": cfg.window, "loss_positions": k, "text_sha256": corpus.text_sha256}))
        return
    click.echo(f"valid loss {short_figure(v, 4)}, cross-entropy {short_figure(ce, 4)}, "
               f"perplexity {short_figure(ppl, 2)} ({len(w)} "
               f"window{'s' if len(w) != 1 else ''} of "
               f"{cfg.window}, last {k} scored; uniform baseline {math.log(cfg.vocab):.4f})")


@cli.command()
@click.argument("ckpt_path", metavar="CKPT", type=PathArg(file=True))
@click.option("--prompt", default="", help="Text to continue.")
@click.option("--tokens", "n_tokens", type=click.IntRange(1), default=100, show_default=True,
              help="Tokens to generate.")
@click.option("--temperature", type=float, default=0.8, show_default=True,
              help="0 takes the most likely token.")
@click.option("--top-k", type=click.IntRange(0), default=40, show_default=True,
              help="Sample among the k most likely tokens (0: all).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the draws (the same seed gives the same text on every machine).")
@click.option("--data", type=PathArg(), default=None, hidden=True,
              help="Ignored: the checkpoint carries its tokenizer.")
def sample(ckpt_path, prompt, n_tokens, temperature, top_k, seed, data):
    """Continue a prompt with a trained model (reproducible for a seed)."""
    import codecs
    import math

    from .sample import sample as sample_ids
    from .step import Worker
    from .train import load_for_inference
    from .validate import MAX_INT, MIN_TEMPERATURE

    need_stdout("sample")
    if not math.isfinite(temperature) or temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise HslmError(f"--temperature must be 0 (greedy) or a finite number of at least "
                        f"{MIN_TEMPERATURE:g}, got {temperature}")
    if not 0 <= seed <= MAX_INT:  # as train's seed
        raise HslmError(f"--seed must be from 0 to 2^63 - 1, got {seed}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the locale could not decode (surrogates): read as the
        try:  # bytes given (a locale not UTF-8 with Python's UTF-8 mode off: C, POSIX)
            prompt = os.fsencode(prompt).decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            raise HslmError("--prompt is not UTF-8 text") from None
    cfg, state, tok, _ = load_for_inference(ckpt_path)
    # the text as it is drawn: an incremental decoder holds a character's first bytes
    # until its last arrives, and ends with the same text as decoding all the ids at once
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout  # (need_stdout: a reader gone ends sample at its next token)

    def write(piece: str):
        """The text as drawn, UTF-8 whatever the locale (the same bytes on every machine),
        and unchanged: click.echo drops what looks like a terminal's colour codes when
        stdout is not a terminal, so a file would not hold the tokens drawn."""
        if isinstance(out, ReaderGone):
            out.write_bytes(piece.encode("utf-8"))
            if out.gone:
                raise ReaderLeft
        else:  # (a test's captured stream)
            out.write(piece)
            out.flush()

    unsaid = prompt  # said with the first token (--tokens is at least 1): a model whose
    # logits are not finite fails there, and had left the prompt on stdout before its line
    line_open = False  # text written since the last newline

    def each(t):
        nonlocal unsaid, line_open
        piece = unsaid + text.decode(tok.decode_bytes([t]))
        write(piece)
        unsaid, line_open = "", line_open if not piece else not piece.endswith("\n")

    try:
        sample_ids(Worker(cfg, DEFAULT_SPEED), state.kernel_model(), state.tables.vsa,
                   tok.encode(prompt), n_tokens, temperature, top_k, seed, cfg.window,
                   each=each, drawable=tok.n_ids)
        write(text.decode(b"", final=True) + "\n")
    except ReaderLeft:
        pass
    except BaseException:  # a stop (Ctrl-C, SIGTERM) or an error: its line on a line of its
        if line_open:      # own in a terminal, not after the text drawn so far
            with contextlib.suppress(Exception):
                write("\n")
        raise


class ReaderLeft(Exception):
    """The reader of `hslm sample`'s output went away: nothing more to draw for."""


@cli.command()
@click.argument("metrics_file", metavar="METRICS", type=PathArg(file=True))
@click.option("-o", "--output", type=PathArg(file=True), default=Path("loss.png"),
              show_default=True, help="Image file to write (.png, .pdf, .svg, ...).")
def plot(metrics_file, output):
    """Training and validation loss against step, from a --metrics file."""
    from .errors import warn
    from .plot import plot_metrics
    plot_metrics(metrics_file, output, warn=warn)
    click.echo(f"wrote {output}")


def _split(values, convert, name):
    """Repeated options whose values may also be comma-separated: "1,2" or 1 and 2."""
    out = []
    for v in values:
        for x in str(v).split(","):
            if x.strip():
                try:
                    out.append(convert(x.strip()))
                except ValueError:
                    raise HslmError(f"{name} takes values such as 1,2 or repeated flags, got "
                                    f"{v!r}") from None
    if not out:
        raise HslmError(f"{name} is empty")
    return list(dict.fromkeys(out))  # a value given twice is run once


@cli.command()
@click.option("--model", multiple=True, default=("hslm-3",), show_default=True, callback=not_empty,
              help="Model(s) to measure: presets or JSON files; repeat or separate by commas.")
@functools.partial(data_options, cache_default="none: bench keeps no token cache")
@click.option("--speed", multiple=True, default=tuple(map(str, SPEEDS)), show_default=True,
              help="Speed(s) to compare; repeat or separate by commas.")
@click.option("--threads", multiple=True, default=("1",), show_default=True,
              help="Thread count(s); repeat or separate by commas.")
@click.option("--batch", multiple=True, default=("8",), show_default=True,
              help="Batch size(s); repeat or separate by commas.")
@click.option("--steps", type=click.IntRange(1), default=2, show_default=True,
              help="Timed steps per run (after one untimed step).")
@click.option("--loss-positions", "-k", type=int, default=None,
              help="Scored positions k [default: the window].")
@click.option("--torch/--no-torch", "with_torch", default=True, show_default=True,
              help="Also time the PyTorch baseline (f64 and f32, one thread) if installed.")
@click.option("--profile/--no-profile", default=True, show_default=True,
              help="Per-phase profile of a speed-3 step (first model and batch).")
@click.option("--json", "json_path", type=PathArg(file=True), default=None,
              help="Also write every figure (machine, versions, rows, ratios, profile) as JSON.")
def bench(model, data, cache_dir, speed, threads, batch, steps, loss_positions, with_torch,
          profile, json_path):
    """Train the same seeded steps at each speed side by side; report tok/s and ratios."""

    if distributed.current() is not None:  # (every rank refuses: one line)
        raise HslmError("hslm bench times one process: run it without mpiexec (its ranks "
                        "would time each other on the same cores, and each write --json)")
    models = _split(model, str, "--model")
    speeds = _split(speed, int, "--speed")
    if any(s not in SPEEDS for s in speeds):
        raise HslmError(f"--speed must be among {','.join(map(str, SPEEDS))}, got "
                        f"{','.join(map(str, speeds))}")
    thread_counts = _split(threads, int, "--threads")
    batches = _split(batch, int, "--batch")
    if min(thread_counts) < 1 or max(thread_counts) > MAX_THREADS or min(batches) < 1:
        raise HslmError(f"--threads must be from 1 to {MAX_THREADS} and --batch at least 1")
    if json_path is not None:  # before minutes of benchmarking, not after
        from .checkpoint import check_atomic_target
        from .validate import check_report_apart
        check_atomic_target(json_path, "--json")
        check_report_apart(json_path, models, data)
    from .precompile import compile_first
    from .token_cache import cache_dir as token_cache_dir
    from .train import resolve_config, tidy_cache_dir
    cfgs = [resolve_config(m) for m in models]  # a bad --model: its error before compiling
    from .validate import check_bench_plan  # -k, the batches, the memory: before compiling
    check_bench_plan(list(zip(models, cfgs)), speeds, thread_counts, batches, loss_positions)
    for p in data:  # and that the text's paths are there (read after compiling)
        if not os.path.exists(p):
            raise HslmError(f"data file not found: {p}")
    cache = token_cache_dir(cache_dir, None)
    tidy_cache_dir(cache)  # (a torn cache write's file, as big as the tokens, as train does)
    compile_first(sorted(set(speeds) | {DEFAULT_SPEED}), cfgs[0].vocab,
                  echo=lambda m: click.echo(m, err=True),
                  teams=max(thread_counts) > min(batches))
    from .bench import run_bench  # (loads the kernels)
    from .bench_report import all_identical, format_report
    report = run_bench(models, speeds, thread_counts, batches, steps, loss_positions, data,
                       with_torch, profile, progress=lambda m: click.echo(f"  {m}", err=True),
                       cache_dir=cache)
    if json_path is not None:  # first: a standard output that fails (a full disk) had lost it
        from .checkpoint import write_atomic
        write_atomic(json_path, (json.dumps(report, indent=1) + "\n").encode(), what="report")
    for line in format_report(report):
        click.echo(line)
    if json_path is not None:
        click.echo(f"wrote {json_path}")
    if not all_identical(report):
        sys.exit(1)


@cli.command("bench-compare")
@click.argument("reports", nargs=-1, required=True, type=PathArg(file=True))
@click.pass_context
def bench_compare(ctx, reports):
    """Compare reports `hslm bench --json` wrote, each against the first: tok/s, the
    PyTorch ratios, the profile's phases, and the checkpoint bytes (exit 1 if runs that
    should end with the same bytes did not)."""
    from .bench_report import compare_reports, load_report
    need_stdout("bench-compare")
    if len(reports) < 2:
        raise HslmError("bench-compare needs two reports or more (hslm bench --json FILE)")
    named = [(str(p), load_report(p)) for p in reports]
    # what a field of the wrong shape raises (a tok/s of 0: ArithmeticError)
    malformed = (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError)
    for name, report in named:  # each against itself first: a bad field names its file
        try:
            compare_reports([(name, report), (name, report)])
        except malformed as e:
            raise HslmError(f"{name}: not an hslm bench report ({type(e).__name__}: "
                            f"{str(e)[:80]})") from None
    try:  # (paths only a comparison of two reports takes: duplicate entries, say)
        lines, differ = compare_reports(named)
    except malformed as e:
        raise HslmError(f"the reports do not compare: one is not an hslm bench report "
                        f"({type(e).__name__}: {str(e)[:80]})") from None
    for line in lines:  # (a report's text fields: control characters and lone surrogates
        click.echo(one_line(line))  # as escapes, not a forged line or a half-printed table)
    ctx.exit(1 if differ else 0)


def need_stdout(command: str, required: bool = True):
    """A command whose product is its standard output: without one (`>&-`: Python then has
    no sys.stdout, and eval had ended quietly with status 0) it refuses to start where
    required (diff's exit status is a product of its own), and a reader that goes (`|
    head`) is not told the command is going on without it (ReaderGone.keep_going)."""
    if sys.stdout is None or any(sys.stdout is s for s in CLOSED_AT_START):
        if required:
            raise HslmError(f"the standard output is closed: {command} has nowhere to write")
        return
    if isinstance(sys.stdout, ReaderGone):
        sys.stdout.keep_going = False


def _is_terminal(stream) -> bool:
    """Whether stream is a terminal, one already hung up included (isatty() says False
    for that: its tcgetattr fails with EIO, where another device's fails with ENOTTY)."""
    try:
        fd = stream.fileno()
        if os.isatty(fd):
            return True
        import termios
        termios.tcgetattr(fd)
    except ImportError:  # (no termios: isatty's word)
        return False
    except Exception as e:  # noqa: BLE001 (termios.error, OSError, no fileno)
        return bool(e.args) and e.args[0] == errno.EIO
    return False


class ReaderGone:
    """sys.stdout and sys.stderr for the CLI: when the reader of a pipe goes away (`hslm
    train | head`, `2>&1 | head`) or the terminal hangs up, that stream's output goes to
    /dev/null from then on and the run goes on, saving as it would, instead of the
    BrokenPipeError (or EIO) that would stop it unsaved (click exits 1 on one). A closed
    standard output is noted on stderr, unless the command's only product is that output
    (keep_going False: `hslm sample` stops at its next token, as `head`'s writer would)."""

    def __init__(self, stream, note=None, name="the standard output"):
        self._stream = stream
        self._note = note
        self._name = name
        self.gone = False
        self.keep_going = True
        self._terminal = _is_terminal(stream)

    def _gone_else_failed(self, e: OSError) -> bool:
        """True for a pipe's reader gone (`| head`: EPIPE), or this terminal hung up (EIO:
        an ssh session dropped; the run then saves and stops, train.StopRequest). Else the
        write failed (an EIO from a file, a failing disk, as any other error): e, for the
        caller to raise, is named for this stream (it had read as the checkpoints' disk's:
        "error: No space left on device"), and the stream goes to /dev/null."""
        if isinstance(e, BrokenPipeError) or (e.errno == errno.EIO and self._terminal):
            return True
        if e.filename is None:
            e.filename = self._name
        self._to_null()  # (what stays buffered would fail again, as a traceback, at exit)
        return False

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            if not self._gone_else_failed(e):
                raise
            self._drop()
            return len(text)

    def write_bytes(self, data: bytes):
        """data as they are, past the text layer (flushed first, so the order holds)."""
        try:
            self._stream.flush()
            self._stream.buffer.write(data)
            self._stream.buffer.flush()
        except OSError as e:
            if not self._gone_else_failed(e):
                raise
            self._drop()

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            if not self._gone_else_failed(e):
                raise
            self._drop()

    def _to_null(self):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())  # what is still buffered goes there too
        os.close(null)

    def _drop(self):
        if self.gone:
            return
        self.gone = True
        self._to_null()
        if self._note and self.keep_going:
            print(self._note, file=sys.stderr, flush=True)  # (stderr may be gone as well)

    def __getattr__(self, name):
        return getattr(self._stream, name)


# The streams put in place of standard streams closed when a command started (`>&-`,
# `2>&-`): /dev/null (open_closed_stream); need_stdout still refuses such a stdout.
CLOSED_AT_START = []


def open_closed_stream(name: str):
    """sys.stdout or sys.stderr for a stream closed at the start: /dev/null. Python leaves
    such a stream None, so that train's progress line had been an AttributeError traceback
    (nothing saved) and print(..., file=sys.stderr) wrote warnings into the standard
    output (eval --json's JSON, sample's text). Its descriptor is held open on /dev/null
    as well where it is still free, so that no file the run opens takes descriptor 1 or 2
    and receives what was meant for the stream."""
    fd = 1 if name == "stdout" else 2
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.fstat(fd)
    except OSError:  # free: /dev/null there
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        null = fd
    stream = open(null, "w", closefd=null != fd)
    stream.gone = True  # (as ReaderGone's: a line the user must see goes to stderr too)
    CLOSED_AT_START.append(stream)
    return stream


class WaitingWriter(io.RawIOBase):
    """A standard stream's descriptor, written as a blocking one is even where another
    program has made it non-blocking (O_NONBLOCK belongs to the open file, which a
    terminal's or a pipe's programs share): a write the reader is not ready for waits for
    it. CPython's own writer drops such text without an error (a run's last 36 lines, its
    "saved" line among them, lost behind a slow reader, exit 0)."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd

    def fileno(self):
        return self._fd

    def writable(self):
        return True

    def isatty(self):
        return os.isatty(self._fd)

    def write(self, data):
        """All of data (a raw writer may write part, but the text layer over it without a
        buffer, as `python -u` has, would drop the rest)."""
        view, done = memoryview(data), 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except BlockingIOError:
                select.select([], [self._fd], [])
        return done


def waiting_stream(stream):
    """stream (a standard stream, flushed) again over a WaitingWriter of its descriptor,
    with its encoding, errors and buffering: none where it had none (`python -u`,
    PYTHONUNBUFFERED: a warning printed unflushed had waited for the run's end)."""
    stream.flush()
    raw = WaitingWriter(stream.fileno())
    buffered = not isinstance(stream.buffer, io.RawIOBase)
    return io.TextIOWrapper(io.BufferedWriter(raw) if buffered else raw,
                            encoding=stream.encoding, errors=stream.errors, newline="\n",
                            line_buffering=stream.line_buffering,
                            write_through=stream.write_through)


def guard_streams():
    """Wrap the standard streams in ReaderGone where they are real files, and write a
    stream closed at the start to /dev/null (open_closed_stream). A character a
    stream cannot encode no longer raises: a path's bytes that are not UTF-8 are written
    as they are on a UTF-8 stream, and on another (PYTHONIOENCODING=latin-1, say) what it
    cannot hold is written as a backslash escape. A write waits for a slow reader even
    where the descriptor is non-blocking (WaitingWriter)."""
    for name, note in (("stdout", "hslm: the standard output was closed; going on without it"),
                       ("stderr", None)):
        shown = "the standard output" if name == "stdout" else "the standard error"
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open_closed_stream(name))
            continue
        if isinstance(stream, ReaderGone):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
            continue
        if hasattr(stream, "reconfigure") and stream.errors == "strict":
            utf8 = codecs.lookup(stream.encoding or "ascii").name == "utf-8"
            # a name of bytes that are not UTF-8 (Python holds them as lone surrogates)
            # goes out as those bytes on a UTF-8 stream, as an escape on another
            stream.reconfigure(errors="surrogateescape" if utf8 else "backslashreplace")
        if isinstance(stream, io.TextIOWrapper):
            stream = waiting_stream(stream)
        setattr(sys, name, ReaderGone(stream, note, shown))



def main(argv=None):
    """Entry point: every error is one line on stderr and a non-zero exit."""
    guard_streams()
    with keeping_dropped_interrupts():
        run_command(argv)


def stopped(e):
    """The end of a command stopped by a signal (e: the KeyboardInterrupt, Terminated or
    click's Abort of one): its one line and 128 + the signal."""
    if _the_hslm_command():  # (not a program calling main())
        quiet_after_interrupt()
    signum = stopped_by(e)
    click.echo(f"error: {stop_word(signum)}", err=True)
    sys.exit(128 + signum)


def run_command(argv):
    """The command itself, each way it can end: one line on stderr and an exit status."""
    try:
        # launched by MPI with P > 1 (hslm/distributed.py)? Until MPI is up a signal ends the
        # start-up by itself (hslm/__init__.py: under MPI this rank dies by it, so that the
        # launcher ends the others, which would wait in MPI's start for it); then the
        # command's own handling takes over
        world = distributed.init()
        end_of_start_up()
        if world is not None:
            distributed.run_main(cli, argv)
        rv = cli.main(args=argv, prog_name="hslm", standalone_mode=False)
        raise_dropped_interrupt()  # (a command that went on after one: it was interrupted)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.UsageError as e:
        msg = e.format_message().replace("\n", " ")
        click.echo(f"error: {msg}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt) as e:  # click makes an Abort of either
        stopped(e)
    except HslmError as e:
        click.echo(f"error: {one_line(str(e))}", err=True)
        sys.exit(2)
    except (OSError, ModuleNotFoundError, MemoryError) as e:  # safety nets: the machine's
        line = machine_error_line(e)
        if line is None:  # a module of hslm's own missing, say: a bug, shown whole
            raise
        click.echo(f"error: {one_line(line)}", err=True)
        sys.exit(2)
    except Exception:  # a bug, shown whole; or what an interrupt inside a compile left
        dropped = take_dropped_interrupt()
        if dropped is None:
            raise
        stopped(dropped)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
