"""The shape of the code a learner reads: short functions, every module's API in its __all__ and its plumbing
`_`-named, the reference path on its own, and scripts of one purpose each. These read the source as text (ast);
nothing runs."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tinyattn_np"
SCRIPTS = ROOT / "scripts"
MAX_FUNCTION_LINES = 60  # lines of code: docstring, comments and blank lines not counted


def code_lines(source: str, node: ast.AST) -> int:
    """Lines of node that hold code: not blank, not only a comment, not its docstring (nested functions count)."""
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    docstring = ast.get_docstring(node, clean=False) is not None
    skip: set[int] = set()
    if docstring:
        first = node.body[0]
        skip = set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    comment_only: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if token.type == tokenize.COMMENT and not lines[token.start[0] - 1][: token.start[1]].strip():
            comment_only.add(token.start[0] + node.lineno - 1)
    return sum(
        1
        for number, text in enumerate(lines, start=node.lineno)
        if text.strip() and number not in skip and number not in comment_only
    )


def functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines of code) of every top-level function and method in the file."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        for member in members:
            if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{node.name}.{member.name}" if isinstance(node, ast.ClassDef) else member.name
                found.append((name, code_lines(source, member)))
    return found


def package_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every relative import in a package file, wherever it stands (functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.append((node.module or "", [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("folder", [PACKAGE, SCRIPTS], ids=["tinyattn_np", "scripts"])
def test_no_function_is_longer_than_a_screen(folder):
    long = [
        f"{path.relative_to(ROOT)}:{name} has {n} lines of code"
        for path in sorted(folder.glob("*.py"))
        for name, n in functions(path)
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, with those inside its top-level if/try/with blocks (they bind at module level)."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        for inner in ("body", "orelse", "finalbody"):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found += top_level(getattr(node, inner, []))
        for handler in getattr(node, "handlers", []):
            found += top_level(handler.body)
    return found


def defined_names(path: Path) -> set[str]:
    """The names a module defines itself: functions, classes and assignments at the top (imports are not)."""
    names = set()
    for node in top_level(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return names - {"__all__"}


def public_names(path: Path) -> list[str] | None:
    """A module's __all__, or None where it has none."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def tuning_knobs() -> set[tuple[str, str]]:
    """("tune", name) for every name tune.py imports from _tuning: the tuning tool offers the knobs it sets."""
    tree = ast.parse((PACKAGE / "tune.py").read_text(encoding="utf-8"))
    found = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "_tuning"]
    return {("tune", alias.name) for node in found for alias in node.names}


# DESIGN.md: tinyattn_np.ring offers shard and unshard; tune offers the knobs
KEPT_REEXPORTS = {("ring", "shard"), ("ring", "unshard"), *tuning_knobs()}


def test_every_module_says_what_it_offers():
    """Each module has __all__, and each name in it is one the module defines (no re-export through a module
    that only imports the name); the package's own __all__ names what __init__ imports."""
    wrong = []
    for path in sorted(PACKAGE.glob("*.py")):
        offered = public_names(path)
        if offered is None:
            wrong.append(f"{path.name} has no __all__")
        elif path.stem == "__init__":
            tree = ast.parse(path.read_text(encoding="utf-8"))
            imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            wrong += [f"__init__.py: __all__ names {n}, which it never imports" for n in offered if n not in imported]
        else:
            defined = defined_names(path)
            wrong += [
                f"{path.name}: __all__ names {name}, which it does not define"
                for name in offered
                if name not in defined and (path.stem, name) not in KEPT_REEXPORTS
            ]
    assert not wrong, "\n".join(wrong)


def test_a_name_that_crosses_modules_is_api_or_private():
    """What one package module imports from another (lazily too) is in that module's __all__, or
    `_`-prefixed, or comes from a `_`-named module: the name alone tells the API from the plumbing."""
    offered = {path.stem: public_names(path) or [] for path in PACKAGE.glob("*.py")}
    offered |= {path.parent.name: public_names(path) or [] for path in PACKAGE.glob("*/__init__.py")}  # subpackages
    crossing = [
        f"{path.name}: from .{module} import {name}: neither in {module}.py's __all__ nor `_`-named"
        for path in sorted(PACKAGE.glob("*.py"))
        for module, names in package_imports(path)
        for name in names
        if module and not module.startswith("_") and not name.startswith("_") and name not in offered[module]
    ]
    assert not crossing, "\n".join(crossing)


def test_each_name_is_imported_from_the_module_that_defines_it():
    """Inside the package, `from .x import name` only where x.py defines name (no chains of re-exports);
    __init__.py, the package's front door, is the one place that gathers names."""
    defined = {path.stem: defined_names(path) for path in PACKAGE.glob("*.py")}
    chained = [
        f"{path.name}: from .{module} import {name}, which {module}.py only imports"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.stem != "__init__"
        for module, names in package_imports(path)
        if module
        for name in names
        if name not in defined[module]
    ]
    assert not chained, "\n".join(chained)


def test_the_reference_path_stands_alone():
    """head.py and attention.py import (transitively) only the softmax, the masks, the checks and their own
    guard: never flash, the bills, the tables or the worker engine."""
    allowed = {"head", "attention", "softmax", "masks", "_checks", "_guard", "_bytes", "_mod_calls"}
    allowed.add("mods")  # flex attention's mods, which the reference applies too: NumPy, _checks and masks only
    seen, todo = set(), ["head", "attention"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [name for name, _ in package_imports(PACKAGE / f"{module}.py")]
    assert seen <= allowed, f"the reference path imports {sorted(seen - allowed)}"


def test_the_counter_counts_what_it_should(tmp_path):
    # the rule's own check: a docstring, comments and blank lines do not count; a nested function does
    path = tmp_path / "sample.py"
    path.write_text(
        'def f(x):\n    """Doc\n    string."""\n    # a comment\n\n    y = x  # code with a comment\n'
        "    def g():\n        return y\n    return g\n"
    )
    assert functions(path) == [("f", 5)]  # def f, y = x, def g, return y, return g


def test_the_pages_the_code_points_to_exist():
    import re

    named = {
        (path.relative_to(ROOT), page)
        for folder in (PACKAGE, SCRIPTS)
        for path in folder.glob("*.py")
        for page in re.findall(r"docs/[\w./-]+\.(?:md|ipynb|png)", path.read_text(encoding="utf-8"))
    }
    missing = sorted(f"{path}: {page}" for path, page in named if not (ROOT / page).exists())
    assert not missing, "\n".join(missing)


def reading_order() -> list[str]:
    """The package docstring's numbered list of files: "  7  flash.py   ..." -> ["softmax", ..., "flash", ...]."""
    import re

    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))) or ""
    return [m.group(1) for m in re.finditer(r"^\s*\d+\s+(\w+)\.py\b", doc, flags=re.MULTILINE)]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, at the top or inside a function (a lazy import is an import)."""
    return {
        path.stem: {
            name.split(".")[0] for module, names in package_imports(path) for name in ([module] if module else names)
        }
        for path in sorted(PACKAGE.glob("*.py"))
        if path.stem != "__init__"
    }


def test_the_reading_order_lists_every_public_module_once():
    order = reading_order()
    public = {stem for stem in import_graph() if not stem.startswith("_")}
    order_public = {module for module in order if not module.startswith("_")}
    assert len(order) == len(set(order)), f"listed twice: {sorted({m for m in order if order.count(m) > 1})}"
    missing = sorted(public - order_public)
    assert not missing, f"public modules missing from the reading order: {missing}"
    unknown = sorted(set(order) - set(import_graph()))
    assert not unknown, f"the reading order lists files that do not exist: {unknown}"


def test_each_file_uses_only_what_came_before_it():
    """A file of the reading order imports files listed before it, or unlisted internal ones (`_`-named); an
    unlisted internal file imports only internal ones, so the plumbing never reaches up into the lessons."""
    order = reading_order()
    place = {module: n for n, module in enumerate(order)}
    later = [
        f"{module}.py (#{place[module] + 1}) imports {used}.py (#{place[used] + 1})"
        for module, uses in import_graph().items()
        if module in place
        for used in sorted(uses)
        if used in place and place[used] >= place[module]
    ]
    upward = [
        f"{module}.py imports {used}.py"
        for module, uses in import_graph().items()
        if module.startswith("_") and module not in place
        for used in sorted(uses)
        if not used.startswith("_")
    ]
    assert not later + upward, "\n".join(later + upward)


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for used in sorted(graph.get(module, ())):
            if state.get(used) == 1:
                return path + [module, used]
            if used not in state and (cycle := visit(used, path + [module])):
                return cycle
        state[module] = 2
        return None

    cycles = [cycle for module in sorted(graph) if module not in state and (cycle := visit(module, []))]
    assert not cycles, " -> ".join(cycles[0])


def test_no_module_defines_a_module_getattr():
    found = [
        path.name
        for path in sorted(PACKAGE.glob("*.py"))
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]
    assert not found, f"a module-level __getattr__ hides an import: {found}"


def test_the_readme_gives_the_same_reading_order():
    """README.md's "Where to start reading" numbers the files of the package docstring, in its order."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Where to start reading", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. `(\w+)\.py`", section, flags=re.MULTILINE)
    numbered = reading_order()
    assert listed == numbered[: len(listed)], f"README: {listed}\npackage docstring: {numbered}"
    rest = " ".join(re.findall(r"`(\w+)\.py`", section.split("Then the bills", 1)[1]))
    assert all(module in rest for module in numbered[len(listed) :]), (
        f"the README names none of {numbered[len(listed) :]}"
    )


# --- the house: each lesson first, the engines beside it, the plumbing below ------------------------------------

MAX_PACKAGE_LINES = 600

# Each lesson's plain algorithm: what a learner meets first after the module docstring and the imports (the
# engine that makes it fast lives in a `_` module beside it, tested equal to it).
LESSON_OPENS_WITH = {
    "softmax": "softmax",
    "masks": "causal_mask",
    "head": "one_head",
    "mods": "causal_band",
    "attention": "attention",
    "blockmask": "Band",
    "flash": "flash_attention_one_head",
    "flex": "flex_attention",
    "backward": "attention_backward",
    "mod_grads": "score_mod_grads",
    "position": "rope",
    "multihead": "multihead_forward",
    "splitkv": "split_kv_attention",
    "kvcache": "KVCache",
    "paged": "PagedKVCache",
    "paged_decode": "paged_attention",
    "layers": "layer_norm",
    "latent": "attend_latent",
    "sparse": "index_topk_plain",
    "dsa": "SparseLatentAttention",
    "linear": "gated_delta_rule_recurrent",
    "deltanet": "gated_deltanet",
    "gpt": "block",
    "sampling": "sample_next",
    "optim": "AdamW",
    "shards": "shard",
    "ring": "ring_attention",
    "ulysses": "ulysses_attention",
}


def lessons() -> list[str]:
    """The numbered files of the package docstring before "Then the bills": the lessons, in reading order."""
    import re

    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))) or ""
    return [m.group(1) for m in re.finditer(r"^\s*\d+\s+(\w+)\.py\b", doc.split("Then the bills")[0], re.MULTILINE)]


def package_files() -> list[Path]:
    """Every Python file of the package, its subpackages' too."""
    return sorted(PACKAGE.rglob("*.py"))


def first_definition(path: Path) -> str | None:
    """The name of a module's first function or class at the top level (imports and constants come before it)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            return node.name
    return None


def test_each_lesson_opens_with_its_plain_algorithm():
    assert sorted(LESSON_OPENS_WITH) == sorted(lessons()), "LESSON_OPENS_WITH names each lesson of the order"
    wrong = [
        f"{module}.py opens with {first_definition(PACKAGE / f'{module}.py')}, not its lesson {plain}"
        for module, plain in LESSON_OPENS_WITH.items()
        if first_definition(PACKAGE / f"{module}.py") != plain
    ]
    assert not wrong, "\n".join(wrong)


def test_no_internal_module_imports_a_lesson_a_bill_or_a_tool():
    upward = [
        f"{module}.py imports {used}.py"
        for module, uses in import_graph().items()
        if module.startswith("_")
        for used in sorted(uses)
        if not used.startswith("_")
    ]
    assert not upward, "\n".join(upward)


def test_no_lesson_imports_a_bill_or_a_tool():
    order, graph = lessons(), import_graph()
    found = [
        f"{module}.py imports {used}"
        for module in order
        for used in sorted(graph[module])
        if used not in order and not used.startswith("_")
    ]
    assert not found, "\n".join(found)


def test_a_private_name_crosses_modules_only_from_an_internal_one():
    """`from .x import _name` only where x is internal (`_`-named): a lesson's `_` names stay in its file."""
    found = [
        f"{path.relative_to(ROOT)}: from {'.' * node.level}{node.module or ''} import {alias.name}"
        for path in package_files()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and node.module  # `from . import _x`: a module
        for alias in node.names
        if alias.name.startswith("_") and not node.module.split(".")[-1].startswith("_")
    ]
    assert not found, "\n".join(found)


def test_no_script_imports_an_internal_module():
    """The scripts use the package's public names (tune is the door to the tuning knobs)."""
    found = [
        f"scripts/{path.name}: {node.module}"
        for path in sorted(SCRIPTS.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom | ast.Import)
        for module in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        if module.startswith("tinyattn_np.") and any(part.startswith("_") for part in module.split(".")[1:])
    ]
    assert not found, "\n".join(found)


def test_no_package_file_is_longer_than_600_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in package_files()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_PACKAGE_LINES
    ]
    assert not long, f"package files over {MAX_PACKAGE_LINES} lines (a lesson, its engine and its reader apart): {long}"


# --- tests where a reader looks ------------------------------------------------------------------------

TESTS = ROOT / "tests"
# What a test file may be named after besides a module (test_<module>.py, a `_`-named one too) or a script
# (test_<script>.py): a concern that cuts across the modules, or a part of one module's tests that has a file
# of its own. A file named after a round of work is none of these.
TEST_CONCERNS = {
    "docs": "every code block of README.md and docs/*.md runs and prints what the page shows",
    "doctests": "the docstrings' examples run",
    "edges": "extreme and empty inputs, the reference and flash alike",
    "properties": "identities for the sizes hypothesis draws",
    "scripts": "what every script does, and the scripts named like a module (attention.py, memory.py, ...)",
    "script_style": "the scripts' shape",
    "structure": "the shape of the code (this file)",
}
TEST_PARTS = {  # file -> the module whose tests it holds a part of
    "flex_backward": "flex",  # flex_attention_backward through every mod, apart from the tile loop's tests
    "flex_properties": "flex",  # the mask_mods hypothesis draws
    "paged_decode": "paged",  # decoding through block tables, apart from the pool and its tables
}
TEST_HELPERS = {"conftest", "ring_worker"}  # not tests: the shared fixtures, the MPI worker the tests start


def test_every_public_module_has_its_test_file():
    modules = sorted(path.stem for path in PACKAGE.glob("*.py") if not path.stem.startswith("_"))
    missing = [f"tests/test_{module}.py" for module in modules if not (TESTS / f"test_{module}.py").exists()]
    assert not missing, f"modules without their test file: {missing}"


def test_every_test_file_is_named_after_a_module_a_script_or_a_concern():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    scripts = {path.stem for path in SCRIPTS.glob("*.py")}
    assert set(TEST_PARTS.values()) <= modules, "TEST_PARTS names a module that does not exist"
    named = modules | scripts | set(TEST_CONCERNS) | set(TEST_PARTS)
    odd = [
        path.name
        for path in sorted(TESTS.glob("*.py"))
        if not (path.stem.startswith("test_") and path.stem.removeprefix("test_") in named)
        and path.stem not in TEST_HELPERS
    ]
    assert not odd, f"test files named after none of the package's modules, scripts or concerns: {odd}"
