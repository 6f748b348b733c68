"""A config.json's dict, read field by field, as transformers' config class reads it.

A field config.json leaves out takes its config class's default (defaults.py); a field given as null is None,
as transformers passes it: a switch that is None is off (the modeling code's `if config.x`), a size that
is None means what the reader's rule for it says, or is refused. Every value is checked before any
arithmetic: a bool is not a number, a float is not a count, NaN and sizes no model has are refused, each
with the field's name and value. The fields read are remembered, so that the ones left over can be judged.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_LAYERS",
    "MAX_SIZE",
    "MISSING",
    "OWN_LAYERS",
    "Fields",
    "Rule",
    "check_depth",
    "shown_value",
    "switch",
]

MISSING: Any = object()  # neither in config.json nor a default of the config class
MAX_SIZE = 2**40  # a width, a count or a vocabulary larger than this is no model's
MAX_DEPTH = 32  # a config.json nests a few levels deep (text_config, rope_parameters per layer kind)
MAX_LAYERS = 10_000  # no model has more than a few hundred layers; a table of 10^7 would take minutes to build

# a rule that switches a part on: a constant, or a true/false field of the config (its class's default
# when config.json leaves it out; null is off)
Rule = bool | str
# the kinds of layer a reader of its own brings where it says which kind each layer is, from the config's fields
OWN_LAYERS = ("own layers",)


class Fields:
    """A config dict read through its class's defaults, remembering which fields were read."""

    def __init__(self, config: dict[str, Any], model_type: str | None, defaults: dict[str, Any]) -> None:
        self.config, self.model_type, self.defaults = config, model_type, defaults
        self.read: set[str] = set()

    def value(self, *names: str) -> Any:
        """The first spelling config.json has (null as None), else the class's default of the first that has
        one, else MISSING."""
        self.read.update(names)
        for name in names:
            if name in self.config:
                return self.config[name]
        return next((self.defaults[name] for name in names if name in self.defaults), MISSING)

    def get(self, *names: str, default: Any = None) -> Any:
        """value(), with MISSING and None as default."""
        value = self.value(*names)
        return default if value is MISSING or value is None else value

    @property
    def whose(self) -> str:
        return "a config without model_type" if self.model_type is None else f"model_type {self.model_type!r}"

    def refuse(self, name: str, why: str, value: Any = MISSING) -> ValueError:
        """The error for a field the reader will not bill: its name, its value, why, and the model_type."""
        value = self.config.get(name) if value is MISSING else value
        return ValueError(
            f"config field {name!r} = {shown_value(value)} {why} for {self.whose}; a bill that guessed could be wrong"
        )

    def missing(self, *names: str) -> ValueError:
        wanted = " or ".join(repr(name) for name in names)
        return ValueError(
            f"config is missing {wanted}, which {self.whose} needs (its class has no default for it); got keys "
            f"{shown_value(sorted(self.config))}"
        )

    def integer(self, *names: str, zero: bool = False, none: bool = False, most: int = MAX_SIZE) -> Any:
        """A positive int (>= 0 with zero=True, at most `most`); None where none=True allows it."""
        value = self.value(*names)
        if value is MISSING:
            raise self.missing(*names)
        if value is None and none:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
            kind = "an integer >= 0" if zero else "a positive integer"
            raise ValueError(f"config field {names[0]!r} must be {kind}; got {shown_value(value)}")
        if value > most:  # checked before any table of that size is built
            raise ValueError(f"config field {names[0]!r} = {value:,} is larger than any model's (at most {most:,})")
        return value

    def boolean(self, name: str) -> bool:
        """A true/false field; null is off, as the modeling code's `if config.x` reads it. JSON's true and false
        only: the string "false" is truthy in Python."""
        value = self.value(name)
        if value is MISSING:
            raise self.missing(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ValueError(
                f"config field {name!r} must be true or false; got {shown_value(value)} ({type(value).__name__})"
            )
        return value

    def agrees(self, name: str, built: Any) -> None:
        """A field of a released config.json that transformers' class ignores: read where it says what transformers
        builds anyway (or is null), refused where it says otherwise."""
        value = self.get(name)
        if value is not None and value != built:
            raise self.refuse(name, f"is not what transformers builds ({shown_value(built)}), which ignores the field")

    def nested(self, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
        """A config nested in a field (DBRX's attn_config, Kimi's linear_attn_config): a dict, null as the
        defaults."""
        value = self.get(name, default={})
        if not isinstance(value, dict):
            raise self.refuse(name, "must be an object")
        return {**defaults, **{key: item for key, item in value.items() if item is not None}}

    def nested_size(self, name: str, nested: dict[str, Any], key: str) -> int:
        """A positive integer of a nested config, refused with the field's name."""
        value = nested.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
            raise self.refuse(name, f"must give {key} as a positive integer; got {shown_value(value)}", nested)
        return value

    def number(self, name: str) -> float | None:
        """A finite real number, or None; NaN and infinity are refused."""
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
            raise ValueError(f"config field {name!r} must be a finite number; got {shown_value(value)}")
        return float(value)

    def integers(self, name: str, length: int | None = None) -> list[int] | None:
        """A list of integers >= 0 (layer indices, 0/1 flags), of `length` entries where given, or None."""
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
            raise ValueError(f"config field {name!r} must be a list of integers >= 0; got {shown_value(value)}")
        if length is not None and len(value) != length:
            raise ValueError(f"config field {name!r} must have {length} entries (one a layer); got {len(value)}")
        return value


def check_depth(config: Any) -> None:
    """Refuse a config nested deeper than MAX_DEPTH before anything recurses into it (repr, comparisons),
    walking it with a stack of its own: thousands of levels are a hostile file, not a model."""
    stack = [(config, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"config nests its values more than {MAX_DEPTH} levels deep; a config.json has a few")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def switch(fields: Fields, rule: Rule) -> bool:
    """A Rule read from the config: a constant, or a true/false field."""
    return rule if isinstance(rule, bool) else fields.boolean(rule)


_SHORT = reprlib.Repr()  # nested lists and dicts cut at 3 levels and 8 items, strings at 60 characters
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 8, 8, 60, 60


def shown_value(value: Any) -> str:
    """A config value for a message: short, however long or deeply nested it is."""
    text = _SHORT.repr(value)
    return text if not isinstance(value, (list, dict)) or len(value) <= 8 else f"{text} ({len(value)} items)"
