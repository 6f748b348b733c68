"""The Hugging Face config.json reader: a ModelShape from the config of any architecture it knows.

load_model_shape reads a config.json (or a preset's name, or a dict) and shape_from_config a config's
dict, by the rules of its model_type (ARCHITECTURES, each as transformers' modeling file builds it); a field
the config leaves out means what its transformers config class means. A field that would change the bill and
that the reader does not understand is refused, naming the field and its value, and so is a model type it
does not bill, with why (census.py): a wrong bill in a clean table is worse than none. The rules, one line
each, are on docs/memory.md.

    fields.py       the config's dict, read field by field through its class's defaults, every value checked
    defaults.py     each model type's config class defaults, for every field that changes the bill
    table.py        one row per model_type: how its block is built, its experts, the parts only it has
    formulas.py     the table's formulas ("2·Hq·E + C") worked out
    layer_kinds.py  which layers slide, chunk, are linear or state-space layers
    experts.py      which layers route and how wide the experts are
    special.py      what one architecture alone has (latent attention, Falcon's switches, Gemma-4's kinds, ...)
    recurrent.py    linear attention and other recurrences of a fixed state (DeltaNet, KDA, RG-LRU, RWKV, mLSTM)
    state_space.py  Mamba, Mamba-2 and the hybrids around them (Jamba, Nemotron-H, Zamba, ...)
    read.py         shape_from_config: the rows applied, every field left over judged
    census.py       every model type of transformers' causal-LM mapping: billed, refused with why, or no text
                    decoder at all
    files.py        load_model_shape: presets, files and folders, JSON read safely
"""

from __future__ import annotations

from .census import NOT_TEXT_DECODERS, REFUSED, census
from .files import MAX_CONFIG_BYTES, load_model_shape
from .read import shape_from_config
from .table import ARCHITECTURES

__all__ = [
    "ARCHITECTURES",
    "MAX_CONFIG_BYTES",
    "NOT_TEXT_DECODERS",
    "REFUSED",
    "census",
    "load_model_shape",
    "shape_from_config",
]
