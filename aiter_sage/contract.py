"""The op contract's numbers, for Python: the values of csrc/include/sage/constants.h and
params.h's alignments (op_tests/infra/test_contract_constants.py compares each with the C++
header). ref.py, ops.py and guards.py read them from here (ref re-exports them)."""

# params.h
HEAD_DIM_ALIGN = 8  # SAGE_HEAD_DIM_ALIGN: a head dim is a multiple of this
SCALE_BLOCK = 32  # SAGE_SCALE_BLOCK: rows per INT8 scale of Q and K
# SAGE_Q_SCALE_ROWS_FINE: q_scale_rows=16, the opt-in Q granularity (one scale per 16 query
# rows; K keeps SCALE_BLOCK). The accepted values of q_scale_rows, the default first:
Q_SCALE_ROWS_FINE = 16
Q_SCALE_ROWS = (SCALE_BLOCK, Q_SCALE_ROWS_FINE)
SEQ_ALIGN = 32  # SAGE_SEQ_ALIGN: sequence axes are padded to a multiple of this
# constants.h
INT8_MAX = 127.0  # kInt8Max
FP8_MAX = 448.0  # kFp8Max: largest finite OCP e4m3fn value
LOG2E = 1.4426950408889634  # kLog2e (double; the Q factor is rounded once after the product)
LN2 = 0.6931471805599453  # kLn2 (float32 in C++)
# kExpOffset: the float32 4 ulps below log2(448), so 2^EXP_OFFSET = 447.9985 and even a
# 1-ulp-accurate exp2 of any argument <= EXP_OFFSET stays below 448.
EXP_OFFSET = 8.807350158691406
