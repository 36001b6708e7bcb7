"""The contract's numbers live once per language: csrc/include/sage/constants.h (and params.h's
alignments) for C++, aiter_sage/contract.py for Python. The C++ header is parsed here and each
value compared with the Python one, at the precision C++ declares it in; no C++ source keeps a
copy of its own."""

import re
import struct

from aiter_sage import contract, ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, run_as_script

CSRC = REPO / "csrc"
CONSTANTS_H = CSRC / "include" / "sage" / "constants.h"
PARAMS_H = CSRC / "include" / "sage" / "params.h"
# C++ name -> contract.py name.
CONSTANTS = {
    "kInt8Max": "INT8_MAX",
    "kFp8Max": "FP8_MAX",
    "kLog2e": "LOG2E",
    "kLn2": "LN2",
    "kExpOffset": "EXP_OFFSET",
}
DEFINES = {
    "SAGE_HEAD_DIM_ALIGN": "HEAD_DIM_ALIGN",
    "SAGE_SCALE_BLOCK": "SCALE_BLOCK",
    "SAGE_Q_SCALE_ROWS_FINE": "Q_SCALE_ROWS_FINE",
    "SAGE_SEQ_ALIGN": "SEQ_ALIGN",
}
CONSTEXPR = re.compile(r"constexpr\s+(float|double|int)\s+(k\w+)\s*=\s*([^;]+);")


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _header_constants() -> dict[str, tuple[str, float]]:
    found = {}
    for ctype, name, literal in CONSTEXPR.findall(CONSTANTS_H.read_text()):
        value = float(literal.strip().rstrip("fF"))
        found[name] = (ctype, _f32(value) if ctype == "float" else value)
    return found


def test_every_header_constant_equals_its_python_twin():
    header = _header_constants()
    assert set(header) == set(CONSTANTS), "a constant of constants.h needs a contract.py twin"
    for cname, pyname in CONSTANTS.items():
        ctype, value = header[cname]
        python = getattr(contract, pyname)
        as_declared = _f32(python) if ctype == "float" else python
        assert as_declared == value, (cname, value, pyname, python)


def test_alignments_equal_params_h():
    text = PARAMS_H.read_text()
    for define, pyname in DEFINES.items():
        (value,) = re.findall(rf"#define {define} (\d+)\b", text)
        assert int(value) == getattr(contract, pyname), define


def test_ref_reads_the_contract():
    for pyname in (*CONSTANTS.values(), *DEFINES.values()):
        assert getattr(ref, pyname) is getattr(contract, pyname), pyname


def test_no_source_keeps_its_own_copy():
    """Only constants.h defines these names: a kernel that declares its own kExpOffset or kLn2
    would shadow the shared value."""
    pattern = re.compile(r"constexpr\s+(?:float|double|int)\s+(" + "|".join(CONSTANTS) + r")\b")
    copies = [
        f"{p.relative_to(REPO)}: {m}"
        for p in sorted(CSRC.rglob("*"))
        if p.suffix in (".h", ".hip", ".cu", ".cpp", ".inc") and p != CONSTANTS_H
        for m in pattern.findall(p.read_text())
    ]
    assert not copies, copies


if __name__ == "__main__":
    run_as_script(__file__)
