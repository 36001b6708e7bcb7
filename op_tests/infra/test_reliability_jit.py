"""Reliability of the JIT driver: awkward paths, unusable cache directories, build
locks held by other processes, atomic installation and the cache's validity check.

Builds here use a one-line probe module (a fraction of a second each) and, where overlap
matters, a compiler wrapper (`CXX`) that records every compile/link with its pid and times and
can be made slow. Only `test_package_in_a_path_with_a_space` builds the torch binding.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from aiter_sage import jit_driver
from aiter_sage.builder import cache as jit_cache
from aiter_sage.builder import driver

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, child_json, run_as_script
from test_jit import call_probe
from test_jit import make_probe as _make_probe

MODULES = jit_driver.module_table()
PACKAGE_DIR = REPO / "aiter_sage"


# ------------------------------------------------------------------------------ helpers
def make_probe(root: Path, value: int):
    return _make_probe(root, value, name="reliability_probe")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(d))
    return d


WRAPPER = '''#!{python}
"""Test compiler: logs "<kind> <event> <pid> <time> [inode]" per compile/link to $WRAP_LOG.
WRAP_COMPILE_SLEEP delays each compile; WRAP_LINK_SLEEP makes the link write its output in
two halves with that pause in between, as a linker writing a large file would."""
import os, subprocess, sys, time
REAL = {real!r}
args = sys.argv[1:]
if "-c" not in args and "-o" not in args:  # --version and other queries
    os.execv(REAL, [REAL] + args)
kind = "compile" if "-c" in args else "link"


def note(event, extra=""):
    with open(os.environ["WRAP_LOG"], "a") as f:
        f.write(f"{{kind}} {{event}} {{os.getpid()}} {{time.time():.6f}} {{extra}}\\n")


note("start")
if kind == "compile":
    time.sleep(float(os.environ.get("WRAP_COMPILE_SLEEP", "0")))
    rc = subprocess.call([REAL] + args)
else:
    i = args.index("-o")
    out = args[i + 1]
    rc = subprocess.call([REAL] + args[:i] + ["-o", out + ".whole"] + args[i + 2:])
    if rc == 0:
        data = open(out + ".whole", "rb").read()
        os.remove(out + ".whole")
        with open(out, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(float(os.environ.get("WRAP_LINK_SLEEP", "0")))
            f.write(data[len(data) // 2:])
        note("inode", os.stat(out).st_ino)
note("end")
sys.exit(rc)
'''


class Wrapper:
    """A `CXX` that records compiles and links (see WRAPPER)."""

    def __init__(self, tmp_path: Path):
        real = shutil.which("g++") or shutil.which("clang++-19") or shutil.which("c++")
        assert real, "the cpu target needs a host C++ compiler"
        self.path = tmp_path / "wrapped-cxx"
        self.path.write_text(WRAPPER.format(python=sys.executable, real=real))
        self.path.chmod(0o755)
        self.log = tmp_path / "compiler.log"
        self.log.touch()

    def env(self, **sleeps) -> dict:
        env = {"CXX": str(self.path), "WRAP_LOG": str(self.log)}
        env.update({f"WRAP_{k.upper()}": str(v) for k, v in sleeps.items()})
        return env

    def events(self, kind: str, event: str) -> list[tuple[int, float, str]]:
        out = []
        for line in self.log.read_text().splitlines():
            k, e, pid, t, *extra = line.split()
            if (k, e) == (kind, event):
                out.append((int(pid), float(t), extra[0] if extra else ""))
        return out

    def wait_for(
        self, kind: str, event: str, proc: subprocess.Popen, timeout: float = 60.0
    ) -> None:
        """Until `proc` (a builder) got as far as `kind event`."""
        deadline = time.monotonic() + timeout
        while not self.events(kind, event):
            assert proc.poll() is None, f"the builder exited: {proc.communicate()}"
            assert time.monotonic() < deadline, f"no {kind} {event} within {timeout} s"
            time.sleep(0.02)


@pytest.fixture
def wrapper(tmp_path):
    return Wrapper(tmp_path)


# A child process that builds the probe module with the driver loaded from its file (no torch
# import, so several start in well under a second). It waits for `go` (a start barrier)
# when given, then prints {"so", "t0", "t1"} as JSON; a LockTimeout is printed and exits 3.
CHILD = textwrap.dedent("""
    import json, os, sys, time
    import types
    pkg = sys.modules["aiter_sage"] = types.ModuleType("aiter_sage")  # as setup.py: no torch
    pkg.__path__ = [{package!r}]
    from aiter_sage.builder import cache as jit_cache, driver as jd, errors, paths
    jit_cache.LOCK_REPORT_EVERY_S = float(os.environ.get("TEST_REPORT_EVERY", "30"))
    m = paths.module_table()
    probe = m.ModuleSpec(name="reliability_probe", archs=(), sources={{"cpu": ("probe.cpp",)}},
                         entry="sage_probe_launch", root={root!r})
    ready, go = os.environ.get("TEST_READY"), os.environ.get("TEST_GO")
    if ready:
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.005)
    t0 = time.time()
    try:
        so = jd.ensure_module(probe, "cpu")
    except errors.LockTimeout as e:
        print(json.dumps({{"timeout": str(e)}}))
        sys.exit(3)
    print(json.dumps({{"so": str(so), "t0": t0, "t1": time.time()}}))
""")


def start_child(src: Path, cache_dir: Path, extra_env: dict, **popen) -> subprocess.Popen:
    env = dict(os.environ, AITER_SAGE_CACHE_DIR=str(cache_dir), **extra_env)
    script = CHILD.format(package=str(PACKAGE_DIR), root=str(src))
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[dict, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child did not finish within {timeout} s (hung on the lock?):\n{err[-2000:]}")
    lines = out.strip().splitlines()
    assert lines, f"child rc={proc.returncode}, no result:\n{err[-3000:]}"
    return json.loads(lines[-1]), err


def manifest_sha(so: Path) -> str:
    return json.loads(so.with_suffix(".json").read_text())["sha256"]


# ------------------------------------------------------------------------------ 1. paths
# Each name holds a character that ninja (space, ':', '$'), the shell (quote, tab, '&', '(')
# or both treat specially; the source tree and the cache both live under it.
AWKWARD = {
    "space": "a b",
    "colon": "a:b",
    "quote": "a'b",
    "tab": "a\tb",
    "shell": "a&(b);c",
    "dollar": "a$b",
    "unicode": "é ü",
}


@pytest.mark.parametrize("name", list(AWKWARD.values()), ids=list(AWKWARD))
def test_awkward_cache_and_source_paths_build(tmp_path, monkeypatch, name):
    base = tmp_path / name
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(base / "cache"))
    so = jit_driver.ensure_module(make_probe(base / "src", 41), "cpu")
    assert so.parent == base / "cache" / "cpu"
    assert call_probe(so) == 41 and manifest_sha(so) == sha256(so)


def test_path_ninja_cannot_express_is_named(tmp_path, cache):
    spec = make_probe(tmp_path / "a|b", 1)
    with pytest.raises(jit_driver.BuildError, match=r"a\|b/probe\.cpp.*contains '\|'"):
        jit_driver.ensure_module(spec, "cpu")


PACKAGE_CALL = textwrap.dedent("""
    import json, torch, aiter_sage
    from aiter_sage import jit_driver
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 1, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    out = aiter_sage.gfx1201_sage_attention(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    print(json.dumps({"pkg": str(jit_driver.PKG_DIR), "csrc": str(jit_driver.csrc_dir()),
                      "shape": list(out.shape), "cos": float(cos),
                      "modules": [info for _, info in aiter_sage.ops.binding().loaded_modules()]}))
""")


def test_package_in_a_path_with_a_space(tmp_path):
    """A copy of the package in "x y" builds the binding and the cpu modules into a cache in
    "x y" and runs the op: every compile sees the space in its sources, flags and output."""
    root = tmp_path / "x y"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "_prebuilt", "*.so")
    for d in ("aiter_sage", "csrc", "jit"):
        shutil.copytree(REPO / d, root / d, ignore=ignore)
    shutil.copy(REPO / "GPU_ARCHS.cfg", root)
    env = dict(
        os.environ,
        PYTHONPATH=str(root),
        AITER_SAGE_CACHE_DIR=str(root / "cache"),
        AITER_SAGE_IGNORE_PREBUILT="1",
    )
    env.pop("AITER_SAGE_BACKEND", None)
    res = child_json(PACKAGE_CALL, env=env, cwd=tmp_path)
    assert res["pkg"] == str(root / "aiter_sage") and res["csrc"] == str(root / "csrc")
    assert res["shape"] == [1, 64, 1, 128] and res["cos"] > 0.99, res
    assert any("target=cpu" in m for m in res["modules"]), res
    built = sorted(p.name.split("-")[0] for p in (root / "cache").rglob("*.so"))
    assert built == [
        "aiter_sage_torch",
        "module_gfx1201_sage_attention",
        "module_gfx1201_sage_prepare",
    ], built


# ------------------------------------------------------------------------------ 2. errors
def test_cache_dir_that_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "cachefile"
    f.write_text("not a directory")
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(f))
    with pytest.raises(
        jit_driver.CacheDirError, match="cachefile is a file, not a directory.*AITER_SAGE_CACHE_DIR"
    ):
        jit_driver.ensure_module(make_probe(tmp_path / "src", 1), "cpu")


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs directory, or None where this process cannot mount
    (not root / no CAP_SYS_ADMIN): callers then simulate the condition instead."""
    mounted = []

    def mount(options: str):
        d = tmp_path / f"mnt{len(mounted)}"
        d.mkdir()
        if os.geteuid() != 0 or not shutil.which("mount"):
            return None
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"{options},size=32m", "tmpfs", str(d)],
            capture_output=True,
        )
        if r.returncode != 0:
            return None
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _simulate_readonly(monkeypatch, cache_dir: Path) -> None:
    """mkdir below `cache_dir` answers as on a read-only filesystem: EEXIST for a directory
    that exists (Linux checks that first), else EROFS."""
    real = os.mkdir

    def mkdir(path, *a, **kw):
        if str(path).startswith(str(cache_dir)):
            code = errno.EEXIST if os.path.exists(path) else errno.EROFS
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)


def _make_read_only(monkeypatch, d: Path, mounted: bool) -> None:
    """Makes the filled directory `d` read-only: remount, chmod (non-root) or simulation."""
    if mounted:
        r = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    elif os.geteuid() != 0:
        for p in (d, *d.rglob("*")):
            if p.is_dir():
                p.chmod(0o555)
    else:
        _simulate_readonly(monkeypatch, d)


def test_read_only_empty_cache_dir(tmp_path, monkeypatch, mount_tmpfs):
    d = mount_tmpfs("ro")
    if d is None and os.geteuid() != 0:  # a real read-only directory for a normal user
        d = tmp_path / "ro"
        d.mkdir(mode=0o555)
    elif d is None:  # root without mount: simulate the filesystem's answer
        d = tmp_path / "ro"
        d.mkdir()
        _simulate_readonly(monkeypatch, d)
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(d))
    with pytest.raises(
        jit_driver.CacheDirError,
        match=r"cannot create .*cpu \((Read-only file system|Permission denied)\)"
        r".*set AITER_SAGE_CACHE_DIR to a writable directory",
    ):
        jit_driver.ensure_module(make_probe(tmp_path / "src", 1), "cpu")


def test_read_only_cache_with_every_module_still_loads(tmp_path, monkeypatch, mount_tmpfs):
    """The checks must not refuse a read-only cache that needs no build (e.g. a shared one)."""
    d = mount_tmpfs("rw")
    mounted = d is not None
    d = d or tmp_path / "filled"
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(d))
    spec = make_probe(tmp_path / "src", 6)
    so = jit_driver.ensure_module(spec, "cpu")
    _make_read_only(monkeypatch, d, mounted)
    assert jit_driver.ensure_module(spec, "cpu") == so and call_probe(so) == 6


def test_noexec_cache_dir_is_explained(tmp_path, monkeypatch, mount_tmpfs):
    d = mount_tmpfs("noexec")
    if d is None:  # simulate the mount flag the driver reads
        d = tmp_path / "noexec"
        monkeypatch.setattr(jit_cache, "_mounted_noexec", lambda p: True)
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(d))
    with pytest.raises(jit_driver.CacheDirError, match="mounted noexec.*set AITER_SAGE_CACHE_DIR"):
        jit_driver.ensure_module(make_probe(tmp_path / "src", 1), "cpu")


def test_noexec_dlopen_failure_is_explained(tmp_path, cache, monkeypatch, mount_tmpfs):
    """Where the mount flag is not visible, the loader's refusal is translated too."""
    so = jit_driver.ensure_module(make_probe(tmp_path / "src", 2), "cpu")
    d = mount_tmpfs("noexec")
    if d is None:  # simulate glibc's answer for a noexec mount
        d = tmp_path
        real = ctypes.CDLL

        def refusing(name, *a, **kw):
            if str(name).startswith(str(d / "copy")):
                raise OSError(f"{name}: failed to map segment from shared object")
            return real(name, *a, **kw)

        monkeypatch.setattr(ctypes, "CDLL", refusing)
    target = d / "copy" / so.name
    target.parent.mkdir()
    shutil.copy(so, target)
    with pytest.raises(jit_driver.CacheDirError, match="noexec.*set AITER_SAGE_CACHE_DIR"):
        jit_driver.load_library(target)


def test_unknown_log_level_warns_instead_of_failing_import():
    env = dict(os.environ, AITER_SAGE_LOG_LEVEL="LOUD", AITER_SAGE_LAZY_REGISTER="1")
    r = subprocess.run(
        [sys.executable, "-c", "import aiter_sage; print('imported')"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-2000:]
    assert "AITER_SAGE_LOG_LEVEL='LOUD'" in r.stderr
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in r.stderr


def test_hung_lock_holder_is_named_and_timeout_raises(tmp_path, wrapper):
    """A builder that hangs holding the lock: the waiter says at once and periodically who
    holds it, and AITER_SAGE_LOCK_TIMEOUT ends the wait with an error naming both."""
    src, cache_dir = tmp_path / "src", tmp_path / "cache"
    make_probe(src, 4)
    holder = start_child(src, cache_dir, wrapper.env(compile_sleep=300), start_new_session=True)
    try:
        wrapper.wait_for("compile", "start", holder)  # the holder is compiling: it has the lock
        waiter = start_child(
            src,
            cache_dir,
            dict(wrapper.env(), AITER_SAGE_LOCK_TIMEOUT="2", TEST_REPORT_EVERY="0.5"),
        )
        res, err = finish(waiter, timeout=60)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # its own session: the python, ninja, wrapper
        holder.communicate()
    assert waiter.returncode == 3, (res, err)
    msg = res["timeout"]
    assert "AITER_SAGE_LOCK_TIMEOUT=2" in msg and ".lock" in msg, msg
    assert f"pid {holder.pid} on " in msg and "python" in msg, msg
    lines = [ln for ln in err.splitlines() if "for the build lock" in ln]
    assert lines and lines[0].startswith("[aiter_sage] waiting for the build lock"), err
    assert f"pid {holder.pid} " in lines[0], lines
    assert sum("still waiting" in ln for ln in lines) >= 2, lines


# ------------------------------------------------------------------------------ 3. locking
def test_overlapping_builds_compile_once(tmp_path, wrapper):
    """Three processes released together against an empty cache while the single compile
    takes 2 s: exactly one compile and one link run, and all get the same valid file."""
    src, cache_dir = tmp_path / "src", tmp_path / "cache"
    make_probe(src, 5)
    procs = []
    for i in range(3):
        barrier = dict(TEST_READY=str(tmp_path / f"ready{i}"), TEST_GO=str(tmp_path / "go"))
        procs.append(start_child(src, cache_dir, dict(wrapper.env(compile_sleep=2), **barrier)))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(3)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
            p.communicate() for p in procs if p.poll() is not None
        ]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = [finish(p)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    compiles, links = wrapper.events("compile", "start"), wrapper.events("link", "start")
    assert len(compiles) == 1 and len(links) == 1, wrapper.log.read_text()
    # The overlap was real: every process asked before the one compile had finished.
    ((_, compile_end, _),) = wrapper.events("compile", "end")
    assert max(r["t0"] for r in results) < compile_end, (results, compile_end)
    paths = {r["so"] for r in results}
    assert len(paths) == 1, paths
    so = Path(paths.pop())
    assert manifest_sha(so) == sha256(so) and call_probe(so) == 5


def test_waiter_loads_the_result_instead_of_rebuilding(tmp_path, wrapper):
    """A process that reaches the lock while another builds waits (and says so) and then
    loads that build: the cache is checked again once the lock is taken."""
    src, cache_dir = tmp_path / "src", tmp_path / "cache"
    make_probe(src, 8)
    first = start_child(src, cache_dir, wrapper.env(compile_sleep=2))
    wrapper.wait_for("compile", "start", first)
    second = start_child(src, cache_dir, wrapper.env(compile_sleep=2))
    (r1, _), (r2, err2) = finish(first), finish(second)
    assert first.returncode == 0 and second.returncode == 0
    assert len(wrapper.events("compile", "start")) == 1, wrapper.log.read_text()
    assert r1["so"] == r2["so"]
    assert f"held by pid {first.pid} on " in err2, err2  # it did wait on the first's lock
    assert "built reliability_probe" not in err2, err2
    so = Path(r2["so"])
    assert manifest_sha(so) == sha256(so) and call_probe(so) == 8


def test_module_appears_only_complete_by_rename(tmp_path, cache, wrapper, monkeypatch):
    """While a slow linker writes its output in two halves, the cache's .so path never shows
    a partial file; the installed file is the very inode the linker wrote (moved, not copied),
    and its manifest never appears before it."""
    for k, v in wrapper.env(link_sleep=1.0).items():
        monkeypatch.setenv(k, v)
    out_dir = cache / "cpu"
    seen, scans, stop = [], [], threading.Event()

    def scan():
        scans.append(time.time())
        if not out_dir.is_dir():
            return
        manifests = list(out_dir.glob("*.json"))
        for so in out_dir.glob("*.so"):
            try:
                seen.append(("so", hashlib.sha256(so.read_bytes()).hexdigest()))
            except FileNotFoundError:
                pass
        seen.extend(
            ("manifest-before-so", m.name) for m in manifests if not m.with_suffix(".so").exists()
        )

    def poll():
        while not stop.is_set():
            scan()
            time.sleep(0.002)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        so = jit_driver.ensure_module(make_probe(tmp_path / "src", 3), "cpu")
    finally:
        stop.set()
        poller.join()
    scan()
    ((_, link_start, _),) = wrapper.events("link", "start")
    ((_, link_end, _),) = wrapper.events("link", "end")
    assert sum(link_start < t < link_end for t in scans) > 20, "the poller did not run"
    final = sha256(so)
    assert {s for s in seen if s != ("so", final)} == set(), "partial or early files were visible"
    ((_, _, inode),) = wrapper.events("link", "inode")
    assert so.stat().st_ino == int(inode), "the .so was rewritten, not renamed into place"
    assert call_probe(so) == 3


def test_cached_file_with_a_different_hash_is_rebuilt(tmp_path, cache):
    """A cached .so that is a valid module exporting every symbol, but not the file its
    manifest hashed (here: another build of the module), is rebuilt, not used."""
    spec = make_probe(tmp_path / "src", 9)
    so = jit_driver.ensure_module(spec, "cpu")  # not loaded: see call_probe
    other = jit_driver.ensure_module(make_probe(tmp_path / "other", 10), "cpu")
    assert other != so
    swapped = so.with_suffix(".swap")
    shutil.copy(other, swapped)
    os.replace(swapped, so)
    assert driver._check_loadable(so, spec.entry) is None  # only the hash tells them apart
    assert manifest_sha(so) != sha256(so)
    again = jit_driver.ensure_module(spec, "cpu")
    assert again == so and manifest_sha(so) == sha256(so) and sha256(so) != sha256(other)
    assert call_probe(so) == 9


if __name__ == "__main__":
    run_as_script(__file__)
