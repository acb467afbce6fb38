"""What the machine did while a benchmark side ran: the hypervisor's steal share and the run's own CPU.

A benchmark on a shared VM can be slowed by a neighbour: the kernel counts the time the hypervisor
gave this VM's virtual CPUs to someone else as `steal` (/proc/stat, the 8th field of the `cpu`
line). A run that is slow with a high steal share was the machine's; a run that is slow with no
steal and more CPU of its own was the program's (docs/performance.md, "Colocated sync's slow runs").

    before = machine_load.snapshot()
    ... run the side (a child process) ...
    load = machine_load.since(before)   # {"wall_s", "steal_share", "cpu_s", "sys_s"}
"""
from __future__ import annotations

import os
import resource
import time

PROC_STAT = "/proc/stat"


def read_cpu_ticks(path: str = PROC_STAT) -> tuple[int, int] | None:
    """(steal, all) ticks of the aggregate `cpu` line, or None where there is no such file (not Linux)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            if line.startswith("cpu "):
                # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
                # already inside user / nice, so it is left out of the total
                ticks = [int(x) for x in line.split()[1:9]]
                ticks += [0] * (8 - len(ticks))
                return ticks[7], sum(ticks)
    return None


def snapshot(stat_path: str = PROC_STAT) -> dict:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"t": time.perf_counter(), "ticks": read_cpu_ticks(stat_path), "utime": ru.ru_utime, "stime": ru.ru_stime}


def since(before: dict, stat_path: str = PROC_STAT) -> dict:
    """The machine's load between `before` and now: wall seconds, steal's share of all CPU ticks
    (None off Linux), and the CPU seconds (user + sys, and sys alone) of the child processes that
    ended and were waited for in between."""
    now = snapshot(stat_path)
    steal_share = None
    if before["ticks"] and now["ticks"]:
        d_steal, d_all = now["ticks"][0] - before["ticks"][0], now["ticks"][1] - before["ticks"][1]
        steal_share = d_steal / d_all if d_all > 0 else 0.0
    sys_s = now["stime"] - before["stime"]
    return {"wall_s": now["t"] - before["t"], "steal_share": steal_share,
            "cpu_s": now["utime"] - before["utime"] + sys_s, "sys_s": sys_s}


def describe(load: dict) -> str:
    steal = "steal n/a" if load["steal_share"] is None else f"steal {load['steal_share']:.1%}"
    return (f"{steal}, cpu {load['cpu_s']:.1f} s (sys {load['sys_s']:.1f}) over {load['wall_s']:.1f} s "
            f"wall ({load['cpu_s'] / max(load['wall_s'], 1e-9):.2f} cores)")
