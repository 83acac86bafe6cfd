// The kernels' arguments and entry points, as the torch operators (ops.cpp) call them.
//
// Each kernel computes a *range* of its work (outputs, or units of attention); ops.cpp splits the
// work over threads by those ranges. No kernel splits a reduction: every output is reduced by
// one thread in one fixed order, so the thread count and the number of rows never change a bit.
// The definitions each kernel implements are in kernels_impl.h.
#pragma once
#include <stdint.h>

namespace multidecode {

enum DataType : int32_t { F32 = 0, BF16 = 1 };

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]), for m in [m0, m1), n in [n0, n1).
struct LinearArgs {
  const void* x;      // [M, K] F32 or BF16, rows x_stride elements apart
  const void* w;      // [N, K] F32 or BF16, rows contiguous
  const float* bias;  // [N] float32, or null
  void* y;            // [M, N] in x's type
  int64_t M, N, K, x_stride;
  DataType x_type, w_type;
};

// Packed weights (see qlinear in kernels_impl.h for the layout) times rows quantized to int8.
struct QuantizedRows {
  const int8_t* codes;  // [M, K]
  const float* scale;   // [M, K / 32] each group's step d (x ~ d * code)
  const float* sum;     // [M, K / 32] each group's sum of codes
};

struct QLinearArgs {
  QuantizedRows rows;
  const uint8_t* codes;     // [N / 16 panels, K / 32 groups, 4 or 8 chunks of 64 bytes]
  const uint16_t* scales;   // float16 bits [panels, groups, 16 steps (+ 16 lows where `lows`)]
  const float* bias;        // [N] or null
  void* y;                  // [M, N] F32 or BF16
  int64_t M, N, K;
  int32_t bits;
  DataType y_type;
  bool lows;                // 4 bits: a low per group kept (else low = -8 step, GGUF's Q4_0)
};

struct QuantizeArgs {
  const void* x;  // [M, K] F32 or BF16, rows x_stride apart
  int8_t* codes;
  float* scale;
  float* sum;
  int64_t M, K, x_stride;
  DataType x_type;
};

// A root-mean-square norm of each row (see rms_norm in kernels_impl.h).
struct NormArgs {
  const void* x;       // [M, K] F32 or BF16, rows x_stride elements apart
  const void* weight;  // [K] in x's type
  void* y;             // [M, K] contiguous, in x's type
  int64_t M, K, x_stride;
  float eps;
  int32_t offset;      // 0: y = round(round(x * r) * w); 1: y = round(x * r * (1 + w))
  DataType type;
};

// Attention over position blocks (see attention in kernels_impl.h).
struct AttentionArgs {
  const void* q;  // [H, R, D] with strides (q_head, q_row, 1)
  const void* k;  // [H_kv, S, D] with strides (k_head, k_slot, 1)
  const void* v;  // [H_kv, S, D] with strides (v_head, v_slot, 1)
  const int32_t* unit_slots;  // [U, 64]: the key slot at each position of each unit's block, -1: none
  const int32_t* unit_rows;   // [U, W]: the query rows that read each unit, -1: none
  const uint64_t* unit_bits;  // [U, W]: bit j set where that row sees the unit's position j
  const int32_t* row_pairs;   // [R + 1]: row r's partials are pair_index[row_pairs[r] .. row_pairs[r + 1])
  const int32_t* pair_index;  // [P]: u * W + w of each of a row's (unit, row) partials, in position order
  float* partials;            // [U * W, H, D + 2] scratch: each partial's weighted values, max, sum
  void* out;                  // [R, H, D] contiguous, in q's type
  int64_t H, H_kv, R, D, U, W;
  int64_t q_head, q_row, k_head, k_slot, v_head, v_slot;
  float scale, softcap;  // softcap <= 0: none
  DataType type;         // of q, k, v and out
};

// Rows that read the same units in the same order (see attention_groups in kernels_impl.h).
#define MD_MAX_GROUP_ROWS 64
struct RowGroups {
  const int32_t* rows;        // the groups' rows, group after group (at most 64 per group)
  const int32_t* row_start;   // [count + 1]
  const int32_t* units;       // each group's units, in position order
  const int32_t* unit_start;  // [count + 1]
  int64_t count;
};

#define MD_DECLARE(isa)                                                                  \
  void linear_##isa(const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1); \
  void quantize_##isa(const QuantizeArgs& a, int64_t m0, int64_t m1);                     \
  void rms_norm_##isa(const NormArgs& a, int64_t m0, int64_t m1);                         \
  void qlinear_##isa(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1); \
  void attention_units_##isa(const AttentionArgs& a, int64_t first, int64_t step);        \
  void attention_merge_##isa(const AttentionArgs& a, int64_t r0, int64_t r1);             \
  void attention_groups_##isa(const AttentionArgs& a, const RowGroups& g, int64_t first, int64_t step, float* scratch);

MD_DECLARE(portable)
MD_DECLARE(avx2)
MD_DECLARE(avx512)
MD_DECLARE(avx512vnni)

}  // namespace multidecode
