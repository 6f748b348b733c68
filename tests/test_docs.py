"""The docs run: every Python block of README.md and the pages of docs/ (docs/results/ too), every link
between the pages, the notebook tour's two forms, and CI's copy of the README's test command. The pages read
as a book (each opens with the files it reads with and ends with the next page of the README's list), every
file and name that a page or a docstring cites is there, and the README's file map names every file.

How a page's code is read (the rules for whoever writes a page):

- A ```python block is a whole program: it runs on its own, in a fresh namespace, as a reader who pastes
  it would run it, and it passes the project's ruff rules (lint and format).
- A ```text block right after it (only blank lines between) is what it prints, and the test compares the
  two line by line. A number written in scientific notation below 1e-3 (a rounding error, such as
  1.2e-07) matches any number within a factor of 10 of it, so that another machine's BLAS does not fail
  the page; every other character must match.
- A block that imports torch skips without torch. A block that imports mpi4py runs under the
  `mpiexec -n N` that it names in a comment, and skips without mpi4py or mpiexec.
- ```bash blocks are commands to copy and never run; nor does any other kind of block.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from test_ring import MPIEXEC, run_mpi

from tinyattn_np import flash_attention_backward_one_head, flash_attention_one_head

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]  # the pages whose Python blocks run
TOPICS = sorted((ROOT / "docs").glob("*.md"))  # the pages that teach
RESULTS = ROOT / "docs" / "results" / "README.md"  # the index of the pages that measure
LINKED = [*PAGES, ROOT / "torch_crosscheck" / "README.md"]  # the pages whose links are followed
README_MAX_LINES = 300


class Block(NamedTuple):
    page: Path
    line: int  # the opening fence's line, 1-based
    end: int  # the closing fence's line
    language: str  # the fence's first word: python, text, bash, ...
    source: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    """Every ``` block of a page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            closing = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if closing is None:
                raise ValueError(f"{page.name}:{i + 1}: a code fence that is never closed")
            language = (lines[i][3:].split() or [""])[0]
            blocks.append(Block(page, i + 1, closing + 1, language, "\n".join(lines[i + 1 : closing]) + "\n"))
            i = closing
        i += 1
    return blocks


def examples() -> list[tuple[Block, Block | None]]:
    """Each Python block of the pages, with the text block that shows its output (None where none does)."""
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        blocks = fenced_blocks(page)
        for index, block in enumerate(blocks):  # a page may have no block at all
            after = blocks[index + 1] if index + 1 < len(blocks) else None
            if block.language != "python":
                continue
            between = lines[block.end : after.line - 1] if after else ["-"]
            shown = after if after and after.language == "text" and not any(s.strip() for s in between) else None
            found.append((block, shown))
    return found


EXAMPLES = examples()
SCIENTIFIC = re.compile(r"[-+]?\d+(?:\.\d+)?e[-+]?\d+")
NUMBER = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|nan|inf)"


def same_output(printed: str, shown: str) -> bool:
    """printed equals shown line by line (trailing spaces aside), small scientific numbers within 10x."""
    printed_lines = [line.rstrip() for line in printed.rstrip("\n").splitlines()]
    shown_lines = [line.rstrip() for line in shown.rstrip("\n").splitlines()]
    if len(printed_lines) != len(shown_lines):
        return False
    for mine, theirs in zip(printed_lines, shown_lines, strict=True):
        small = [m for m in SCIENTIFIC.finditer(theirs) if abs(float(m.group())) < 1e-3]
        if not small:
            if mine != theirs:
                return False
            continue
        pattern, start = "", 0  # the shown line as a pattern: its small numbers become any number
        for m in small:
            pattern += re.escape(theirs[start : m.start()]) + NUMBER
            start = m.end()
        match = re.fullmatch(pattern + re.escape(theirs[start:]), mine)
        if match is None:
            return False
        for value, m in zip(match.groups(), small, strict=True):
            got, want = abs(float(value)), abs(float(m.group()))
            if not (got == want == 0 or (want > 0 and want / 10 <= got <= want * 10)):
                return False
    return True


def needs(block: Block, module: str) -> bool:
    return re.search(rf"^\s*(import|from) {module}\b", block.source, re.MULTILINE) is not None


def run_here(block: Block) -> str:
    """Run a block in this process, in a namespace of its own; return what it printed."""
    printed = io.StringIO()
    code = compile(block.source, block.name, "exec")  # a traceback names the page and the block
    with contextlib.redirect_stdout(printed):
        exec(code, {"__name__": "__main__"})
    return printed.getvalue()


def run_under_mpiexec(block: Block, folder: Path) -> str:
    """Run a block as a script under the `mpiexec -n N` its comment names; return rank output."""
    pytest.importorskip("mpi4py", reason='mpi4py is missing: pip install -e ".[distributed]"')
    if MPIEXEC is None:
        pytest.skip('mpiexec is missing: pip install -e ".[distributed]"')
    ranks = re.search(r"mpiexec -n (\d+)", block.source)
    assert ranks, f"{block.name}: a block that imports mpi4py names how it runs: `mpiexec -n N python ...`"
    script = folder / "block.py"
    script.write_text(block.source, encoding="utf-8")
    result = run_mpi(int(ranks.group(1)), str(script), timeout=120, cwd=folder)
    assert result.returncode == 0, (
        f"{block.name} under mpiexec: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


@pytest.mark.parametrize(("block", "shown"), EXAMPLES, ids=[block.name for block, _ in EXAMPLES])
def test_python_block_runs_and_prints_what_the_page_shows(block: Block, shown: Block | None, tmp_path: Path) -> None:
    assert ">>>" not in block.source, f"{block.name}: write a plain program, and its output in a text block"
    if needs(block, "torch"):
        pytest.importorskip("torch", reason="this block needs torch (the crosscheck extra)")
    printed = run_under_mpiexec(block, tmp_path) if needs(block, "mpi4py") else run_here(block)
    if shown is not None:
        assert same_output(printed, shown.source), f"{block.name} printed:\n{printed}\nthe page shows:\n{shown.source}"


def test_the_pages_have_python_blocks_and_outputs() -> None:
    """The collector finds what it should: the README's example and its output, and blocks on the pages."""
    assert EXAMPLES[0][0].page == README and EXAMPLES[0][1] is not None
    assert len({block.page for block, _ in EXAMPLES}) >= 5


def test_python_blocks_pass_ruff(tmp_path: Path) -> None:
    """Every block passes the project's ruff rules, as if it were a file of the project."""
    ruff = shutil.which("ruff", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if ruff is None:
        pytest.skip('ruff is missing: pip install -e ".[test]"')
    files = []
    for block, _ in EXAMPLES:
        files.append(tmp_path / (block.name.replace("/", "_").replace(":", "_").replace(".md", "") + ".py"))
        files[-1].write_text(block.source, encoding="utf-8")
    config = ["--config", str(ROOT / "pyproject.toml"), "--no-cache"]
    for command in (["check", *config], ["format", "--check", "--diff", *config]):
        result = subprocess.run([ruff, *command, *map(str, files)], capture_output=True, text=True)
        assert result.returncode == 0, f"ruff {command[0]}:\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize(
    ("printed", "shown", "same"),
    [
        ("(2, 3) 1.19e-06\n", "(2, 3) 1.1920928955078125e-06", True),  # a rounding error within 10x
        ("(2, 3) 2.0e-05\n", "(2, 3) 1.2e-06", False),  # 17x: too far
        ("(2, 3) 0.0e+00\n", "(2, 3) 1.2e-06", False),
        ("0.0e+00", "0.0e+00", True),
        ("1.5e+03", "1.4e+03", False),  # a large number matches exactly
        ("[45, 93, 189]", "[45, 93, 188]", False),
        ("a  \nb\n", "a\nb", True),  # trailing spaces and newlines aside
        ("a\nb\nc", "a\nb", False),
    ],
)
def test_same_output(printed: str, shown: str, same: bool) -> None:
    assert same_output(printed, shown) is same


# --- links --------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path, *, inline_code: bool = False) -> list[tuple[int, str]]:
    """The lines of a page outside code blocks, (line number, text); inline code removed unless asked for."""
    lines, inside = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            lines.append((number, line if inline_code else re.sub(r"`[^`]*`", "", line)))
    return lines


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens,
    -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose(page, inline_code=True):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_link_between_the_pages_resolves() -> None:
    broken = []
    for page in LINKED:
        for number, line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                if not file.exists() or ROOT not in [file, *file.parents]:
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such file)")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def linked_pages(page: Path) -> set[Path]:
    """The files a page links to, resolved."""
    targets = [target.partition("#")[0] for _, line in prose(page) for target in LINK.findall(line)]
    return {(page.parent / target).resolve() for target in targets if target}


def test_the_readme_is_short_and_links_every_page() -> None:
    """The README links every topic page, the tour and the index of the results; the index links every
    results page."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move some to a page in docs/"
    pages = {*TOPICS, ROOT / "docs" / "tour.ipynb", RESULTS}
    missing = sorted(str(page.relative_to(ROOT)) for page in pages - linked_pages(README))
    assert not missing, f"pages the README does not link: {missing}"
    results = set(RESULTS.parent.glob("*.md")) - {RESULTS}
    assert results, "docs/results/ holds no results page"
    missing = sorted(str(page.relative_to(ROOT)) for page in results - linked_pages(RESULTS))
    assert not missing, f"results pages docs/results/README.md does not link: {missing}"


COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # a git commit id


def test_only_the_results_pages_name_commits() -> None:
    """The README and the topic pages cite no commit: the numbers they quote link to a results page, whose
    header names the commit, the machine and the BLAS kernels."""
    cited = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in [README, *TOPICS]
        for number, line in prose(page, inline_code=True)
        if COMMIT.search(line)
    ]
    assert not cited, "\n".join(cited)


def test_ci_runs_the_readmes_test_command() -> None:
    commands = [block.source.strip() for block in fenced_blocks(README) if block.language == "bash"]
    test_command = next(command for command in commands if "pytest" in command)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci, f".ci/run must run the README's test command as it stands: {test_command}"


# --- the pages as a book: each opens with the files it reads with and ends with the next page --------


def paragraphs(page: Path) -> list[tuple[int, str]]:
    """A page's paragraphs outside code blocks, (first line number, text): its lines joined by spaces."""
    found: list[tuple[int, str]] = []
    lines: list[tuple[int, str]] = []
    inside = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        fence = line.startswith("```")
        inside ^= fence
        if inside or fence or not line.strip():  # a blank line or a code block ends a paragraph
            if lines:
                found.append((lines[0][0], " ".join(text.strip() for _, text in lines)))
            lines = []
        else:
            lines.append((number, line))
    if lines:
        found.append((lines[0][0], " ".join(text.strip() for _, text in lines)))
    return found


def book_order() -> list[Path]:
    """The topic pages in the order of the README's "What it shows" list (a page linked twice counts once)."""
    section = README.read_text(encoding="utf-8").split("## What it shows\n", 1)[1].split("\n## ", 1)[0]
    order: list[Path] = []
    for target in LINK.findall(section):
        page = (ROOT / target.partition("#")[0]).resolve()
        if page in TOPICS and page not in order:
            order.append(page)
    return order


ORDER = book_order()
PATH_LIKE = re.compile(r"[\w.-]*/[\w./-]*|[\w.-]+\.(?:py|md|sh|ipynb)")  # a backticked file or folder


def test_the_readme_puts_every_topic_page_in_the_order():
    missing = sorted(str(page.relative_to(ROOT)) for page in TOPICS if page not in ORDER)
    assert not missing, f"topic pages the README's What it shows list leaves out: {missing}"


@pytest.mark.parametrize("page", TOPICS, ids=[page.name for page in TOPICS])
def test_a_topic_page_opens_with_the_files_it_reads_with(page: Path):
    """Before its first section, a paragraph `Read with: `file`, `file` (what it holds), ...`, every file there."""
    opening = []
    for _, text in paragraphs(page)[1:]:  # after the title
        if text.startswith("## "):
            break
        opening.append(text)
    read_with = next((text for text in opening if text.startswith("Read with: ")), None)
    assert read_with, f"{page.name} opens with no `Read with: ` paragraph before its first section"
    files = [code for code in re.findall(r"`([^`]+)`", read_with) if PATH_LIKE.fullmatch(code)]
    assert files, f"{page.name}: its Read with line names no file"
    missing = [file for file in files if not (ROOT / file).exists()]
    assert not missing, f"{page.name} reads with files that do not exist: {missing}"


@pytest.mark.parametrize("page", TOPICS, ids=[page.name for page in TOPICS])
def test_a_topic_page_ends_with_the_next_page(page: Path):
    """Its last paragraph is `Next: [...](next.md)...`, the next page of the README's list; the last page's
    points back to the README."""
    assert page in ORDER, f"{page.name} is not in the README's What it shows list"
    place = ORDER.index(page)
    expected = ORDER[place + 1] if place + 1 < len(ORDER) else README
    number, last = paragraphs(page)[-1]
    links = LINK.findall(last)
    assert last.startswith("Next: ") and links, f"{page.name}:{number} does not end with `Next: [page](page.md)`"
    assert (page.parent / links[0].partition("#")[0]).resolve() == expected, (
        f"{page.name}:{number}: Next is {links[0]}, but the README's next page is {expected.relative_to(ROOT)}"
    )


# --- what the pages and the docstrings cite: files that exist, names that import ------------------------

PACKAGE = ROOT / "tinyattn_np"
CODE_FOLDERS = ("tinyattn_np", "scripts", "tests", "torch_crosscheck")
CITED_PATH = re.compile(
    rf"(?<![\w./~$-])(?:(?:{'|'.join(CODE_FOLDERS)})/(?:\w+/)*(?:\w+\.(?:py|sh|md))?|docs/[\w./-]*[\w/])"
)
IMPORT = re.compile(r"\bfrom (tinyattn_np[\w.]*) import ([\w, ]+)")
DOTTED = re.compile(r"(?<![\w./])tinyattn_np(?:\.\w+)+")  # tinyattn_np.tune, tinyattn_np.mpi_job.StopTogether
FILE_SUFFIX = {"py", "md", "sh", "json", "png", "ipynb", "txt", "npz", "cfg", "toml"}
MODULES = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"} | {"hf_config"}
QUALIFIED = re.compile(rf"(?<![\w./])({'|'.join(sorted(MODULES))})\.(\w+)")  # _tuning.default_tiles, ...


class Cited(NamedTuple):
    where: str  # a page, or a docstring's file and name
    text: str
    page: bool


def cited_texts() -> list[Cited]:
    """Every page outside its Python blocks and printed outputs (its bash blocks and the README's file maps
    are in), and every docstring of the package and the scripts, doctest lines left out (they run)."""
    texts = []
    for page in LINKED:
        lines = page.read_text(encoding="utf-8").splitlines()
        for block in reversed([block for block in fenced_blocks(page) if block.language in ("python", "text")]):
            lines[block.line - 1 : block.end] = []
        texts.append(Cited(str(page.relative_to(ROOT)), "\n".join(lines), page=True))
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = (ast.get_docstring(node) or "").splitlines()
                text = "\n".join(line for line in doc if not line.lstrip().startswith((">>>", "...")))
                texts.append(Cited(f"{path.relative_to(ROOT)}:{getattr(node, 'name', 'module')}", text, page=False))
    return texts


CITED = cited_texts()


def resolves(dotted: str) -> bool:
    """Whether tinyattn_np.a.b.c names something: the longest prefix that imports as a module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_every_file_a_page_or_a_docstring_cites_exists():
    missing = [
        f"{where}: {path}"
        for where, text, _ in CITED
        for path in CITED_PATH.findall(text)
        if not (ROOT / path).exists()
    ]
    assert not missing, "\n".join(missing)


def test_every_import_a_page_or_a_docstring_states_imports():
    """`from tinyattn_np.x import a, b` and `tinyattn_np.x.y`, and a module's `name.attr` (in a page's inline
    code, anywhere in a docstring), name what is there."""
    wrong = []
    for where, text, page in CITED:
        for module, names in IMPORT.findall(text):
            wrong += [
                f"{where}: from {module} import {name}"
                for name in names.split(",")
                if not resolves(f"{module}.{name.strip()}")
            ]
        wrong += [f"{where}: {dotted}" for dotted in DOTTED.findall(text) if not resolves(dotted)]
        qualified = QUALIFIED.findall(" ".join(re.findall(r"`([^`]+)`", text)) if page else text)
        wrong += [
            f"{where}: {module}.{name}"
            for module, name in qualified
            if name not in FILE_SUFFIX and not resolves(f"tinyattn_np.{module}.{name}")
        ]
    assert not wrong, "\n".join(wrong)


# --- the maps: the README's Files block, and the crosscheck's two lists ---------------------------------


def files_block() -> dict[Path, set[str]]:
    """The README's Files block as folder -> the `name.py` files and `name/` folders it names there: an entry
    at the margin (`scripts/`) or indented two (`  hf_config/`) opens a folder, whose lines name its files."""
    block = next(block for block in fenced_blocks(README) if block.source.startswith("tinyattn_np/"))
    named: dict[Path, set[str]] = {}
    top = folder = ROOT
    for line in block.source.splitlines():
        entry = re.match(r"( {0,2})([\w.]+/)\s", line)
        if entry:  # a folder's own line: the folder is named in the one above it
            parent = ROOT if not entry.group(1) else top
            named.setdefault(parent, set()).add(entry.group(2))
            folder = parent / entry.group(2)
            top = folder if not entry.group(1) else top
            line = line[entry.end() :]
        elif re.match(r"\S", line):  # setup.cfg, .ci/run: files of the root
            top = folder = ROOT
        elif re.match(r" {2}\S", line):
            folder = top
        named.setdefault(folder, set()).update(re.findall(r"(?<![\w/.])\w+\.py\b", line))
    return named


def test_the_readmes_file_map_names_every_module_and_script_and_nothing_else():
    named = files_block()
    package, scripts = named.get(PACKAGE, set()), named.get(ROOT / "scripts", set())
    unnamed = [
        f"tinyattn_np/{path.name}" for path in PACKAGE.glob("*.py") if path.name not in package | {"__init__.py"}
    ]
    unnamed += [
        f"tinyattn_np/{path.name}/"
        for path in PACKAGE.iterdir()
        if (path / "__init__.py").exists() and f"{path.name}/" not in package
    ]
    unnamed += [f"scripts/{path.name}" for path in (ROOT / "scripts").glob("*.py") if path.name not in scripts]
    assert not unnamed, f"the README's Files block leaves out: {sorted(unnamed)}"
    absent = [
        str((folder / name).relative_to(ROOT))
        for folder, names in named.items()
        for name in names
        if not (folder / name).exists()
    ]
    assert not absent, f"the README's Files block names what is not there: {sorted(absent)}"


def test_both_crosscheck_pages_list_every_crosscheck_file():
    folder = ROOT / "torch_crosscheck"
    files = sorted(path.name for path in folder.iterdir() if path.is_file() and path.name != "README.md")
    for page in (ROOT / "docs" / "torch.md", folder / "README.md"):
        text = page.read_text(encoding="utf-8")
        missing = [name for name in files if not re.search(rf"(?<![\w.]){re.escape(name)}\b", text)]
        assert not missing, f"{page.relative_to(ROOT)} does not list {missing}"


# --- the notebook tour: docs/tour.ipynb and its jupytext twin docs/tour.py ---------------------------


def percent_cells(text: str) -> list[tuple[str, str]]:
    """The cells of a jupytext percent-format script: (cell type, source). A cell starts at a line
    `# %%` (code) or `# %% [markdown]` (its lines are comments); the header before the first is metadata."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if line.strip() == "# %% [markdown]" else "code", []))
        elif cells and cells[-1][0] == "markdown":
            cells[-1][1].append(line[2:] if line.startswith("# ") else line.removeprefix("#"))
        elif cells:
            cells[-1][1].append(line)
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def notebook() -> dict:
    return json.loads((ROOT / "docs" / "tour.ipynb").read_text(encoding="utf-8"))


def test_the_notebook_and_its_script_hold_the_same_cells() -> None:
    script = percent_cells((ROOT / "docs" / "tour.py").read_text(encoding="utf-8"))
    cells = [(cell["cell_type"], "".join(cell["source"]).strip("\n")) for cell in notebook()["cells"]]
    assert len(script) == len(cells), f"docs/tour.py has {len(script)} cells, docs/tour.ipynb {len(cells)}"
    for number, (mine, theirs) in enumerate(zip(script, cells, strict=True)):
        assert mine == theirs, f"cell {number} differs: run `jupytext --sync docs/tour.py`\n{mine}\n---\n{theirs}"


def test_the_notebook_is_saved_with_its_outputs() -> None:
    """So that it renders where the code is hosted: every code cell ran, in order, and the pictures are in it."""
    code = [cell for cell in notebook()["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1))
    pictures = sum("image/png" in output.get("data", {}) for cell in code for output in cell["outputs"])
    assert pictures >= 4, f"the tour shows {pictures} pictures; it should show at least 4"
    errors = [output for cell in code for output in cell["outputs"] if output["output_type"] == "error"]
    assert not errors, errors


def test_the_notebook_extra_brings_jupyter_and_the_tour_says_how_to_open_it() -> None:
    """`pip install -e ".[notebook]"` installs Jupyter itself, pinned, and the tour's first cell names the command
    that opens it, so that "open it in Jupyter" works on a fresh clone."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg", encoding="utf-8")
    extra = setup["options.extras_require"]["notebook"].split()
    assert any(re.fullmatch(r"(notebook|jupyterlab)==[0-9.]+", requirement) for requirement in extra), extra
    first = "".join(notebook()["cells"][0]["source"])
    assert 'pip install -e ".[notebook]"' in first and "`jupyter notebook docs/tour.ipynb`" in first, first


@pytest.mark.skipif(importlib.util.find_spec("jupytext") is None, reason="jupytext is missing: the notebook extra")
def test_jupytext_reads_the_script_as_the_notebook() -> None:
    """The same comparison, by jupytext itself, where it is installed (CI installs it)."""
    import jupytext

    script = jupytext.read(ROOT / "docs" / "tour.py")
    cells = [(cell.cell_type, cell.source) for cell in script.cells]
    assert cells == [(cell["cell_type"], "".join(cell["source"])) for cell in notebook()["cells"]]


# --- docs/online_softmax.md quotes the plain paths ------------------------------------------------


def test_the_online_softmax_page_prints_the_plain_paths_as_they_are():
    """docs/online_softmax.md shows each plain path as print(inspect.getsource(...)) with its output: the
    page's text block is the source itself (tests/test_docs.py compares the two), so it cannot drift."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "online_softmax.md").read_text(encoding="utf-8")
    for function in (flash_attention_one_head, flash_attention_backward_one_head):
        assert f"print(inspect.getsource({function.__name__}))" in page
        assert f"```text\n{inspect.getsource(function)}```" in page, f"the page's copy of {function.__name__}"
