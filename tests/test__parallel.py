"""The worker engine: run_items runs every item quietly and reports the first failure, on one worker and on
several; the BLAS limit, one_blas_thread, restores BLAS's thread counts and holds no lock after an exception
raised at any bytecode of entering or leaving it, its caller's included."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import numpy as np
import pytest
from test_kvcache import _interrupted_at
from threadpoolctl import threadpool_info

from tinyattn_np import _parallel

# the bytecodes swept: the limit's own, holding's, and this file's (the callers' `with` statements below)
CODE = tuple(
    str(path) for path in (Path(_parallel.__file__), Path(_parallel.__file__).with_name("_atomic.py"), Path(__file__))
)


@pytest.mark.parametrize("workers", [1, 2])
def test_run_items_runs_them_in_order_quietly_and_raises_the_first_failure(workers):
    seen: list[int] = []
    failed: list[bool] = []

    def run(item: int, fail_at: int | None = None) -> None:
        seen.append(item)
        np.log(np.array([-1.0, 0.0]))  # NaN and -inf, without a RuntimeWarning inside the engine
        if item == fail_at:
            raise ValueError(f"item {item} failed")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _parallel.run_items(run, range(4), workers)
        assert sorted(seen) == [0, 1, 2, 3] and (workers > 1 or seen == [0, 1, 2, 3])
        seen.clear()
        with pytest.raises(ValueError, match="item 2 failed"):
            _parallel.run_items(
                lambda item: run(item, fail_at=2), range(6), workers, on_failure=lambda: failed.append(True)
            )
    assert failed and 2 in seen
    assert workers > 1 or seen == [0, 1, 2]  # one worker stops at the failure


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


def test_cpu_cores_is_the_cpu_count_asked_once(monkeypatch):
    import os

    cores = _parallel.cpu_cores()
    assert cores == (os.cpu_count() or 1)
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # what os.cpu_count() says where it cannot tell
    assert _parallel.cpu_cores() == cores  # not asked again
    _parallel.cpu_cores.cache_clear()
    try:
        assert _parallel.cpu_cores() == 1  # asked afresh: None counts as one core
    finally:
        _parallel.cpu_cores.cache_clear()  # the next call asks the real os.cpu_count() again


def test_the_maker_is_the_first_processors_vendor(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n")
    assert _parallel.cpu_fields(str(cpuinfo))["vendor_id"] == "GenuineIntel"
    assert _parallel.cpu_fields(str(tmp_path / "absent")) == {}  # another system: nothing known
