"""MultiHeadLatentAttention against transformers' DeepseekV3Attention with the same random weights: a scaled-down
DeepSeek-V3 config, both RoPE pair layouts, with and without YaRN; the forward, every gradient through torch's
autograd, and cached decoding with the bytes its cache holds.

Our weights are transformers' transposed (x @ W, W (in, out)): w_dq = q_a_proj.weightᵀ, q_norm =
q_a_layernorm.weight, w_uq = q_b_proj.weightᵀ (or w_q = q_proj.weightᵀ), w_dkv = kv_a_proj_with_mqa.weightᵀ,
kv_norm = kv_a_layernorm.weight, w_ukv = kv_b_proj.weightᵀ, w_o = o_proj.weightᵀ.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from devices import DEVICE_PARAMS  # noqa: E402  (needs torch, so after the importorskip)
from transformers import DeepseekV3Config  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek  # noqa: E402

from tinyattn_np import (  # noqa: E402
    KVCache,
    MultiHeadLatentAttention,
    PagedKVCache,
    rope_attention_factor,
    rope_frequencies,
    to_half_split,
)

SIZES = dict(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
D_MODEL, HEADS, MAX_POSITIONS = 32, 4, 256
ROPE = {
    "plain": None,
    # DeepSeek-V3's YaRN (mscale = mscale_all_dim: RoPE's own factor is 1, the softmax scale carries mscale²)
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    },
    # mscale != mscale_all_dim: RoPE's cos and sin are scaled too, by mscale(1) / mscale(0.707)
    "yarn, mscale 1 / 0.707": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "rope_theta": 10000.0,
    },
}
# transformers computes its RMSNorm in float32 whatever the input dtype (DeepseekV3RMSNorm.forward casts to float32
# and back), and its RoPE tables too (DeepseekV3RotaryEmbedding), so against its float64 layer ours agrees to
# about 1e-8 relative, not 1e-15 (the worst of these tests, a gradient, is 2e-7: AS_IS leaves room). With that
# norm computed in float64 (`norm_in_float64`) and the cos and sin tables made in float64 from the same θ
# (`float64_tables`), the two agree to float64 rounding (IN_FLOAT64).
AS_IS, IN_FLOAT64 = 1e-6, 1e-12


def make_pair(q_lora_rank, interleave, rope_name, device):
    """Our layer (float64, random weights, the norms' gains not 1) and transformers' with the same weights."""
    layer = MultiHeadLatentAttention(
        D_MODEL,
        HEADS,
        **SIZES,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        rope_scaling=ROPE[rope_name],
        max_position_embeddings=MAX_POSITIONS,
        rng=0,
        dtype=np.float64,
    )
    gains = np.random.default_rng(1)
    for w in layer.parameters.values():
        if w.ndim == 1:
            w[:] = gains.uniform(0.5, 1.5, w.shape)
    rope_parameters = ROPE[rope_name] or {"rope_type": "default", "rope_theta": 10000.0}
    config = DeepseekV3Config(
        hidden_size=D_MODEL,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=MAX_POSITIONS,
        attention_bias=False,
        **SIZES,
    )
    config._attn_implementation = "sdpa"  # torch SDPA in float64 (the eager path takes its softmax in float32)
    theirs = deepseek.DeepseekV3Attention(config, layer_idx=0).to(device=device, dtype=torch.float64)
    names = {
        "w_q": "q_proj",
        "w_dq": "q_a_proj",
        "q_norm": "q_a_layernorm",
        "w_uq": "q_b_proj",
        "w_o": "o_proj",
        "w_dkv": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "w_ukv": "kv_b_proj",
    }
    with torch.no_grad():
        for name, w in layer.parameters.items():
            getattr(theirs, names[name]).weight.copy_(torch.from_numpy(w.T.copy()))
    rotary = deepseek.DeepseekV3RotaryEmbedding(config).to(device)
    return layer, theirs, rotary, names, config


def run_theirs(theirs, rotary, x, positions, cache=None):
    """transformers' layer on x (B, T, C) at positions (T,), causal (a mask over the T new tokens, after the
    cached ones). rotary: its DeepseekV3RotaryEmbedding, or a function of the positions giving (cos, sin)."""
    B, T, _ = x.shape
    position_ids = torch.as_tensor(positions, device=x.device)[None].expand(B, -1)
    cos, sin = rotary(x, position_ids) if isinstance(rotary, torch.nn.Module) else rotary(positions, B, x.device)
    cached = 0 if cache is None else cache.get_seq_length()
    hidden = torch.ones(T, cached + T, dtype=torch.bool, device=x.device).triu(cached + 1)  # True: may not attend
    mask = torch.zeros(T, cached + T, dtype=x.dtype, device=x.device).masked_fill(hidden, -torch.inf)
    out, _ = theirs(x, (cos, sin), mask[None, None], cache=cache)
    return out


@pytest.fixture
def norm_in_float64(monkeypatch):
    """DeepseekV3RMSNorm computed in its input's dtype: the same formula, without the float32 round trip."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(deepseek.DeepseekV3RMSNorm, "forward", forward)


def float64_tables(layer):
    """(cos, sin) as transformers' attention takes them, (B, T, d_rope) with each pair's angle twice, made in
    float64 from rope_frequencies' θ and rope_attention_factor, the numbers our rope() uses."""
    theta = rope_frequencies(
        layer.d_rope, layer.rope_theta, scaling=layer.rope_scaling, max_position_embeddings=MAX_POSITIONS
    )
    factor = rope_attention_factor(layer.rope_scaling, max_position_embeddings=MAX_POSITIONS)

    def tables(positions, batch, device):
        angles = np.asarray(positions, np.float64)[:, None] * theta  # (T, d_rope / 2)
        angles = np.concatenate([angles, angles], axis=-1)  # (T, d_rope): transformers' cat(freqs, freqs)
        return tuple(
            torch.from_numpy(factor * f(angles)).to(device)[None].expand(batch, -1, -1) for f in (np.cos, np.sin)
        )

    return tables


def relative(mine, gold):
    gold = gold.detach().cpu().numpy() if hasattr(gold, "detach") else gold
    return float(np.max(np.abs(mine - gold)) / np.max(np.abs(gold)))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("rope_name", list(ROPE))
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [8, None])
@pytest.mark.parametrize("norm", ["norm and RoPE tables as transformers computes them", "in float64"])
def test_forward_and_every_gradient_equal_transformers(request, device, rope_name, interleave, q_lora_rank, norm):
    layer, theirs, rotary, names, _ = make_pair(q_lora_rank, interleave, rope_name, device)
    tol = AS_IS
    if norm == "in float64":
        request.getfixturevalue("norm_in_float64")
        rotary, tol = float64_tables(layer), IN_FLOAT64
    rng = np.random.default_rng(2)
    x, dout = rng.standard_normal((2, 9, D_MODEL)), rng.standard_normal((2, 9, D_MODEL))
    positions = np.sort(rng.choice(200, 9, replace=False))  # positions with gaps, past YaRN's original 64
    x_t = torch.tensor(x, device=device, requires_grad=True)
    gold = run_theirs(theirs, rotary, x_t, positions)
    (gold * torch.from_numpy(dout).to(device)).sum().backward()
    for absorbed in (True, False):
        out, saved = layer.forward(x, absorbed=absorbed, positions=positions)
        assert relative(out, gold) <= tol, f"forward, absorbed={absorbed}"
        dx, grads = layer.backward(dout, saved)
        assert relative(dx, x_t.grad) <= tol, f"dx, absorbed={absorbed}"
        for name, grad in grads.items():
            theirs_grad = getattr(theirs, names[name]).weight.grad
            assert relative(grad, theirs_grad.T if grad.ndim == 2 else theirs_grad) <= tol, f"{name}, {absorbed}"


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("rope_name", ["plain", "yarn"])
def test_cached_decoding_equals_transformers_and_caches_the_same_bytes(device, interleave, rope_name):
    layer, theirs, rotary, _, config = make_pair(8, interleave, rope_name, device)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 10, D_MODEL))
    r = SIZES["kv_lora_rank"]
    ours, cache = KVCache(2, 1, 10, layer.latent_dim, dtype=np.float64, value_prefix=r), DynamicCache(config=config)
    # the two sequences of x in a pool of exactly their blocks: 2 · 10 tokens in 4 blocks of 5
    paged = PagedKVCache(4, 5, 1, layer.latent_dim, dtype=np.float64, value_prefix=r)
    seqs = [paged.add_sequence(), paged.add_sequence()]
    with torch.no_grad():
        for start, stop in [(0, 6), (6, 7), (7, 8), (8, 10)]:  # a prefill, two decode steps, a chunk of two
            x_t = torch.from_numpy(x[:, start:stop]).to(device)
            gold = run_theirs(theirs, rotary, x_t, np.arange(start, stop), cache)
            naive = layer(x[:, start:stop], cache=copy_of(ours), absorbed=False)  # continues a copy of ours
            absorbed = layer(x[:, start:stop], cache=ours)
            through_pages = layer(x[:, start:stop], cache=paged, seq_ids=seqs)
            assert relative(naive, gold) <= AS_IS and relative(absorbed, gold) <= AS_IS, (start, stop)
            assert relative(through_pages, gold) <= AS_IS, (start, stop)
    # what each cache holds: the normalised c_KV and the rotated k_rope of every token, once: the bytes that
    # each of our caches allocates are the bytes of transformers' cache (its keys c_KV, its values k_rope)
    keys, values = (
        cache.layers[0].keys.cpu().numpy(),
        cache.layers[0].values.cpu().numpy(),
    )  # (2, 1, 10, r), (..., d_rope)
    assert ours.nbytes == paged.nbytes == keys.nbytes + values.nbytes == 2 * 10 * (12 + 4) * 8
    assert paged.bytes_used == paged.nbytes  # every block in use, every slot filled
    for b, seq in enumerate(seqs):
        np.testing.assert_array_equal(paged.gather(seq)[0], ours.keys[b])
    np.testing.assert_allclose(ours.keys[..., :r], keys, rtol=AS_IS, atol=AS_IS)
    # transformers writes the interleaved rotation's output with the pairs' halves apart (each pair i at i and
    # i + d/2); the scores do not see that order, since q_rope and k_rope are laid out the same way
    k_rope = to_half_split(ours.keys[..., r:]) if interleave else ours.keys[..., r:]
    np.testing.assert_allclose(k_rope, values, rtol=AS_IS, atol=AS_IS)


def copy_of(cache):
    """A KVCache holding the latents `cache` holds, for the naive form to continue without changing `cache`."""
    twin = KVCache(
        cache.batch,
        cache.kv_heads,
        cache.max_tokens,
        cache.head_dim,
        dtype=cache.dtype,
        value_prefix=cache.value_prefix,
    )
    twin.append(cache.keys.copy(), cache.values.copy())
    return twin
