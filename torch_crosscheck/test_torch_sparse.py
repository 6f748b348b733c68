"""Sparse attention against torch: index_topk against torch.topk and against transformers' DeepseekV32Indexer
(the same key sets), sparse_attention against SDPA with the equivalent boolean mask, forward and torch autograd's
backward, over many shapes, and SparseLatentAttention against transformers' DeepseekV32Attention (and GLM-5's
GlmMoeDsaAttention, whose indexer turns interleaved pairs) with the same weights: forward in both MLA forms, the
gradients with the chosen keys held fixed, and cached decoding through KVCache and PagedKVCache (sequences of
different lengths and a fork) against its DynamicCache, with the indexer keys each cache holds.

Ties. Our choice breaks a tie by the earlier key; torch.topk keeps whichever of the tied keys it meets. Where the
k-th best score ties with a key left out, the tests compare what is defined: the keys scoring above the k-th
score (the same set), the number chosen at it (the same), and ours at it the earliest (checked). transformers'
indexer scores in float32 (`q.float()`) where ours are float64: there its keys are compared where they are not
within float32 rounding of the k-th score, which these inputs never are (asserted).

Our weights are transformers' transposed (x @ W): the attention's as torch_crosscheck/test_torch_latent.py says;
the indexer's w_index_q = wq_b.weightᵀ, w_index_k = wk.weightᵀ, index_k_norm(_bias) = k_norm.weight (.bias),
w_index_weights = weights_proj.weightᵀ.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from devices import DEVICE_PARAMS  # noqa: E402  (needs torch, so after the importorskip)
from transformers import DeepseekV32Config, GlmMoeDsaConfig  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as deepseek  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm  # noqa: E402

from tinyattn_np import (  # noqa: E402
    KVCache,
    PagedKVCache,
    SparseLatentAttention,
    index_topk,
    rope_frequencies,
    sparse_attention,
    sparse_attention_backward,
    to_half_split,
)
from tinyattn_np.sparse import index_scores  # noqa: E402

SIZES = dict(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, q_lora_rank=8)
INDEXER = dict(index_n_heads=8, index_head_dim=8)  # 8 heads: a score is exactly 0 (every ReLU 0) once in 2^8
D_MODEL, HEADS, MAX_POSITIONS = 32, 4, 256
AS_IS = 1e-6  # transformers' RMSNorm in float32 (test_torch_latent.py says why); float64 RoPE tables here


def same_choice(ours, theirs, scores, topk):
    """Row by row: the keys above the k-th best score are the same set, as many are chosen at it, and ours at it
    are the earliest. ours (T, topk) with -1 for an empty slot; theirs (T, k') torch's, any order, maybe hidden
    keys (score -inf) where a row sees fewer than topk; scores (T, S) ours, -inf where hidden."""
    for t, row in enumerate(scores):
        visible = np.flatnonzero(row > -np.inf)
        picked = {int(s) for s in theirs[t] if row[s] > -np.inf}
        mine = {int(s) for s in ours[t] if s >= 0}
        if len(visible) <= topk:
            assert mine == picked == set(visible.tolist()), t
            continue
        kth = np.sort(row)[::-1][topk - 1]
        above = set(np.flatnonzero(row > kth).tolist())
        assert above <= mine and above <= picked, t
        assert len(mine) == len(picked) == topk, t
        assert mine - above == set(np.flatnonzero(row == kth)[: topk - len(above)].tolist()), t  # the earliest


@pytest.mark.parametrize("integers", [False, True], ids=["normal", "small integers: ties"])
@pytest.mark.parametrize(("T", "S", "topk"), [(16, 16, 5), (7, 12, 3), (1, 9, 4), (6, 6, 10)])
def test_index_topk_chooses_torch_topks_keys(integers, T, S, topk):
    rng = np.random.default_rng(T * S + topk)
    if integers:
        q, k = rng.integers(-2, 3, (2, 3, T, 4)).astype(float), rng.integers(-2, 3, (2, S, 4)).astype(float)
        w = rng.integers(-1, 3, (2, T, 3)).astype(float)
    else:
        q, k, w = rng.standard_normal((2, 3, T, 4)), rng.standard_normal((2, S, 4)), rng.standard_normal((2, T, 3))
    dots = torch.from_numpy(q) @ torch.from_numpy(k)[:, None].transpose(-1, -2)  # (B, H_I, T, S)
    scores = torch.einsum("bth,bhts->bts", torch.from_numpy(w), torch.relu(dots))
    hidden = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)  # bottom-right causal
    scores = scores.masked_fill(hidden, -torch.inf)
    theirs = scores.topk(min(topk, S), dim=-1).indices.numpy()
    ours = index_topk(q, k, w, topk)
    np.testing.assert_allclose(index_scores(q, k, w), scores.numpy(), rtol=1e-12, atol=1e-12)
    for b in range(2):
        same_choice(ours[b], theirs[b], scores[b].numpy(), topk)


# --- sparse_attention against SDPA with the mask that keeps the chosen keys -------------------------

SHAPES = {  # (B, H, Hkv, T, S, E, Ev, n)
    "MHA": (2, 4, 4, 10, 10, 8, 8, 4),
    "GQA, E != Ev": (2, 6, 2, 9, 13, 7, 5, 6),
    "MQA, MLA's widths": (1, 8, 1, 12, 12, 18, 14, 5),
    "topk past T": (2, 2, 1, 5, 5, 4, 4, 9),
    "T = 1": (3, 4, 2, 1, 20, 8, 6, 7),
}


def chosen_mask(indices, S):
    B, T, _ = indices.shape
    mask = np.zeros((B, 1, T, S), bool)
    b, t, j = np.nonzero(indices >= 0)
    mask[b, 0, t, indices[b, t, j]] = True
    return mask


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sparse_attention_and_its_backward_equal_sdpa_with_the_mask(shape, dtype, device):
    B, H, Hkv, T, S, E, Ev, n = SHAPES[shape]
    rng = np.random.default_rng(len(shape))
    q, k, v, dout = (
        rng.standard_normal(s).astype(dtype) for s in ((B, H, T, E), (B, Hkv, S, E), (B, Hkv, S, Ev), (B, H, T, Ev))
    )
    indices = np.full((B, T, n), -1)
    for b, t in np.ndindex(B, T):  # distinct keys, causal ones (t + S - T and before), in any order
        seen = rng.permutation(t + S - T + 1)[:n]
        indices[b, t, : len(seen)] = seen
    out, lse = sparse_attention(q, k, v, indices, return_lse=True)
    dq, dk, dv = sparse_attention_backward(q, k, v, indices, out, dout, lse)
    q_t, k_t, v_t = (torch.tensor(x, device=device, requires_grad=True) for x in (q, k, v))
    mask = torch.from_numpy(chosen_mask(indices, S)).to(device)
    gold = torch.nn.functional.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, enable_gqa=Hkv != H)
    gold.backward(torch.from_numpy(dout).to(device))
    tol = 1e-12 if dtype == "float64" else 2e-5
    for mine, theirs, name in [(out, gold, "out"), (dq, q_t.grad, "dq"), (dk, k_t.grad, "dk"), (dv, v_t.grad, "dv")]:
        np.testing.assert_allclose(mine, theirs.detach().cpu().numpy(), rtol=tol, atol=tol, err_msg=name)


# --- the layer against transformers' -------------------------------------------------------------------


def make_pair(model, device, topk):
    """Our layer (float64, random weights, gains not 1) and transformers' (DeepseekV32Attention, or GLM-5's
    GlmMoeDsaAttention) with the same weights, and the names of its modules by our weights' names. Both turn
    the attention's RoPE in interleaved pairs (transformers' two layers do whatever config.rope_interleave says)."""
    module, Config = (deepseek, DeepseekV32Config) if model == "deepseek_v32" else (glm, GlmMoeDsaConfig)
    layer = SparseLatentAttention(
        D_MODEL,
        HEADS,
        **SIZES,
        **INDEXER,
        index_topk=topk,
        rope_interleave=True,
        index_rope_interleave=model == "glm_moe_dsa",
        max_position_embeddings=MAX_POSITIONS,
        rng=0,
        dtype=np.float64,
    )
    gains = np.random.default_rng(1)
    for w in layer.parameters.values():
        if w.ndim == 1:
            w[:] = gains.uniform(0.5, 1.5, w.shape)
    config = Config(
        hidden_size=D_MODEL,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        **SIZES,
        **INDEXER,
        index_topk=topk,
        rope_interleave=True,
        max_position_embeddings=MAX_POSITIONS,
        attention_bias=False,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "sdpa"
    attention_class = deepseek.DeepseekV32Attention if model == "deepseek_v32" else glm.GlmMoeDsaAttention
    theirs = attention_class(config, layer_idx=0).to(device=device, dtype=torch.float64)
    names = {
        "w_dq": "q_a_proj",
        "q_norm": "q_a_layernorm",
        "w_uq": "q_b_proj",
        "w_o": "o_proj",
        "w_dkv": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "w_ukv": "kv_b_proj",
        "w_index_q": "indexer.wq_b",
        "w_index_k": "indexer.wk",
        "index_k_norm": "indexer.k_norm",
        "w_index_weights": "indexer.weights_proj",
    }
    with torch.no_grad():
        for name, w in layer.parameters.items():
            if name == "index_k_norm_bias":
                theirs.indexer.k_norm.bias.copy_(torch.from_numpy(w))
            else:
                theirs.get_submodule(names[name]).weight.copy_(torch.from_numpy(w.T.copy()))
    return layer, theirs, names


def tables(positions, batch, device, d_rope=SIZES["qk_rope_head_dim"]):
    """(cos, sin) as transformers' layers take them, (B, T, d_rope), made in float64 from our θ."""
    angles = np.asarray(positions, np.float64)[:, None] * rope_frequencies(d_rope)  # (T, d_rope / 2)
    angles = np.concatenate([angles, angles], axis=-1)
    return tuple(torch.from_numpy(f(angles)).to(device)[None].expand(batch, -1, -1) for f in (np.cos, np.sin))


def run_theirs(theirs, x, positions, cache=None):
    """transformers' layer on x (B, T, C) at positions, causal after the cache's tokens: (out, indices)."""
    B, T, _ = x.shape
    cached = 0 if cache is None else cache.get_seq_length()
    hidden = torch.ones(T, cached + T, dtype=torch.bool, device=x.device).triu(cached + 1)
    mask = torch.zeros(T, cached + T, dtype=x.dtype, device=x.device).masked_fill(hidden, -torch.inf)
    position_ids = torch.as_tensor(positions, device=x.device)[None].expand(B, -1)
    result = theirs(
        x, tables(positions, B, x.device), mask[None, None].expand(B, 1, -1, -1), cache=cache, position_ids=position_ids
    )
    return result[0]


def relative(mine, gold):
    gold = gold.detach().cpu().numpy() if hasattr(gold, "detach") else gold
    return float(np.max(np.abs(mine - gold)) / np.max(np.abs(gold)))


def clear_of_float32(layer, x, positions, margin=1e-5):
    """That no query's k-th best indexer score is within `margin` (relative; float32 rounds to 6e-8) of the next:
    transformers scores in float32, and would then choose by rounding; an exact tie, by its own order."""
    _, saved = layer.forward(x, positions=positions)
    ix = saved.indexer
    scores = np.sort(index_scores(ix.q, ix.k, ix.weights), axis=-1)[..., ::-1]  # (B, T, S) highest first
    k = layer.index_topk
    kth, rest = scores[..., k - 1], scores[..., k]
    finite = np.isfinite(rest)
    close = np.abs(kth[finite] - rest[finite]) <= margin * np.maximum(np.abs(kth[finite]), 1e-3)
    return not close.any()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("model", ["deepseek_v32", "glm_moe_dsa"])
def test_the_layer_and_its_gradients_equal_transformers(model, device):
    layer, theirs, names = make_pair(model, device, topk=4)
    rng = np.random.default_rng(2)
    x, dout = rng.standard_normal((2, 11, D_MODEL)), rng.standard_normal((2, 11, D_MODEL))
    positions = np.sort(rng.choice(200, 11, replace=False))
    assert clear_of_float32(layer, x, positions)
    x_t = torch.tensor(x, device=device, requires_grad=True)
    gold = run_theirs(theirs, x_t, positions)
    (gold * torch.from_numpy(dout).to(device)).sum().backward()  # the indexer runs under no_grad: keys held
    for absorbed in (True, False):
        out, saved = layer.forward(x, absorbed=absorbed, positions=positions)
        assert relative(out, gold) <= AS_IS, f"forward, absorbed={absorbed}"
        dx, grads = layer.backward(dout, saved)
        assert relative(dx, x_t.grad) <= AS_IS, f"dx, absorbed={absorbed}"
        for name, grad in grads.items():
            theirs_grad = theirs.get_submodule(names[name]).weight.grad
            assert relative(grad, theirs_grad.T if grad.ndim == 2 else theirs_grad) <= AS_IS, f"{name}, {absorbed}"


def decode_theirs(theirs, tokens, chunks, device):
    """transformers' layer over one sequence's tokens (T, C) in chunks through its own DynamicCache: the outputs
    (T, C) and the indexer keys it holds (T, d_I)."""
    cache, outs = DynamicCache(config=theirs.config), []
    with torch.no_grad():
        for start, stop in chunks:
            x = torch.from_numpy(tokens[None, start:stop]).to(device)
            outs.append(run_theirs(theirs, x, np.arange(start, stop), cache)[0].cpu().numpy())
    return np.concatenate(outs), cache.layers[0].indexer_keys[0].cpu().numpy()


def assert_same_indexer_keys(model, layer, ours, theirs):
    """ours (T, cache_dim), a token's latent then its indexer key, against transformers' indexer keys (T, d_I),
    rotated: the same numbers in either pair layout (transformers writes GLM-5's interleaved rotation's pairs
    halves apart, as it does k_rope)."""
    keys, d_rope = ours[:, layer.mla.latent_dim :], SIZES["qk_rope_head_dim"]
    rotated = to_half_split(keys[:, :d_rope]) if model == "glm_moe_dsa" else keys[:, :d_rope]
    np.testing.assert_allclose(np.concatenate([rotated, keys[:, d_rope:]], axis=-1), theirs, rtol=AS_IS, atol=AS_IS)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("model", ["deepseek_v32", "glm_moe_dsa"])
def test_decoding_through_a_kv_cache_equals_transformers(model, device):
    layer, theirs, _ = make_pair(model, device, topk=3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 10, D_MODEL))
    assert clear_of_float32(layer, x, np.arange(10))
    ours = KVCache(2, 1, 10, layer.cache_dim, dtype=np.float64, value_prefix=SIZES["kv_lora_rank"])
    cache = DynamicCache(config=theirs.config)
    with torch.no_grad():
        for start, stop in [(0, 6), (6, 7), (7, 8), (8, 10)]:  # a prefill, two decode steps, a chunk of two
            gold = run_theirs(theirs, torch.from_numpy(x[:, start:stop]).to(device), np.arange(start, stop), cache)
            assert relative(layer(x[:, start:stop], cache=ours), gold) <= AS_IS, (start, stop)
    for b in range(2):
        assert_same_indexer_keys(model, layer, ours.keys[b, 0], cache.layers[0].indexer_keys[b].cpu().numpy())


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("model", ["deepseek_v32", "glm_moe_dsa"])
def test_decoding_through_a_paged_cache_equals_transformers(model, device):
    """Three sequences in one pool, decoding together at their own lengths: a, b (shorter), and c, a fork of a after
    its prefill that goes on with tokens of its own; transformers runs each alone through a DynamicCache."""
    layer, theirs, _ = make_pair(model, device, topk=3)
    rng = np.random.default_rng(5)
    tokens = rng.standard_normal((3, 10, D_MODEL))  # a's, b's and c's; c's first 6 are a's
    tokens[2, :6] = tokens[0, :6]
    assert all(clear_of_float32(layer, tokens[i : i + 1], np.arange(10)) for i in range(3))
    pool = PagedKVCache(24, 2, 1, layer.cache_dim, dtype=np.float64, value_prefix=SIZES["kv_lora_rank"])
    a, b = pool.add_sequence(), pool.add_sequence()
    outs = [[layer(tokens[:1, :6], cache=pool, seq_ids=[a])[0]], [layer(tokens[1:2, :3], cache=pool, seq_ids=[b])[0]]]
    c = pool.fork(a)
    outs.append([outs[0][0]])
    starts = np.array([6, 3, 6])
    for n in (1, 1, 2):  # two decode steps and a chunk of two, the three sequences at once
        x = np.stack([tokens[i, start : start + n] for i, start in enumerate(starts)])  # (3, n, C)
        for i, out in enumerate(layer(x, cache=pool, seq_ids=[a, b, c])):
            outs[i].append(out)
        starts += n
    for i, (seq, prefill) in enumerate(zip([a, b, c], [6, 3, 6], strict=True)):
        chunks = [(0, prefill), (prefill, prefill + 1), (prefill + 1, prefill + 2), (prefill + 2, prefill + 4)]
        gold, keys = decode_theirs(theirs, tokens[i], chunks, device)
        assert relative(np.concatenate(outs[i]), gold) <= AS_IS, f"sequence {seq}"
        assert_same_indexer_keys(model, layer, pool.gather(seq)[0][0], keys)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_the_indexer_loss_gradient_equals_torch_autograd(device):
    """transformers has no indexer loss: the KL of DeepSeek-V3.2's paper is written here in torch over its
    indexer's own modules, and autograd gives the indexer weights' gradients."""
    layer, theirs, names = make_pair("deepseek_v32", device, topk=4)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 9, D_MODEL))
    _, saved = layer.forward(x)
    loss, grads = layer.indexer_loss(saved)
    ix_module, B, T = theirs.indexer, 2, 9
    x_t = torch.from_numpy(x).to(device)
    c_q = torch.from_numpy(saved.proj.c_q).to(device)  # detached: the indexer's inputs
    cos, sin = tables(np.arange(T), B, device)
    d_rope = SIZES["qk_rope_head_dim"]
    q = ix_module.wq_b(c_q).view(B, T, 8, 8)
    k = ix_module.k_norm(ix_module.wk(x_t)).unsqueeze(2)
    q_rot, k_rot = deepseek.apply_rotary_pos_emb(q[..., :d_rope], k[..., :d_rope], cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q[..., d_rope:]], -1), torch.cat([k_rot, k[..., d_rope:]], -1).squeeze(2)
    scores = torch.relu(q.transpose(1, 2) @ k.transpose(-1, -2)[:, None] * 8**-0.5)  # (B, H_I, T, S)
    index = torch.einsum("bth,bhts->bts", ix_module.weights_proj(x_t) * 8**-0.5, scores)
    chosen = torch.from_numpy(saved.indices).to(device)
    listed = chosen >= 0
    picked = torch.gather(index, -1, chosen.clamp(min=0)).masked_fill(~listed, -torch.inf)  # (B, T, n)
    log_q = torch.log_softmax(picked, dim=-1)
    a = saved.attended
    p = torch.softmax(
        torch.from_numpy(np.einsum("bhte,bhse->bhts", a.q, a.k) * layer.mla.softmax_scale).masked_fill(
            ~torch.from_numpy(chosen_mask(saved.indices, T)), -torch.inf
        ),
        dim=-1,
    )
    target = torch.gather(p.sum(1) / HEADS, -1, chosen.cpu().clamp(min=0)).masked_fill(~listed.cpu(), 0).to(device)
    gold = torch.where(listed, target * (torch.log(target.clamp(min=1e-300)) - log_q), 0).sum()
    gold.backward()
    assert loss == pytest.approx(gold.item(), rel=1e-10)
    for name, grad in grads.items():
        module = ix_module.k_norm if name.startswith("index_k_norm") else theirs.get_submodule(names[name])
        theirs_grad = module.bias.grad if name.endswith("bias") else module.weight.grad
        assert relative(grad, theirs_grad.T if grad.ndim == 2 else theirs_grad) <= 1e-10, name
