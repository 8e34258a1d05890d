"""A model (not a measurement) of `mpiexec -n P hslm train` on P nodes of 16 cores.

    python tools/mpi_model.py [--core-tok-s 3440] [--adam-ms 3.9] [--requantise-ms 1.5]

The defaults are one core of a 2-core AMD Zen 4 (2026-12-05, as built: hslm bench's
docs/bench/zen4.json, batch 8 one thread; AdamW alone and requantising alone, each
over hslm-3's arrays after 256 MB of other writes).

Per step, each node runs w = ceil(B / P) windows of 27 tokens at the measured one-core
rate: the windows phase (about half of it) on min(16, w) cores, the weight gradients
on 16 (linear in cores: optimistic), its 1/P of the AdamW step and the whole
model's requantising (every node requantises the tensors the other nodes updated
too); both measured on one core and memory-bound, so taken at 4 cores' worth of
bandwidth. The node's 16 cores may be 16 threads of one rank or 16 ranks sharing
the node's memory: the same work. Communication over one link per node, whichever
reduction moves less (hslm/distributed.py chooses the same way):
* running sums: 8n bytes through the pipeline (pipelined in 1 MB chunks: a fill of
  (P - 1) chunks), the last node's 8n (P - 1) / P finished pieces to their owners;
* records: each node receives (B - B/P) windows' records (2.78 MB each for hslm-3);
then the parameters' allgather, 8n (P - 1) / P per node. n = 2,130,138 (hslm-3).
"""
import argparse
import math

N_PARAMS = 2_130_138
RECORD_BYTES = 2.78e6          # what the weight gradients read of one window (hslm-3)
CHUNK = 1 << 20                # bytes per message of the pipeline
LATENCY = 20e-6                # seconds per message


def step_seconds(B, P, link_gbit, core_tok_s, adam_s, requantise_s):
    link = link_gbit * 1e9 / 8
    w = math.ceil(B / P)
    one_core = w * 27 / core_tok_s
    compute = 0.5 * one_core / min(16, w) + 0.5 * one_core / 16 + (adam_s / P + requantise_s) / 4
    if P == 1:
        return compute
    g = 8 * N_PARAMS
    sums = g / link + (P - 1) * (CHUNK / link + LATENCY) + g * (P - 1) / P / link
    records = (B - B // P) * RECORD_BYTES / link + (P - 1) * LATENCY
    params = g * (P - 1) / P / link + (P - 1) * LATENCY
    return compute + min(sums, records) + params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--core-tok-s", type=float, default=3440.0)
    ap.add_argument("--adam-ms", type=float, default=3.9)
    ap.add_argument("--requantise-ms", type=float, default=1.5)
    a = ap.parse_args()

    def tok_s(B, P, gbit):
        return B * 27 / step_seconds(B, P, gbit, a.core_tok_s, a.adam_ms / 1e3,
                                     a.requantise_ms / 1e3)

    nodes = (1, 4, 16, 64)
    print("| batch | link | " + " | ".join(f"{p} node{'s' if p > 1 else ''}" for p in nodes)
          + " |")
    print("|---|---|" + "---|" * len(nodes))
    for B in (8, 64, 512):
        for gbit in (10, 100):
            row = [tok_s(B, p, gbit) for p in nodes]
            print(f"| {B} | {gbit} Gb/s | " + " | ".join(f"{t / 1e3:.1f}k" for t in row) + " |")
    for gbit in (10, 100):
        b = next((B for B in range(1, 4096) if tok_s(B, 4, gbit) > tok_s(B, 1, gbit)), None)
        print(f"4 nodes beat one over {gbit} Gb/s " + ("at every batch" if b == 1 else f"from batch {b}"))


if __name__ == "__main__":
    main()
