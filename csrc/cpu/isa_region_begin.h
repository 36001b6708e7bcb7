// Opens a target region for SAGE_CPU_TARGET (see isa_region.h). No include guard on purpose.
// _Pragma through two macro levels so that SAGE_CPU_TARGET is expanded inside the pragma.
#define SAGE_CPU_PRAGMA_STR(x) _Pragma(#x)
#define SAGE_CPU_PRAGMA(x) SAGE_CPU_PRAGMA_STR(x)
#if defined(__clang__)
SAGE_CPU_PRAGMA(clang attribute push(__attribute__((target(SAGE_CPU_TARGET))), apply_to = function))
#elif defined(__GNUC__)
#pragma GCC push_options
SAGE_CPU_PRAGMA(GCC target(SAGE_CPU_TARGET))
#endif
