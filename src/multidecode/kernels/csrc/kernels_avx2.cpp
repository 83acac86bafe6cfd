// The kernels for AVX2 with FMA and F16C (dispatched to only where the CPU has them).
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#define MD_LANES 2
#define MD_ISA avx2
#include "kernels_impl.h"
#endif
