"""The Hugging Face config.json reader: a ModelShape from the config of any architecture it knows.

load_model_shape reads a config.json (or a preset's name, or a dict) and shape_from_config a config's
dict, by the rules of its model_type (ARCHITECTURES, each as transformers' modeling file builds it). A field
that would change the bill and that the reader does not understand is refused, naming the field, its value
and the architectures it knows: a wrong bill in a clean table is worse than none. The rules, one line
each, are on docs/memory.md.

    fields.py       the config's dict, read field by field (which were read, each value's type)
    table.py        one row per model_type: how its block is built
    layer_kinds.py  which layers slide, chunk or are linear
    experts.py      how each family names its experts
    special.py      what one architecture alone has (latent attention, linear layers, Falcon's switches)
    read.py         shape_from_config: the rows applied, every field left over judged
    files.py        load_model_shape: presets, files and folders, JSON read safely
"""

from __future__ import annotations

from .census import NOT_TEXT_DECODERS, REFUSED, census
from .files import MAX_CONFIG_BYTES, load_model_shape
from .read import shape_from_config
from .table import ARCHITECTURES

__all__ = ["ARCHITECTURES", "MAX_CONFIG_BYTES", "NOT_TEXT_DECODERS", "REFUSED", "census", "load_model_shape",
           "shape_from_config"]  # fmt: skip
