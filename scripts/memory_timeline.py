"""Run a command and sample its process tree's resident memory (anonymous and file-mapped apart) every half second:
the timeline goes to a file, the peak to stderr. `/usr/bin/time -v` gives the peak alone and counts a mapped
checkpoint's pages as resident; this says which stage or phase the peak falls in.

    python scripts/memory_timeline.py run.mem -- pipeline run --config configs/qwen-coder.yaml
"""
from __future__ import annotations

import os
import subprocess
import sys
import time


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    found = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in open(f"/proc/{pid}/task/{task}/children").read().split():
                found += tree(int(child))
    except OSError:
        pass  # gone meanwhile
    return found


def resident_kib(pids: list[int]) -> tuple[int, int]:
    """(resident, anonymous) KiB over the processes."""
    rss = anon = 0
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Anonymous:"):
                    anon += int(line.split()[1])
        except OSError:
            pass
    return rss, anon


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit("usage: memory_timeline.py TIMELINE_FILE -- COMMAND...")
    proc = subprocess.Popen(sys.argv[3:])
    start, peak = time.time(), (0, 0, 0.0)
    with open(sys.argv[1], "w") as out:
        while proc.poll() is None:
            rss, anon = resident_kib(tree(proc.pid))
            t = time.time() - start
            peak = max(peak, (rss, anon, t))
            out.write(f"{t:.1f} s  rss {rss / 2**20:.2f} GB  anonymous {anon / 2**20:.2f}  file {(rss - anon) / 2**20:.2f}\n")
            out.flush()
            time.sleep(0.5)
    rss, anon, t = peak
    print(f"peak resident {rss / 2**20:.2f} GB (anonymous {anon / 2**20:.2f}, file-mapped {(rss - anon) / 2**20:.2f}) "
          f"at {t:.0f} s; exit status {proc.returncode}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
