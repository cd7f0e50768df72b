"""Lines per module and the longest functions of nmt/ (or given files): the shape the house style asks for.

    python benchmarks/code_shape.py [--top 5] [paths...]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def function_lengths(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in `path`, decorators and docstring included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def modules(paths: list[str]) -> list[Path]:
    found = [Path(p).resolve() for p in paths] or [ROOT / "nmt"]
    return sorted(f for p in found for f in ([p] if p.is_file() else p.rglob("*.py")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    files = modules(args.paths)
    for f in files:
        print(f"{len(f.read_text(encoding='utf-8').splitlines()):5d}  {f.relative_to(ROOT)}")
    longest = sorted(((n, f"{f.relative_to(ROOT)}:{name}") for f in files for n, name in function_lengths(f)),
                     reverse=True)
    print(f"longest {args.top} functions:")
    for n, name in longest[: args.top]:
        print(f"{n:5d}  {name}")


if __name__ == "__main__":
    main()
