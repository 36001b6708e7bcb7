// aiter_sage: the numeric constants of the op contract, shared by every backend and the binding.
// aiter_sage/contract.py holds the same values for ref.py;
// op_tests/infra/test_contract_constants.py parses this file (and params.h's alignments) and
// compares each value with it.
#pragma once

namespace sage {

constexpr float kInt8Max = 127.0f;  // INT8 codes of Q and K: [-127, 127]
constexpr float kFp8Max = 448.0f;   // largest finite OCP e4m3fn value
// log2(e) in double: the Q factor float32(softmax_scale * kLog2e) rounds the product once.
constexpr double kLog2e = 1.4426950408889634;
constexpr float kLn2 = 0.6931471805599453f;  // the LSE turns log2 units into natural ones
// The exponent offset that folds the e4m3 scale into exp2: the float32 4 ulps below
// log2(448), so 2^kExpOffset = 447.9985 and a 1-ulp-accurate exp2 of any argument
// <= kExpOffset stays below 448 (csrc/gfx12/attention.hip says why that is enough).
constexpr float kExpOffset = 8.807350158691406f;

}  // namespace sage
