"""The docs say what the code does: the README's size and its two commands, links that lead
somewhere, and the gfx12 ISA figures the READMEs quote equal to what `python3 -m aiter_sage.isa`
reports for today's kernels (VGPRs, scratch, waves, LDS, the main loop's mix, the model's
prediction). Runnable as a script or under pytest."""

import re

import pytest

from aiter_sage import isa

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, run_as_script
from test_isa import ATTENTION, PREPARE, _reports

README = REPO / "README.md"
GFX12_README = REPO / "csrc" / "gfx12" / "README.md"
README_MAX_LINES = 150  # a newcomer reads it on one screen; the rest lives in docs/
# The README's two commands, word for word (.ci/run runs the tests' pytest line itself).
MAIN_JOB = (
    "bash .ci/install && python3 op_benchmarks/bench_gfx1201_sage_attention.py --compare_to_ref"
)
TESTS = "bash .ci/install && python3 -m pytest op_tests -q"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Kernel-name pieces of the variant labels in csrc/gfx12/README.md's tables.
PREPARE_COLUMNS = ("", "_d64", "_f16", "_d64_f16")  # BF16 Dp 128, BF16 Dp 64, FP16 128, FP16 64
MODEL_ARGS = dict(queries_per_group=128, compute_queries=32)  # what the CLI uses for ours


def _markdown_files():
    yield from (README, REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md")
    yield from sorted((REPO / "docs").rglob("*.md"))
    yield from sorted((REPO / "csrc").rglob("README.md"))
    yield from sorted((REPO / "examples").rglob("*.md"))


def test_readme_fits_one_screen_and_keeps_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    assert MAIN_JOB in lines and TESTS in lines
    run = (REPO / ".ci" / "run").read_text().splitlines()
    assert TESTS.split(" && ")[1] in run  # CI runs the README's test command


def test_relative_links_resolve():
    broken = []
    for md in _markdown_files():
        assert md.is_file(), f"{md.relative_to(REPO)} is missing"
        for target in LINK.findall(md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_readme_figures_are_committed_pngs():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README.read_text())
    assert len(images) >= 3, images  # one per backend with a speed figure, plus accuracy
    for rel in images:
        assert (REPO / rel).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", rel


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    """Cells of the rows of the markdown table whose header row starts with `first_cell`."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_cell} |"))
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def _attention_kernel(label: str) -> str:
    words = label.split()
    suffix = "_d64" if words[0] == "D64" else ""
    suffix += "_causal" if "causal" in words else ""
    return "sage_attention_fwd_kernel" + suffix + ("_pv16" if "pv16" in words else "")


@pytest.fixture(scope="module")
def gfx1201_kernels():
    return {**_reports("gfx1201", ATTENTION), **_reports("gfx1201", PREPARE)}


def test_gfx12_readme_attention_budgets_are_the_isa_report(gfx1201_kernels):
    rows = _table_rows(GFX12_README.read_text(), "kernel | VGPRs | scratch")
    assert len(rows) == 8, rows
    for label, vgprs, scratch, waves, lds, wmmas, valu, share in rows:
        k = gfx1201_kernels[_attention_kernel(label)]
        lp = k.loop
        pv, kind = (lp.wmma_f16, "f16") if "pv16" in label else (lp.wmma_fp8, "fp8")
        quoted = (vgprs, scratch, waves, lds, wmmas, valu, share)
        assert quoted == (
            str(k.vgprs),
            str(k.scratch_bytes),
            str(k.waves_per_simd),
            f"{k.lds_bytes} B",
            f"{lp.wmma_iu8} + {pv} {kind}",
            f"{lp.valu} ({lp.rescale_valu}) / {lp.trans}",
            f"{100 * lp.wmma_cycle_share():.1f} % / "
            f"{100 * lp.wmma_cycle_share(skip_rescale=True):.1f} %",
        ), label


def test_gfx12_readme_prepare_occupancy_is_the_isa_report(gfx1201_kernels):
    rows = _table_rows(GFX12_README.read_text(), "prepare kernel")
    kinds = ("v_scale", "v_scale_smooth", "qk", "qk_smooth", "qk_plain", "v_quant", "v_quant16")
    assert {r[0] for r in rows} == {f"`{k}`" for k in kinds}
    for kind, *cells in rows:
        assert len(cells) == len(PREPARE_COLUMNS), kind
        for suffix, cell in zip(PREPARE_COLUMNS, cells):
            k = gfx1201_kernels[f"sage_prepare_{kind.strip('`')}{suffix}_kernel"]
            assert k.scratch_bytes == 0, k.name
            assert cell == f"{k.vgprs} ({k.waves_per_simd})", k.name


def _predicted(k, d: int) -> tuple[str, str]:
    every = isa.predict(k, isa.R9700, d=d, **MODEL_ARGS)
    never = isa.predict(k, isa.R9700, d=d, rescale_executed=False, **MODEL_ARGS)
    t513, t512 = (
        isa.predict(k, isa.R9700, d=d, h=768, s=s, **MODEL_ARGS).seconds for s in (513, 512)
    )
    return f"{every.tflops:.0f} / {never.tflops:.0f}", f"{t513 / t512:.2f}×"


def test_quoted_predictions_are_the_model(gfx1201_kernels):
    rows = _table_rows(GFX12_README.read_text(), "kernel | predicted TFLOPS")
    assert rows, "csrc/gfx12/README.md has no prediction table"
    for label, tflops, tail in rows:
        d = 64 if label.startswith("D64") else 128
        assert (tflops, tail) == _predicted(gfx1201_kernels[_attention_kernel(label)], d), label


def test_quoted_calibrated_prediction_is_the_model(gfx1201_kernels):
    """The README's and csrc/gfx12/README.md's R9700 figure for the D128 FP8 kernel at B1 H24
    S16384 is the calibrated model's, for ROCm 7.2's code (and clang-19's in brackets), with
    the calibration's band."""
    from aiter_sage import perf_model

    from test_isa import _rocm_reports

    rocm = _rocm_reports("gfx12/attention.hip")  # {kernel name: report}
    name = "sage_attention_fwd_kernel"
    shape = perf_model.Shape(1, 24, 16384, 128, False)

    def predicted(k):
        return perf_model.predict(perf_model.Kernel.from_report(k), perf_model.R9700, shape, 128)

    r, c = predicted(rocm[name]), predicted(gfx1201_kernels[name])
    text = " ".join(README.read_text().split())
    assert f"predicted at {r.tflops:.0f} TFLOPS at B1 H24 S16384" in text
    assert f"({r.tflops * (1 - r.band):.0f}–{r.tflops * (1 + r.band):.0f}:" in text
    assert f"{c.tflops:.0f} with clang-19's code" in text
    rows = _table_rows(GFX12_README.read_text(), "kernel | B1 H24 S4k")
    cell = dict((row[0], row[2]) for row in rows)[f"D128 FP8 (`{name}`)"]
    assert cell == f"{r.tflops:.0f} ({c.tflops:.0f})", cell


if __name__ == "__main__":
    run_as_script(__file__)
