"""bill.py: model_bill for one context or many, what it says it recognized, contexts past the trained length."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyattn_np.bill import model_bill
from tinyattn_np.presets import PRESETS


def test_model_bill_takes_one_context_or_a_list():
    model = PRESETS["llama-3-8b"]
    one = model_bill(model, 8192)
    assert one["contexts"] == model_bill(model, [8192])["contexts"]
    assert one["contexts"][0]["kv_cache_bytes"] == 8192 * 131_072
    assert model_bill(model, np.int64(8192))["contexts"] == one["contexts"]
    with pytest.raises(TypeError, match="tokens must be an int or a list of ints; got str"):
        model_bill(model, "8192")
    with pytest.raises(TypeError, match="tokens must be an int or a list of ints; got bool"):
        model_bill(model, True)


def test_model_bill_says_what_it_recognized_and_is_json():
    bill = model_bill(PRESETS["qwen3-next-80b-a3b"], [4096, 262144])
    assert bill["architecture"] == "qwen3_next" and bill["parameters"] > bill["active_parameters"]
    assert bill["state_bytes"] == PRESETS["qwen3-next-80b-a3b"].state_bytes()
    assert [c["cache_bytes"] - c["kv_cache_bytes"] for c in bill["contexts"]] == [bill["state_bytes"]] * 2
    assert bill["kv_bytes_per_token_by_kind"] == {"full_attention": 12 * 2 * 2 * 256 * 2}
    assert any(line.startswith("48 layers: 12 full + 36 linear") for line in bill["description"])
    json.dumps(bill)
    assert model_bill(PRESETS["llama-3-8b"], 1)["kv_bytes_per_token_decompressed"] is None


def test_model_bill_flags_contexts_beyond_max_positions():
    bill = model_bill(PRESETS["llama-3-8b"], [8192, 8193])
    assert [c["beyond_max_positions"] for c in bill["contexts"]] == [False, True]
    assert bill["kv_bytes_per_token"] == 131_072
    assert bill["contexts"][0]["score_matrix_bytes"] == 137_438_953_472
    json.dumps(bill)  # plain ints and bools
