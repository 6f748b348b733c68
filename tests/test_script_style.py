"""The scripts read like the library: no function over 60 lines of code, no file over 500 lines, one shared
helper module (scripts/common.py) instead of copies, and the same flags on every benchmark.

Lines of code: the lines of a function that hold code, not its docstring, comments or blank lines; a nested
function counts inside its parent (the parent is as long to read either way).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
TORCH_SCRIPTS = [ROOT / "torch_crosscheck" / name for name in ("report.py", "gpu_scaling.py")]
MAX_FUNCTION_LINES, MAX_FILE_LINES = 60, 500


def code_lines(source: str) -> set[int]:
    """Line numbers that hold code: a token other than a comment, a newline or a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def function_lengths(source: str) -> dict[str, int]:
    """Lines of code of every top-level function and method (nested functions inside their parent)."""
    code = code_lines(source)
    lengths = {}
    for node in ast.parse(source).body:
        functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef):
            functions = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            span = range(function.lineno, (function.end_lineno or function.lineno) + 1)
            lengths[function.name] = sum(1 for line in span if line in code)
    return lengths


def test_the_line_counter_counts_code_only() -> None:
    source = (
        'def f(x):\n    """Doc\n    string."""\n    # a comment\n\n    y = (x +\n         1)\n\n'
        "    def g():\n        return y\n    return g\n"
    )
    assert function_lengths(source) == {"f": 6}  # def, y = (two lines), def g, return y, return g


@pytest.mark.parametrize("path", SCRIPTS + TORCH_SCRIPTS, ids=lambda p: p.name)
def test_no_function_over_60_lines_and_no_file_over_500(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(source.splitlines())} lines"
    long = {name: n for name, n in function_lengths(source).items() if n > MAX_FUNCTION_LINES}
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines of code: {long}"


def test_the_torch_install_hint_lives_in_one_constant() -> None:
    hint = "bash torch_crosscheck/install_torch_cpu.sh"
    common = (ROOT / "scripts" / "common.py").read_text(encoding="utf-8")
    assert f'TORCH_INSTALL_HINT = "{hint}"' in common
    for path in [*SCRIPTS, *TORCH_SCRIPTS]:
        text = path.read_text(encoding="utf-8")
        assert "pip install torch" not in text, f"{path.name} has its own torch install line"
        if path.name != "common.py":
            assert hint not in text, f"{path.name} repeats the hint instead of using common.TORCH_INSTALL_HINT"


@pytest.mark.parametrize(
    "name", ["max_diff", "load_torch", "matmul_rate", "settled_median_ms", "progress", "code_version", "doubling"]
)
def test_shared_helpers_are_defined_once(name: str) -> None:
    defined = [p.name for p in [*SCRIPTS, *TORCH_SCRIPTS] if re.search(rf"^def {name}\(", p.read_text(), re.M)]
    assert defined == ["common.py"], f"{name} is defined in {defined}"
