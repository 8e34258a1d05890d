"""The README's bench figures, regenerated from the reports kept in docs/bench/.

    python tools/bench_readme.py           # rewrite README.md's generated blocks
    python tools/bench_readme.py --check   # exit 1, naming each block, if README.md differs

Exit 2, with one line, on a malformed block or a report that cannot make its block
(README.md is then left as it is).

A generated block lies between a line `<!-- bench KIND FILE ... -->` and the next
`<!-- /bench -->`; KIND says how it is made from the reports (`hslm bench --json`) named
after it, relative to the repository root:

  report FILE           the lines `hslm bench` printed for that run (hslm.bench_report)
  batch AVX512 AVX2     tok/s and share of peak against the batch, both builds side by side
                        (refused unless every batch ended with the same checkpoint bytes in both)
  sizes FILE            tok/s, share of peak and memory of each model of a sizes run

So every figure in those blocks is a report's, and tests/test_usability.py checks that
each block says what its reports say (figures quoted in the prose around them are not
checked). Reading reports needs no kernels and no torch.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hslm.bench_report import format_report, load_report  # noqa: E402
from hslm.checkpoint import write_atomic  # noqa: E402
from hslm.errors import HslmError, one_line  # noqa: E402

BLOCK = re.compile(r"^<!-- bench (?P<args>[^>]*?) -->\n(?P<body>.*?)^<!-- /bench -->$",
                   re.M | re.S)


def _stamp(report) -> str:
    """"hslm 0.2.0 (f09b25d860a7), 2026-12-01 18:54:51 UTC"."""
    version = f"hslm {report['hslm']}" + (f" ({report['commit']})" if report.get("commit") else "")
    return f"{version}, {report.get('date', 'undated')}"


def _machine(report) -> str:
    return report["machine"].split(",")[0]


def _row(entry, speed=3, threads=1):
    """The model's row for speed 3 on one thread (the figures these tables are of)."""
    row = next((r for r in entry["rows"] if r["speed"] == speed and r["threads"] == threads),
               None)
    if row is None:
        raise ValueError(f"{entry['model']}: no speed-{speed} {threads}-thread row")
    return row


def _label(model: str) -> str:
    """A preset's name, or a JSON config's file name with its dashes as spaces
    (docs/bench/models/width-81.json: "width 81")."""
    if not model.endswith(".json"):
        return model
    return model.rsplit("/", 1)[-1].removesuffix(".json").replace("-", " ")


def report_block(path) -> list:
    return ["```", *format_report(load_report(ROOT / path)), "```"]


def batch_block(path_wide, path_avx2) -> list:
    """Both builds' rows by batch (speed 3, one thread), each % of its own build's
    measured FMA peak; every batch's checkpoint the same bytes in both."""
    wide, avx2 = load_report(ROOT / path_wide), load_report(ROOT / path_avx2)
    if (wide["vector_lanes"], avx2["vector_lanes"]) != (8, 4):
        raise ValueError(f"{path_wide} must be an AVX-512 build's report (8-wide) and "
                         f"{path_avx2} an AVX2 build's (4-wide)")
    ew, ea = wide["models"][0], avx2["models"][0]
    rows_w, rows_a = ({r["batch"]: r for r in e["rows"] if r["speed"] == 3 and r["threads"] == 1}
                      for e in (ew, ea))
    if not rows_w or set(rows_w) != set(rows_a):
        raise ValueError(f"{path_wide} and {path_avx2} must hold speed-3 one-thread rows of "
                         f"the same batches (they hold {sorted(rows_w)} and {sorted(rows_a)})")
    digests = []
    for g in ew["groups"]:
        other = next((x for x in ea["groups"] if x["batch"] == g["batch"]), None)
        if other is None or other["digest"] != g["digest"] or not (g["identical"]
                                                                   and other["identical"]):
            raise ValueError(f"batch {g['batch']}: the builds' checkpoints differ "
                             f"({path_wide}, {path_avx2})")
        digests.append(f"`{g['digest'][:8]}...`")
    out = [f"{ew['model']}, speed 3, one thread, `--steps {wide['steps']}`; "
           f"{_machine(wide)} built for its own vectors ({wide['vector_lanes']}-wide, "
           f"measured FMA peak {wide['peak_gflops_per_core']:.1f} GFLOP/s: {_stamp(wide)}) and "
           f"for AVX2 ({avx2['vector_lanes']}-wide, {avx2['peak_gflops_per_core']:.1f} GFLOP/s: "
           f"{_stamp(avx2)}); each % is of its own build's peak. Every batch's checkpoint "
           f"sha256 is the same in both builds ({', '.join(digests)}).",
           "",
           "| batch | AVX-512 build: tok/s | % of its peak | traced memory "
           "| AVX2 build: tok/s | % of its peak |",
           "|---|---|---|---|---|---|"]
    for batch in sorted(rows_w):
        rw, ra = rows_w[batch], rows_a[batch]
        out.append(f"| {rw['batch']} | {rw['tok_s']:,.0f} | {100 * rw['peak_share']:.1f}% | "
                   f"{rw['memory_bytes'] / 2 ** 20:.0f} MiB | {ra['tok_s']:,.0f} | "
                   f"{100 * ra['peak_share']:.1f}% |")
    return out


def sizes_block(path) -> list:
    """Each model's speed-3 one-thread row; "share vs hslm-3" is its % of peak over
    hslm-3's."""
    report = load_report(ROOT / path)
    ref = next((e for e in report["models"] if e["model"] == "hslm-3"), None)
    ref_share = _row(ref)["peak_share"] if ref else None
    r0 = _row(report["models"][0])
    if any(_row(e)["batch"] != r0["batch"] or e["k"] != e["window"] for e in report["models"]):
        raise ValueError(f"{path}: the caption says one batch and k = window for every model")
    out = [f"Batch {r0['batch']}, k = window, `--steps {report['steps']}`; {_machine(report)}, "
           f"{report['vector_lanes']}-wide vectors, measured FMA peak "
           f"{report['peak_gflops_per_core']:.1f} GFLOP/s; {_stamp(report)}.",
           "",
           "| model | parameters | tok/s | GFLOP/s | % of peak | share vs hslm-3 "
           "| traced memory | checkpoint (.bin + .state) |",
           "|---|---|---|---|---|---|---|---|"]
    for e in report["models"]:
        r = _row(e)
        share = f"{r['peak_share'] / ref_share:.2f}" if ref_share else "-"
        out.append(f"| {_label(e['model'])} | {e['params']:,} | {r['tok_s']:,.0f} | "
                   f"{r['gflops']:.1f} | {100 * r['peak_share']:.1f}% | {share} | "
                   f"{r['memory_bytes'] / 2 ** 20:.0f} MiB | "
                   f"{r['checkpoint_bytes'] / 1e6:.0f} MB |")
    return out


KINDS = {"report": (report_block, 1), "batch": (batch_block, 2), "sizes": (sizes_block, 1)}


def generate(text: str):
    """(new text, names of the blocks that changed): every block made again. A marker
    that opens or closes no block of its own (a closing marker left out, a mistyped
    opening) is an error, never a block that swallows the text up to the next one's end."""
    changed = []
    opening = len(re.findall(r"^<!-- ?bench\b", text, re.M))
    closing = len(re.findall(r"^<!-- ?/bench\b", text, re.M))
    blocks = list(BLOCK.finditer(text))
    if not opening == closing == len(blocks) or any(
            "<!-- bench" in m.group("body") for m in blocks):
        raise ValueError(f"README.md: {opening} opening and {closing} closing bench markers "
                         f"make {len(blocks)} blocks: each '<!-- bench KIND FILE ... -->' line "
                         "needs its own '<!-- /bench -->' line")

    def make(m):
        args = m.group("args").split()
        kind = KINDS.get(args[0]) if args else None
        if kind is None or len(args) - 1 != kind[1]:
            raise ValueError(f"bad block '<!-- bench {m.group('args')} -->' (kinds: "
                             + ", ".join(f"{k} with {n} file(s)" for k, (_, n) in KINDS.items())
                             + ")")
        body = "\n".join(kind[0](*args[1:])) + "\n"
        if body != m.group("body"):
            changed.append(m.group("args"))
        return f"<!-- bench {m.group('args')} -->\n{body}<!-- /bench -->"

    return BLOCK.sub(make, text), changed


def main(argv) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    readme = ROOT / "README.md"
    try:
        try:
            text = readme.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise HslmError(f"{readme} is not UTF-8 ({e.reason} at byte {e.start})") from None
        new, changed = generate(text)
        new.encode("utf-8")  # (a report's name that is not UTF-8: refused, not half-written)
    # a field of the wrong shape (a tok/s of 0: ArithmeticError; a part that is no pair:
    # AttributeError), said in one line and 2: 1 is --check's "the README differs"
    except (HslmError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            ArithmeticError) as e:
        said = str(e) if isinstance(e, HslmError) else f"{type(e).__name__}: {e}"
        print(f"error: {one_line(said)}".encode("utf-8", "backslashreplace").decode("utf-8"),
              file=sys.stderr)
        return 2
    if argv == ["--check"]:
        for name in changed:
            print(f"README.md: the block 'bench {name}' differs from its reports "
                  "(python tools/bench_readme.py rewrites it)")
        return 1 if changed else 0
    if changed:  # atomically: a failed write had left README.md empty
        write_atomic(readme, new.encode("utf-8"), what="README")
    print(f"README.md: {len(changed)} block(s) rewritten" if changed else "README.md: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
