// Closes the region opened by isa_region_begin.h. No include guard on purpose.
#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#undef SAGE_CPU_PRAGMA
#undef SAGE_CPU_PRAGMA_STR
