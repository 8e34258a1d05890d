"""What else the machine ran while hslm bench timed: the other processes' CPU time and
the hypervisor's steal, as shares of all the CPUs' time over the bench.

A shared machine's figures move 5-20% from one run to the next (docs/performance-
history.md), and a figure from a busy spell reads low. Which spells were quiet had
been judged from the measured peak and the step's length; this says it from the
kernel's own accounting. Linux's /proc/stat counts every CPU's busy, idle and steal
time since boot (in clock ticks, USER_HZ); the bench's own CPU time (os.times, every
thread, and the children it has waited for) is taken from the busy part, and what is
left ran beside it. Steal is the time the hypervisor gave this machine's virtual CPUs
to another guest while they had work. Neither sees a neighbour on the same physical
core's other hardware thread, nor one sharing the caches or memory: so a quiet reading
is needed for a quiet spell, not enough for one.
"""
from __future__ import annotations

import os
import time

PROC_STAT = "/proc/stat"


def parse_cpu_line(text: str):
    """(busy, steal) clock ticks of all CPUs from /proc/stat's text, or None. The first
    line: cpu user nice system idle iowait irq softirq steal [guest guest_nice]; guest
    time is counted in user already."""
    first = text.split("\n", 1)[0].split()
    if len(first) < 9 or first[0] != "cpu" or not all(x.isdigit() for x in first[1:9]):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
    return user + nice + system + irq + softirq, steal


def snapshot():
    """The machine's counters now: a dict, or None where /proc/stat cannot be read (not
    Linux)."""
    try:
        with open(PROC_STAT) as f:
            ticks = parse_cpu_line(f.read())
    except OSError:
        return None
    if ticks is None:
        return None
    t = os.times()
    return {"wall": time.monotonic(), "busy": ticks[0], "steal": ticks[1],
            "ours_s": t.user + t.system + t.children_user + t.children_system}


def load_between(before, after, cpus=None, hz=None):
    """What ran beside us from snapshot `before` to `after`: {"cpus", "wall_s",
    "others", "steal"}, the last two shares of the CPUs' time over the interval; None
    where either snapshot is missing or no time passed."""
    if before is None or after is None:
        return None
    wall = after["wall"] - before["wall"]
    cpus = cpus or os.cpu_count() or 1
    hz = hz or os.sysconf("SC_CLK_TCK")
    if wall <= 0:
        return None
    capacity = wall * cpus
    busy = (after["busy"] - before["busy"]) / hz
    ours = after["ours_s"] - before["ours_s"]
    steal = (after["steal"] - before["steal"]) / hz
    # ticks are sampled, our time is not: a small negative remainder is rounding
    return {"cpus": cpus, "wall_s": wall, "others": min(max(busy - ours, 0.0) / capacity, 1.0),
            "steal": min(max(steal, 0.0) / capacity, 1.0)}


def describe(load) -> str:
    """One phrase for a report's line: 'other processes 0.4% and the hypervisor's steal
    0.0% of the 2 CPUs' time'."""
    cpus = "the CPU's" if load["cpus"] == 1 else f"the {load['cpus']} CPUs'"
    return (f"other processes {100 * load['others']:.1f}% and the hypervisor's steal "
            f"{100 * load['steal']:.1f}% of {cpus} time")
