"""Plot how cost grows with model size, from `hslm bench --model A,B,... --json FILE`.

    python tools/plot_bench_sizes.py sizes.json docs/model_sizes.png

Left: time per token against parameters, with the two-term fit of the README
(seconds per token = a * P / (B L) + b * FLOPs per token: the work every step does
on every parameter, plus the matrices). Right: each size's share of the core's
f64 FMA peak. Needs matplotlib (pip install matplotlib).
"""
from __future__ import annotations

import json
import sys

import numpy as np


def main(src: str, dst: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.load(open(src))
    rows = []
    for m in report["models"]:
        # the figure is of speed 3 on one thread: that row, whatever else the bench ran
        r = next((x for x in m["rows"] if x["speed"] == 3 and x["threads"] == 1), None)
        if r is None:
            sys.exit(f"{src}: {m['model']} has no speed-3 one-thread row (run hslm bench "
                     "--speed 3 --threads 1)")
        name = m["model"].rsplit("/", 1)[-1].removesuffix(".json")
        rows.append((name, m["params"], r["batch"] * m["window"], m["flops_per_token"],
                     1e6 / r["tok_s"], 100 * r["peak_share"]))
    P = np.array([x[1] for x in rows], float)
    X = np.stack([P / np.array([x[2] for x in rows]), np.array([x[3] for x in rows])], 1)
    us = np.array([x[4] for x in rows])
    coef, *_ = np.linalg.lstsq(X, us, rcond=None)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.scatter(P, us, label="measured")
    a.scatter(P, X @ coef, marker="x", label=f"fit: {1e3 * coef[0]:.1f} ns x P/(B L) + "
                                              f"{1e6 * coef[1]:.1f} ps x FLOPs/token")
    b.bar(range(len(rows)), [x[5] for x in rows])
    ref = next((x[5] for x in rows if x[0] == "hslm-3"), None)
    if ref is not None:
        b.axhline(0.8 * ref, ls="--", color="gray", label="80% of hslm-3's share")
        b.legend(fontsize=8)
    b.set_xticks(range(len(rows)), [x[0] for x in rows], rotation=45, ha="right")
    for name, p, _, _, t, _ in rows:
        a.annotate(name, (p, t), textcoords="offset points", xytext=(4, 3), fontsize=8)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("parameters")
    a.set_ylabel("microseconds per token (speed 3, one thread)")
    a.legend(fontsize=8)
    b.set_ylabel("% of the f64 FMA peak")
    fig.suptitle(f"hslm bench, batch 8: {report['machine'].split(':')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        sys.exit("usage: python tools/plot_bench_sizes.py REPORT.json OUT.png")
    main(*sys.argv[1:3])
