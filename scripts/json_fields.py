"""A JSON file's fields, read with their types checked: a file edited by hand or written by another program is
one line that names the file and the field, never a KeyError or a traceback. checkpoint.py reads
checkpoint.json through it.

    meta = Fields.read(Path("run/checkpoint.json"))
    meta.get("step", int)                           # run/checkpoint.json: step must be an int; got '8'
    meta.get("data.validation", float, check=fraction)   # run/checkpoint.json: data.validation = 2.0: must be ...

The kinds are JSON's: int (not a bool), float (an int or a float, finite), str, bool, list, dict. check is a
function of the value that raises ValueError (or argparse's ArgumentTypeError) with what is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

MISSING = object()  # get()'s default: the field must be there
KIND_NAMES = {
    int: "an int",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}


class FieldError(ValueError):
    """A JSON file that does not hold what it should; the message names the file and the field."""


def is_kind(value: Any, kind: type) -> bool:
    """Whether a JSON value is of the kind: an int is no bool, a float is any finite number."""
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def shown(value: Any) -> str:
    """A value as a message quotes it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


class Fields:
    """A JSON object read from `where` (a file's name); prefix: this object's own path in the file ("data.")."""

    def __init__(self, values: Any, where: str, prefix: str = ""):
        if not isinstance(values, dict):
            what = prefix.rstrip(".") or "the file"
            raise FieldError(f"{where}: {what} must be {KIND_NAMES[dict]}; got {shown(values)}")
        self.values, self.where, self.prefix = values, where, prefix

    @staticmethod
    def read(path: Path) -> Fields:
        """The JSON object in the file at path; a FieldError for a file that cannot be read, is not UTF-8 or
        not JSON, nests too deep for Python's parser, or holds something other than an object."""
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise FieldError(f"{path}: cannot read it ({err.strerror})") from None
        except UnicodeDecodeError as err:
            raise FieldError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
        except ValueError as err:
            raise FieldError(f"{path} is not JSON ({err})") from None
        except RecursionError:
            raise FieldError(f"{path} nests its lists or objects too deep to be read") from None
        return Fields(values, str(path))

    def error(self, name: str, what: str) -> FieldError:
        """A FieldError: '{file}: {prefix}{name} {what}'."""
        return FieldError(f"{self.where}: {self.prefix}{name} {what}")

    def get(self, name: str, kind: type, default: Any = MISSING, check: Callable[[Any], Any] | None = None) -> Any:
        """The field `name` ("a.b" for b inside a), of the kind, passed through check where given; default
        where it is absent (or null, with default None), else a FieldError that names it."""
        head, _, rest = name.partition(".")
        if rest:
            return self.object(head).get(rest, kind, default, check)
        value = self.values.get(name, MISSING)
        if value is MISSING or (value is None and default is None):
            if default is MISSING:
                raise self.error(name, "is missing")
            return default
        if not is_kind(value, kind):
            raise self.error(name, f"must be {KIND_NAMES[kind]}; got {shown(value)}")
        if check is not None:
            try:
                value = check(value)
            except (ValueError, argparse.ArgumentTypeError) as err:  # the second: a flag's own type as the check
                raise self.error(name, f"= {shown(value)}: {err}") from None
        return value

    def object(self, name: str) -> Fields:
        """The field `name`, an object, as Fields of its own."""
        return Fields(self.get(name, dict), self.where, f"{self.prefix}{name}.")

    def items(self, name: str) -> list[Fields]:
        """The field `name`, a list of objects, each as Fields of its own (name[0], name[1], ...)."""
        values = self.get(name, list)
        return [Fields(value, self.where, f"{self.prefix}{name}[{i}].") for i, value in enumerate(values)]
