"""The docs a newcomer reads: a README short enough to read in ten minutes, a house table equal to
the tree, links that lead somewhere, and the README's commands run by some test.

Which test runs each fenced command of the README:
  - Quick start, first block (install, then `xlaopt train ...`): the same training argv is run by
    tests/test_cli.py (`test_train_tiny_on_data2_fsdp2_tensor2_lowers_loss`); checked here.
  - Quick start, second block (install, then `pytest -q -n 2 --dist loadfile`): CI's test command (`.ci/run`).
  - "The Python API" block: tests/test_api.py (`test_the_readme_example_runs`).
  - "A first look" block: run here, each line in-process through `xlaopt.cli.main`.
The installs themselves (`python3 -m venv ... && pip install ...`) are run by no test: CI runs
the second block whole, and `.ci/wheel_check` builds and installs the wheel.
"""
from __future__ import annotations

import ast
import contextlib
import io
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
HOUSE = ROOT / "docs" / "house.md"
MAX_README_LINES = 300
# Source folders whose modules docs/house.md lists (pyproject.toml's package-dir roots).
CODE_ROOTS = ("xlaopt", "models", "passes")

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)


def _markdown_files() -> list[pathlib.Path]:
    return [README, ROOT / "BENCHMARKS.md", ROOT / "BAD_INPUTS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next heading of level 2 or 1."""
    start = text.index(f"\n## {heading}\n") + 1
    end = re.search(r"^#{1,2} ", text[start + 3:], re.M)
    return text[start:start + 3 + end.start()] if end else text[start:]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


# --- (a) the README's length -----------------------------------------------------------------

def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move the detail into docs/*.md and link it")


# --- (b) docs/house.md against the tree ------------------------------------------------------

def house_rows() -> list[str]:
    """The paths in the first column of docs/house.md's table, in order."""
    return re.findall(r"^\| `([^`]+)` \|", HOUSE.read_text(), re.M)


def tree_rows() -> set[str]:
    """What the table must list: each package by its folder (which covers its `__init__.py`) and
    every other module by its path."""
    rows = set()
    for root in CODE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if "__pycache__" in rel.parts:
                continue
            rows.add(f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix())
    return rows


def _summary(row: str) -> str:
    """A module's docstring, first sentence: a starting point for its job in a new row."""
    path = ROOT / row / "__init__.py" if row.endswith("/") else ROOT / row
    doc = ast.get_docstring(ast.parse(path.read_text())) or "(its job)"
    return " ".join(doc.split()).split(". ")[0].rstrip(".").replace("|", "\\|")


def test_house_table_lists_every_module_and_only_those():
    listed = house_rows()
    dup = sorted({r for r in listed if listed.count(r) > 1})
    assert not dup, f"docs/house.md lists these paths twice; keep one row each: {dup}"
    code = {r for r in listed if r.split("/", 1)[0] in CODE_ROOTS}
    tree = tree_rows()
    missing, stale = sorted(tree - code), sorted(code - tree)
    gone = sorted(r for r in set(listed) - code if not (ROOT / r).exists())
    problems = []
    if missing:
        problems.append("add a row to docs/house.md's table for each of these (a package by its folder, "
                        "with a trailing /; the job below is the docstring's first sentence, edit it):\n"
                        + "\n".join(f"| `{r}` | {_summary(r)} |" for r in missing))
    if stale or gone:
        problems.append("remove these rows from docs/house.md's table (no such module or folder in the tree):\n"
                        + "\n".join(f"| `{r}` |" for r in stale + gone))
    assert not problems, "docs/house.md is out of date with the tree.\n" + "\n\n".join(problems)


def test_house_check_sees_packages_and_modules():
    tree = tree_rows()
    assert {"xlaopt/", "xlaopt/analysis/", "models/", "passes/", "xlaopt/api.py", "passes/mesh_layout.py"} <= tree
    assert not any(r.endswith("__init__.py") for r in tree)
    assert _summary("xlaopt/errors.py") == "Errors a user can fix"


# --- (c) relative links lead to files (and headings) that exist -------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", path.read_text()), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _FENCE.sub("", path.read_text()))  # code is not a link
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files_and_headings(doc):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken relative links:\n" + "\n".join(broken)


def test_link_checker_reads_links_and_github_anchors(tmp_path):
    assert slug("Data loading when I/O bound: real-size clips (`xlaopt bench data --io`)") == \
        "data-loading-when-io-bound-real-size-clips-xlaopt-bench-data---io"
    assert slug("Collective matmul on XLA's GPU schedule (issue 16)") == "collective-matmul-on-xlas-gpu-schedule-issue-16"
    doc = tmp_path / "a.md"
    doc.write_text("# T\n## Twice\n## Twice\n[x](b.md#c) `[not](a link)`\n```\n[nor](this)\n```\n")
    assert links(doc) == ["b.md#c"]
    assert anchors(doc) == {"t", "twice", "twice-1"}


# --- (d) the README's commands ----------------------------------------------------------------

def _leading_strings(node: ast.List) -> list[str]:
    """The string literals a list literal starts with (`["train", ..., str(out)]` -> `["train", ...]`)."""
    out = []
    for e in node.elts:
        if not (isinstance(e, ast.Constant) and isinstance(e.value, str)):
            break
        out.append(e.value)
    return out


def test_quick_start_has_the_two_commands_ci_and_test_cli_run():
    blocks = _blocks(_section(README.read_text(), "Quick start"), "bash")
    assert len(blocks) == 2, "Quick start holds exactly two ```bash blocks; .ci/run runs the second"
    train, tests = (b.strip() for b in blocks)
    assert tests.startswith("python3 -m venv .venv && ") and tests.endswith("&& pytest -q -n 2 --dist loadfile"), tests
    # The training command is the one tests/test_cli.py runs.
    argv = shlex.split(train.rsplit("&& xlaopt ", 1)[1])
    cli_tests = ast.parse((ROOT / "tests" / "test_cli.py").read_text())
    argvs = [_leading_strings(node) for node in ast.walk(cli_tests) if isinstance(node, ast.List)]
    assert any(a[:len(argv)] == argv for a in argvs), (
        f"README's quick-start command `xlaopt {' '.join(argv)}` is not the one tests/test_cli.py trains with: "
        "change them together")


def test_python_api_block_is_where_test_api_reads_it():
    section = README.read_text().split("## The Python API", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "xlaopt.simulated_devices(8)" in example and "xlaopt.train(" in example


# What each "A first look" command must print, besides exiting 0. A new command there needs a row.
FIRST_LOOK = {
    "models": ["cosmos3-tiny", "llama3-70b", "15.17B"],
    "passes": ["1. layout-plan", "mesh-layout", "overlap-flags"],
    "plan --model llama3-70b --topology h100:1x8 --serve decode": ["serve llama3-70b on h100:1x8", "tp=8"],
    "plan --model llama3-8b --topology h100:2x8 --top 0": ["best: ", "baseline (pure FSDP)", "0 compiled"],
    "plan --model cosmos3-nano --topology h200:1x8 --serve video --resolution 720p --frames 189":
        ["44,160 generator tokens", "cfg2 x sp4", "best", "tp8"],
    "--help": ["usage: xlaopt", "train", "plan", "analyze"],
}


def first_look_commands() -> list[str]:
    block = _blocks(_section(README.read_text(), "A first look, in seconds"), "bash")
    assert len(block) == 1
    lines = [line.split("#", 1)[0].strip() for line in block[0].splitlines()]
    assert all(line.startswith("xlaopt ") for line in lines if line), lines
    return [line.removeprefix("xlaopt ") for line in lines if line]


def test_first_look_rows_match_the_readme():
    assert sorted(first_look_commands()) == sorted(FIRST_LOOK), (
        "README's 'A first look' commands and FIRST_LOOK in tests/test_docs.py differ: give each command "
        "what it must print")


@pytest.mark.parametrize("command", list(FIRST_LOOK))
def test_first_look_command_runs(command):
    from xlaopt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(shlex.split(command))
        except SystemExit as e:  # argparse's --help
            code = e.code
    assert code in (0, None), (command, code, err.getvalue()[-2000:])
    printed = out.getvalue()
    missing = [s for s in FIRST_LOOK[command] if s not in printed]
    assert not missing, f"`xlaopt {command}` printed none of {missing}:\n{printed[-2000:]}"


def test_benchmarks_open_with_headline_figures_each_linked_to_its_section():
    text = (ROOT / "BENCHMARKS.md").read_text()
    first = re.search(r"^## (.+)$", text, re.M).group(1)
    assert first == "Headline figures", f"BENCHMARKS.md's first section is {first!r}, not the headline table"
    table = [line for line in _section(text, "Headline figures").splitlines() if line.startswith("| ")]
    assert table[0] == "| figure | value | anchor | date | command |", table[0]
    rows = table[1:]
    assert len(rows) >= 10
    sections = anchors(ROOT / "BENCHMARKS.md") - {"headline-figures", "benchmarks"}
    for row in rows:
        link = re.match(r"\| \[[^\]]+\]\(#([^)]+)\) \|", row)
        assert link and link.group(1) in sections, f"a headline row must link to the section it comes from: {row}"
        assert re.search(r"\| 20\d\d-\d\d-\d\d \|", row), f"a headline row needs its date: {row}"
