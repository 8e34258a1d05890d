"""Checks shared by the CLI and the file loaders: a value read from a file is judged
exactly as the same value given as a flag, and sizes are judged before anything is
allocated.

Nothing here trusts its input: JSON is parsed with bounded size and depth, without
NaN/Infinity literals, and every field must have the exact type and range the
writer produces.
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from .errors import HslmError
from .hyper import HYPER_PARAMS

MAX_JSON = 16 << 20  # bytes of any JSON text we parse (a checkpoint header, a tokenizer)
MAX_INT = 2 ** 63 - 1  # integer hyper-parameters must fit a signed 64-bit integer
MIN_TEMPERATURE = 1e-6  # below this (and above 0) logits / T overflow

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")

HYPER_INT = tuple(p.name for p in HYPER_PARAMS if p.type is int)
HYPER_FLOAT = tuple(p.name for p in HYPER_PARAMS if p.type is float)


class Invalid(ValueError):
    """A field that fails a check; the caller words it (flag or file)."""


def _no_constants(name):
    raise Invalid(f"the literal {name} is not allowed")


def unique_keys(pairs):
    """json's object_pairs_hook: a dict, or Invalid for a key given twice (json.loads
    would keep the last one silently)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise Invalid(f"the key {key!r} is given twice")
        obj[key] = value
    return obj


def parse_json(text, what: str, limit: int = MAX_JSON):
    """json.loads with a size bound, no NaN/Infinity literals and no RecursionError."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid(f"{what} is not UTF-8") from None
    if not isinstance(text, str):
        raise Invalid(f"{what} is not a string")
    if len(text) > limit:
        raise Invalid(f"{what} is {len(text):,} bytes, more than the {limit:,} allowed")
    try:
        value = json.loads(text, parse_constant=_no_constants, object_pairs_hook=unique_keys)
    except Invalid as e:
        raise Invalid(f"{what}: {e}") from None
    except RecursionError:
        raise Invalid(f"{what} is nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise Invalid(f"{what} is not valid JSON ({str(e)[:80]})") from None
    if _depth(text) > MAX_JSON_DEPTH:  # (what parses may not be encodable again: the
        # encoder's frames are deeper than the parser's, a RecursionError just past it)
        raise Invalid(f"{what} is nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    return value


# No JSON hslm reads (configs, hyper-parameters, checkpoint headers) nests beyond 5 levels.
MAX_JSON_DEPTH = 64
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def _depth(text: str) -> int:
    """How deeply lists and objects nest in valid JSON text: its brackets outside
    strings, counted (a tokenizer's million merges in 0.1 s, where walking the parsed
    value took seconds)."""
    step = _BRACKETS[np.frombuffer(_JSON_STRINGS.sub("", text).encode(), np.uint8)]
    return int(np.cumsum(step, dtype=np.int64).max()) if step.size else 0


_BRACKETS = np.zeros(256, np.int8)
_BRACKETS[[ord("["), ord("{")]], _BRACKETS[[ord("]"), ord("}")]] = 1, -1


def ends_as_folder(name: str) -> bool:
    """Whether a name ends as only a folder's can: a slash, or a last part . or .. (Path
    drops the slash and the ".", so `ck.bin/` read as a Path is ck.bin)."""
    return name.endswith(tuple(filter(None, (os.sep, os.altsep)))) or os.path.basename(
        name) in (".", "..")


def file_named_as_folder(name: str) -> str | None:
    """What is wrong where a name that ends as a folder's (ends_as_folder) is a file's,
    else None: `info ck.bin/` had described ck.bin, `--model c.json/` read c.json and
    `--data a.txt/` trained on a.txt."""
    from pathlib import Path
    if ends_as_folder(name) and os.path.isfile(Path(name)):
        return (f"{name} ends as a folder's name does (a slash, . or ..), but {Path(name)} "
                "is a file; give the file's name")
    return None


def check_file_not_named_as_folder(name: str, what: str = ""):
    """One line, `what` first (a flag), where file_named_as_folder finds a problem."""
    problem = file_named_as_folder(name)
    if problem is not None:
        raise HslmError(what + problem)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_hex64(v) -> bool:
    return isinstance(v, str) and _HEX64.match(v) is not None


def exact_keys(obj, keys, what):
    if not isinstance(obj, dict):
        raise Invalid(f"{what} is not a JSON object")
    missing = sorted(set(keys) - set(obj))
    extra = sorted(set(obj) - set(keys))
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(map(repr, extra))[:80]}"] if extra else [])
        raise Invalid(f"{what}: {'; '.join(parts)}")


# ------------------------------------------------------------ hyper-parameters
def hyper_problems(cfg, h):
    """[(field, message)] for every hyper-parameter out of range (empty when all fit)."""
    out = []

    def bad(f, msg):
        out.append((f, f"{msg}, got {getattr(h, f)!r}"))

    for f in HYPER_INT:
        if not is_int(getattr(h, f)):
            bad(f, "must be an integer")
        elif abs(getattr(h, f)) > MAX_INT:
            bad(f, "must fit a signed 64-bit integer (magnitude at most 2^63 - 1)")
    for f in HYPER_FLOAT:
        v = getattr(h, f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            bad(f, "must be a finite number")
    if out:
        return out
    for p in HYPER_PARAMS:  # the table's ranges
        v = getattr(h, p.name)
        if p.name == "loss_positions":
            if not 1 <= v <= cfg.window:
                bad(p.name, f"must be between 1 and the window ({cfg.window})")
        elif p.low_excluded and not v > p.low:
            bad(p.name, f"must be above {p.low:g}")
        elif not p.low_excluded and not v >= p.low:
            bad(p.name, f"must be at least {p.low:g}")
    # each step scales the decayed weights by 1 - lr x weight_decay (lr at most its peak):
    # at 0 or below they would be wiped or flip sign every step
    if not out and not h.lr * h.weight_decay < 1.0:
        out.append(("weight_decay", f"times --lr must be below 1 (each step scales the weights "
                                    f"by 1 - lr x weight decay), got {h.weight_decay!r} x "
                                    f"{h.lr!r}"))
    return out


def check_hyper(cfg, h):
    """Hyper-parameters given as flags: the first problem (hyper_problems) as one error
    naming its flag. A .state's are judged by the same rules in hyper_from_json, but for
    the last: a new run's --decay-steps must be past its --warmup (the cosine runs from the
    warm-up's end to it; at or before that end the rate fell from the peak to 10% in the
    step after it), which runs begun before the rule keep (the formula is defined)."""
    problems = hyper_problems(cfg, h)
    if problems:
        f, msg = problems[0]
        raise HslmError(f"--{f.replace('_', '-')} {msg}")
    if not h.decay_steps > h.warmup:
        raise HslmError(f"--decay-steps must be past --warmup's {h.warmup} (the cosine decay "
                        f"runs from the warm-up's end to it), got {h.decay_steps}")



def bench_hyper(cfg, batch: int, loss_positions):
    """hslm bench's hyper-parameters for a model and batch (k: the window unless given;
    seed 1729), judged as train judges its flags (check_hyper)."""
    from .hyper import Hyper
    h = Hyper(batch=batch, seed=1729,
              loss_positions=cfg.window if loss_positions is None else loss_positions)
    check_hyper(cfg, h)
    return h


def check_report_apart(json_path, models, data):
    """bench --json may not name one of the bench's inputs, even through a link: a model's
    config file, a --data file, or a name in a --data folder (whose files are read as
    text). The report had replaced them."""
    from pathlib import Path

    from .config import PRESETS
    from .data import check_apart_from_text, same_file
    for m in models:
        if m not in PRESETS and same_file(m, json_path):
            raise HslmError(f"--json {json_path} is the model config {m}; give another name")
    for p in data:
        if same_file(p, json_path):
            raise HslmError(f"--json {json_path} is the --data file {p}; give another name")
    # (the name's own folder, a link's included: write_atomic replaces a link, it does not
    # write through it)
    check_apart_from_text(data, Path(json_path).parent, "report's folder", "--json")
    if os.path.isfile(json_path) and os.path.getsize(json_path) > 0:
        from .bench_report import load_report  # an earlier report is replaced; any other
        try:  # file is not (a checkpoint, a run's lock: the report had replaced them)
            load_report(json_path)
        except HslmError:
            raise HslmError(f"--json {json_path} is a file that is not a bench report; give "
                            "another name (a report replaces only an earlier report)") from None


def check_bench_plan(named_cfgs, speeds, threads, batches, loss_positions):
    """hslm bench's runs judged before anything is compiled or timed: each model's and
    batch's hyper-parameters (bench_hyper), and the memory of its runs side by side."""
    from .data import check_vocab
    combos = [(s, t) for t in threads for s in speeds]
    shown = ",".join(str(t) for t in sorted(set(threads)))
    for name, cfg in named_cfgs:
        try:  # (else found when its text is tokenized: after the models before it had
            check_vocab(cfg.vocab)  # been timed, minutes lost)
        except HslmError as e:
            raise HslmError(f"--model {name}: {e}") from None
        for batch in batches:
            bench_hyper(cfg, batch, loss_positions)
            check_fits(sum(memory_estimate(cfg, batch, t, s) for s, t in combos),
                       f"bench --model {name} --batch {batch} --threads {shown} (its "
                       f"{len(combos)} run{'s' if len(combos) != 1 else ''} side by side)")


def hyper_from_json(text, cfg):
    """A Hyper from a .state's "hyper" field, checked as the flags are."""
    from .hyper import Hyper
    obj = parse_json(text, "hyper")
    fields = HYPER_INT + HYPER_FLOAT
    exact_keys(obj, fields, "hyper")
    for f in HYPER_INT:
        if not is_int(obj[f]):
            raise Invalid(f"hyper {f} is not an integer: {obj[f]!r}")
    for f in HYPER_FLOAT:
        if not isinstance(obj[f], float):
            raise Invalid(f"hyper {f} is not a number: {obj[f]!r}")
    h = Hyper(**obj)
    if h.to_json() != text:
        raise Invalid("hyper is not in canonical form")
    problems = hyper_problems(cfg, h)
    if problems:
        f, msg = problems[0]
        raise Invalid(f"hyper-parameter {f} {msg}")
    return h


# ------------------------------------------------------------------ RNG state
def check_rng_state(text):
    """The data generator's state: numpy's PCG64 bit_generator.state, as JSON."""
    obj = parse_json(text, "rng")
    exact_keys(obj, ("bit_generator", "state", "has_uint32", "uinteger"), "rng")
    if obj["bit_generator"] != "PCG64":
        raise Invalid(f"rng bit_generator is {str(obj['bit_generator'])[:40]!r}, not 'PCG64'")
    exact_keys(obj["state"], ("state", "inc"), "rng state")
    s, inc = obj["state"]["state"], obj["state"]["inc"]
    if not (is_int(s) and 0 <= s < 2 ** 128):
        raise Invalid("rng state.state is not a 128-bit unsigned integer")
    if not (is_int(inc) and 0 < inc < 2 ** 128 and inc % 2 == 1):
        raise Invalid("rng state.inc is not an odd 128-bit unsigned integer")
    if obj["has_uint32"] not in (0, 1) or not is_int(obj["has_uint32"]):
        raise Invalid("rng has_uint32 is not 0 or 1")
    if not (is_int(obj["uinteger"]) and 0 <= obj["uinteger"] < 2 ** 32):
        raise Invalid("rng uinteger is not a 32-bit unsigned integer")
    from .config import canonical_json
    if canonical_json(obj) != text:  # (as written: hslm diff names a field by its text)
        raise Invalid("rng is not in canonical form")
    return obj


# --------------------------------------------------------------------- config
def config_from_json(text):
    """A Config from its JSON, exact fields and canonical form, or Invalid."""
    from dataclasses import fields as dc_fields

    from .config import Config
    obj = parse_json(text, "config", limit=4096)
    exact_keys(obj, [f.name for f in dc_fields(Config)], "config")
    try:
        cfg = Config(**obj)
    except (ValueError, TypeError) as e:
        raise Invalid(str(e)) from None
    if cfg.to_json() != text:
        raise Invalid("config is not in canonical form")
    return cfg


# --------------------------------------------------------------------- memory
def memory_estimate(cfg, batch=0, threads=1, speed=3, training=True) -> int:
    """Bytes the largest buffers of a run (training) or an evaluation need, roughly."""
    V, d, H, F, nb, L = cfg.vocab, cfg.width, cfg.heads, cfg.mlp, cfg.blocks, cfg.window
    P = cfg.n_params
    f64 = 8
    total = P * f64  # theta
    total += 2 * P  # the ternary panels (int8)
    total += V * cfg.vsa_dim * 2  # the VSA table (int8, drawn into in place) and a copy
    # per block and position: 17 rows of d, the KV cache's two panel copies for the
    # forward (about 2 d, hslm.layers.cache_panels), 2 of the MLP width, the attention row
    per_window = L * (nb * (19 * d + 2 * F + H * L + 1) + 3 * V + 3 * d + 1) * f64
    # per thread; the weight gradient's output-gradient panels and transposed inputs for
    # a group of windows
    from .micro import WGRAD_PANEL  # noqa: PLC0415 (numba, no compiling)
    from .panel_kernels import WGRAD_WINDOWS  # noqa: PLC0415
    scratch = L * ((12 + 2 * nb) * d + 3 * V + 3 * F  # (each block's backward panels)
                   + WGRAD_WINDOWS * (2 * max(V, F, d) + WGRAD_PANEL)) * f64
    total += threads * (per_window + scratch)
    if training:
        total += 3 * P * f64  # gradient, Adam m and v
        from .speeds import SPEEDS
        if SPEEDS[speed].plain_layouts:  # Tf and Tb, and a window accumulator per thread
            total += 2 * P * f64 + threads * P * f64 * (2 if threads > 1 else 1)
        else:
            total += batch * per_window
        total += batch * (L + 1) * 8
    return int(total)


def available_memory() -> int:
    """Bytes of memory available now: the machine's (MemAvailable, or the physical
    memory), or less where this process is held to less: its control group's limit (a
    container's; past it the kernel kills the process, with no line) or its address space
    limit (`ulimit -v`: past it an allocation fails)."""
    have = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if have is None:  # (no /proc, or a kernel before 3.14: no MemAvailable)
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            have = 1 << 62
    return min(have, cgroup_headroom(), address_space_headroom())


MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_OF_PROCESS = "/proc/self/cgroup"
NO_LIMIT = 1 << 60  # a control group's "no limit" (v1 writes 2^63 less a page)


def cgroup_headroom() -> int:
    """Bytes this process's control groups (v2, or v1's memory controller) may still take:
    the least, over its group and the groups above it, of the limit less what is used but
    cannot be taken back (the page cache can, and v2's reclaimable slab). A group's
    folder not seen
    from here (a container sees its own group as the root) is passed over."""
    least = 1 << 62
    try:
        with open(CGROUP_OF_PROCESS) as f:
            lines = f.read().splitlines()
    except OSError:
        return least
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, limit, used, cache = (CGROUP_ROOT, "memory.max", "memory.current",
                                        ("active_file", "inactive_file", "slab_reclaimable"))
        elif "memory" in controllers.split(","):
            base, limit, used, cache = (os.path.join(CGROUP_ROOT, "memory"),
                                        "memory.limit_in_bytes", "memory.usage_in_bytes",
                                        ("total_active_file", "total_inactive_file"))
        else:
            continue
        parts = [x for x in path.split("/") if x]
        for n in range(len(parts), -1, -1):
            folder = os.path.join(base, *parts[:n])
            try:
                with open(os.path.join(folder, limit)) as f:
                    cap = f.read().strip()
                if cap == "max" or int(cap) >= NO_LIMIT:
                    continue
                with open(os.path.join(folder, used)) as f:
                    taken = int(f.read())
            except (OSError, ValueError):
                continue
            try:  # (the page cache is taken back before the kernel kills, as MemAvailable
                with open(os.path.join(folder, "memory.stat")) as f:  # counts it)
                    stat = dict(x.split()[:2] for x in f if len(x.split()) >= 2)
                taken -= min(sum(int(stat.get(k, 0)) for k in cache), taken)
            except (OSError, ValueError):
                pass
            least = min(least, max(int(cap) - taken, 0))
    return least


def address_space_headroom() -> int:
    """Bytes of address space left under RLIMIT_AS (`ulimit -v`), or 2^62 without one."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return 1 << 62
        with open("/proc/self/status") as f:
            size = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))
        return max(soft - size, 0)
    except (ImportError, OSError, ValueError, StopIteration):
        return 1 << 62


def gib(n) -> str:
    return f"{n / 2 ** 30:,.1f} GiB"


def check_fits(need: int, what: str):
    have = available_memory()
    if need > have:
        raise HslmError(f"{what} needs about {gib(need)} of memory, but only {gib(have)} "
                        "is available")
