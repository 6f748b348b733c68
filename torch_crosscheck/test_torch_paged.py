"""paged_decode and cascade_decode against torch's scaled_dot_product_attention over each sequence.

The gold is independent of our cache: each sequence's keys and values are drawn in torch as one tensor,
SDPA attends over it (enable_gqa), and the same tokens are appended to a PagedKVCache a few at a time, in
turn with the other sequences, so that every sequence's blocks lie scattered across the pool.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from cases import make_inputs, to_numpy, tolerance  # noqa: E402
from devices import DEVICE_PARAMS  # noqa: E402

import tinyattn_np as ta  # noqa: E402

LENGTHS = [1, 37, 200, 64, 5]


def filled(keys, values, block_size, dtype):
    """A PagedKVCache holding sequence i's keys[i] and values[i] (Hkv, S_i, E), grown 3 tokens at a time in turn."""
    hkv, e = keys[0].shape[0], keys[0].shape[-1]
    blocks = sum(-(-k.shape[1] // block_size) for k in keys) + 1
    cache = ta.PagedKVCache(blocks, block_size, hkv, e, dtype=np.dtype(dtype))
    seqs = [cache.add_sequence() for _ in keys]
    for start in range(0, max(k.shape[1] for k in keys), 3):
        for seq, k, v in zip(seqs, keys, values, strict=True):
            if start < k.shape[1]:
                cache.append(seq, k[:, start : start + 3], v[:, start : start + 3])
    return cache, seqs


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_decode_matches_sdpa_over_each_sequence(device, dtype, hq, hkv, block_size):
    name = f"paged {dtype} {hq} {hkv} {block_size}"
    shapes = [(hkv, n, 32) for n in LENGTHS] * 2 + [(len(LENGTHS), hq, 1, 32)]
    arrays, tensors = make_inputs(name, shapes, dtype, device)
    keys, values, q = arrays[: len(LENGTHS)], arrays[len(LENGTHS) : -1], arrays[-1]
    cache, seqs = filled(keys, values, block_size, dtype)
    out = ta.paged_decode(q, cache, seqs, kv_splits=2)
    for i in range(len(LENGTHS)):
        tq, tk, tv = tensors[-1][i : i + 1], tensors[i][None], tensors[len(LENGTHS) + i][None]
        gold = to_numpy(F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))[0]
        np.testing.assert_allclose(out[i], gold, rtol=0, atol=tolerance(dtype, float(np.max(np.abs(values[i])))))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_cascade_decode_of_forked_samples_matches_sdpa(device, block_size):
    """Four samples forked from one 50-token prompt, each with its own continuation: SDPA over the prompt
    and the continuation laid end to end, for each."""
    own = [7, 0, 19, 2]
    shapes = [(2, 50, 16)] * 2 + [(2, n, 16) for n in own] * 2 + [(4, 8, 1, 16)]
    arrays, tensors = make_inputs(f"cascade {block_size}", shapes, "float64", device)
    prompt_k, prompt_v, q = arrays[0], arrays[1], arrays[-1]
    cache = ta.PagedKVCache(64, block_size, 2, 16, dtype=np.float64)
    parent = cache.add_sequence()
    cache.append(parent, prompt_k, prompt_v)
    seqs = [parent] + [cache.fork(parent) for _ in own[1:]]
    for i, seq in enumerate(seqs):
        cache.append(seq, arrays[2 + i], arrays[2 + len(own) + i])
    out = ta.cascade_decode(q, cache, seqs)
    for i in range(len(own)):
        tk = torch.cat([tensors[0], tensors[2 + i]], dim=1)[None]  # (1, 2, 50 + own_i, 16)
        tv = torch.cat([tensors[1], tensors[2 + len(own) + i]], dim=1)[None]
        gold = to_numpy(F.scaled_dot_product_attention(tensors[-1][i : i + 1], tk, tv, enable_gqa=True))[0]
        np.testing.assert_allclose(out[i], gold, rtol=0, atol=tolerance("float64", 5.0))
