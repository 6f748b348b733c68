"""The memory guard of the blockwise doors: flash_attention, flex_attention, their backwards and create_mask
refuse, before allocating, work that does not fit in what this process can take (AttentionMemoryError, as the
reference path does); the bound they check is never short of what they allocate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyattn_np as ta
from tinyattn_np._checks import QKVShape
from tinyattn_np._guard import blockwise_bytes
from tinyattn_np.measure import traced_peak

ROOT = Path(__file__).resolve().parents[1]

# Each door with inputs that fit this machine's memory but not 64 MiB above what the process has mapped; the
# inputs are np.zeros (mapped, never written), so setting them up costs no memory.
DOORS = {
    "flash_attention()": "ta.flash_attention(q, k, v, causal=True)",
    "flash_attention_backward()": "ta.flash_attention_backward(q, k, v, q, q, lse, causal=True)",
    "flex_attention()": "ta.flex_attention(q, k, v)",
    "flex_attention_backward()": "ta.flex_attention_backward(q, k, v, q, q, lse)",
    "create_mask()": "ta.create_mask(ta.causal_mod(2**14), None, None, 2**14, 2**14)",
    "attention()": "ta.attention(q[:, :1, :8192], k[:, :1, :8192], v[:, :1, :8192])",
    "attention_backward()": "ta.attention_backward(q[:, :1, :4096], k[:, :1, :4096], v[:, :1, :4096], q[:, :1, :4096])",
    "a call that fits": "ta.flash_attention(q[:, :2, :256], k[:, :2, :256], v[:, :2, :256], causal=True)",
}
SCRIPT = """
import resource, numpy as np, tinyattn_np as ta
q = k = v = np.zeros((1, 8, 2**16, 64), np.float32)  # 128 MiB each, never written
lse = np.zeros((1, 8, 2**16), np.float32)
ta.flash_attention(q[:, :2, :256], k[:, :2, :256], v[:, :2, :256])  # the worker threads and their BLAS buffers, first
status = open("/proc/self/status").read().splitlines()
mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + 64 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
for door, call in DOORS.items():
    try:
        eval(call)
    except ta.AttentionMemoryError as error:
        print(door, "| refused:", error)
    except MemoryError as error:  # NumPy tried: the guard came too late, or not at all
        print(door, "|", type(error).__name__ + ":", error)
    else:
        print(door, "| ran")
"""


@pytest.fixture(scope="module")
def under_the_limit() -> dict[str, str]:
    """door -> what it did under the address-space limit (RLIMIT_AS, what ulimit -v sets), all in one Python."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = f"DOORS = {DOORS!r}\n{SCRIPT}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return dict(line.split(" | ", 1) for line in done.stdout.splitlines())


@pytest.mark.parametrize("door", [door for door in DOORS if door != "a call that fits"])
def test_every_door_refuses_before_allocating_under_an_address_space_limit(under_the_limit, door):
    printed = under_the_limit[door]
    assert printed.startswith(f"refused: {door} would allocate "), printed  # not NumPy's own MemoryError
    assert "of memory is available" in printed and ("lower" in printed or "gives the same result" in printed)


def test_a_call_that_fits_runs_under_the_same_limit(under_the_limit):
    assert under_the_limit["a call that fits"] == "ran"


CASES = {  # name -> (q, k, v shapes, dtype, flex keywords or None for flash_attention)
    "flash, grouped heads": (((2, 4, 300, 16), (2, 2, 200, 16), (2, 2, 200, 8)), np.float32, None),
    "flash, float16": (((1, 2, 130, 32), (1, 2, 260, 32), (1, 2, 260, 32)), np.float16, None),
    "flex, softcap and a mask": (((2, 2, 200, 16), (2, 2, 200, 16), (2, 2, 200, 16)), np.float64, "mods"),
}


@pytest.mark.parametrize("name", CASES)
def test_the_bound_is_never_short_of_what_the_doors_allocate(rng, name):
    shapes, dtype, flex = CASES[name]
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in shapes)
    dims = QKVShape(q.shape[:1], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    plan = type("Plan", (), {"block_q": 64, "block_k": 48, "workers": 2})()
    compute = np.result_type(dtype, np.float32)
    ta.flash_attention(q, k, v, workers=2)  # the first call's one-time Python state (threadpoolctl's look at BLAS)
    if flex:
        mask = ta.create_block_mask(ta.causal_mod(200), None, None, 200, 200, BLOCK_SIZE=(64, 48))
        tiles = dict(score_mod=ta.Softcap(5.0), block_mask=mask, workers=2)
        (out, lse), forward = traced_peak(ta.flex_attention, q, k, v, **tiles, return_lse=True)
        _, backward = traced_peak(ta.flex_attention_backward, q, k, v, out, out, lse, **tiles)
    else:
        tiles = dict(causal=True, block_q=64, block_k=48, workers=2)
        (out, lse), forward = traced_peak(ta.flash_attention, q, k, v, **tiles, kv_heads_per_step=1, return_lse=True)
        _, backward = traced_peak(ta.flash_attention_backward, q, k, v, out, out, lse, **tiles)
    assert forward <= blockwise_bytes(dims, dtype, compute, plan), name
    assert backward <= blockwise_bytes(dims, dtype, compute, plan, backward=True), name
