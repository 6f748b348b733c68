"""A config.json's dict, read field by field: which fields were read, and each value's type checked."""

from __future__ import annotations

from typing import Any

__all__ = ["Fields", "Rule", "shown_value", "switch"]


class Fields:
    """A config dict that remembers which fields were read, so that the ones left over can be judged."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.read: set[str] = set()

    def get(self, *names: str, default: Any = None) -> Any:
        """The first of names present and not null (null means "not given"), else default."""
        self.read.update(names)
        for name in names:
            if self.config.get(name) is not None:
                return self.config[name]
        return default

    def integer(self, *names: str, required: bool = True, default: Any = None, zero: bool = False) -> Any:
        """A positive int (>= 0 with zero=True); a missing required field names every spelling."""
        value = self.get(*names)
        if value is None:
            if required:
                wanted = " or ".join(repr(name) for name in names)
                raise ValueError(f"config is missing {wanted}; got keys {sorted(self.config)}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
            kind = "an integer >= 0" if zero else "a positive integer"
            raise ValueError(f"config field {names[0]!r} must be {kind}; got {value!r}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        """A true/false field; JSON's true and false only (the string "false" is truthy in Python)."""
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"config field {name!r} must be true or false; got {value!r} ({type(value).__name__})")
        return value

    def integers(self, name: str) -> list[int] | None:
        """A list of integers >= 0 (layer indices, 0/1 flags), or None."""
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
            raise ValueError(f"config field {name!r} must be a list of integers >= 0; got {shown_value(value)}")
        return value


def shown_value(value: Any) -> str:
    """A config value for a message: whole when short, else its start and its length."""
    text = repr(value)
    return (
        text if len(text) <= 80 else f"{text[:60]} ... ({len(value) if hasattr(value, '__len__') else len(text)} items)"
    )


# a rule that switches a part on: a constant, a true/false field (absent: false), or (field, the config
# class's default when config.json leaves the field out)
Rule = bool | str | tuple[str, bool]


def switch(fields: Fields, rule: Rule) -> bool:
    """A Rule read from the config: a constant, a field (absent: false), or (field, the class's default)."""
    if isinstance(rule, bool):
        return rule
    name, default = rule if isinstance(rule, tuple) else (rule, False)
    return fields.boolean(name, default)
