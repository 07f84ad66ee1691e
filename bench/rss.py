"""Peak-RSS sampling for the benchmarks' measuring child processes.

A child (a fresh ``python -c`` process, so nothing measured earlier is resident) imports
this after its warm-up; it imports only psutil and the standard library, so it changes
nothing about the allocator the child chose before importing pyarrow.
"""

from __future__ import annotations

import threading
import time

import psutil


class RssPeak:
    """Samples this process's RSS every 5 ms from ``start()`` until ``stop()``.

    ``baseline`` is the RSS when it started; ``peak`` the largest sample (at least the
    baseline). ``vm_hwm()`` is the kernel's own high-water mark, which catches a peak
    between two samples.
    """

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.baseline = self._proc.memory_info().rss
        self.peak = self.baseline
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def start(self) -> RssPeak:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def vm_hwm() -> int:
    """This process's VmHWM in bytes (``ru_maxrss`` would include the parent's, inherited
    across fork+exec on Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
