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
