"""A benchmark process's own memory: peak RSS (``ru_maxrss``), sampled peak ``RssAnon``, and
``/proc/self/status`` now. ``ru_maxrss`` also counts the clean file pages a process maps (memory-
mapped shards, indexes, LMDB), which the kernel can drop; ``RssAnon`` is what the process holds."""
from __future__ import annotations

import resource
import threading


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def status() -> dict:
    """This process's memory now (VmRSS, RssAnon: its own; RssFile: mapped file pages) in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(line.split()[1]) / 1024
    return out


class RssSampler:
    """Peak anonymous RSS (RssAnon, sampled every 0.1 s): ``ru_maxrss`` also counts the clean
    file pages a process maps (the memory-mapped shards and index), which the kernel can drop."""

    def __init__(self) -> None:
        self.peak = 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def now(self) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.peak = max(self.peak, self.now())

    def done(self) -> float:
        self.stop.set()
        self.t.join()
        return max(self.peak, self.now()) / 2 ** 20
