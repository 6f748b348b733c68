"""Every model type of transformers' causal-LM mapping, sorted: the ones the reader bills (table.py), the text
decoders it refuses (each with why), and the models that are not decoder-only text models (each with what
they are). torch_crosscheck/test_torch_architectures.py checks the list against transformers at the pinned
version, bills every one of the first kind against transformers' own model, and prints the counts that
census() gives and `python scripts/memory.py --architectures` prints.
"""

from __future__ import annotations

from typing import Any

from .fields import shown_value
from .table import ARCHITECTURES, TEXT_CONFIG

__all__ = [
    "BILLED",
    "CAUSAL_LM_MODEL_TYPES",
    "NOT_TEXT_DECODERS",
    "REFUSED",
    "TRANSFORMERS_VERSION",
    "census",
    "refuse_model_type",
]

TRANSFORMERS_VERSION = "5.24.0"
# MODEL_FOR_CAUSAL_LM_MAPPING_NAMES of that version, by model type
CAUSAL_LM_MODEL_TYPES = tuple(
    """
afmoe apertus apertus1p5_text arcee aria_text axk1 axk2 bailing_hybrid bamba bart beam bert bert-generation
big_bird bigbird_pegasus biogpt bitnet blenderbot blenderbot-small bloom blt camembert codegen cohere cohere2
cohere2_moe cohere_compass_text cpmant ctrl cwm data2vec-text dbrx deepseek_v2 deepseek_v3 deepseek_v32
deepseek_v4 diffllama doge dory dots1 dots3_note dots3_note_text electra emu3 ernie ernie4_5 ernie4_5_moe exaone
exaone4 exaone_moe falcon falcon_h1 falcon_mamba flex_olmo flint fuyu gemma gemma2 gemma3 gemma3_text gemma3n
gemma3n_text gemma4 gemma4_assistant gemma4_text gemma4_unified gemma4_unified_assistant gemma4_unified_text git
glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa got_ocr2 gpt-sw3 gpt2 gpt_bigcode gpt_neo gpt_neox gpt_neox_japanese
gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared helium hrm_text
hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax inkling2_loop_text inkling2_text inkling_text internlm3
iquestcoder jais2 jamba jetmoe kimi_linear kolibri1 laguna lara_mini lfm2 lfm2_moe lfm3 llama llama4 llama4_text
longcat_flash mamba mamba2 marian mbart megatron-bert mellum mimo_v2_flash minicpm3 minimax minimax_m2
minimax_m3_vl_text ministral ministral3 mistral mixtral mllama modernbert-decoder moshi moss_transcribe_diarize
mpt musicgen musicgen_melody mvp nanochat nemotron nemotron_h olmo olmo2 olmo3 olmo_hybrid olmoe openai-gpt opt
pegasus persimmon phi phi3 phi4_multimodal phimoe plbart prophetnet qwen2 qwen2_moe qwen3 qwen3_5 qwen3_5_moe
qwen3_5_moe_text qwen3_5_text qwen3_moe qwen3_next qwen4_exp qwen4_exp_text recurrent_gemma reformer rembert
roberta roberta-prelayernorm roc_bert roformer rwkv sarvam_mla sarvam_moe seed_oss smollm3 solar_open stablelm
starcoder2 trocr vaultgemma whisper xglm xlm xlm-roberta xlm-roberta-xl xlnet xlstm xmod youtu zamba zamba2 zaya
""".split()
)

# text decoders the reader refuses, and why: each has a part no row of the table reads yet
REFUSED: dict[str, str] = {
    "axk2": "its norms run an MLP of their own (input_layernorm.mlp) beside DeepSeek's indexer",
    "bailing_hybrid": "its linear layers (forget gates, a short convolution) sit between latent-attention layers",
    "blt": "bytes grouped into patches: a local encoder and decoder around a global transformer",
    "cpmant": "segment embeddings and a relative position bias in place of a decoder's positions",
    "deepseek_v4": "compressed attention with hyper-connections: its compressor's sizes vary by layer",
    "dory": "depth recurrence: its middle layers run n_recurrent_loops times, with a cache per loop",
    "hrm_text": "two stacks of layers run in nested cycles (H_cycles, L_cycles)",
    "hy_v4": "hyper-connections around every block, beside DeepSeek's indexer",
    "inkling2_text": "short convolutions and message gates in attention, and kv heads that vary by layer",
    "inkling2_loop_text": "looped layers with message gates: its middle layers run several passes",
    "qwen4_exp_text": "hyper-connections and n-gram embeddings around a Qwen3-Next stack",
    "qwen4_exp": "its language model (qwen4_exp_text) has hyper-connections and n-gram embeddings",
    "reformer": "LSH and chunked local attention with axial position embeddings",
    "zaya": "compressed convolutional attention and a router that is an MLP of its own",
}

_ENCODER = "an encoder (a masked language model) that transformers can run as a decoder"
_ENCODER_DECODER = "an encoder-decoder: its decoder cross-attends to what an encoder read"
_VISION = "a vision-language model whose causal-LM class holds its vision tower"
_DRAFTER = "a drafting head for speculative decoding: it reads the hidden states of the model it drafts for"
# model types of the mapping that are not decoder-only text models, and what they are
NOT_TEXT_DECODERS: dict[str, str] = {
    **dict.fromkeys(
        "bart bigbird_pegasus blenderbot blenderbot-small marian mbart mvp pegasus plbart prophetnet".split(),
        _ENCODER_DECODER,
    ),
    **dict.fromkeys(
        """bert bert-generation big_bird camembert data2vec-text electra ernie megatron-bert rembert roberta
        roberta-prelayernorm roc_bert roformer xlm xlm-roberta xlm-roberta-xl xmod""".split(),
        _ENCODER,
    ),
    "xlnet": "a permutation language model: two streams of relative attention, an encoder's architecture",
    "trocr": "the decoder of an image-to-text encoder-decoder: it cross-attends to the image",
    "whisper": "speech recognition: an encoder-decoder over audio",
    "moshi": "speech: a temporal transformer and a depth decoder over audio codebooks",
    "musicgen": "music: a decoder over audio codebooks, conditioned by a text encoder",
    "musicgen_melody": "music: a decoder over audio codebooks, conditioned by text and a melody",
    "moss_transcribe_diarize": "speech: an audio tower in front of its text decoder",
    **dict.fromkeys(("fuyu", "git", "got_ocr2", "phi4_multimodal"), _VISION),
    "mllama": "vision-language: its text layers cross-attend to the image (Llama 3.2 Vision)",
    "gemma3": f"{_VISION}; its text decoder is gemma3_text",
    "gemma3n": f"{_VISION} and an audio tower; its text decoder is gemma3n_text",
    "gemma4": f"{_VISION}; its text decoder is gemma4_text",
    "gemma4_unified": f"{_VISION}; its text decoder is gemma4_unified_text",
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), _DRAFTER),
}


# every model type the reader bills: a row of its own, or its language model's, in text_config
BILLED = set(ARCHITECTURES) | {outer for outer, inner in TEXT_CONFIG.items() if inner in ARCHITECTURES}


def census() -> dict[str, Any]:
    """The counts of the mapping: model types, text decoders, billed, refused, not text decoders; and a summary."""
    text = [model_type for model_type in CAUSAL_LM_MODEL_TYPES if model_type not in NOT_TEXT_DECODERS]
    billed = [model_type for model_type in text if model_type in BILLED]
    refused = sorted(set(text) - set(billed))
    share = len(billed) / len(text)
    summary = (
        f"transformers {TRANSFORMERS_VERSION}'s causal-LM mapping: {len(CAUSAL_LM_MODEL_TYPES)} model types, "
        f"{len(text)} of them text decoders: {len(billed)} billed ({share:.0%}), {len(refused)} refused; "
        f"{len(NOT_TEXT_DECODERS)} are not text decoders"
    )
    return dict(
        model_types=len(CAUSAL_LM_MODEL_TYPES),
        text_decoders=len(text),
        billed=len(billed),
        billed_types=billed,
        refused=refused,
        not_text_decoders=len(NOT_TEXT_DECODERS),
        summary=summary,
    )


def refuse_model_type(model_type: Any) -> ValueError:
    """The error for a model_type the reader does not bill: why, where the census says; else that it is unknown."""
    if isinstance(model_type, str) and model_type in REFUSED:
        why = f"is a text decoder the reader does not bill: {REFUSED[model_type]}"
    elif isinstance(model_type, str) and model_type in TEXT_CONFIG:
        inner = TEXT_CONFIG[model_type]
        why = f"keeps its language model in text_config (model_type {inner!r}), which this config lacks"
    elif isinstance(model_type, str) and model_type in NOT_TEXT_DECODERS:
        why = f"is not a decoder-only text model ({NOT_TEXT_DECODERS[model_type]}): the reader bills those only"
    else:
        why = (
            f"is not an architecture the reader knows (it reads {len(BILLED)} model types; python "
            "scripts/memory.py --architectures lists them)"
        )
    shown = shown_value(model_type)
    return ValueError(f"config field 'model_type' = {shown} {why}. A bill that guessed could be wrong.")
