"""How long OpenBLAS's idle threads spin before they sleep, set for the training scripts.

After a matmul that ran on several threads, OpenBLAS's helper threads wait for the next one by spinning, for
2^26 or 2^28 processor cycles as it was built (tens of milliseconds), and only then sleep. A training step
runs its large matmuls through BLAS on every core and its attention through our own worker threads on every
core (BLAS held to one thread meanwhile: tinyattn_np/_parallel.py); a helper still spinning from the matmul
before takes a core from a worker, and the attention runs at the speed of fewer cores.

OPENBLAS_THREAD_TIMEOUT=18 has the helpers sleep after 2^18 cycles (about 0.1 ms): long enough to catch the
next matmul of a run of them, short enough to give the workers their cores. (4, the least, costs a wake-up
at every call.) OpenBLAS reads the setting once, when NumPy loads it, so shorten_spin() must run before
NumPy is imported: the training scripts call it at the top of their file, and only when they run as programs
(their __main__), as with the malloc setting (training.keep_freed_memory). A value the user set is kept.

    python scripts/train_speed.py --torch   # its "OpenBLAS:" line says which timeout its steps ran under
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OPENBLAS_THREAD_TIMEOUT"
SPIN_CYCLES_LOG2 = 18  # the helpers sleep after 2^18 cycles without work


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
