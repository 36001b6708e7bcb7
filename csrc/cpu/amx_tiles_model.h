// aiter_sage cpu attention, amx_model tier tile layer: a plain C++ model of the AMX
// instructions in amx_tiles.h (same interface), so that the amx tier's kernel code
// (attention_tiles.inc) runs and is tested on any CPU. Semantics from the Intel SDM pseudocode
// of LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBSSD, TDPBSUD and TDPBF16PS (palette 1):
// 8 tiles of up to 16 rows x 64 bytes; a load zeroes the bytes past colsb and the rows past
// `rows`; a dot product's shapes must agree (else the hardware raises #UD: here, an
// exception).
// TDPBF16PS treats BF16 denormal inputs as zero, rounds each fp32 add to nearest even and
// flushes denormal results to zero (DAZ/FTZ, MXCSR ignored); the products of two BF16 values
// are exact in fp32, so only the adds round. The hardware may add in another order; the
// kernel's results only rely on the accuracy band, not on the order.

constexpr int kTileRegs = 8;
constexpr int kTileMaxRows = 16;
constexpr int kTileMaxColsb = 64;

struct ModelTiles {
  alignas(64) uint8_t data[kTileRegs][kTileMaxRows][kTileMaxColsb];
  int rows[kTileRegs];
  int colsb[kTileRegs];
  bool configured;
};
// One tile file per thread, like the hardware's per-thread tile state.
thread_local ModelTiles g_model_tiles;

inline void model_require(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("amx_model: ") + what);
}

inline void tile_configure_all(int rows, int colsb) {
  model_require(
      rows >= 1 && rows <= kTileMaxRows && colsb >= 4 && colsb <= kTileMaxColsb && colsb % 4 == 0,
      "tile shape outside palette 1");
  for (int t = 0; t < kTileRegs; ++t) {
    g_model_tiles.rows[t] = rows;
    g_model_tiles.colsb[t] = colsb;
  }
  memset(g_model_tiles.data, 0, sizeof g_model_tiles.data);  // LDTILECFG zeroes every tile
  g_model_tiles.configured = true;
}
inline void tile_release() { g_model_tiles.configured = false; }

template <int T>
inline uint8_t* model_row(int r) {
  static_assert(T >= 0 && T < kTileRegs, "no such tile register");
  model_require(g_model_tiles.configured, "tile instruction without a tile configuration");
  return g_model_tiles.data[T][r];
}
template <int T>
inline void tile_zero() {
  for (int r = 0; r < kTileMaxRows; ++r) memset(model_row<T>(r), 0, kTileMaxColsb);
}
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  const int rows = g_model_tiles.rows[T], colsb = g_model_tiles.colsb[T];
  for (int r = 0; r < kTileMaxRows; ++r) {
    uint8_t* dst = model_row<T>(r);
    memset(dst, 0, kTileMaxColsb);
    if (r < rows) memcpy(dst, static_cast<const uint8_t*>(base) + r * stride, size_t(colsb));
  }
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  const int rows = g_model_tiles.rows[T], colsb = g_model_tiles.colsb[T];
  for (int r = 0; r < rows; ++r)
    memcpy(static_cast<uint8_t*>(base) + r * stride, model_row<T>(r), size_t(colsb));
}

// Shapes of C += A . B with K dwords: A rows == C rows, B rows == A dwords, B colsb == C colsb.
template <int C, int A, int B>
inline void model_check_dot() {
  const int* rows = g_model_tiles.rows;
  const int* colsb = g_model_tiles.colsb;
  model_require(rows[A] == rows[C] && rows[B] == colsb[A] / 4 && colsb[B] == colsb[C],
                "tile dot product shapes disagree (#UD on hardware)");
}

inline int32_t model_dword(const uint8_t* row, int k) {
  int32_t x;
  memcpy(&x, row + 4 * k, 4);
  return x;
}
// C[m][n] += sum over dwords k of the 4 byte products A[m][4k+j] * B[k][4n+j], A's bytes as
// TA and B's as TB (int8_t or uint8_t); int32 accumulation wraps modulo 2^32 like the hardware.
template <class TA, class TB, int C, int A, int B>
inline void model_dot_bytes() {
  model_check_dot<C, A, B>();
  const int m_rows = g_model_tiles.rows[C], n_cols = g_model_tiles.colsb[C] / 4;
  const int k_dwords = g_model_tiles.colsb[A] / 4;
  for (int m = 0; m < m_rows; ++m) {
    uint8_t* c_row = model_row<C>(m);
    for (int n = 0; n < n_cols; ++n) {
      uint32_t acc = uint32_t(model_dword(c_row, n));
      for (int k = 0; k < k_dwords; ++k) {
        const TA* a = reinterpret_cast<const TA*>(model_row<A>(m) + 4 * k);
        const TB* b = reinterpret_cast<const TB*>(model_row<B>(k) + 4 * n);
        for (int j = 0; j < 4; ++j) acc += uint32_t(int32_t(a[j]) * int32_t(b[j]));
      }
      memcpy(c_row + 4 * n, &acc, 4);
    }
  }
}
template <int C, int A, int B>
inline void tile_dpbssd() {  // signed x signed
  model_dot_bytes<int8_t, int8_t, C, A, B>();
}
template <int C, int A, int B>
inline void tile_dpbsud() {  // signed A x unsigned B
  model_dot_bytes<int8_t, uint8_t, C, A, B>();
}

inline float model_bf16_daz(uint16_t h) {  // BF16 -> fp32, denormals (and -0) as signed zero
  const uint32_t bits = (h & 0x7f80u) == 0 ? uint32_t(h & 0x8000u) << 16 : uint32_t(h) << 16;
  return __builtin_bit_cast(float, bits);
}
inline float model_ftz(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  return (bits & 0x7f800000u) == 0 ? __builtin_bit_cast(float, bits & 0x80000000u) : x;
}
template <int C, int A, int B>
inline void tile_dpbf16ps() {
  model_check_dot<C, A, B>();
  const int m_rows = g_model_tiles.rows[C], n_cols = g_model_tiles.colsb[C] / 4;
  const int k_dwords = g_model_tiles.colsb[A] / 4;
  for (int m = 0; m < m_rows; ++m) {
    uint8_t* c_row = model_row<C>(m);
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      memcpy(&acc, c_row + 4 * n, 4);
      for (int k = 0; k < k_dwords; ++k) {
        for (int j = 0; j < 2; ++j) {
          uint16_t a, b;
          memcpy(&a, model_row<A>(m) + 4 * k + 2 * j, 2);
          memcpy(&b, model_row<B>(k) + 4 * n + 2 * j, 2);
          acc = model_ftz(acc + model_bf16_daz(a) * model_bf16_daz(b));
        }
      }
      memcpy(c_row + 4 * n, &acc, 4);
    }
  }
}
