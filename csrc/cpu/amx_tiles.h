// aiter_sage cpu attention, amx tier tile layer: the AMX instructions the kernel uses, one
// inline function each, on hardware. amx_tiles_model.h is the same interface as a plain C++
// model, so attention_tiles.inc runs unchanged in CI (the amx_model tier).
//
// Tile registers are named by template arguments (an instruction encodes them as immediates).
// The tile state is invisible to the compiler: every statement is volatile and, where it reads
// or writes memory, clobbers "memory", so the compiler keeps them in program order around the
// plain loads and stores of the kernel. Written as inline asm (AT&T operand order: sources
// first, destination last) so that no -mamx-* flag is needed: binutils >= 2.36 and clang's
// integrated assembler know the mnemonics.

constexpr int kTileRegs = 8;  // tmm0..tmm7

// Palette 1 tile configuration (64 bytes, SDM vol. 1 "TILECFG"): every tile `rows` x `colsb`.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved0[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "TILECFG is 64 bytes");

inline void tile_configure_all(int rows, int colsb) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < kTileRegs; ++t) {
    cfg.colsb[t] = uint16_t(colsb);
    cfg.rows[t] = uint8_t(rows);
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}
inline void tile_release() { asm volatile("tilerelease" ::: "memory"); }

template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" : : "i"(T));
}
// tileloadd: row r of tile T <- colsb bytes at base + r * stride.
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "i"(T) : "memory");
}
// tilestored: colsb bytes at base + r * stride <- row r of tile T.
template <int T>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "i"(T) : "memory");
}
// tdpbssd: C[m][n] += sum over dwords k of the 4 int8 x int8 products A[m][4k+j] * B[k][4n+j].
template <int C, int A, int B>
inline void tile_dpbssd() {
  asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
}
// tdpbsud: as tdpbssd with A's bytes signed and B's unsigned (P.V on int8 V and uint8 P codes).
template <int C, int A, int B>
inline void tile_dpbsud() {
  asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
}
// tdpbf16ps: C[m][n] += sum over dwords k of the 2 bf16 x bf16 products (fp32 accumulate).
template <int C, int A, int B>
inline void tile_dpbf16ps() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
}
