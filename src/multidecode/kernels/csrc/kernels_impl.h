// The kernels, written once over the lanes of lanes.h and compiled once per instruction set.
//
// Each kernel is *defined* by the order in which it reduces, below; the vector code is only a way
// to run that definition, and every instruction set runs the same one (see lanes.h). None of the
// definitions mentions the number of rows, the other rows, or threads: a row's result is a
// function of that row's inputs alone.
//
// linear (float weights): y[m, n] = tree16(p) (+ bias[n]) where p[l], l = 0..15, is the chain
//   p[l] = fma(x[m, k], w[n, k], p[l]) over k = l, l + 16, l + 32, ... in increasing k, from +0,
//   K padded with zeros to a multiple of 16, and tree16 the fixed tree of `f_sum_tree`. Inputs are
//   float32 or bfloat16 (widened exactly); the sum is float32, rounded once to x's type.
//
// quantize (a row to int8, llama.cpp's Q8_0 rule): per group of 32, d = max|x| / 127,
//   code = round-to-nearest-even(x * (1 / d)) clamped to +-127 (0 where d is 0), sum = sum of codes.
//
// qlinear (4- or 8-bit weight codes c with a float16 step s and, for 4 bits, a float16 low L per
//   group of 32: w = s * c + L): for each group g in increasing order,
//   I = sum of code(x) * c over the group (int32: exact in any order),
//   t = fma(s, I, L * sum(code(x))) for 4 bits, t = s * I for 8 bits,
//   acc = fma(t, d(x), acc) from +0; then + bias, rounded once to the output type.
//
// attention (one query row r and head h, over the keys it sees): the keys are cut into position
//   blocks of 64 (block b: positions 64b .. 64b + 63). Within a block, in increasing position:
//   s_j = fma chain over d of q[d] * k_j[d] (q times the scale first, unless softcapped:
//   then s_j = cap * tanh(s_j * scale / cap)), m_b = max s_j, e_j = exp(s_j - m_b),
//   l_b = sum of e_j in position order, o_b = fma chain over j of e_j * v_j. Blocks are merged in
//   increasing b: the first block's (m, l, o) as they are, then m' = max(m, m_b),
//   a = exp(m - m'), c = exp(m_b - m'), l = fma(l, a, l_b * c), o = fma(o, a, o_b * c). The
//   output is o / l (0 for a row that sees nothing). A row sees the same keys at the same
//   positions whatever else shares its forward, so it gets the same bits.
#pragma once
#include "kernels.h"
#include "lanes.h"

namespace {

using namespace multidecode;

constexpr int GROUP = 32;
constexpr int BLOCK = 64;
constexpr int MAX_HEAD_DIM = 512;

#if MD_LANES == 2
constexpr int LINEAR_ROWS = 2;  // AVX2 has 16 registers: tiles of 2 x 4
#else
constexpr int LINEAR_ROWS = 4;
#endif

inline void store_out(void* y, DataType type, int64_t index, float value) {
  if (type == F32) {
    static_cast<float*>(y)[index] = value;
  } else {
    static_cast<uint16_t*>(y)[index] = f32_to_bf16(value);
  }
}

// ------------------------------------------------------------------------------------ linear
template <int MR, int NR, class XT, class WT>
inline void linear_tile(const LinearArgs& a, int64_t m, int64_t n) {
  const XT* x[MR];
  const WT* w[NR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const XT*>(a.x) + (m + r) * a.x_stride;
  for (int j = 0; j < NR; ++j) w[j] = static_cast<const WT*>(a.w) + (n + j) * a.K;
  F acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = f_zero();
  int64_t k = 0;
  for (; k + LANES <= a.K; k += LANES) {
    F xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = f_load_any(x[r] + k);
    for (int j = 0; j < NR; ++j) {
      F wv = f_load_any(w[j] + k);
      for (int r = 0; r < MR; ++r) acc[r][j] = f_fma(xv[r], wv, acc[r][j]);
    }
  }
  if (k < a.K) {  // the zero padding of the definition
    int rest = (int)(a.K - k);
    F xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = f_load_any_n(x[r] + k, rest);
    for (int j = 0; j < NR; ++j) {
      F wv = f_load_any_n(w[j] + k, rest);
      for (int r = 0; r < MR; ++r) acc[r][j] = f_fma(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float value = f_sum_tree(acc[r][j]);
      if (a.bias) value = value + a.bias[n + j];
      store_out(a.y, a.x_type, (m + r) * a.N + n + j, value);
    }
}

template <int MR, class XT, class WT>
inline void linear_rows(const LinearArgs& a, int64_t m, int64_t n0, int64_t n1) {
  constexpr int NR = MR == 1 ? 8 : 4;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) linear_tile<MR, NR, XT, WT>(a, m, n);
  for (; n < n1; ++n) linear_tile<MR, 1, XT, WT>(a, m, n);
}

template <class XT, class WT>
inline void linear_typed(const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  int64_t m = m0;
  for (; m + LINEAR_ROWS <= m1; m += LINEAR_ROWS) linear_rows<LINEAR_ROWS, XT, WT>(a, m, n0, n1);
  for (; m < m1; ++m) linear_rows<1, XT, WT>(a, m, n0, n1);
}

inline void linear_impl(const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if (a.x_type == F32 && a.w_type == F32) linear_typed<float, float>(a, m0, m1, n0, n1);
  else if (a.x_type == F32) linear_typed<float, uint16_t>(a, m0, m1, n0, n1);
  else if (a.w_type == F32) linear_typed<uint16_t, float>(a, m0, m1, n0, n1);
  else linear_typed<uint16_t, uint16_t>(a, m0, m1, n0, n1);
}

// ------------------------------------------------------------------------------------ quantize
inline float load_scalar(const void* x, DataType type, int64_t index) {
  return type == F32 ? static_cast<const float*>(x)[index] : bf16_to_f32(static_cast<const uint16_t*>(x)[index]);
}

inline void quantize_impl(const QuantizeArgs& a, int64_t m0, int64_t m1) {
  const int64_t groups = a.K / GROUP;
  float values[GROUP];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float high = 0.0f;
      for (int i = 0; i < GROUP; ++i) {
        values[i] = load_scalar(a.x, a.x_type, m * a.x_stride + g * GROUP + i);
        float magnitude = values[i] < 0 ? -values[i] : values[i];
        high = magnitude > high ? magnitude : high;
      }
      float d = high / 127.0f;
      float inverse = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t total = 0;
      int8_t* codes = a.codes + m * a.K + g * GROUP;
      for (int i = 0; i < GROUP; ++i) {
        float rounded = __builtin_nearbyintf(values[i] * inverse);
        rounded = rounded > 127.0f ? 127.0f : rounded < -127.0f ? -127.0f : rounded;
        codes[i] = (int8_t)rounded;
        total += codes[i];
      }
      a.scale[m * groups + g] = d;
      a.sum[m * groups + g] = (float)total;
    }
  }
}

// ------------------------------------------------------------------------------------ qlinear
// Layout of a panel of 16 output features: for each group of 32 inputs, 64-byte chunks in which
// lane l (output 16p + l) holds 4 bytes. 4 bits: chunk c's byte 4l + b has the code of input
// 32g + 8c + b in its low half and of 32g + 8c + 4 + b in its high half (4 chunks). 8 bits: chunk
// c's byte 4l + b is the signed code of input 32g + 4c + b (8 chunks). Steps and lows: float16
// [panel, group, 16 steps, then 16 lows (4 bits)].
template <int MR, int NP, int BITS>
inline void qlinear_tile(const QLinearArgs& a, int64_t m, int64_t p) {
  constexpr int CHUNKS = BITS == 4 ? 4 : 8;
  constexpr int HALVES = BITS == 4 ? 32 : 16;
  const int64_t groups = a.K / GROUP;
  const int8_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = a.rows.codes + (m + r) * a.K;
  F acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = f_zero();
  for (int64_t g = 0; g < groups; ++g) {
    I dots[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NP; ++j) dots[r][j] = i_zero();
    const uint8_t* codes[NP];
    for (int j = 0; j < NP; ++j) codes[j] = a.codes + ((p + j) * groups + g) * CHUNKS * 64;
    for (int c = 0; c < CHUNKS; ++c) {
      if (BITS == 4) {
        B low_x[MR], high_x[MR];
        for (int r = 0; r < MR; ++r) {
          low_x[r] = b_bcast4(x[r] + g * GROUP + 8 * c);
          high_x[r] = b_bcast4(x[r] + g * GROUP + 8 * c + 4);
        }
        for (int j = 0; j < NP; ++j) {
          B w = b_load(codes[j] + c * 64), low = b_low_nibbles(w), high = b_high_nibbles(w);
          for (int r = 0; r < MR; ++r) dots[r][j] = i_dot_us(i_dot_us(dots[r][j], low, low_x[r]), high, high_x[r]);
        }
      } else {
        B xs[MR];
        for (int r = 0; r < MR; ++r) xs[r] = b_bcast4(x[r] + g * GROUP + 4 * c);
        for (int j = 0; j < NP; ++j) {
          B w = b_load(codes[j] + c * 64);
          for (int r = 0; r < MR; ++r) dots[r][j] = i_dot_ss(dots[r][j], w, xs[r]);
        }
      }
    }
    for (int j = 0; j < NP; ++j) {
      const uint16_t* halves = a.scales + ((p + j) * groups + g) * HALVES;
      F step = f_load_f16(halves);
      F low = BITS == 4 ? f_load_f16(halves + 16) : f_zero();
      for (int r = 0; r < MR; ++r) {
        F total = f_from_i(dots[r][j]);
        F t = BITS == 4 ? f_fma(step, total, f_mul(low, f_set1(a.rows.sum[(m + r) * groups + g])))
                        : f_mul(step, total);
        acc[r][j] = f_fma(t, f_set1(a.rows.scale[(m + r) * groups + g]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) {
      float out[LANES];
      f_store(out, acc[r][j]);
      for (int l = 0; l < LANES; ++l) {
        int64_t n = (p + j) * LANES + l;
        if (n >= a.N) break;
        float value = a.bias ? out[l] + a.bias[n] : out[l];
        store_out(a.y, a.y_type, (m + r) * a.N + n, value);
      }
    }
}

template <int MR, int BITS>
inline void qlinear_rows(const QLinearArgs& a, int64_t m, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + 2 <= p1; p += 2) qlinear_tile<MR, 2, BITS>(a, m, p);
  for (; p < p1; ++p) qlinear_tile<MR, 1, BITS>(a, m, p);
}

template <int BITS>
inline void qlinear_bits(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) qlinear_rows<4, BITS>(a, m, p0, p1);
  for (; m < m1; ++m) qlinear_rows<1, BITS>(a, m, p0, p1);
}

inline void qlinear_impl(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  if (a.bits == 4) qlinear_bits<4>(a, m0, m1, p0, p1);
  else qlinear_bits<8>(a, m0, m1, p0, p1);
}

// ------------------------------------------------------------------------------------ attention
inline const float* as_float(const void* base, DataType type, int64_t offset, float* buffer, int64_t n) {
  if (type == F32) return static_cast<const float*>(base) + offset;
  const uint16_t* half = static_cast<const uint16_t*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) buffer[i] = bf16_to_f32(half[i]);
  return buffer;
}

// [D, 64] keys of one unit's block for one kv head, transposed (missing positions: 0).
inline void gather_keys(const AttentionArgs& a, const int32_t* slots, int64_t kv, float* keys, float* row) {
  for (int j = 0; j < BLOCK; ++j) {
    if (slots[j] < 0) {
      for (int64_t d = 0; d < a.D; ++d) keys[d * BLOCK + j] = 0.0f;
      continue;
    }
    const float* k = as_float(a.k, a.type, kv * a.k_head + slots[j] * a.k_slot, row, a.D);
    for (int64_t d = 0; d < a.D; ++d) keys[d * BLOCK + j] = k[d];
  }
}

// The scores of one query (already scaled unless softcapped) against a unit's 64 keys.
inline void block_scores(const AttentionArgs& a, const float* query, const float* keys, float* scores) {
  F s[BLOCK / LANES];
  for (int t = 0; t < BLOCK / LANES; ++t) s[t] = f_zero();
  for (int64_t d = 0; d < a.D; ++d) {
    F qd = f_set1(query[d]);
    for (int t = 0; t < BLOCK / LANES; ++t) s[t] = f_fma(qd, f_load(keys + d * BLOCK + t * LANES), s[t]);
  }
  for (int t = 0; t < BLOCK / LANES; ++t) {
    if (a.softcap > 0.0f) {  // cap * tanh(s * scale / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
      F x = f_div(f_mul(s[t], f_set1(a.scale)), f_set1(a.softcap));
      F e = f_exp(f_add(x, x));
      s[t] = f_mul(f_set1(a.softcap), f_sub(f_set1(1.0f), f_div(f_set1(2.0f), f_add(e, f_set1(1.0f)))));
    }
    f_store(scores + t * LANES, s[t]);
  }
}

// One (row, head)'s partial over a unit: weighted values o[0..D), then max, then sum.
inline void block_partial(const AttentionArgs& a, const float* scores, uint64_t bits, int64_t kv,
                          const int32_t* slots, float* partial, float* row) {
  float high = -__builtin_inff();
  for (int j = 0; j < BLOCK; ++j)
    if ((bits >> j) & 1u) high = scores[j] > high ? scores[j] : high;
  float weights[BLOCK];
  for (int t = 0; t < BLOCK / LANES; ++t)
    f_store(weights + t * LANES, f_exp(f_sub(f_load(scores + t * LANES), f_set1(high))));
  const int64_t chunks = (a.D + LANES - 1) / LANES;
  F o[MAX_HEAD_DIM / LANES];
  for (int64_t c = 0; c < chunks; ++c) o[c] = f_zero();
  float total = 0.0f;
  for (int j = 0; j < BLOCK; ++j) {
    if (!((bits >> j) & 1u)) continue;
    total = total + weights[j];
    F e = f_set1(weights[j]);
    const float* v = as_float(a.v, a.type, kv * a.v_head + slots[j] * a.v_slot, row, a.D);
    for (int64_t c = 0; c < chunks; ++c) {
      int rest = (int)(a.D - c * LANES);
      F vc = rest >= LANES ? f_load(v + c * LANES) : f_load_n(v + c * LANES, rest);
      o[c] = f_fma(e, vc, o[c]);
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    int rest = (int)(a.D - c * LANES);
    if (rest >= LANES) f_store(partial + c * LANES, o[c]);
    else f_store_n(partial + c * LANES, o[c], rest);
  }
  partial[a.D] = high;
  partial[a.D + 1] = total;
}

inline void attention_units_impl(const AttentionArgs& a, int64_t u0, int64_t u1) {
  const int64_t group = a.H / a.H_kv, width = a.D + 2;
  float* keys = static_cast<float*>(__builtin_alloca(sizeof(float) * a.D * BLOCK));
  float query[MAX_HEAD_DIM], row[MAX_HEAD_DIM], scores[BLOCK];
  for (int64_t u = u0; u < u1; ++u) {
    const int32_t* slots = a.unit_slots + u * BLOCK;
    for (int64_t kv = 0; kv < a.H_kv; ++kv) {
      gather_keys(a, slots, kv, keys, row);
      for (int64_t w = 0; w < a.W; ++w) {
        int32_t r = a.unit_rows[u * a.W + w];
        if (r < 0) continue;
        uint64_t bits = a.unit_bits[u * a.W + w];
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          float* partial = a.partials + ((u * a.W + w) * a.H + h) * width;
          if (bits == 0) {
            partial[a.D] = -__builtin_inff();
            partial[a.D + 1] = 0.0f;
            continue;
          }
          const float* q = as_float(a.q, a.type, h * a.q_head + r * a.q_row, row, a.D);
          for (int64_t d = 0; d < a.D; ++d) query[d] = a.softcap > 0.0f ? q[d] : q[d] * a.scale;
          block_scores(a, query, keys, scores);
          block_partial(a, scores, bits, kv, slots, partial, row);
        }
      }
    }
  }
}

inline void attention_merge_impl(const AttentionArgs& a, int64_t r0, int64_t r1) {
  const int64_t width = a.D + 2, chunks = (a.D + LANES - 1) / LANES;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t h = 0; h < a.H; ++h) {
      F o[MAX_HEAD_DIM / LANES];
      float high = 0.0f, total = 0.0f;
      bool seen = false;
      for (int32_t i = a.row_pairs[r]; i < a.row_pairs[r + 1]; ++i) {
        const float* partial = a.partials + ((int64_t)a.pair_index[i] * a.H + h) * width;
        float block_high = partial[a.D], block_total = partial[a.D + 1];
        if (block_total == 0.0f) continue;  // the row sees nothing in this block
        if (!seen) {
          for (int64_t c = 0; c < chunks; ++c) {
            int rest = (int)(a.D - c * LANES);
            o[c] = rest >= LANES ? f_load(partial + c * LANES) : f_load_n(partial + c * LANES, rest);
          }
          high = block_high;
          total = block_total;
          seen = true;
          continue;
        }
        float top = block_high > high ? block_high : high;
        float keep = exp_scalar(high - top), add = exp_scalar(block_high - top);
        total = fmaf_exact(total, keep, block_total * add);
        for (int64_t c = 0; c < chunks; ++c) {
          int rest = (int)(a.D - c * LANES);
          F part = rest >= LANES ? f_load(partial + c * LANES) : f_load_n(partial + c * LANES, rest);
          o[c] = f_fma(o[c], f_set1(keep), f_mul(part, f_set1(add)));
        }
        high = top;
      }
      float out[MAX_HEAD_DIM];
      for (int64_t c = 0; c < chunks; ++c) {
        F value = seen ? f_div(o[c], f_set1(total)) : f_zero();
        int rest = (int)(a.D - c * LANES);
        if (rest >= LANES) f_store(out + c * LANES, value);
        else f_store_n(out + c * LANES, value, rest);
      }
      for (int64_t d = 0; d < a.D; ++d) store_out(a.out, a.type, (r * a.H + h) * a.D + d, out[d]);
    }
  }
}

}  // namespace

// The entry points of one instruction set (MD_ISA names it).
#define MD_CONCAT2(a, b) a##_##b
#define MD_CONCAT(a, b) MD_CONCAT2(a, b)
namespace multidecode {
void MD_CONCAT(linear, MD_ISA)(const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  linear_impl(a, m0, m1, n0, n1);
}
void MD_CONCAT(quantize, MD_ISA)(const QuantizeArgs& a, int64_t m0, int64_t m1) { quantize_impl(a, m0, m1); }
void MD_CONCAT(qlinear, MD_ISA)(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  qlinear_impl(a, m0, m1, p0, p1);
}
void MD_CONCAT(attention_units, MD_ISA)(const AttentionArgs& a, int64_t u0, int64_t u1) {
  attention_units_impl(a, u0, u1);
}
void MD_CONCAT(attention_merge, MD_ISA)(const AttentionArgs& a, int64_t r0, int64_t r1) {
  attention_merge_impl(a, r0, r1);
}
}  // namespace multidecode
