"""Two settings of the whole process that make a training step faster, set where train.py and train_speed.py
start as programs (their __main__), before NumPy loads, and never in main(), which a test or a notebook may
call in its own process. Why each, in short (measured: docs/results/gpt.md):

OpenBLAS's idle threads. After a matmul on several threads, OpenBLAS's helper threads wait for the next one by
spinning, for 2^26 or 2^28 processor cycles as it was built (tens of milliseconds), and only then sleep. A
training step runs its large matmuls through BLAS on every core and its attention through our own worker
threads on every core (BLAS held to one thread meanwhile: tinyattn_np/_parallel.py); a helper still spinning
from the matmul before takes a core from a worker. OPENBLAS_THREAD_TIMEOUT=18 has the helpers sleep after 2^18
cycles (about 0.1 ms): long enough to catch the next matmul of a run of them, short enough to give the workers
their cores (4, the least, costs a wake-up at every call). OpenBLAS reads it once, when NumPy loads it. A
value the user set is kept.

glibc's freed memory. A step frees and makes the same large arrays every step, and an array made in memory
that malloc handed back to the system faults its pages in again one by one, in the system's time. mallopt
keeps the memory of freed arrays for the next ones, up to 1 GiB; the process keeps its peak memory in exchange.

    python scripts/train_speed.py --torch   # its "OpenBLAS:" and "malloc:" lines say which settings it ran under
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

VARIABLE = "OPENBLAS_THREAD_TIMEOUT"
SPIN_CYCLES_LOG2 = 18  # the helpers sleep after 2^18 cycles without work
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h: mallopt's two settings that keep memory
freed_memory_kept = False  # whether keep_freed_memory() took in this process


def speed_up() -> None:
    """Both settings, for a program that starts: its first lines, before NumPy is imported."""
    shorten_spin()
    keep_freed_memory()


def shorten_spin() -> bool:
    """Set OPENBLAS_THREAD_TIMEOUT for this process and its children, unless the user set it or NumPy (and so
    OpenBLAS) is loaded already, which would make it a setting without effect. Returns whether it was set."""
    if VARIABLE in os.environ or "numpy" in sys.modules:
        return False
    os.environ[VARIABLE] = str(SPIN_CYCLES_LOG2)
    return True


def describe() -> str:
    """One line: the idle-thread timeout this process's OpenBLAS started with (it reads the variable once)."""
    value = os.environ.get(VARIABLE)
    if value is None:
        return "OpenBLAS: idle threads spin as built (2^26 or 2^28 cycles) before they sleep"
    return f"OpenBLAS: idle threads sleep after 2^{value} cycles without work ({VARIABLE}={value})"


def keep_freed_memory() -> bool:
    """Ask glibc's malloc (mallopt) to keep the memory of freed arrays for the next ones, up to 1 GiB, instead
    of handing it back to the system. Returns whether it took: False where the C library is not glibc."""
    global freed_memory_kept
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or one without mallopt
        return False
    freed_memory_kept = bool(mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    return freed_memory_kept
