"""`hslm diff` and `hslm info`: what a checkpoint holds, and exactly how two differ."""
from __future__ import annotations

import json

import numpy as np

from . import checkpoint as ckpt
from .config import canonical_json
from .errors import HslmError, one_line


def ternary_scale(W) -> float:
    """A ternary matrix's alpha as the model makes it (params.quantize_into): sum |W| in
    element order from 0.0, over the count; 1.0 at or below 1e-6. np.add.accumulate adds
    in that order; .mean() sums pairwise, which can differ in the last bits (and then
    count an element at the threshold on the wrong side)."""
    with np.errstate(over="ignore"):  # (finite values past 1e308 sum to inf, as the model's)
        a = float(np.add.accumulate(np.abs(W.ravel()))[-1]) / W.size if W.size else 0.0
    return 1.0 if a <= 1e-6 else a


# Elements compared at a time: two whole tensors' masks and differences had taken about
# three times the files' own memory for two .state files that differ everywhere.
DIFF_CHUNK = 1 << 20


def _differences(x, y):
    """(count, first index, max |x - y| ignoring NaN: NaN when every difference is)
    over the elements whose bits differ, a chunk at a time."""
    count, first, mad = 0, -1, np.nan
    for c0 in range(0, x.size, DIFF_CHUNK):
        xs, ys = x[c0:c0 + DIFF_CHUNK], y[c0:c0 + DIFF_CHUNK]
        neq = xs.view(np.uint64) != ys.view(np.uint64)
        k = int(np.count_nonzero(neq))
        if k == 0:
            continue
        if count == 0:
            first = c0 + int(np.argmax(neq))
        count += k
        with np.errstate(invalid="ignore", over="ignore"):  # (inf - inf: NaN, ignored as
            # NaNs are; 1e308 - -1e308: inf)
            mad = np.fmax(mad, np.fmax.reduce(np.abs(xs[neq] - ys[neq])))
    return count, first, float(mad)


def diff_checkpoints(a, b):
    """Returns (identical, lines). Elements are compared by their bits (so -0.0 != +0.0)."""
    A, B = ckpt.read(a), ckpt.read(b)
    if A.same_bytes(B):
        return True, [f"identical: {a} and {b} ({A.size:,} bytes, sha256 of data "
                      f"{A.data_sha256[:16]}...)"]
    if A.kind != B.kind:
        raise HslmError(f"cannot compare a '{A.kind}' file with a '{B.kind}' file")
    lines = [f"differ: {a} and {b}"]
    # data_sha256 differs exactly when a tensor does (named below), and header_sha256
    # whenever anything else in the header does: noise. params_sha256 (a .state's .bin)
    # is compared like any other field.
    for key in sorted(set(A.meta) | set(B.meta)):
        if key in ("data_sha256", "header_sha256"):
            continue
        va, vb = A.meta.get(key), B.meta.get(key)
        if va == vb:
            continue
        ja, jb = _json_dict(va), _json_dict(vb)
        if ja is not None and jb is not None:  # config, hyper: name the fields that differ
            for f in sorted(set(ja) | set(jb)):  # by their JSON (0.0 == -0.0 in Python)
                if canonical_json(ja.get(f)) != canonical_json(jb.get(f)):
                    # (a nested value as JSON: rng's state had been shown as Python's dict)
                    fa, fb = (v if isinstance(v, str) else canonical_json(v)
                              for v in (ja.get(f), jb.get(f)))
                    lines.append(f"  metadata {key}: {f} {_differing(fa, fb)}")
        else:
            lines.append(f"  metadata {key}: {_differing(va, vb)}")
    names = A.names() + [n for n in B.names() if n not in A.header]
    n_diff_tensors = 0
    for name in names:
        if name not in A.header or name not in B.header:
            lines.append(f"  {name}: only in {a if name in A.header else b}")
            n_diff_tensors += 1
            continue
        x, y = A.tensor(name), B.tensor(name)
        if x.shape != y.shape:
            lines.append(f"  {name}: shape {list(x.shape)} != {list(y.shape)}")
            n_diff_tensors += 1
            continue
        count, at, mad = _differences(x.reshape(-1), y.reshape(-1))
        if count == 0:
            continue
        n_diff_tensors += 1
        first = np.unravel_index(at, x.shape)
        idx = ",".join(str(int(i)) for i in first)
        lines.append(f"  {name}: {count:,} of {x.size:,} elements differ, max |diff| {mad:.3e}, "
                     f"first at [{idx}] ({_values(x[first], y[first])})")
    if len(lines) == 1:  # nothing named, yet the bytes differ: never leave it unsaid
        ha, hb = A.meta.get("header_sha256"), B.meta.get("header_sha256")
        if ha != hb:
            lines.append(f"  the headers differ: header_sha256 {_differing(ha, hb)}")
        else:
            lines.append("  the bytes differ outside the metadata and tensors compared")
    lines.append(f"{n_diff_tensors} tensor(s) differ")
    return False, lines


def _json_dict(s):
    try:
        v = json.loads(s)
    except (TypeError, ValueError, RecursionError):  # (a field nested past json's depth)
        return None
    return v if isinstance(v, dict) else None


def _values(u, v) -> str:
    """'u vs v', two elements whose bits differ: as numbers, or as their bits where the
    numbers print alike (two NaNs of other payloads or signs)."""
    su, sv = repr(float(u)), repr(float(v))
    if su == sv:
        su, sv = (f"{su} 0x{int(np.float64(w).view(np.uint64)):016x}" for w in (u, v))
    return f"{su} vs {sv}"


def _differing(a, b, n=60):
    """'a != b', long values cut to 24 characters from where they first differ (from the
    start when that is within the first 16: a digest's prefix, as hslm info prints it),
    so the difference is on the line."""
    sa, sb = str(a), str(b)
    if len(sa) <= n and len(sb) <= n:
        return f"{one_line(sa)} != {one_line(sb)}"  # (control characters as escapes)
    i = next((j for j, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    start = 0 if i < 16 else i - 8

    def cut(s):
        part = one_line(s[start:start + 24])
        return (("..." if start else "") + part + ("..." if start + 24 < len(s) else "")
                + f" ({len(s)} chars)")
    return f"{cut(sa)} != {cut(sb)} (first difference at character {i})"


def describe_tokenizer(path):
    """`hslm info` of a tokenizer a run wrote: tokenizer.json beside its checkpoints, or a
    token cache folder's bpe-*.json (the same, with the text it was learned from)."""
    from .data import Tokenizer
    from .errors import read_bytes
    from .token_cache import TOKENIZER_CACHE_VERSION
    from .validate import MAX_JSON
    raw = read_bytes(path, "tokenizer", MAX_JSON + 4096)
    try:
        obj = json.loads(raw.decode("utf-8-sig"))
    except (ValueError, RecursionError):
        obj = None
    version = str(obj.get("version", "")) if isinstance(obj, dict) else ""
    if version.startswith("hslm-bpe-cache/") and version != TOKENIZER_CACHE_VERSION:
        raise HslmError(f"{path} is a token cache's tokenizer of another hslm's rules "
                        f"({one_line(version)[:40]}; this one reads {TOKENIZER_CACHE_VERSION})")
    cached = version == TOKENIZER_CACHE_VERSION
    try:
        tok = Tokenizer.from_json(json.dumps(obj["tokenizer"]) if cached
                                  else raw.decode("utf-8-sig", errors="replace"))
    except (HslmError, KeyError, TypeError) as e:
        raise HslmError(f"{path}: {e}") from None
    lines = [f"file      {path}",
             "kind      tokenizer (byte-level BPE, hslm-bpe v1)" + (
                 ", cached with the text it was learned from" if cached else
                 ": a copy for other tools; hslm reads the one each .bin carries"),
             f"vocab     {tok.vocab:,}",
             f"tokenizer {tok.identity[:16]}... ({len(tok.merges)} merges)"]
    if cached:
        lines.append(f"data      text sha256 {one_line(str(obj.get('text_sha256')))[:16]}...")
    return lines


def describe_tokens(path):
    """`hslm info` of a token cache's tokens-*.tok: its header, and whether its tokens
    still match the checksum there (a damaged cache is tokenized again by a run)."""
    from .token_cache import HEADER, checksum, map_tokens, read_header
    header = read_header(path)
    if header is None:
        raise HslmError(f"token cache {path}: its header does not describe it (torn or "
                        "damaged); a run tokenizes its text again")
    item, n, text, tokenizer, digest = header
    try:
        tokens = map_tokens(path, item, n)
    except OSError:  # (a file system that cannot map: read instead)
        tokens = np.fromfile(path, dtype=f"<u{item}", offset=HEADER)
    whole = checksum(tokens) == digest
    return [f"file      {path}",
            "kind      token cache (HSLMTOK2): a text's tokens, as a run cached them",
            f"tokens    {n:,} of {item} bytes",
            f"data      text sha256 {text.hex()[:16]}...",
            f"tokenizer {tokenizer.hex()[:16]}...",
            "checksum  " + ("ok" if whole else "MISMATCH: damaged; a run tokenizes its text "
                                               "again")]


def describe(path):
    ck = ckpt.read(path)
    cfg = ck.config
    lines = [
        f"file      {path}",
        f"kind      {ck.kind} (format {ck.meta['format']} v{ck.meta['format_version']})",
        f"step      {ck.step}",
        f"config    {cfg.to_json()}",
        f"params    {cfg.n_params:,}",
        f"checksum  ok (header sha256 {ck.meta['header_sha256']}, data sha256 "
        f"{ck.data_sha256})",
    ]
    # (a consistent file can hold them: its checksums are of its bytes, whatever they are):
    # what eval, sample and a resume refuse, said before the shares
    found = ck.non_finite()
    if found is not None:
        lines.append(f"values    {found}: eval, sample and --resume refuse this file")
    if ck.kind == "params":
        tok = ck.tokenizer()
        lines.append(f"tokenizer {tok.identity[:16]}... ({len(tok.merges)} merges, carried "
                     "in this file)")
        lines.append("ternary   share of -1 / 0 / +1, scale alpha")
        for name, shape, kind in cfg.tensors():
            if kind != "ternary":
                continue
            W = ck.tensor(name)
            a = ternary_scale(W)
            neg = np.count_nonzero(W < -a / 2) / W.size
            pos = np.count_nonzero(W > a / 2) / W.size
            scale = f"{a:.6f}" if abs(a) < 1e6 else f"{a:.6e}"  # (a crafted file's 1e300)
            lines.append(f"  {name:16s} {neg:6.1%} {1 - neg - pos:6.1%} {pos:6.1%}  "
                         f"alpha {scale}")
    else:
        hyper = json.loads(ck.meta["hyper"])  # checked when the file was read
        lines += [
            f"hyper     {json.dumps(hyper, sort_keys=True)}",
            # (the one free text of a checkpoint's: a crafted one's control characters, a
            # terminal's escapes or lines of its own, printed as escapes)
            f"data      {one_line(str(ck.meta.get('data_source')))} (text sha256 "
            f"{ck.meta.get('text_sha256', '')[:16]}...)",
            f"tokenizer {ck.meta.get('tokenizer', '')[:16]}...",
            f"weights   {ck.meta.get('params_sha256', '')[:16]}... (the .bin this state belongs to)",
        ]
    return lines
