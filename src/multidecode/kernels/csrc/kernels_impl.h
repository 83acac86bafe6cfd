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
//   (Each a lane operation, or exact: max and integer sums do not depend on their order.)
//
// qlinear (4- or 8-bit weight codes c with a float16 step s and, for 4 bits, a float16 low L per
//   group of 32: w = s * c + L; or, 4-bit codes kept without lows (GGUF's Q4_0), L = -8 * s,
//   exact in float32): for each group g in increasing order,
//   I = sum of code(x) * c over the group (int32: exact in any order),
//   t = fma(s, I, L * sum(code(x))) for 4 bits, t = s * I for 8 bits,
//   acc = fma(t, d(x), acc) from +0; then + bias, rounded once to the output type.
//
// rms_norm (a row x of K values, weight w, epsilon e): q = tree16(p), p[l] the chain
//   p[l] = fma(x[k], x[k], p[l]) over k = l, l + 16, ... from +0 (as linear's, x times itself);
//   r = 1 / sqrt(q / K + e) (IEEE division and square root, each rounded once); then per value
//   y[k] = round(round(x[k] * r) * w[k]) (Llama's order: normed, rounded to x's type, weighted),
//   or, with `offset`, y[k] = round(x[k] * r * (1 + w[k])) (Gemma's: weighted in float32), where
//   round is to x's type (none for float32).
//
// attention (one query row r and head h, over the keys it sees): the keys are cut into position
//   blocks of 64 (block b: positions 64b .. 64b + 63). Within a block, in increasing position:
//   s_j = fma chain over d of q[d] * k_j[d] (q times the scale first, unless softcapped:
//   then s_j = cap * tanh(s_j * scale / cap)), m_b = max s_j, e_j = exp(s_j - m_b) (0 for a key
//   the row does not see), l_b = f_sum_tree of the 16 lanes (lane l: e_l + e_(l+16) + e_(l+32) +
//   e_(l+48), in that order), o_b = fma chain over the seen j, in position order, of e_j * v_j. Blocks are merged in
//   increasing b: the first block's (m, l, o) as they are, then m' = max(m, m_b),
//   a = exp(m - m'), c = exp(m_b - m'), l = fma(l, a, l_b * c), o = fma(o, a, o_b * c). The
//   output is o / l (0 for a row that sees nothing). A row sees the same keys at the same
//   positions whatever else shares its forward, so it gets the same bits.
#pragma once
#include <cmath>

#include "kernels.h"
#include "lanes.h"

namespace {

using namespace multidecode;

constexpr int GROUP = 32;
constexpr int BLOCK = 64;
constexpr int MAX_HEAD_DIM = 512;
constexpr int MAX_GROUP = MD_MAX_GROUP_ROWS;

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

// ------------------------------------------------------------------------------------ rms_norm
inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) { return bf16_to_f32(v); }
inline float rounded(float v, DataType type) { return type == F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

template <class XT>
inline void rms_norm_typed(const NormArgs& a, int64_t m0, int64_t m1) {
  const XT* w = static_cast<const XT*>(a.weight);
  for (int64_t m = m0; m < m1; ++m) {
    const XT* x = static_cast<const XT*>(a.x) + m * a.x_stride;
    F acc = f_zero();
    int64_t k = 0;
    for (; k + LANES <= a.K; k += LANES) {
      F v = f_load_any(x + k);
      acc = f_fma(v, v, acc);
    }
    if (k < a.K) {  // the zero padding of the definition
      F v = f_load_any_n(x + k, (int)(a.K - k));
      acc = f_fma(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(f_sum_tree(acc) / (float)a.K + a.eps);
    for (k = 0; k < a.K; ++k) {
      float value = a.offset ? as_float(x[k]) * r * (1.0f + as_float(w[k]))
                             : rounded(as_float(x[k]) * r, a.type) * as_float(w[k]);
      store_out(a.y, a.type, m * a.K + k, value);
    }
  }
}

inline void rms_norm_impl(const NormArgs& a, int64_t m0, int64_t m1) {
  if (a.type == F32) rms_norm_typed<float>(a, m0, m1);
  else rms_norm_typed<uint16_t>(a, m0, m1);
}

// ------------------------------------------------------------------------------------ quantize
template <class XT>
inline void quantize_typed(const QuantizeArgs& a, int64_t m0, int64_t m1) {
  const int64_t groups = a.K / GROUP;
  float rounded[GROUP];
  for (int64_t m = m0; m < m1; ++m) {
    const XT* x = static_cast<const XT*>(a.x) + m * a.x_stride;
    for (int64_t g = 0; g < groups; ++g) {
      F low = f_load_any(x + g * GROUP), high = f_load_any(x + g * GROUP + LANES);
      float d = f_max_lanes(f_max(f_abs(low), f_abs(high))) / 127.0f;
      F inverse = f_set1(d != 0.0f ? 1.0f / d : 0.0f), top = f_set1(127.0f), bottom = f_set1(-127.0f);
      f_store(rounded, f_min(f_max(f_round_even(f_mul(low, inverse)), bottom), top));
      f_store(rounded + LANES, f_min(f_max(f_round_even(f_mul(high, inverse)), bottom), top));
      int32_t total = 0;
      int8_t* codes = a.codes + m * a.K + g * GROUP;
      for (int i = 0; i < GROUP; ++i) {
        codes[i] = (int8_t)rounded[i];
        total += codes[i];
      }
      a.scale[m * groups + g] = d;
      a.sum[m * groups + g] = (float)total;
    }
  }
}

inline void quantize_impl(const QuantizeArgs& a, int64_t m0, int64_t m1) {
  if (a.x_type == F32) quantize_typed<float>(a, m0, m1);
  else quantize_typed<uint16_t>(a, m0, m1);
}

// ------------------------------------------------------------------------------------ qlinear
// Layout of a panel of 16 output features: for each group of 32 inputs, 64-byte chunks in which
// lane l (output 16p + l) holds 4 bytes. 4 bits: chunk c's byte 4l + b has the code of input
// 32g + 8c + b in its low half and of 32g + 8c + 4 + b in its high half (4 chunks). 8 bits: chunk
// c's byte 4l + b is the signed code of input 32g + 4c + b (8 chunks). Steps and lows: float16
// [panel, group, 16 steps, then 16 lows (4 bits with lows)].
constexpr int PREFETCH_GROUPS = 4;
// How many groups ahead a tile asks for its codes (a one-row product streams them from memory once).

// The weights' form: 4-bit codes with a low per group, 4-bit codes centred on 8 (no lows kept:
// L = -8 s), or 8-bit signed codes.
enum Form { Q4_LOWS, Q4_CENTRED, Q8 };

template <int MR, int NP, Form FORM>
inline void qlinear_tile(const QLinearArgs& a, int64_t m, int64_t p) {
  constexpr int BITS = FORM == Q8 ? 8 : 4;
  constexpr int CHUNKS = BITS == 4 ? 4 : 8;
  constexpr int HALVES = FORM == Q4_LOWS ? 32 : 16;
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
    for (int j = 0; j < NP; ++j) {
      codes[j] = a.codes + ((p + j) * groups + g) * CHUNKS * 64;
      for (int c = 0; c < CHUNKS; ++c) __builtin_prefetch(codes[j] + (PREFETCH_GROUPS * CHUNKS + c) * 64);
      __builtin_prefetch(a.scales + ((p + j) * groups + g + PREFETCH_GROUPS) * HALVES);
    }
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
      F low = FORM == Q4_LOWS ? f_load_f16(halves + 16) : FORM == Q4_CENTRED ? f_mul(step, f_set1(-8.0f)) : f_zero();
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
      const int64_t n = (p + j) * LANES, index = (m + r) * a.N + n;
      F value = a.bias && n + LANES <= a.N ? f_add(acc[r][j], f_load(a.bias + n)) : acc[r][j];
      if (n + LANES <= a.N && a.y_type == F32) {
        f_store(static_cast<float*>(a.y) + index, value);
      } else if (n + LANES <= a.N) {
        f_store_bf16(static_cast<uint16_t*>(a.y) + index, value);
      } else {  // the last panel's outputs past N are padding
        float out[LANES];
        f_store(out, acc[r][j]);
        for (int l = 0; n + l < a.N; ++l) store_out(a.y, a.y_type, index + l, a.bias ? out[l] + a.bias[n + l] : out[l]);
      }
    }
}

template <int MR, Form FORM>
inline void qlinear_rows(const QLinearArgs& a, int64_t m, int64_t p0, int64_t p1) {
  constexpr int NP = MR == 1 ? 4 : 2;  // one row: more panels at once, for more independent chains
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) qlinear_tile<MR, NP, FORM>(a, m, p);
  for (; p < p1; ++p) qlinear_tile<MR, 1, FORM>(a, m, p);
}

#if MD_LANES >= 3
constexpr int QLINEAR_ROWS = 6;  // 32 registers: 6 x 2 integer and 6 x 2 float accumulators
#else
constexpr int QLINEAR_ROWS = 4;
#endif

template <Form FORM>
inline void qlinear_form(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  int64_t m = m0;
  for (; m + QLINEAR_ROWS <= m1; m += QLINEAR_ROWS) qlinear_rows<QLINEAR_ROWS, FORM>(a, m, p0, p1);
  for (; m + 2 <= m1; m += 2) qlinear_rows<2, FORM>(a, m, p0, p1);
  for (; m < m1; ++m) qlinear_rows<1, FORM>(a, m, p0, p1);
}

inline void qlinear_impl(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  if (a.bits == 8) qlinear_form<Q8>(a, m0, m1, p0, p1);
  else if (a.lows) qlinear_form<Q4_LOWS>(a, m0, m1, p0, p1);
  else qlinear_form<Q4_CENTRED>(a, m0, m1, p0, p1);
}

// ------------------------------------------------------------------------------------ attention
// A unit (one position block and the rows that read it) is worked per kv head: its keys are
// gathered once, transposed to [D, 64] in float32 (its values are read in place); then
// the query heads of the group are scored together (more independent chains for the same loads)
// and their weighted values summed together (each value row loaded once for all of them). Neither
// grouping changes a lane's arithmetic: each (row, head) is still the chain of the definition.

inline void load_row(const void* base, DataType type, int64_t offset, int64_t n, float* out) {
  if (type == F32) {
    memcpy(out, static_cast<const float*>(base) + offset, sizeof(float) * n);
    return;
  }
  const uint16_t* half = static_cast<const uint16_t*>(base) + offset;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) f_store(out + i, f_load_bf16(half + i));
  for (; i < n; ++i) out[i] = bf16_to_f32(half[i]);
}

// keys [D, 64] (transposed) of one unit's block for one kv head (missing: 0); `rows` is [64, D]
// scratch for the keys as read. (Values are read where they lie, in the cache's dtype.)
inline void gather_keys(const AttentionArgs& a, const int32_t* slots, int64_t kv, float* keys, float* rows) {
  for (int j = 0; j < BLOCK; ++j) {
    if (slots[j] < 0) {
      memset(rows + j * a.D, 0, sizeof(float) * a.D);
      continue;
    }
    load_row(a.k, a.type, kv * a.k_head + slots[j] * a.k_slot, a.D, rows + j * a.D);
  }
  const int64_t whole = a.D / LANES * LANES;
  for (int j = 0; j < BLOCK; j += LANES)
    for (int64_t d = 0; d < whole; d += LANES) transpose16(rows + j * a.D + d, a.D, keys + d * BLOCK + j, BLOCK);
  for (int64_t d = whole; d < a.D; ++d)
    for (int j = 0; j < BLOCK; ++j) keys[d * BLOCK + j] = rows[j * a.D + d];
}

// Scores of HC query heads (already scaled unless softcapped) against the block's 64 keys.
template <int HC>
inline void block_scores(const AttentionArgs& a, const float* queries, const float* keys, float* scores) {
  constexpr int T = BLOCK / LANES;
  F s[HC][T];
  for (int h = 0; h < HC; ++h)
    for (int t = 0; t < T; ++t) s[h][t] = f_zero();
  for (int64_t d = 0; d < a.D; ++d) {
    F k[T];
    for (int t = 0; t < T; ++t) k[t] = f_load(keys + d * BLOCK + t * LANES);
    for (int h = 0; h < HC; ++h) {
      F qd = f_set1(queries[h * MAX_HEAD_DIM + d]);
      for (int t = 0; t < T; ++t) s[h][t] = f_fma(qd, k[t], s[h][t]);
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int t = 0; t < T; ++t) {
      if (a.softcap > 0.0f) {  // cap * tanh(s * scale / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        F x = f_div(f_mul(s[h][t], f_set1(a.scale)), f_set1(a.softcap));
        F e = f_exp(f_add(x, x));
        s[h][t] = f_mul(f_set1(a.softcap), f_sub(f_set1(1.0f), f_div(f_set1(2.0f), f_add(e, f_set1(1.0f)))));
      }
      f_store(scores + h * BLOCK + t * LANES, s[h][t]);
    }
}

// Each head's weights exp(s - max) over the keys it sees, their max and their sum. The sum is the
// 16-lane fixed tree of `f_sum_tree` over chunks added in position order, unseen keys as +0: the
// weights are never negative, so a +0 changes no partial sum (as if the key were skipped).
template <int HC>
inline void block_weights(const float* scores, uint64_t bits, float* weights, float* high, float* total) {
  constexpr int T = BLOCK / LANES;
  float seen[BLOCK], hidden[BLOCK];  // 1 / 0, and 0 / -inf, by whether the row sees each key
  for (int j = 0; j < BLOCK; ++j) {
    seen[j] = ((bits >> j) & 1u) ? 1.0f : 0.0f;
    hidden[j] = ((bits >> j) & 1u) ? 0.0f : -__builtin_inff();
  }
  for (int h = 0; h < HC; ++h) {
    F most = f_set1(-__builtin_inff());
    for (int t = 0; t < T; ++t)
      most = f_max(most, f_add(f_load(scores + h * BLOCK + t * LANES), f_load(hidden + t * LANES)));
    float top = f_max_lanes(most);
    F sum = f_zero();
    for (int t = 0; t < T; ++t) {
      F w = f_mul(f_exp(f_sub(f_load(scores + h * BLOCK + t * LANES), f_set1(top))), f_load(seen + t * LANES));
      f_store(weights + h * BLOCK + t * LANES, w);
      sum = f_add(sum, w);
    }
    high[h] = top;
    total[h] = f_sum_tree(sum);
  }
}

// o[h] = fma chain over the keys seen, in position order, of weight[h][j] * value[j]: DC chunks of
// 16 dims (DC = 0: the head dim read at run time). Values are widened from the cache's dtype as read.
template <class VT, int HC, int DC>
inline void block_values(const AttentionArgs& a, const float* weights, uint64_t bits, const VT* values,
                         const int32_t* slots, float* out, int64_t stride) {
  const int64_t chunks = DC ? DC : (a.D + LANES - 1) / LANES;
  constexpr int HOLD = DC ? DC : MAX_HEAD_DIM / LANES;
  F o[HC][HOLD];
  for (int h = 0; h < HC; ++h)
    for (int64_t c = 0; c < chunks; ++c) o[h][c] = f_zero();
  for (uint64_t rest = bits; rest; rest &= rest - 1) {
    int j = __builtin_ctzll(rest);
    const VT* v = values + slots[j] * a.v_slot;
    for (int64_t c = 0; c < chunks; ++c) {
      int left = DC ? LANES : (int)(a.D - c * LANES);
      F vc = left >= LANES ? f_load_any(v + c * LANES) : f_load_any_n(v + c * LANES, left);
      for (int h = 0; h < HC; ++h) o[h][c] = f_fma(f_set1(weights[h * BLOCK + j]), vc, o[h][c]);
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int64_t c = 0; c < chunks; ++c) {
      int left = DC ? LANES : (int)(a.D - c * LANES);
      if (left >= LANES) f_store(out + h * stride + c * LANES, o[h][c]);
      else f_store_n(out + h * stride + c * LANES, o[h][c], left);
    }
}

// HC heads h0.. of one row over one unit: their partials (weighted values, max, sum) written.
template <int HC, int DC>
inline void row_partials(const AttentionArgs& a, int32_t row, uint64_t bits, int64_t h0, const float* keys,
                         const int32_t* slots, float* partials) {
  const int64_t width = a.D + 2;
  float queries[HC * MAX_HEAD_DIM], q[MAX_HEAD_DIM], scores[HC * BLOCK], weights[HC * BLOCK], high[HC], total[HC];
  for (int h = 0; h < HC; ++h) {
    load_row(a.q, a.type, (h0 + h) * a.q_head + row * a.q_row, a.D, q);
    for (int64_t d = 0; d < a.D; ++d) queries[h * MAX_HEAD_DIM + d] = a.softcap > 0.0f ? q[d] : q[d] * a.scale;
  }
  block_scores<HC>(a, queries, keys, scores);
  block_weights<HC>(scores, bits, weights, high, total);
  const int64_t kv = h0 / (a.H / a.H_kv);
  if (a.type == F32)
    block_values<float, HC, DC>(a, weights, bits, static_cast<const float*>(a.v) + kv * a.v_head, slots,
                                partials + h0 * width, width);
  else
    block_values<uint16_t, HC, DC>(a, weights, bits, static_cast<const uint16_t*>(a.v) + kv * a.v_head, slots,
                                   partials + h0 * width, width);
  for (int h = 0; h < HC; ++h) {
    partials[(h0 + h) * width + a.D] = high[h];
    partials[(h0 + h) * width + a.D + 1] = total[h];
  }
}

// The heads of one kv group in chunks of up to MOST (as many as the group has, so none is left alone).
template <int MOST, int DC>
inline void group_partials(const AttentionArgs& a, int32_t row, uint64_t bits, int64_t kv, const float* keys,
                           const int32_t* slots, float* partials) {
  const int64_t group = a.H / a.H_kv, end = (kv + 1) * group;
  for (int64_t h = kv * group; h < end;) {
    int64_t left = end - h;
    if (MOST >= 4 && left >= 4) {
      row_partials<(MOST >= 4 ? 4 : 1), DC>(a, row, bits, h, keys, slots, partials);
      h += 4;
    } else if (MOST >= 3 && left == 3) {
      row_partials<(MOST >= 3 ? 3 : 1), DC>(a, row, bits, h, keys, slots, partials);
      h += 3;
    } else if (MOST >= 2 && left >= 2) {
      row_partials<(MOST >= 2 ? 2 : 1), DC>(a, row, bits, h, keys, slots, partials);
      h += 2;
    } else {
      row_partials<1, DC>(a, row, bits, h, keys, slots, partials);
      h += 1;
    }
  }
}

inline void unit_row(const AttentionArgs& a, int32_t row, uint64_t bits, int64_t kv, const float* keys,
                     const int32_t* slots, float* partials) {
  if (a.D == 64) group_partials<4, 4>(a, row, bits, kv, keys, slots, partials);
  else if (a.D == 128) group_partials<2, 8>(a, row, bits, kv, keys, slots, partials);
  else group_partials<1, 0>(a, row, bits, kv, keys, slots, partials);
}

// Ask the memory for a task's keys and values ahead of their use (the cache is read once a step,
// long after it was last touched: without this the reads wait on memory one row at a time).
inline void prefetch_block(const AttentionArgs& a, int64_t task) {
  const int64_t u = task / a.H_kv, kv = task % a.H_kv;
  const int32_t* slots = a.unit_slots + u * BLOCK;
  const int64_t size = a.type == F32 ? 4 : 2, row_bytes = a.D * size;
  for (int j = 0; j < BLOCK; ++j) {
    if (slots[j] < 0) continue;
    const char* k = static_cast<const char*>(a.k) + (kv * a.k_head + slots[j] * a.k_slot) * size;
    const char* v = static_cast<const char*>(a.v) + (kv * a.v_head + slots[j] * a.v_slot) * size;
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(k + b);
      __builtin_prefetch(v + b);
    }
  }
}

// Units u0 .. u1 of the flat (unit, kv head) task list, every `step`-th (the caller's threads take
// interleaved tasks, so heavy and light units spread evenly).
inline void attention_units_impl(const AttentionArgs& a, int64_t first, int64_t step) {
  const int64_t group = a.H / a.H_kv, width = a.D + 2;
  float* keys = static_cast<float*>(__builtin_alloca(sizeof(float) * a.D * BLOCK));
  float* rows = static_cast<float*>(__builtin_alloca(sizeof(float) * a.D * BLOCK));
  for (int64_t task = first; task < a.U * a.H_kv; task += step) {
    const int64_t u = task / a.H_kv, kv = task % a.H_kv;
    const int32_t* slots = a.unit_slots + u * BLOCK;
    if (task + step < a.U * a.H_kv) prefetch_block(a, task + step);
    gather_keys(a, slots, kv, keys, rows);
    for (int64_t w = 0; w < a.W; ++w) {
      int32_t r = a.unit_rows[u * a.W + w];
      if (r < 0) continue;
      uint64_t bits = a.unit_bits[u * a.W + w];
      float* partials = a.partials + (u * a.W + w) * a.H * width;
      if (bits == 0) {  // the row sees nothing here: an empty partial, skipped by the merge
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          partials[h * width + a.D] = -__builtin_inff();
          partials[h * width + a.D + 1] = 0.0f;
        }
        continue;
      }
      unit_row(a, r, bits, kv, keys, slots, partials);
    }
  }
}

// A row's running merge of its blocks for one head: state = [o (D), high, total]; total 0: nothing yet.
inline void merge_into(float* state, const float* partial, int64_t dim) {
  const int64_t chunks = (dim + LANES - 1) / LANES;
  float block_high = partial[dim], block_total = partial[dim + 1];
  if (block_total == 0.0f) return;  // the row sees nothing in this block
  if (state[dim + 1] == 0.0f) {  // the first block: as it is
    for (int64_t i = 0; i < dim + 2; ++i) state[i] = partial[i];
    return;
  }
  float high = state[dim], top = block_high > high ? block_high : high;
  float keep = exp_scalar(high - top), add = exp_scalar(block_high - top);
  state[dim + 1] = fmaf_exact(state[dim + 1], keep, block_total * add);
  for (int64_t c = 0; c < chunks; ++c) {
    int rest = (int)(dim - c * LANES);
    F part = rest >= LANES ? f_load(partial + c * LANES) : f_load_n(partial + c * LANES, rest);
    F o = rest >= LANES ? f_load(state + c * LANES) : f_load_n(state + c * LANES, rest);
    o = f_fma(o, f_set1(keep), f_mul(part, f_set1(add)));
    if (rest >= LANES) f_store(state + c * LANES, o);
    else f_store_n(state + c * LANES, o, rest);
  }
  state[dim] = top;
}

// The output of a merged state: o / total (0 for a row that saw nothing), stored as out[0 .. D).
inline void finish(const AttentionArgs& a, const float* state, int64_t index) {
  const int64_t chunks = (a.D + LANES - 1) / LANES;
  float out[MAX_HEAD_DIM];
  for (int64_t c = 0; c < chunks; ++c) {
    int rest = (int)(a.D - c * LANES);
    F o = rest >= LANES ? f_load(state + c * LANES) : f_load_n(state + c * LANES, rest);
    F value = state[a.D + 1] != 0.0f ? f_div(o, f_set1(state[a.D + 1])) : f_zero();
    if (rest >= LANES) f_store(out + c * LANES, value);
    else f_store_n(out + c * LANES, value, rest);
  }
  for (int64_t d = 0; d < a.D; ++d) store_out(a.out, a.type, index + d, out[d]);
}

inline void attention_merge_impl(const AttentionArgs& a, int64_t r0, int64_t r1) {
  const int64_t width = a.D + 2;
  float state[MAX_HEAD_DIM + 2];
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t h = 0; h < a.H; ++h) {
      state[a.D + 1] = 0.0f;
      for (int32_t i = a.row_pairs[r]; i < a.row_pairs[r + 1]; ++i)
        merge_into(state, a.partials + ((int64_t)a.pair_index[i] * a.H + h) * width, a.D);
      finish(a, state, (r * a.H + h) * a.D);
    }
}

// Rows that read the same units in the same order (a long prompt's rows, 64 at a time), worked
// together per kv head: each unit's keys gathered once for them, each row's blocks merged as they
// come. The same partials, merged in the same order as `attention_merge_impl` merges them, so the
// same bits; but no partial is kept for the whole forward (a long prompt would need gigabytes).
// scratch: the calling thread's [64 rows x group heads + all heads] x (D + 2) floats.
inline void attention_groups_impl(const AttentionArgs& a, const RowGroups& g, int64_t first, int64_t step,
                                  float* scratch) {
  const int64_t group = a.H / a.H_kv, width = a.D + 2;
  float* keys = static_cast<float*>(__builtin_alloca(sizeof(float) * a.D * BLOCK));
  float* rows = static_cast<float*>(__builtin_alloca(sizeof(float) * a.D * BLOCK));
  float* partials = scratch + MAX_GROUP * group * width;  // [H, D + 2], the kv group's heads written
  for (int64_t task = first; task < g.count * a.H_kv; task += step) {
    const int64_t gi = task / a.H_kv, kv = task % a.H_kv;
    const int32_t* members = g.rows + g.row_start[gi];
    const int64_t n = g.row_start[gi + 1] - g.row_start[gi];
    for (int64_t i = 0; i < n * group; ++i) scratch[i * width + a.D + 1] = 0.0f;
    for (int32_t t = 0; t < g.unit_start[gi + 1] - g.unit_start[gi]; ++t) {
      const int64_t u = g.units[g.unit_start[gi] + t];
      const int32_t* slots = a.unit_slots + u * BLOCK;
      gather_keys(a, slots, kv, keys, rows);
      for (int64_t i = 0; i < n; ++i) {
        const int32_t r = members[i];
        const uint64_t bits = a.unit_bits[a.pair_index[a.row_pairs[r] + t]];
        if (bits == 0) continue;  // an empty partial: the merge skips it
        unit_row(a, r, bits, kv, keys, slots, partials);
        for (int64_t h = 0; h < group; ++h)
          merge_into(scratch + (i * group + h) * width, partials + (kv * group + h) * width, a.D);
      }
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < group; ++h)
        finish(a, scratch + (i * group + h) * width, (members[i] * a.H + kv * group + h) * a.D);
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
void MD_CONCAT(rms_norm, MD_ISA)(const NormArgs& a, int64_t m0, int64_t m1) { rms_norm_impl(a, m0, m1); }
void MD_CONCAT(qlinear, MD_ISA)(const QLinearArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  qlinear_impl(a, m0, m1, p0, p1);
}
void MD_CONCAT(attention_units, MD_ISA)(const AttentionArgs& a, int64_t first, int64_t step) {
  attention_units_impl(a, first, step);
}
void MD_CONCAT(attention_merge, MD_ISA)(const AttentionArgs& a, int64_t r0, int64_t r1) {
  attention_merge_impl(a, r0, r1);
}
void MD_CONCAT(attention_groups, MD_ISA)(const AttentionArgs& a, const RowGroups& g, int64_t first, int64_t step,
                                         float* scratch) {
  attention_groups_impl(a, g, first, step, scratch);
}
}  // namespace multidecode
