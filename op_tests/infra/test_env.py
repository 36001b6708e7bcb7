"""The environment variables are declared once (aiter_sage/env.py) and the code and docs agree.

The code is searched as text: every ``AITER_SAGE_*`` name in a Python, C++ or shell file of
the product must be declared, every declared variable must be read by the files it names, and
the README's table must be the table env.py prints. The docs may name declared variables only.
Python reads them through ``env.get`` alone: a read of ``os.environ`` / ``os.getenv`` that names
one (as a literal or a module constant) anywhere else fails.
"""

import ast
import re

import pytest

from aiter_sage import env

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, run_as_script

# Where the product's code lives, and which files in it are code.
CODE_ROOTS = ("aiter_sage", "jit", "csrc", "op_benchmarks", "setup.py", ".ci")
CODE_SUFFIXES = {".py", ".h", ".cpp", ".hip", ".cu", ".inc", ".sh", ""}  # "": .ci/install, run
DOC_FILES = ("README.md", "CONTRIBUTING.md")
DOC_ROOTS = ("docs", "csrc")
NAME = re.compile(r"\b" + env.PREFIX + r"[A-Z0-9_]*[A-Z0-9]\b")
ENV_FILE = REPO / "aiter_sage" / "env.py"


def _files(roots, keep):
    for root in roots:
        path = REPO / root
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        yield from (p for p in found if keep(p) and p != ENV_FILE and "__pycache__" not in p.parts)


def _names_in(paths) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for p in paths:
        for name in set(NAME.findall(p.read_text(errors="replace"))):
            seen.setdefault(name, []).append(str(p.relative_to(REPO)))
    return seen


def _code_files():
    return _files(CODE_ROOTS, lambda p: p.suffix in CODE_SUFFIXES)


def test_every_name_in_the_code_is_declared():
    used = _names_in(_code_files())
    undeclared = {n: files for n, files in used.items() if n not in env.BY_NAME}
    assert not undeclared, f"declare these in aiter_sage/env.py: {undeclared}"


def test_every_declared_prefixed_name_is_used():
    used = _names_in(_code_files())
    declared = {n for n in env.BY_NAME if n.startswith(env.PREFIX)}
    assert declared <= set(used), sorted(declared - set(used))


def test_declarations_are_complete_and_unique():
    assert len(env.BY_NAME) == len(env.VARIABLES)
    for v in env.VARIABLES:
        assert v.default and v.doc and v.readers, v
        assert "|" not in v.default + v.doc, f"{v.name}: '|' would split its table row"


def test_each_reader_reads_its_variable():
    for v in env.VARIABLES:
        for reader in v.readers:
            path = REPO / reader
            assert path.is_file(), (v.name, reader)
            assert re.search(rf"\b{v.name}\b", path.read_text()), f"{reader} never names {v.name}"


def _readme_table() -> str:
    text = (REPO / "README.md").read_text()
    header = env.markdown_table().splitlines()[0]
    assert header in text, "README.md has no environment table"
    rows = text[text.index(header) :].splitlines()
    return "\n".join(r for r in _leading_table(rows))


def _leading_table(lines):
    for line in lines:
        if not line.startswith("|"):
            return
        yield line


def test_readme_table_is_the_declared_table():
    readme = _readme_table()
    listed = re.findall(r"^\| `([A-Z0-9_]+)` \|", readme, flags=re.M)
    assert set(listed) == set(env.BY_NAME), (
        sorted(set(env.BY_NAME) - set(listed)),
        sorted(set(listed) - set(env.BY_NAME)),
    )
    assert readme == env.markdown_table(), "regenerate it: python3 -m aiter_sage.env"


def test_docs_name_declared_variables_only():
    docs = [REPO / f for f in DOC_FILES] + list(_files(DOC_ROOTS, lambda p: p.suffix == ".md"))
    unknown = {n: f for n, f in _names_in(docs).items() if n not in env.BY_NAME}
    assert not unknown, unknown


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "literal" assignments (ENV_BACKEND = "AITER_SAGE_BACKEND")."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def _is_environ(node) -> bool:
    """os.environ, environ (imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _read_names(node) -> list:
    """The name expressions an expression reads from the environment, if it does."""
    if isinstance(node, ast.Call):
        f = node.func
        environ_get = isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)
        getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
            isinstance(f, ast.Name) and f.id == "getenv"
        )
        if (environ_get or getenv) and node.args:
            return [node.args[0]]
    if isinstance(node, ast.Subscript) and _is_environ(node.value):
        if isinstance(node.ctx, ast.Load):
            return [node.slice]
    if isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
        return [node.left]
    return []


def _name_value(expr, constants: dict[str, str], modules: dict[str, dict[str, str]]):
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Name):
        return constants.get(expr.id)
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        return modules.get(expr.value.id, {}).get(expr.attr)  # backends.ENV_BACKEND
    return None


def bypassing_reads(paths) -> list[str]:
    """`file:line NAME` for every environment read of an AITER_SAGE_* name outside env.py."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in paths}
    by_module = {p.stem: _string_constants(tree) for p, tree in trees.items()}
    found = []
    for p, tree in trees.items():
        constants = by_module[p.stem]
        for node in ast.walk(tree):
            for expr in _read_names(node):
                name = _name_value(expr, constants, by_module)
                if name and name.startswith(env.PREFIX):
                    where = p.relative_to(REPO) if p.is_relative_to(REPO) else p
                    found.append(f"{where}:{node.lineno} {name}")
    return found


def test_python_reads_go_through_env_get():
    python = [p for p in _code_files() if p.suffix == ".py"]
    assert not bypassing_reads(python), "read these through aiter_sage.env.get"


def test_the_bypass_check_sees_each_read_form(tmp_path):
    """Each way of reading the environment is caught, and a read through env.get is not."""
    forms = {
        'os.environ.get("AITER_SAGE_X")': True,
        'os.environ["AITER_SAGE_X"]': True,
        'os.getenv("AITER_SAGE_X", "")': True,
        '"AITER_SAGE_X" in os.environ': True,
        "os.environ.get(ENV_X)": True,
        'env.get("AITER_SAGE_X")': False,
        'os.environ.get("CXX")': False,
    }
    for i, (code, caught) in enumerate(forms.items()):
        f = tmp_path / f"probe_{i}.py"
        f.write_text(f'import os\nENV_X = "AITER_SAGE_X"\nvalue = {code}\n')
        assert bool(bypassing_reads([f])) == caught, code


def test_get_reads_at_call_time_and_refuses_undeclared_names(monkeypatch):
    monkeypatch.setenv("AITER_SAGE_CHECK", "1")
    assert env.get("AITER_SAGE_CHECK") == "1"
    monkeypatch.delenv("AITER_SAGE_CHECK")
    assert env.get("AITER_SAGE_CHECK", "unset") == "unset"
    with pytest.raises(KeyError, match="AITER_SAGE_NOT_A_VARIABLE"):
        env.get("AITER_SAGE_NOT_A_VARIABLE")


if __name__ == "__main__":
    run_as_script(__file__)
