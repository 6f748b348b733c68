"""Peak memory (tracemalloc), timing, read bandwidth and the machine's memory, for the scripts and the memory
tests.

NumPy reports its array buffers to tracemalloc, so the traced peak of a call is the most memory its
NumPy arrays held at once, above what was already allocated when the call began. memory_total and
memory_available are the memory guard's own probes (the guard refuses a call past them), for a script that
refuses a run before it starts.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from . import _guard
from ._parallel import cpu_fields

__all__ = [
    "alternating_medians_ms",
    "cpu_model",
    "machine_info",
    "median_ms",
    "memory_available",
    "memory_total",
    "read_bandwidth",
    "read_once",
    "time_calls",
    "traced_peak",
]

R = TypeVar("R")


def traced_peak(fn: Callable[..., R], *args: Any, **kwargs: Any) -> tuple[R, int]:
    """Run fn(*args, **kwargs) under tracemalloc; return (its result, peak bytes above the start).

    The result stays alive when the peak is read, so it counts: the peak includes the output array.
    """
    already_tracing = tracemalloc.is_tracing()
    if not already_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        result = fn(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not already_tracing:
            tracemalloc.stop()
    return result, peak - start


def time_calls(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds taken by each of `repeats` calls of fn(), after `warmup` untimed calls."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more; got {warmup}")
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return seconds


def median_ms(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in milliseconds."""
    return 1e3 * statistics.median(time_calls(fn, repeats, warmup))


def alternating_medians_ms(
    fns: list[Callable[[], object]], repeats: int, rounds: int, idle: float = 0.0, warmup: int = 2
) -> list[float]:
    """The median wall time in ms of each fn over `rounds` turns of `repeats` calls, the fns taking turns (fn 0,
    fn 1, ..., fn 0, fn 1, ...), each turn after `idle` seconds of sleep and `warmup` untimed calls. A machine
    whose speed drifts during the run (another tenant's load) slows every fn alike, so their ratio holds where
    one fn timed after the other would not."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1; got {rounds}")
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, seconds in zip(fns, samples, strict=True):
            time.sleep(idle)
            seconds += time_calls(fn, repeats, warmup)
    return [1e3 * statistics.median(seconds) for seconds in samples]


def read_once(arrays: list[np.ndarray], threads: int) -> None:
    """Every byte of the two arrays read once (NumPy sums), on one thread, or on two with one array each (a sum
    releases the interpreter lock, so the two threads read at once): the floor of a step bound by reading them."""
    second = threading.Thread(target=arrays[1].sum)
    if threads == 1:
        second.run()  # Thread.run: the same call, on this thread
    else:
        second.start()
    arrays[0].sum()
    if threads == 2:
        second.join()


def read_bandwidth(n_bytes: int = 2**30, repeats: int = 5) -> float:
    """GB/s (decimal) of reading n_bytes from memory once, two halves on two threads (read_once): the machine's
    read bandwidth now, with n_bytes far past its caches."""
    halves = [np.ones(n_bytes // 8, np.float32) for _ in range(2)]  # n_bytes / 2 each
    return n_bytes / median_ms(lambda: read_once(halves, threads=2), repeats) / 1e6


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo on Linux with its family and model numbers, else what platform
    reports: 'AMD EPYC (family 25, model 17)'. The numbers tell apart what a cloud machine's name does not (an
    "AMD EPYC" may be a Zen 4, whose AVX-512 runs at the AVX2 rate, or a Zen 5, where it runs at twice it)."""
    fields = cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if fields.get("cpu family") and fields.get("model"):
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def machine_info() -> dict[str, Any]:
    """What a benchmark figure depends on: CPU, cores, Python, NumPy and its BLAS with its threads."""
    from threadpoolctl import threadpool_info

    blas = [
        {key: pool.get(key) for key in ("internal_api", "version", "num_threads", "architecture")}
        for pool in threadpool_info()
        if pool.get("user_api") == "blas"
    ]
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas,
    }


def memory_total() -> int:
    """The machine's physical memory in bytes (2 GiB where the operating system does not say)."""
    return _guard.memory_total()


def memory_available() -> int:
    """Bytes a new allocation can take now without swapping: Linux's MemAvailable (free memory plus the page
    cache the kernel can drop), else the free pages, else 2 GiB."""
    return _guard.memory_available()
