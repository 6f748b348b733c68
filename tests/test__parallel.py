"""The worker engine's BLAS limit: one_blas_thread restores BLAS's thread counts and holds no lock after an
exception raised at any bytecode of entering or leaving it, its caller's included."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from test_kvcache import _interrupted_at
from threadpoolctl import threadpool_info

from tinyattn_np import _parallel

# the bytecodes swept: the limit's own, holding's, and this file's (the callers' `with` statements below)
CODE = tuple(str(path) for path in (Path(_parallel.__file__), Path(_parallel.__file__).with_name("_atomic.py"),
                                    Path(__file__)))  # fmt: skip


def blas_threads() -> list[int]:
    return [library["num_threads"] for library in threadpool_info() if library["user_api"] == "blas"]


def one_call() -> None:
    with _parallel.one_blas_thread():
        np.ones((2, 2)) @ np.ones((2, 2))  # a body that runs BLAS, on one thread


def nested_calls() -> None:
    with _parallel.one_blas_thread():
        with _parallel.one_blas_thread():
            pass
        assert blas_threads() and set(blas_threads()) == {1}


def sweep(call) -> int:
    """Raise a KeyboardInterrupt at the 1st, 2nd, ... bytecode of call() in CODE until it runs to its end; after
    each, no lock may be held, BLAS's thread counts must be the ones before, and no call be left counted
    inside. Returns the number of bytecodes swept."""
    before = blas_threads()
    assert before, "no BLAS library found"
    for n in itertools.count(1):
        came = _interrupted_at(n, call, CODE)
        assert _parallel._blas_lock.acquire(timeout=5), f"the lock was left held at bytecode {n}"
        _parallel._blas_lock.release()
        assert blas_threads() == before, f"bytecode {n}: BLAS left at {blas_threads()} threads"
        one_call()  # no call left counted inside: the next one out restores the counts
        assert blas_threads() == before, f"bytecode {n}: a call left counted inside"
        if not came:
            return n - 1
    raise AssertionError("unreachable")


def test_an_interrupt_at_any_bytecode_of_one_call_restores_the_limit():
    assert sweep(one_call) > 40  # enter, the body, exit: every bytecode of each


def test_an_interrupt_at_any_bytecode_of_nested_calls_restores_the_limit():
    assert sweep(nested_calls) > 80


def test_the_limit_holds_inside_and_is_restored_after():
    before = blas_threads()
    with _parallel.one_blas_thread():
        assert set(blas_threads()) == {1}
    assert blas_threads() == before
