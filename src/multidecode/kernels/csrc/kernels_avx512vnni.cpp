// The kernels for AVX-512 with VNNI: integer dot products in one instruction (dispatched to only
// where the CPU has them).
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define MD_LANES 4
#define MD_ISA avx512vnni
#include "kernels_impl.h"
#endif
