"""The readers of linear attention and the other recurrences that keep a state of fixed size: gated DeltaNet
(Qwen3-Next, OLMo-Hybrid), a short convolution (LFM2), lightning attention (MiniMax), Kimi Delta Attention, the
RG-LRU (RecurrentGemma), RWKV's time mixing and xLSTM's mLSTM, each what its config alone says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..model_parts import LinearAttention
from .fields import OWN_LAYERS, Fields

__all__ = ["LINEAR_READERS"]


def _special_gated_deltanet(fields: Fields, found: dict[str, Any]) -> None:
    """Qwen3-Next: its linear layers' heads, widths and convolution."""
    found["linear"] = LinearAttention(
        "gated_deltanet",
        key_heads=fields.integer("linear_num_key_heads"),
        value_heads=fields.integer("linear_num_value_heads"),
        key_dim=fields.integer("linear_key_head_dim"),
        value_dim=fields.integer("linear_value_head_dim"),
        conv_kernel=fields.integer("linear_conv_kernel_dim"),
    )


def _special_deltanet_olmo(fields: Fields, found: dict[str, Any]) -> None:
    """OLMo-Hybrid: gated DeltaNet layers whose heads default to the attention's, keys 0.75 · C wide in all."""
    key_heads = fields.integer("linear_num_key_heads", none=True) or found["heads"]
    key_dim = fields.integer("linear_key_head_dim", none=True) or int(0.75 * found["hidden"] / key_heads)
    found["linear"] = LinearAttention(
        "gated_deltanet",
        key_heads=key_heads,
        value_heads=fields.integer("linear_num_value_heads", none=True) or found["heads"],
        key_dim=key_dim,
        value_dim=fields.integer("linear_value_head_dim", none=True) or 2 * key_dim,
        conv_kernel=fields.integer("linear_conv_kernel_dim"),
    )


def _special_short_conv(fields: Fields, found: dict[str, Any]) -> None:
    """LFM2: its conv layers, a gated short convolution over the hidden width."""
    hidden = found["hidden"]
    short_conv = LinearAttention(
        "short_conv", 1, 1, hidden, hidden, conv_kernel=fields.integer("conv_L_cache"), bias=fields.boolean("conv_bias")
    )
    found["linear"] = short_conv if "linear_attention" in (found["layer_types"] or ()) else None


def _special_lightning(fields: Fields, found: dict[str, Any]) -> None:
    """MiniMax: its linear layers have the attention's heads and head_dim."""
    heads, head_dim = found["heads"], found["head_dim"]
    found["linear"] = LinearAttention("lightning", heads, heads, head_dim, head_dim)


# what linear_attn_config may hold (Kimi Linear): what transformers reads from it, and the gate's floor
KIMI_LINEAR_KEYS = (
    "head_dim",
    "num_heads",
    "short_conv_kernel_size",
    "full_attn_layers",
    "kda_layers",
    "gate_lower_bound",
    "use_full_rank_gate",
)


def _special_kda(fields: Fields, found: dict[str, Any]) -> None:
    """Kimi Linear: Kimi Delta Attention layers, their heads and convolution from linear_attn_config where it
    gives them (as transformers reads it), else linear_num_heads, linear_head_dim, linear_conv_kernel_dim;
    its latent attention has no RoPE (mla_use_nope), and moe_layer_freq, which transformers ignores, says 1."""
    nested = fields.nested("linear_attn_config", {})
    unknown = sorted(set(nested) - set(KIMI_LINEAR_KEYS))
    if unknown or nested.get("use_full_rank_gate"):  # a full-rank forget gate: weights transformers does not build
        raise fields.refuse(
            "linear_attn_config",
            f"holds {', '.join(unknown) or 'use_full_rank_gate'}, which transformers does not build",
            nested,
        )
    sizes = {}
    for name, key in (
        ("linear_num_heads", "num_heads"),
        ("linear_head_dim", "head_dim"),
        ("linear_conv_kernel_dim", "short_conv_kernel_size"),
    ):
        own = fields.integer(name)
        sizes[name] = fields.nested_size("linear_attn_config", nested, key) if key in nested else own
    heads, width = sizes["linear_num_heads"], sizes["linear_head_dim"]
    conv_kernel = sizes["linear_conv_kernel_dim"]
    found["linear"] = LinearAttention("kda", heads, heads, width, width, conv_kernel=conv_kernel)
    for name, built in (("mla_use_nope", True), ("moe_layer_freq", 1), ("mla_use_output_gate", False)):
        fields.agrees(name, built)


def _special_rglru(fields: Fields, found: dict[str, Any]) -> None:
    """RecurrentGemma (Griffin): block_types repeated over the layers, each recurrent block an RG-LRU of lru_width
    (heads of lru_width / num_attention_heads), each attention block a window of attention_window_size; heads of
    hidden_size / num_attention_heads, whatever head_dim says, as its config class sets them."""
    heads, layers, hidden = found["heads"], found["layers"], found["hidden"]
    if found["head_dim"] != hidden // heads:
        raise fields.refuse(
            "head_dim",
            f"is not hidden_size // num_attention_heads = {hidden // heads}, which transformers builds",
            found["head_dim"],
        )
    blocks = fields.get("block_types")
    if not isinstance(blocks, (list, tuple)) or not blocks or not set(blocks) <= {"recurrent", "attention"}:
        raise fields.refuse("block_types", "must be a list of 'recurrent' and 'attention'")
    kinds = tuple(
        "linear_attention" if blocks[i % len(blocks)] == "recurrent" else "sliding_attention" for i in range(layers)
    )
    width = fields.integer("lru_width", none=True) or hidden
    if width % heads:
        raise fields.refuse("lru_width", f"must split into {heads} blocks (num_attention_heads)", width)
    linear = LinearAttention("rglru", heads, heads, 1, width // heads, conv_kernel=fields.integer("conv1d_width"))
    window = fields.integer("attention_window_size", "sliding_window")
    found.update(layer_types=kinds, sliding_window=window, linear=linear if "linear_attention" in kinds else None)


def _special_rwkv(fields: Fields, found: dict[str, Any]) -> None:
    """RWKV-4: time mixing in every layer (its channel mixing is the MLP and a part of the table); transformers
    keeps its state hidden_size wide, so attention_hidden_size must be hidden_size."""
    width = fields.integer("attention_hidden_size", none=True) or found["hidden"]
    if width != found["hidden"]:
        raise fields.refuse("attention_hidden_size", "is not hidden_size, the width of transformers' RWKV state", width)
    found.update(linear=LinearAttention("rwkv", 1, 1, 1, width), layer_types=("linear_attention",) * found["layers"])


def _round_up(fields: Fields, name: str, size: int, multiple: int) -> int:
    """size · the factor `name`, rounded up to a multiple, as xLSTM's config rounds its widths."""
    factor = fields.number(name)
    if factor is None or not 0 < factor <= 2**10:
        raise fields.refuse(name, "must be a positive number")
    return int(((size * factor + multiple - 1) // multiple) * multiple)


def _special_mlstm(fields: Fields, found: dict[str, Any]) -> None:
    """xLSTM: an mLSTM layer and a gated MLP in every block. transformers builds the q, k and v widths as
    int(hidden_size · factor) and sizes its cache by the same rounded up to 64: they must agree (a multiple of 64,
    split into num_heads); the MLP is hidden_size · ffn_proj_factor rounded up to ffn_round_up_to_multiple_of."""
    hidden, heads = found["hidden"], fields.integer("num_heads")
    for name, other in (("num_blocks", found["layers"]), ("embedding_dim", hidden)):
        fields.agrees(name, other)  # transformers builds the blocks, the table by these, the rest by the others
    widths = []
    for name in ("qk_dim_factor", "v_dim_factor"):
        width = _round_up(fields, name, hidden, 64)
        if width != int(hidden * fields.get(name)) or width % heads:
            raise fields.refuse(name, f"times hidden_size must be a multiple of 64 that {heads} heads split")
        widths.append(width // heads)
    found["intermediate"] = _round_up(fields, "ffn_proj_factor", hidden, fields.integer("ffn_round_up_to_multiple_of"))
    mlstm = LinearAttention("mlstm", heads, heads, widths[0], widths[1], bias=fields.boolean("use_bias"))
    found.update(linear=mlstm, layer_types=("linear_attention",) * found["layers"])


# name -> (the reader, the kinds of layer it brings besides softmax attention), as special.SPECIAL_READERS
LINEAR_READERS: dict[str, tuple[Callable[[Fields, dict[str, Any]], None], tuple[str, ...]]] = {
    "gated_deltanet": (_special_gated_deltanet, ("linear_attention",)),
    "deltanet_olmo": (_special_deltanet_olmo, ("linear_attention",)),
    "short_conv": (_special_short_conv, ("linear_attention",)),
    "lightning": (_special_lightning, ("linear_attention",)),
    "kda": (_special_kda, ("linear_attention",)),
    "rglru": (_special_rglru, OWN_LAYERS),
    "rwkv": (_special_rwkv, OWN_LAYERS),
    "mlstm": (_special_mlstm, OWN_LAYERS),
}
