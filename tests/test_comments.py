"""Comments and docstrings in services/ say what they mean: none points at an issue tag (a capital
letter and a number in square brackets; those belong in commit messages and docs)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[1] / "services"
ISSUE_TAG = re.compile(r"\[[A-Z]\d+\]")
GENERATED = SERVICES / "protocol" / "pb"


def comments(source: str):
    """(line, text) of every comment and docstring in a module's source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def tag(name: str) -> str:
    """An issue tag, spelled here so that this file carries none itself."""
    return f"[{name}]"


def test_the_tag_pattern_finds_a_tag_in_a_comment_and_a_docstring():
    source = (f'"""Fixed in {tag("S3")}."""\nx = 1  # see {tag("H3")} for why\n'
              f'y = "{tag("A3")} in a plain string"\n')
    assert sorted(line for line, text in comments(source) if ISSUE_TAG.search(text)) == [1, 2]


def test_no_comment_or_docstring_under_services_carries_an_issue_tag():
    found = [f"{path.relative_to(SERVICES.parent)}:{line}: {ISSUE_TAG.search(text).group()}"
             for path in sorted(SERVICES.rglob("*.py")) if GENERATED not in path.parents
             for line, text in comments(path.read_text(encoding="utf-8"))
             if ISSUE_TAG.search(text)]
    assert not found, "comments should say what they mean, not cite issues:\n" + "\n".join(found)
