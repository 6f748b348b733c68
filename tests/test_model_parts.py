"""model_parts.py: each part's weights and state by hand, and the sizes each refuses."""

from __future__ import annotations

import pytest

from tinyattn_np.model_parts import Experts, LatentAttention, LinearAttention


def test_an_expert_and_the_router_by_hand():
    """C = 8, experts of F = 6: gate, up and down 3·8·6; biases 2·6 + 8; the router 8 a expert, + 1 per bias."""
    plain = Experts(4, 2, 6, (0, 1))
    assert plain.expert_parameters(8) == 3 * 8 * 6
    assert plain.router_parameters(8) == 4 * 8
    biased = Experts(4, 2, 6, (0, 1), expert_bias=True, router_bias=True, score_bias=True)
    assert biased.expert_parameters(8) == 3 * 8 * 6 + 2 * 6 + 8
    assert biased.router_parameters(8) == 4 * (8 + 2)


def test_latent_attention_by_hand():
    """2 heads; kv_rank 4, q_rank 3, rope 2, nope 2, v 3; C = 8 (the formula of the class docstring)."""
    latent = LatentAttention(4, 2, 2, 3, q_rank=3)
    assert latent.parameters(8, 2) == (8 * 3 + 3 + 3 * 2 * 4) + (8 * 6 + 4) + 4 * 2 * 5 + 2 * 3 * 8 == 191
    assert LatentAttention(4, 2, 2, 3).parameters(8, 2) == 8 * 2 * 4 + 52 + 40 + 48
    assert LatentAttention(4, 2, 2, 3, q_rank=3, bias=True).parameters(8, 2) == 191 + 3 + 6 + 8


def test_linear_attention_by_hand():
    """Gated DeltaNet: 1 key head of 3, 2 value heads of 5, a convolution of 4 over 2·3 + 2·5 = 16 channels."""
    deltanet = LinearAttention("gated_deltanet", 1, 2, 3, 5, conv_kernel=4)
    assert deltanet.conv_channels == 16
    assert deltanet.parameters(8) == 8 * (2 * 3 + 2 * 10) + 8 * 4 + 16 * 4 + 4 + 5 + 10 * 8
    assert deltanet.state_bytes(3, "fp32") == 3 * (2 * 3 * 5 + 16 * 4) * 4
    lightning = LinearAttention("lightning", 2, 2, 4, 4)
    assert lightning.conv_channels == 0 and lightning.parameters(8) == 8 * 24 + 8 + 8 * 8 + 8 * 8
    assert lightning.state_bytes(1, "fp32") == 2 * 4 * 4 * 4


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Experts(4, 5, 6, (0,)), ValueError, "per_token must be at most count=4; got 5"),
        (lambda: Experts(4, 2, 6, ()), TypeError, "layers must be a non-empty tuple"),
        (lambda: Experts(4, 2, 6, (1, 0)), ValueError, "layers must be increasing layer indices"),
        (lambda: Experts(4, 2, 6, (0,), shared_gate=True), ValueError, "needs shared_intermediate > 0"),
        (lambda: LatentAttention(0, 2, 2, 3), ValueError, "kv_rank must be a positive int; got 0"),
        (lambda: LinearAttention("mamba", 1, 1, 2, 2), ValueError, "kind must be one of gated_deltanet, lightning"),
        (lambda: LinearAttention("gated_deltanet", 2, 3, 2, 2, 4), ValueError, "multiple of key_heads"),
        (lambda: LinearAttention("gated_deltanet", 1, 1, 2, 2), ValueError, "conv_kernel must be >= 1; got 0"),
        (lambda: LinearAttention("lightning", 1, 1, 2, 3), ValueError, "key_dim == value_dim"),
    ],
)
def test_each_part_refuses_sizes_that_mean_nothing(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_state_space_layers_by_hand():
    """Mamba: C = 8, inner 16, N 4, a convolution of 3, Δ of rank 2. Mamba-2: 2 heads, 1 group."""
    from tinyattn_np.model_parts import StateSpace

    mamba = StateSpace("mamba", inner=16, state=4, conv_kernel=3, dt_rank=2)
    # in 8·32, conv 16·3 + 16, x_proj 16·(2 + 8), dt_proj 2·16 + 16, A 16·4, D 16, out 16·8
    assert mamba.parameters(8) == 8 * 32 + 16 * 3 + 16 + 16 * 10 + 2 * 16 + 16 + 16 * 4 + 16 + 16 * 8
    assert mamba.conv_channels == 16 and mamba.state_bytes(2, "fp32") == 2 * (16 * 4 + 16 * 3) * 4
    mamba2 = StateSpace("mamba2", inner=16, state=4, conv_kernel=3, heads=2)
    # in 8·(32 + 8 + 2), conv (16 + 8)·3 + 24, Δ bias, A, D 3·2, norm 16, out 16·8
    assert mamba2.parameters(8) == 8 * 42 + 24 * 3 + 24 + 6 + 16 + 16 * 8
    assert mamba2.conv_channels == 24 and mamba2.state_bytes(1, "fp32") == (16 * 4 + 24 * 3) * 4
    with pytest.raises(ValueError, match="dt_rank >= 1"):
        StateSpace("mamba", inner=16, state=4, conv_kernel=3)
    with pytest.raises(ValueError, match="must split into heads"):
        StateSpace("mamba2", inner=16, state=4, conv_kernel=3, heads=3)


def test_the_indexer_and_a_short_convolution_by_hand():
    from tinyattn_np.model_parts import Indexer

    indexer = Indexer(heads=2, head_dim=4, topk=8, q_rank=6)
    assert indexer.parameters(8) == 6 * 2 * 4 + 8 * 4 + 2 * 4 + 8 * 2
    short = LinearAttention("short_conv", 1, 1, 8, 8, conv_kernel=3, bias=True)
    assert short.parameters(8) == 8 * 24 + 8 * 3 + 8 * 8 + 5 * 8
    assert short.state_bytes(2, "fp32") == 2 * 8 * 3 * 4  # the convolution's inputs, no recurrent state


def test_an_extra_counts_where_it_sits():
    from tinyattn_np.model_parts import Extra
    from tinyattn_np.models import ModelShape

    sizes = dict(layers=4, heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=10, intermediate=12)
    plain = ModelShape("plain", **sizes)
    gated = ModelShape(
        "gated",
        **sizes,
        extras=(
            Extra("a gate", "attention", 5),
            Extra("a table", "model", 7),
            Extra("idle", "every layer", 3, active=False),
        ),
    )
    assert gated.num_parameters == plain.num_parameters + 4 * 5 + 7 + 4 * 3
    assert gated.active_parameters == gated.num_parameters - 4 * 3
    with pytest.raises(ValueError, match="the place of extra 'nowhere'"):
        ModelShape("bad", **sizes, extras=(Extra("nowhere", "attic", 1),))


def test_kda_rglru_rwkv_and_mlstm_by_hand():
    """C = 8. KDA: 2 heads of 4, a convolution of 3 over q, k, v (24 channels). RG-LRU: 2 blocks of 3 (W = 6),
    a convolution of 4 keeping 3 inputs. RWKV: A = C = 8. mLSTM: 2 heads, keys of 2, values of 4."""
    kda = LinearAttention("kda", 2, 2, 4, 4, conv_kernel=3)
    # q, k, v 8·24, conv 24·3, forget and output gates 2·(8·4 + 4·8), dt bias 8, A 2, step 8·2, norm 4, out 8·8
    assert kda.parameters(8) == 8 * 24 + 24 * 3 + 2 * (8 * 4 + 4 * 8) + 8 + 2 + 8 * 2 + 4 + 8 * 8
    assert kda.state_bytes(2, "fp32") == 2 * (2 * 4 * 4 + 24 * 3) * 4
    rglru = LinearAttention("rglru", 2, 2, 1, 3, conv_kernel=4)
    # x and y branches 2·(8·6 + 6), out 6·8 + 8, conv 6·4 + 6, the recurrence 6, the gates 2·(2·3·3 + 6)
    assert rglru.parameters(8) == 2 * (8 * 6 + 6) + 6 * 8 + 8 + 6 * 4 + 6 + 6 + 2 * (2 * 3 * 3 + 6)
    assert rglru.state_numbers() == 6 + 6 * 3
    rwkv = LinearAttention("rwkv", 1, 1, 1, 8)
    assert rwkv.parameters(8) == 4 * 8 * 8 + 2 * 8 + 3 * 8 and rwkv.state_numbers() == 5 * 8
    mlstm = LinearAttention("mlstm", 2, 2, 2, 4)
    # q, k 8·4 each, v and the output gate 8·8 each, the gates 8·2·2 + 2·2, the head norm 8, out 8·8
    assert mlstm.parameters(8) == 8 * (2 * 4 + 2 * 8) + 8 * 4 + 4 + 8 + 8 * 8
    assert LinearAttention("mlstm", 2, 2, 2, 4, bias=True).parameters(8) == mlstm.parameters(8) + 2 * 4 + 3 * 8 + 8
    assert mlstm.state_numbers() == 2 * 2 * 4 + 2 * 2 + 2
    with pytest.raises(ValueError, match="rwkv has no convolution"):
        LinearAttention("rwkv", 1, 1, 1, 8, conv_kernel=2)
    with pytest.raises(ValueError, match="kda has key_heads == value_heads"):
        LinearAttention("kda", 1, 2, 4, 4, conv_kernel=3)


def test_a_kind_of_attention_and_experts_beside_the_mlp():
    """KindAttention checks its sizes; experts beside the MLP keep the layer's dense MLP in the count."""
    from tinyattn_np.model_parts import KindAttention
    from tinyattn_np.models import ModelShape

    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        KindAttention("sliding_attention", 4, 3, 8)
    with pytest.raises(ValueError, match="head_dim is nope_dim \\+ rope_dim"):
        KindAttention("full_attention", 2, 2, 8, latent=LatentAttention(4, 2, 2, 3))
    sizes = dict(layers=2, heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=10, intermediate=12)
    instead = ModelShape("instead", **sizes, experts=Experts(4, 2, 6, (0, 1)))
    beside = ModelShape("beside", **sizes, experts=Experts(4, 2, 6, (0, 1), beside_mlp=True))
    assert beside.num_parameters - instead.num_parameters == 2 * 3 * 8 * 12  # each layer's gated MLP, kept
