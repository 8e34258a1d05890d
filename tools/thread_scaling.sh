#!/bin/bash
# The threads table on a machine of many cores, in one go (issue 12, item 3):
#   bash tools/thread_scaling.sh [OUT_DIR] [THREADS]     (defaults: thread-scaling, 1,2,4,8,16)
# Writes OUT_DIR/machine.txt (lscpu, versions, memory), OUT_DIR/train.txt (the default run on
# the most threads, with its ckpt_10.bin sha256: 72db9af5... on every machine) and
# OUT_DIR/bench.{txt,json} (speed 3 on each thread count at batches 8, 1, 16 and 64, with
# PyTorch's one-thread baseline and the profile at batch 8, the first). Run from the
# repository root; needs about 2 GB of memory and, on a 16-core machine, 2-4 minutes with
# empty kernel caches. (Prepared for the lent 16-core machine, which none of these sessions
# could start yet.)
set -u -o pipefail
out=${1:-thread-scaling}
threads=${2:-1,2,4,8,16}
most=$(tr , '\n' <<< "$threads" | sort -n | tail -1)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
{ date -u; nproc; lscpu; free -g
  $py -c "import os, sys, numba, numpy; print(len(os.sched_getaffinity(0)), 'cores usable;',
sys.version.split()[0], 'numba', numba.__version__, 'numpy', numpy.__version__)"
} > "$out/machine.txt" 2>&1
grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L2|L3|cores usable" "$out/machine.txt"
run=$(mktemp -d)
t0=$(date +%s)
$py -m hslm train --speed 3 --steps 10 --seed 1729 --threads "$most" --out "$run" 2>&1 \
    | tail -4 > "$out/train.txt"
sha256sum "$run/ckpt_10.bin" >> "$out/train.txt"
rm -rf "$run"
echo "train ($(( $(date +%s) - t0 )) s):"; cat "$out/train.txt"
$py -m hslm bench --speed 3 --threads "$threads" --batch 8,1,16,64 --steps 6 \
    --json "$out/bench.json" > "$out/bench.txt" 2>&1
echo "bench exit $? ($(( $(date +%s) - t0 )) s):"
grep -v -E "^  (round|set up|ran) " "$out/bench.txt"
