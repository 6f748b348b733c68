"""The model types of transformers' causal-LM mapping that the reader does not bill, each with why: the text
decoders it refuses, and the models that are not text decoders at all."""

from __future__ import annotations

from typing import Any

from .fields import shown_value
from .table import ARCHITECTURES

__all__ = ["NOT_TEXT_DECODERS", "REFUSED", "TRANSFORMERS_VERSION", "refuse_model_type"]

TRANSFORMERS_VERSION = "5.24.0"  # the version whose MODEL_FOR_CAUSAL_LM_MAPPING_NAMES this census covers

# text decoders the reader refuses, and why
REFUSED: dict[str, str] = {}

# model types of the mapping that are not decoder-only text models, and what they are
NOT_TEXT_DECODERS: dict[str, str] = {}


def refuse_model_type(model_type: Any) -> ValueError:
    """The error for a model_type the reader does not bill: why, where the census says; else that it is unknown."""
    if isinstance(model_type, str) and model_type in REFUSED:
        why = f"is a text decoder the reader does not bill: {REFUSED[model_type]}"
    elif isinstance(model_type, str) and model_type in NOT_TEXT_DECODERS:
        why = f"is not a decoder-only text model ({NOT_TEXT_DECODERS[model_type]}): the reader bills those only"
    else:
        why = (f"is not an architecture the reader knows (it reads {len(ARCHITECTURES)} model types; python "
               "scripts/memory.py --architectures lists them)")  # fmt: skip
    shown = shown_value(model_type)
    return ValueError(f"config field 'model_type' = {shown} {why}. A bill that guessed could be wrong.")
