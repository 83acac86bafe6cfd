// The kernels in plain C: the portable path, and the reference the other sets must equal bit for bit.
#define MD_LANES 1
#define MD_ISA portable
#include "kernels_impl.h"
