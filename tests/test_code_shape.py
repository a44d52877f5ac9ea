"""The shape the code keeps, so that a change stays cheap to make (issue 35's limits).

- few long functions in the package: a function over :data:`LONG` lines is one a reader must hold
  whole; at most :data:`MAX_LONG` of them;
- imports at the top: an optional dependency is one module-level ``lazy_module`` (a command's
  ``--help`` stays fast, the edge runtime stays without it), so an import inside a function body
  is the exception (an import cycle, a test hook): at most :data:`MAX_INNER_IMPORTS`;
- no benchmark file over :data:`MAX_BENCHMARK_LINES` lines.

Each limit prints what breaks it, so the fix is in the message.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hydra_deploy"
LONG = 80
MAX_LONG = 5
MAX_INNER_IMPORTS = 140
MAX_BENCHMARK_LINES = 1200

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _modules(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def long_functions(folder: Path = PACKAGE, limit: int = LONG) -> list[tuple[int, str]]:
    """(lines, ``path:line name``) of every function of ``folder`` longer than ``limit`` lines."""
    found = []
    for path in _modules(folder):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, _FUNCTIONS):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = f"{_name(path)}:{node.lineno} {node.name}"
                    found.append((lines, where))
    return sorted(found, reverse=True)


def inner_imports(folder: Path = PACKAGE) -> dict[str, int]:
    """Imports inside function bodies, per module of ``folder``."""
    counts: dict[str, int] = {}

    def visit(node: ast.AST, in_function: bool, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                counts[name] = counts.get(name, 0) + 1
            visit(child, in_function or isinstance(child, _FUNCTIONS), name)

    for path in _modules(folder):
        visit(ast.parse(path.read_text(encoding="utf-8")), False, _name(path))
    return counts


def test_the_counters_count_what_they_say(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os\n"
        "def short():\n    import json\n    return json\n"
        "def long():\n" + "    x = 1\n" * 90 + "    def inner():\n        import sys\n"
    )
    assert [lines for lines, _ in long_functions(tmp_path)] == [93]
    assert sum(inner_imports(tmp_path).values()) == 2  # json, and sys in the nested function


def test_at_most_a_few_long_functions():
    found = long_functions()
    listing = "\n".join(f"  {lines:4d} {where}" for lines, where in found)
    assert len(found) <= MAX_LONG, (
        f"{len(found)} functions over {LONG} lines (at most {MAX_LONG}); split one where a reader "
        f"gains:\n{listing}"
    )


def test_imports_sit_at_the_top():
    counts = inner_imports()
    total = sum(counts.values())
    worst = sorted(counts.items(), key=lambda item: -item[1])[:10]
    listing = "\n".join(f"  {count:3d} {name}" for name, count in worst)
    assert total <= MAX_INNER_IMPORTS, (
        f"{total} imports inside function bodies (at most {MAX_INNER_IMPORTS}): move them to the "
        "top of the module, an optional dependency as one module-level "
        f"hydra_deploy.optional.lazy_module; the most:\n{listing}"
    )


def test_no_benchmark_file_is_over_the_limit():
    sizes = {
        _name(path): len(path.read_text(encoding="utf-8").splitlines())
        for path in _modules(ROOT / "benchmarks")
    }
    over = {name: lines for name, lines in sizes.items() if lines > MAX_BENCHMARK_LINES}
    assert not over, f"benchmark files over {MAX_BENCHMARK_LINES} lines (split by concern): {over}"
