"""``from sageattention import sageattn`` gets aiter_sage's where SageAttention is not installed.

Opt-in, two ways:

* in a program, before the import: ``aiter_sage.integrations.enable_sageattention_shim()``;
* for every Python start of this environment (ComfyUI's ``--use-sage-attention``, scripts you
  do not edit): ``python3 -m aiter_sage.integrations.sageattention_shim install`` writes a
  ``.pth`` file into site-packages (``uninstall`` removes it; ``--site-dir DIR`` picks
  another site directory).

Either way a finder goes at the *end* of ``sys.meta_path`` and answers only for the top-level
name ``sageattention``, only after every other finder said it has none: a real SageAttention
install always wins. The module it provides exposes :func:`aiter_sage.sageattn` as
``sageattn``, SageAttention's per-kernel names (``sageattn_qk_int8_pv_fp8_cuda``, ...) with
their options keyword-only, and ``__aiter_sage_shim__ = True``; all of them smooth K whatever
``smooth_k`` says (see SMOOTH_K_POSITION's comment for why and the measurement), and
``sageattn_varlen`` (packed sequences). Not provided: the ``sageattention.core`` submodule.

This file imports neither torch nor aiter_sage: the ``.pth`` line runs it by its path at every
interpreter start, and only the ``import sageattention`` it answers loads aiter_sage.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys

NAME = "sageattention"
PTH_NAME = "aiter_sage_sageattention_shim.pth"
# SageAttention's per-kernel entry points that nodes import next to sageattn; here they all
# run aiter_sage's kernels and take their options by keyword only (their positional orders
# differ from sageattn's).
KEYWORD_VARIANTS = (
    "sageattn_qk_int8_pv_fp16_triton",
    "sageattn_qk_int8_pv_fp16_cuda",
    "sageattn_qk_int8_pv_fp8_cuda",
    "sageattn_qk_int8_pv_fp8_cuda_sm90",
)
_MARK = "_aiter_sage_sageattention_shim"
_BOOT = "_aiter_sage_sageattention_shim_boot"  # module name the .pth runs this file under


# SageAttention's smooth_k chooses how K is quantized, not what is computed: subtracting the
# keys' mean moves every score of a row by one constant, which the softmax removes. The shim
# therefore smooths always, also when a caller passes smooth_k=False (ComfyUI does on every
# call). Measured with the cpu backend (256 query rows, H 8, D 128, relative L2 against FP32):
# DiT-like inputs (outlier Q channels, a per-channel K offset N(0, 3)) 0.0801 -> 0.0667 at
# S 1024 and 0.0826 -> 0.0678 at S 4096; a K offset alone 0.0394 -> 0.0316; randn 0.0313 both;
# 30x outlier key rows 0.0543 -> 0.0550; cost +8 % (0.148 -> 0.160 s at S 4096). Calls to
# aiter_sage.sageattn itself keep the smooth_k they pass.
SMOOTH_K_POSITION = 7  # sageattn(q, k, v, tensor_layout, is_causal, sm_scale, return_lse, smooth_k)
_override_noted = []


def _note_smooth_k_override() -> None:
    import torch  # loaded by now: the shim module exists only once aiter_sage is imported

    if _override_noted or torch.compiler.is_compiling():  # logging would break the graph
        return
    _override_noted.append(True)
    import logging

    logging.getLogger("aiter_sage").info(
        "sageattention shim: smooth_k=False is read as SageAttention's quantization choice; "
        "aiter_sage smooths K on every call (the softmax is unchanged, the INT8 error of "
        "offset keys drops: docs/api.md)"
    )


def always_smoothed(fn, smooth_k_position=None):
    """``fn`` with ``smooth_k`` forced on (by keyword, or at ``smooth_k_position``); its
    signature (``inspect.signature``) stays ``fn``'s, ``attn_mask`` included."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if smooth_k_position is not None and len(args) > smooth_k_position:
            given = args[smooth_k_position]
            args = (*args[:smooth_k_position], True, *args[smooth_k_position + 1 :])
        else:
            given = kwargs.get("smooth_k", True)
            kwargs["smooth_k"] = True
        if not given:
            _note_smooth_k_override()
        return fn(*args, **kwargs)

    return call


class _ShimLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from aiter_sage.integrations.router import sageattn, sageattn_keywords
        from aiter_sage.integrations.varlen import sageattn_varlen

        module.sageattn = always_smoothed(sageattn, SMOOTH_K_POSITION)
        for name in KEYWORD_VARIANTS:
            setattr(module, name, always_smoothed(sageattn_keywords))
        module.sageattn_varlen = sageattn_varlen
        module.__aiter_sage_shim__ = True
        module.__all__ = ["sageattn", "sageattn_varlen", *KEYWORD_VARIANTS]


class SageAttentionShimFinder(importlib.abc.MetaPathFinder):
    """Provides ``sageattention`` when no other finder on ``sys.meta_path`` can."""

    _aiter_sage_sageattention_shim = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME or real_sageattention_installed(path, target):
            return None  # not ours, or a real SageAttention the normal import finds
        return importlib.util.spec_from_loader(
            NAME, _ShimLoader(), origin="aiter_sage (sageattention shim)"
        )


def real_sageattention_installed(path=None, target=None) -> bool:
    """Whether a finder other than this shim's provides ``sageattention``."""
    for finder in list(sys.meta_path):
        if getattr(finder, _MARK, False):
            continue
        find = getattr(finder, "find_spec", None)
        if find is not None and find(NAME, path, target) is not None:
            return True
    return False


def enable_sageattention_shim() -> bool:
    """Let ``import sageattention`` load aiter_sage's ``sageattn`` when SageAttention itself is
    not installed. Idempotent; returns True if the finder was added by this call."""
    if any(getattr(f, _MARK, False) for f in sys.meta_path):
        return False
    sys.meta_path.append(SageAttentionShimFinder())
    return True


def disable_sageattention_shim() -> bool:
    """Remove the finder (an already imported shim module stays in sys.modules)."""
    found = [f for f in sys.meta_path if getattr(f, _MARK, False)]
    for f in found:
        sys.meta_path.remove(f)
    return bool(found)


def pth_line(path: str = __file__) -> str:
    """The .pth line: runs this file (not the aiter_sage package) and enables the shim; a
    missing file (aiter_sage moved or removed) is skipped."""
    p = os.path.abspath(path)
    return (
        f"import os; p = {p!r}; os.path.exists(p) and exec(compile(open(p).read(), p, 'exec'), "
        f"{{'__name__': {_BOOT!r}, '__file__': p}})\n"
    )


def _default_site_dir() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def install(site_dir: str | None = None) -> str:
    """Write the .pth file into site_dir (default: this interpreter's site-packages)."""
    target = os.path.join(site_dir or _default_site_dir(), PTH_NAME)
    with open(target, "w") as f:
        f.write(pth_line())
    return target


def uninstall(site_dir: str | None = None) -> str:
    target = os.path.join(site_dir or _default_site_dir(), PTH_NAME)
    if os.path.exists(target):
        os.remove(target)
    return target


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python3 -m aiter_sage.integrations.sageattention_shim",
        description="Make `import sageattention` load aiter_sage where SageAttention is absent.",
    )
    ap.add_argument("action", choices=("install", "uninstall"))
    ap.add_argument("--site-dir", default=None, help="site directory (default: site-packages)")
    a = ap.parse_args(argv)
    path = (install if a.action == "install" else uninstall)(a.site_dir)
    print(f"{a.action}ed {path}")
    return 0


if __name__ == _BOOT:
    enable_sageattention_shim()
elif __name__ == "__main__":
    sys.exit(main())
