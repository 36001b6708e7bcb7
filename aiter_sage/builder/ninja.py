"""build.ninja for a module and the ninja run that builds it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from .. import env
from .errors import BuildError, CompilerNotFound
from .paths import _spec_flags, _src_root, _which

if TYPE_CHECKING:
    from .toolchains import Toolchain


def _ninja() -> str:
    exe = _which(env.get("AITER_SAGE_NINJA", ""), "ninja")
    if exe:
        return exe
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError:
        raise CompilerNotFound(
            "aiter_sage: ninja is needed to build modules: "
            "`pip install ninja` or `apt-get install ninja-build`"
        ) from None


# Two escapings meet in build.ninja. Paths in `build` lines are read by ninja's lexer, where
# "$", " " and ":" need "$$", "$ " and "$:" (and "|", newlines cannot be written at all);
# ninja shell-quotes them itself when it substitutes $in / $out. Values of the variables that
# the rules paste into a command (compiler, flags) reach /bin/sh verbatim, so they are
# shell-quoted, and then every "$" is doubled for ninja.
_NINJA_UNWRITABLE = re.compile(r"[|\n\r\0]")


def _unwritable(text: str, what: str) -> BuildError:
    bad = _NINJA_UNWRITABLE.search(text).group(0)
    return BuildError(
        f"aiter_sage: the {what} {text!r} contains {bad!r}, which a ninja build "
        f"file cannot express; move it to a path without that character "
        f"(the module cache: AITER_SAGE_CACHE_DIR)"
    )


def ninja_path(path) -> str:
    """A path as written in a ninja `build` line."""
    text = str(path)
    if _NINJA_UNWRITABLE.search(text):
        raise _unwritable(text, "path")
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def ninja_command_words(words) -> str:
    """Words for a ninja variable that a rule substitutes into a shell command."""
    out = []
    for w in map(str, words):
        if re.search(r"[\n\r\0]", w):
            raise _unwritable(w, "compiler argument")
        out.append(shlex.quote(w).replace("$", "$$"))
    return " ".join(out)


def write_ninja(spec, tc: Toolchain, build_dir: Path, output: Path) -> Path:
    """build.ninja for one module; ninja runs in build_dir, so objects are named relative to
    it and the cache directory's own name never has to appear in a build line."""
    root = _src_root(spec)
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {ninja_command_words([tc.compiler])}",
        f"cflags = {ninja_command_words(tc.cflags + _spec_flags(spec, tc.kind))}",
        f"ldflags = {ninja_command_words(tc.ldflags)}",
        "rule cxx\n  command = $cxx $lang $cflags -c $in -o $out\n  description = CXX $in",
        "rule link\n  command = $cxx $in $ldflags -o $out\n  description = LINK $out",
    ]
    objs = []
    for i, src in enumerate(spec.sources[tc.kind]):
        obj = ninja_path(f"{i}_{Path(src).stem}.o")
        lang = "-x c++" if (tc.hip_as_cxx and src.endswith(".hip")) else ""
        lines.append(f"build {obj}: cxx {ninja_path(root / src)}\n  lang = {lang}")
        objs.append(obj)
    out = os.path.relpath(output, build_dir)
    lines.append(f"build {ninja_path(out)}: link {' '.join(objs)}")
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_ninja(build_dir: Path, spec, target: str) -> None:
    jobs = os.environ.get("MAX_JOBS") or str(max(1, os.cpu_count() or 1))
    proc = subprocess.run(
        [_ninja(), "-C", str(build_dir), "-j", jobs], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise BuildError(
            f"aiter_sage: building {spec.name} for {target} failed:\n"
            f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
