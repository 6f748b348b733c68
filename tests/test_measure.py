"""measure.py: tracemalloc peaks, timing and the machine facts the scripts and the memory guard use."""

import io
import time
import tracemalloc

import numpy as np
import pytest

from tinyattn_np import _guard as guard
from tinyattn_np import measure


def test_traced_peak_counts_numpy_buffers_and_the_result():
    def make(n_bytes):
        scratch = np.ones(n_bytes // 8)  # float64: n_bytes; freed before return, but it was the peak
        del scratch
        return np.zeros(n_bytes // 64)  # n_bytes / 8, alive when the peak is read

    result, peak = measure.traced_peak(make, 2**20)
    assert result.nbytes == 2**17
    assert 2**20 <= peak < 2**20 + 2**16  # the 1 MiB scratch plus small Python bookkeeping


def test_traced_peak_inside_an_outer_trace_leaves_it_running():
    tracemalloc.start()
    try:
        _, peak = measure.traced_peak(np.ones, 1000)
        assert peak >= 8000 and tracemalloc.is_tracing()
    finally:
        tracemalloc.stop()
    assert not tracemalloc.is_tracing()


def test_timing():
    calls = []
    seconds = measure.time_calls(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(seconds) == 4 and len(calls) == 6 and all(s >= 0 for s in seconds)
    assert measure.median_ms(lambda: None, repeats=3) >= 0
    with pytest.raises(ValueError, match="repeats"):
        measure.time_calls(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        measure.time_calls(lambda: None, warmup=-1)


def test_alternating_medians_take_turns_and_each_turn_warms_up():
    """Each fn's calls come in `rounds` turns, the fns taking turns, so that a machine whose speed drifts slows
    each alike; a turn starts with its untimed calls, and each figure is the median of every turn's calls."""
    calls = []
    medians = measure.alternating_medians_ms([lambda: calls.append("a"), lambda: calls.append("b")], 2, 3)
    assert calls == (["a"] * 4 + ["b"] * 4) * 3 and len(medians) == 2 and min(medians) >= 0
    slow = measure.alternating_medians_ms([lambda: time.sleep(0.004), lambda: None], 3, 2, warmup=0)
    assert slow[0] >= 3.5 and slow[1] < slow[0]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        measure.alternating_medians_ms([lambda: None], 1, 0)


def test_read_bandwidth_reads_both_halves_once_each(monkeypatch):
    reads = []
    monkeypatch.setattr(
        measure, "read_once", lambda arrays, threads: reads.append(([a.nbytes for a in arrays], threads))
    )
    assert measure.read_bandwidth(2**20, repeats=2) > 0
    assert reads == [([2**19, 2**19], 2)] * 3  # one warm-up call, then the two timed


def test_machine_info():
    info = measure.machine_info()
    assert info["cores"] >= 1 and info["numpy"] == np.__version__
    assert isinstance(info["cpu"], str) and info["cpu"]
    assert all("num_threads" in pool for pool in info["blas"])


@pytest.mark.parametrize(
    "cpuinfo,expected",
    [
        (
            "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n",
            "AMD EPYC (family 25, model 17)",
        ),  # the first processor's block
        ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n", "Intel(R) Xeon(R) Processor"),
    ],
)
def test_cpu_model_names_the_family_and_model(monkeypatch, cpuinfo, expected):
    """Two generations under one name ("AMD EPYC": Zen 4 or Zen 5) are told apart by the family and model numbers,
    which tune's cache key and every benchmark's machine line carry; without them, the name alone."""
    monkeypatch.setattr("builtins.open", lambda *args, **kwargs: io.StringIO(cpuinfo))
    assert measure.cpu_model() == expected


def test_cpu_model_without_proc(monkeypatch):
    def no_file(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", no_file)
    assert isinstance(measure.cpu_model(), str)


def test_memory_from_proc_sysconf_or_fallback(monkeypatch, tmp_path):
    assert 0 < guard.memory_available() <= guard.memory_total()
    # /proc/meminfo unreadable: os.sysconf answers
    monkeypatch.setattr(guard, "meminfo_bytes", lambda field: None)
    assert guard.memory_total() > 0 and guard.memory_available() > 0
    # neither answers: the conservative fallback
    monkeypatch.setattr(guard, "sysconf_bytes", lambda name: None)
    assert guard.memory_available() == guard.memory_total() == guard.FALLBACK_MEMORY_BYTES == 2 * 2**30


def test_meminfo_parsing(monkeypatch, tmp_path):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16384 kB\nMemAvailable:    8192 kB\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(fake if path == "/proc/meminfo" else path, *a, **k)
    )
    assert guard.meminfo_bytes("MemTotal") == 16384 * 1024
    assert guard.meminfo_bytes("MemAvailable") == 8192 * 1024
    assert guard.meminfo_bytes("SwapTotal") is None


def test_sysconf_failures(monkeypatch):
    def broken(name):
        raise ValueError(name)

    monkeypatch.setattr(guard.os, "sysconf", broken)
    assert guard.sysconf_bytes("SC_PHYS_PAGES") is None


def test_the_public_memory_probes_are_the_guards(monkeypatch):
    """measure.memory_total and memory_available, what the scripts refuse a run by, read what the memory guard
    refuses a call by."""
    assert 0 < measure.memory_available() <= measure.memory_total() == guard.memory_total()
    monkeypatch.setattr(guard, "meminfo_bytes", lambda field: None)
    monkeypatch.setattr(guard, "sysconf_bytes", lambda name: None)
    assert measure.memory_available() == measure.memory_total() == guard.FALLBACK_MEMORY_BYTES
