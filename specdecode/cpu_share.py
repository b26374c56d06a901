"""How busy other processes keep this process's CPUs, from /proc: the calibration keeps no costs timed on a busy
machine (speculative/adaptive), and the huge-page mover leaves a co-hosted server's requests alone
(models/huge_pages.py)."""
from __future__ import annotations

import os


def cpu_times() -> tuple[int, int, int] | None:
    """(busy ticks of the CPUs this process may run on, all their ticks, this process's own ticks), from
    /proc; None where /proc is not there."""
    try:
        cpus = os.sched_getaffinity(0)
        busy = total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return busy, total, int(own[11]) + int(own[12])  # utime, stime
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def other_cpu_share(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """The share of this process's CPUs that other processes (or a hypervisor's steal) used between two
    cpu_times() readings: 0 on a quiet machine, 0.5 when another busy process holds one of two cores."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return max(0.0, min(1.0, others / (after[1] - before[1])))
