"""The one worker engine: flash_attention, its backward and the split-KV decode run their work items
through run_items(), with BLAS held to one thread while they do (one_blas_thread()); the elementwise layers
(layers.py) run their lines on blocks of rows through by_row_blocks().

Why threads help at all in Python: NumPy releases the interpreter lock inside a matmul or a ufunc, so
while one worker multiplies a tile, another can multiply the next. BLAS is held to one thread meanwhile:
the workers are the parallelism, and a one-thread matmul sums in one fixed order, so the result is the
same bits for any number of workers.

The helper threads are started once and kept, in a pool: starting a thread costs about as much as a small
call's whole work (a layer norm of a few hundred rows), and a training step makes dozens of such calls.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ._atomic import holding

__all__ = [
    "Stopped",
    "blas_kernel_set",
    "by_row_blocks",
    "cpu_cores",
    "cpu_fields",
    "cpu_maker",
    "l2_cache_bytes",
    "nonfinite_quiet",
    "one_blas_thread",
    "run_items",
]

Item = TypeVar("Item")
_DONE = object()  # what next() gives when the items are used up

# Calls may overlap (threads) or nest, so the first one in sets the limit and the last one out restores
# what it found: a module lock and one state, (the calls inside, each by its token; the BLAS libraries with
# the thread counts they had), replaced by one assignment, so that an interrupt at any bytecode leaves
# either the state before or the state after (see _atomic.py). Leaving twice is harmless: the second finds
# its token gone, or redoes a restore that an interrupt cut short (setting a count again changes nothing).
_blas_lock = threading.RLock()
_blas_state: tuple[frozenset[object], tuple[tuple[Any, int], ...]] = (frozenset(), ())
_blas_controller: Any = None


def _enter_blas(token: object) -> None:
    """Count the call `token` in; the first one in records BLAS's thread counts, then sets them to 1."""
    global _blas_state, _blas_controller
    inside, originals = _blas_state
    if token in inside:
        return
    if inside:
        _blas_state = (inside | {token}, originals)
        return
    if _blas_controller is None:
        from threadpoolctl import ThreadpoolController

        _blas_controller = ThreadpoolController()
    libraries = _blas_controller.select(user_api="blas").lib_controllers
    _blas_state = (frozenset({token}), tuple((library, library.num_threads) for library in libraries))  # commit
    for library in libraries:  # an interrupt in here: the caller leaves, which restores the recorded counts
        library.set_num_threads(1)


def _leave_blas(token: object) -> None:
    """Count the call `token` out (nothing if it is not in); the last one out restores the recorded counts."""
    global _blas_state
    inside, originals = _blas_state
    if token not in inside:
        return
    if len(inside) > 1:
        _blas_state = (inside - {token}, originals)
        return
    for library, threads in originals:  # an interrupt in here: the caller leaves again and finishes it
        library.set_num_threads(threads)
    _blas_state = (frozenset(), ())


def _leave_blas_fully(token: object) -> None:
    """_leave_blas under the lock, and if an exception cuts it short, once more: the count and the restore
    are then done, whatever bytecode the exception was raised at."""
    try:
        holding(_blas_lock, _leave_blas, token)
    except BaseException:
        holding(_blas_lock, _leave_blas, token)
        raise


class one_blas_thread:  # noqa: N801 (named as the function it is used as: with one_blas_thread(): ...)
    """A context in which BLAS runs single-threaded (threadpoolctl), safe for overlapping and nested use.

    The limit is process-wide: a matmul in another thread of yours runs single-threaded meanwhile. An
    exception raised at any bytecode of entering or leaving (a Ctrl-C) leaves no lock held, and the limit
    restored once no call is inside: __enter__ leaves again if it cannot finish, __exit__ finishes a leave cut
    short, and where the caller's own bytecodes between its body and the call of __exit__ (or __exit__'s
    first) are interrupted, a `with` statement skips __exit__ and drops the context at once: a finalizer
    (weakref.finalize, detached by a whole __exit__) leaves then."""

    def __enter__(self) -> None:
        token = object()
        try:
            self._token = token
            self._left_when_dropped = weakref.finalize(self, _leave_blas_fully, token)
            holding(_blas_lock, _enter_blas, token)
            return None
        except BaseException:
            _leave_blas_fully(token)
            raise

    def __exit__(self, *exc: object) -> None:
        _leave_blas_fully(self._token)
        self._left_when_dropped.detach()


@functools.cache
def blas_kernel_set() -> str:
    """The kernels NumPy's BLAS runs, as OpenBLAS names them ("SkylakeX": AVX-512, "Haswell": AVX2, "Zen", ...;
    OPENBLAS_CORETYPE chooses them), through threadpoolctl; "" where the BLAS does not say. Asked once."""
    from threadpoolctl import threadpool_info

    pools = [pool for pool in threadpool_info() if pool.get("user_api") == "blas"]
    ours = [pool for pool in pools if "numpy" in str(pool.get("filepath", ""))] or pools  # NumPy's, not torch's
    return str(ours[0].get("architecture") or "") if ours else ""


def cpu_fields(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields in Linux's /proc/cpuinfo ("vendor_id", "model name", "cpu family", "model",
    ...); empty where there is no such file (another system)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip() and fields:  # the first processor's block is enough
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@functools.cache
def cpu_maker() -> str:
    """Who made the CPU, as it names itself ("GenuineIntel", "AuthenticAMD"); "" where Linux does not say.
    Asked once."""
    return cpu_fields().get("vendor_id", "")


@functools.cache
def cpu_cores() -> int:
    """os.cpu_count(), at least 1, asked once: each os.cpu_count() reads a file of /sys, tens of microseconds
    inside a training step, whose defaults (tiles, row blocks, workers) ask for the cores dozens of times."""
    return os.cpu_count() or 1


@functools.cache
def l2_cache_bytes(caches: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of one core's level-2 cache in bytes, as Linux's sysfs gives it ("2048K" -> 2,097,152); None
    where it cannot be read (another system, or no such file). caches: the first core's cache folder. Asked
    once."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in sorted(Path(caches).glob("index*")):
        try:
            level, size = (index / "level").read_text().strip(), (index / "size").read_text().strip()
        except OSError:
            continue
        if level == "2" and size[:-1].isdigit() and size[-1] in units:
            return int(size[:-1]) * units[size[-1]]
    return None


def nonfinite_quiet() -> Any:
    """A context in which NumPy's floating-point warnings are off: a NaN or inf in the inputs becomes NaN in
    what it reaches (inf - inf, 0 · inf), as in torch, and never a RuntimeWarning from inside the package.
    NumPy's error state belongs to the thread (a context variable): each worker enters its own."""
    return np.errstate(invalid="ignore", over="ignore", divide="ignore")


_MOST_HELPERS = 64  # the pool's threads are started as calls need them, up to this many
_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.RLock()


def _helper_pool() -> ThreadPoolExecutor:
    """The pool of helper threads, started on first use."""
    return holding(_helpers_lock, _start_helper_pool)


def _start_helper_pool() -> ThreadPoolExecutor:
    global _helpers
    if _helpers is None:
        _helpers = ThreadPoolExecutor(max_workers=_MOST_HELPERS, thread_name_prefix="tinyattn_np-worker")
    return _helpers


def _join(helpers: list[Future[None]]) -> None:
    """Wait for the helpers that have started. One still queued (every pooled thread busy, as in a call made
    from inside an item) is cancelled instead: the caller has taken the last item, so it would find none."""
    for helper in helpers:
        if not helper.cancel():
            helper.result()


class Stopped(Exception):
    """Raised by a work item that gives up waiting because another item failed; run_items never reports it."""


def run_items(
    run: Callable[[Item], None],
    items: Iterable[Item],
    workers: int,
    *,
    on_failure: Callable[[], None] | None = None,
) -> None:
    """Call run(item) for every item on `workers` threads: the caller's own and workers - 1 helpers of the pool.

    - In order: items are taken one at a time, in the order given, by whichever worker is free, so item n
      starts only after items 0 .. n-1 have started. An item may therefore wait for an earlier one (the
      backward's dq adds in key-block order): that one is already running. A wait must be able to end:
      an item that finds what it waits for will never come (every item it waits on has finished without
      it) raises instead, and a failure anywhere wakes every waiter (on_failure).
    - The first failure wins: an exception in any item (Ctrl-C included) stops the workers from taking new
      items and calls on_failure(), so that items waiting for another can stop (they raise Stopped). Once
      every worker has finished its item, that first exception is raised here, with its traceback.
    - Non-finite inputs: the items run inside nonfinite_quiet(), on every worker.
    - Ctrl-C stops it promptly: Python delivers it to the main thread, which is one of the workers, so it
      lands between two NumPy calls of an item, or in a wait, never in a join that lasts the whole call.
    Each item must write only its own slices of the shared outputs.
    """
    if workers == 1:  # the caller's thread alone: the items in turn, and no locks, events or pool to set up
        try:
            with nonfinite_quiet():
                for item in items:
                    run(item)
        except BaseException:
            if on_failure is not None:
                on_failure()
            raise
        return
    pending = iter(items)
    take = threading.RLock()  # taken through holding(): a Ctrl-C at any bytecode never leaves it held
    stop = threading.Event()
    failures: list[BaseException] = []

    def record(err: BaseException) -> None:
        if not isinstance(err, Stopped):
            failures.append(err)

    def fail(err: BaseException) -> None:
        holding(take, record, err)
        stop.set()
        if on_failure is not None:
            on_failure()

    def work() -> None:
        while not stop.is_set():
            item = holding(take, next, pending, _DONE)
            if item is _DONE:
                return
            try:
                with nonfinite_quiet():
                    run(item)
            except BaseException as err:  # Ctrl-C too: the others must stop
                fail(err)
                return

    pool = _helper_pool() if workers > 1 else None
    helpers = [pool.submit(work) for _ in range(workers - 1)] if pool is not None else []
    try:
        work()
        _join(helpers)
    except BaseException as err:  # Ctrl-C outside an item (taking one, waiting): stop the others first
        fail(err)
        _join(helpers)
    if failures:
        raise failures[0]


# --- the elementwise layers' blocks of rows ---------------------------------------------------------

_ELEMENTS_PER_WORKER = 1 << 19  # less work than this a core (2 MiB of float32), and handing it out costs more
# than the core gains (measured: docs/results/zen4.md)


def by_row_blocks(lines: Callable[..., None], block: int, *arrays: np.ndarray) -> None:
    """lines(*views) for every block of about `block` elements (at least one row) of the arrays' rows: each
    array (N, ...) is sliced by the same rows, and a block's size counts the first array's row (N, C). The
    blocks run on as many of the machine's cores as have _ELEMENTS_PER_WORKER elements each (at least one:
    the caller's thread); each call writes only its own rows, so the result is the same bits for any block
    and any number of workers as long as each line treats each row alone."""
    n_rows, row_size = arrays[0].shape[0], arrays[0].shape[-1]
    step = max(1, block // max(1, row_size))
    blocks = [slice(start, start + step) for start in range(0, n_rows, step)]
    workers = max(1, min(n_rows * row_size // _ELEMENTS_PER_WORKER, cpu_cores()))
    run_items(lambda rows: lines(*(array[rows] for array in arrays)), blocks, workers)
