"""The architecture table's formulas, such as "2·Hq·E + C": the weights (or state) of a part one architecture
alone has, written as docs/memory.md writes them.

A formula is + - · // and parentheses over whole numbers and names: the sizes read so far (C hidden, F the
MLP's width, L layers, V vocabulary, Hq and Hkv heads, E head size, P positions) and any other integer field
of the config, read by name (so read, checked and never judged as left over).
"""

from __future__ import annotations

import ast
from typing import Any

from .fields import Fields

__all__ = ["SYMBOLS", "evaluate"]

# the short names, and the ModelShape size each stands for
SYMBOLS = {
    "C": "hidden",
    "F": "intermediate",
    "L": "layers",
    "V": "vocab",
    "Hq": "heads",
    "Hkv": "kv_heads",
    "E": "head_dim",
    "P": "max_positions",
}
_OPERATIONS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}


def evaluate(formula: str, sizes: dict[str, Any], fields: Fields) -> int:
    """The whole number a formula of the table comes to, with the sizes found and the config's fields."""
    tree = ast.parse(formula.replace("·", "*"), mode="eval")
    return _value(tree.body, sizes, fields, formula)


def _value(node: ast.AST, sizes: dict[str, Any], fields: Fields, formula: str) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        size = sizes.get(SYMBOLS[node.id]) if node.id in SYMBOLS else fields.integer(node.id, zero=True)
        if not isinstance(size, int):
            raise ValueError(f"the formula {formula!r} needs {node.id}, which this config does not give")
        return size
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
        left, right = _value(node.left, sizes, fields, formula), _value(node.right, sizes, fields, formula)
        return _OPERATIONS[type(node.op)](left, right)
    raise SyntaxError(f"a table formula is + - · // over numbers and names; got {formula!r}")
