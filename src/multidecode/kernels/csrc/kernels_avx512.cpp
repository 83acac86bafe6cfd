// The kernels for AVX-512 F, BW, VL and DQ (dispatched to only where the CPU has them).
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define MD_LANES 3
#define MD_ISA avx512
#include "kernels_impl.h"
#endif
