// Lanes: the few vector operations the kernels are written in, once per instruction set.
//
// Every kernel in this folder is defined lane by lane: a lane is one output's value, and each
// operation below does to each lane what one scalar IEEE operation (or one exact integer
// operation) does. So a kernel computes the same bits whichever set of lanes runs it: 16 lanes in
// one AVX-512 register, in two AVX2 registers, or in a plain C array (the portable path). The
// only cross-lane operations are `f_sum_tree` (a fixed tree: lane l += lane l+8, then l += l+4,
// l += l+2, 0 += 1) and `f_max` (order-free), defined the same way for every set.
//
// Included once per instruction-set translation unit, after that unit's `#pragma GCC target`
// and with MD_LANES set: 1 portable C, 2 AVX2 + FMA + F16C, 3 AVX-512 (F, BW, VL, DQ), 4 the
// same with VNNI. Everything here has internal linkage, so the units never share a function
// compiled for another instruction set. Only C headers: nothing from the C++ library is
// instantiated under a target pragma.
#pragma once
#include <stdint.h>
#include <string.h>
#if MD_LANES >= 2
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;

// ---------------------------------------------------------------------------------- scalar helpers
inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

inline uint16_t f32_to_bf16(float x) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {  // exact, subnormals included
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while (!(mantissa & 0x400u)) { mantissa <<= 1; ++shift; }
    bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

inline float fmaf_exact(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

// exp for one lane, as every set computes it: Cody-Waite reduction by ln 2, Cephes' degree-5
// polynomial, 2^n by the exponent bits; 0 below -87 (the weights of a softmax there are nil).
constexpr float EXP_LOW = -87.0f, EXP_HIGH = 88.0f, LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

inline float exp_scalar(float x) {
  if (!(x >= EXP_LOW)) return 0.0f;
  if (x > EXP_HIGH) x = EXP_HIGH;
  float n = __builtin_nearbyintf(x * LOG2E);
  float r = fmaf_exact(n, -LN2_HI, x);
  r = fmaf_exact(n, -LN2_LO, r);
  float y = fmaf_exact(P0, r, P1);
  y = fmaf_exact(y, r, P2);
  y = fmaf_exact(y, r, P3);
  y = fmaf_exact(y, r, P4);
  y = fmaf_exact(y, r, P5);
  float r2 = r * r;
  y = fmaf_exact(y, r2, r);
  y = y + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, 4);
  return y * scale;
}

#if MD_LANES >= 2
// The 8 floats of s8 summed in a fixed tree: the two halves, then pairs, then the last two.
inline float sum8_tree(__m256 s8) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
#endif

#if MD_LANES == 1
// ================================================================================= portable C
struct F { float x[LANES]; };
struct I { int32_t x[LANES]; };
struct B { uint8_t x[4 * LANES]; };  // 4 bytes per lane

inline F f_zero() { F a; for (int l = 0; l < LANES; ++l) a.x[l] = 0.0f; return a; }
inline F f_set1(float v) { F a; for (int l = 0; l < LANES; ++l) a.x[l] = v; return a; }
inline F f_load(const float* p) { F a; for (int l = 0; l < LANES; ++l) a.x[l] = p[l]; return a; }
inline F f_load_n(const float* p, int n) { F a = f_zero(); for (int l = 0; l < n; ++l) a.x[l] = p[l]; return a; }
inline F f_load_bf16(const uint16_t* p) { F a; for (int l = 0; l < LANES; ++l) a.x[l] = bf16_to_f32(p[l]); return a; }
inline F f_load_bf16_n(const uint16_t* p, int n) {
  F a = f_zero(); for (int l = 0; l < n; ++l) a.x[l] = bf16_to_f32(p[l]); return a;
}
inline F f_load_f16(const uint16_t* p) { F a; for (int l = 0; l < LANES; ++l) a.x[l] = f16_to_f32(p[l]); return a; }
inline F f_fma(F a, F b, F c) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = fmaf_exact(a.x[l], b.x[l], c.x[l]); return o; }
inline F f_add(F a, F b) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] + b.x[l]; return o; }
inline F f_sub(F a, F b) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] - b.x[l]; return o; }
inline F f_mul(F a, F b) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] * b.x[l]; return o; }
inline F f_div(F a, F b) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] / b.x[l]; return o; }
inline F f_max(F a, F b) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] > b.x[l] ? a.x[l] : b.x[l]; return o; }
inline F f_min(F a, F b) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] < b.x[l] ? a.x[l] : b.x[l]; return o; }
inline F f_abs(F a) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = a.x[l] < 0 ? -a.x[l] : a.x[l]; return o; }
inline F f_round_even(F a) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = __builtin_nearbyintf(a.x[l]); return o; }
inline void f_store_bf16(uint16_t* p, F a) { for (int l = 0; l < LANES; ++l) p[l] = f32_to_bf16(a.x[l]); }
inline void f_store(float* p, F a) { for (int l = 0; l < LANES; ++l) p[l] = a.x[l]; }
inline void f_store_n(float* p, F a, int n) { for (int l = 0; l < n; ++l) p[l] = a.x[l]; }
inline F f_pow2(F n) {
  F o;
  for (int l = 0; l < LANES; ++l) {
    int32_t e = ((int32_t)n.x[l] + 127) << 23;
    memcpy(&o.x[l], &e, 4);
  }
  return o;
}
inline F f_zero_below(F value, F x, float low) {  // 0 where x < low (or NaN)
  for (int l = 0; l < LANES; ++l) value.x[l] = x.x[l] >= low ? value.x[l] : 0.0f;
  return value;
}
inline F f_from_i(I a) { F o; for (int l = 0; l < LANES; ++l) o.x[l] = (float)a.x[l]; return o; }
inline float f_sum_tree(F a) {
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) a.x[l] = a.x[l] + a.x[l + width];
  return a.x[0];
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for a 16 x 16 tile (moves only: no rounding).
inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  for (int r = 0; r < LANES; ++r)
    for (int c = 0; c < LANES; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
}

inline I i_zero() { I a; for (int l = 0; l < LANES; ++l) a.x[l] = 0; return a; }
inline B b_load(const uint8_t* p) { B b; memcpy(b.x, p, sizeof b.x); return b; }
inline B b_low_nibbles(B b) { for (int i = 0; i < 4 * LANES; ++i) b.x[i] &= 0x0f; return b; }
inline B b_high_nibbles(B b) { for (int i = 0; i < 4 * LANES; ++i) b.x[i] >>= 4; return b; }
inline B b_bcast4(const int8_t* p) { B b; for (int l = 0; l < LANES; ++l) memcpy(b.x + 4 * l, p, 4); return b; }
// acc + sum over a lane's 4 bytes of u (unsigned) * s (signed)
inline I i_dot_us(I acc, B u, B s) {
  for (int l = 0; l < LANES; ++l)
    for (int j = 0; j < 4; ++j) acc.x[l] += (int32_t)u.x[4 * l + j] * (int32_t)(int8_t)s.x[4 * l + j];
  return acc;
}
// acc + sum over a lane's 4 bytes of c (signed) * s (signed)
inline I i_dot_ss(I acc, B c, B s) {
  for (int l = 0; l < LANES; ++l)
    for (int j = 0; j < 4; ++j) acc.x[l] += (int32_t)(int8_t)c.x[4 * l + j] * (int32_t)(int8_t)s.x[4 * l + j];
  return acc;
}

#elif MD_LANES == 2
// ================================================================================= AVX2
struct F { __m256 lo, hi; };
struct I { __m256i lo, hi; };
struct B { __m256i lo, hi; };

inline __m256i mask8(int n) {  // lanes < n of 8 set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline F f_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F f_set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F f_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F f_load_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, mask8(n)), _mm256_maskload_ps(p + 8, mask8(n - 8))};
}
inline F f_load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline F f_load_bf16_n(const uint16_t* p, int n) {
  uint16_t tmp[LANES] = {0};
  for (int l = 0; l < n; ++l) tmp[l] = p[l];
  return f_load_bf16(tmp);
}
inline F f_load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline F f_fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F f_add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F f_sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F f_mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F f_div(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F f_max(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F f_min(F a, F b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F f_abs(F a) {
  __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F f_round_even(F a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline __m128i bf16x8_of(__m256 x) {  // round to nearest even, NaN quieted: as f32_to_bf16
  __m256i bits = _mm256_castps_si256(x);
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                             _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1))));
  __m256i nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  __m256i out = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, nan, is_nan), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}
inline void f_store_bf16(uint16_t* p, F a) {
  _mm_storeu_si128((__m128i*)p, bf16x8_of(a.lo));
  _mm_storeu_si128((__m128i*)(p + 8), bf16x8_of(a.hi));
}
inline void f_store(float* p, F a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline void f_store_n(float* p, F a, int n) {
  _mm256_maskstore_ps(p, mask8(n), a.lo);
  _mm256_maskstore_ps(p + 8, mask8(n - 8), a.hi);
}
inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F f_pow2(F n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline F f_zero_below(F value, F x, float low) {  // 0 where x < low (or NaN)
  return {_mm256_and_ps(value.lo, _mm256_cmp_ps(x.lo, _mm256_set1_ps(low), _CMP_GE_OQ)),
          _mm256_and_ps(value.hi, _mm256_cmp_ps(x.hi, _mm256_set1_ps(low), _CMP_GE_OQ))};
}
inline F f_from_i(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline float f_sum_tree(F a) { return sum8_tree(_mm256_add_ps(a.lo, a.hi)); }

inline void transpose8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm256_shuffle_ps(t[i + j], t[i + 2 + j], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 2 + j] = _mm256_shuffle_ps(t[i + j], t[i + 2 + j], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // r[0..7] now hold rows 0, 1, 2, 3 of each 4x4 quarter: join the 128-bit halves
  const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[order[i]], r[order[i + 4]], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[order[i]], r[order[i + 4]], 0x31));
  }
}

inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 16; j += 8) transpose8(src + i * src_stride + j, src_stride, dst + j * dst_stride + i, dst_stride);
}

inline I i_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline B b_load(const uint8_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
inline B b_low_nibbles(B b) {
  __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
}
inline B b_high_nibbles(B b) {
  __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
inline B b_bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  __m256i a = _mm256_set1_epi32(v);
  return {a, a};
}
inline __m256i dot8_us(__m256i acc, __m256i u, __m256i s) {  // u <= 127 per byte pair sum: no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline I i_dot_us(I acc, B u, B s) { return {dot8_us(acc.lo, u.lo, s.lo), dot8_us(acc.hi, u.hi, s.hi)}; }
inline __m256i dot8_ss(__m256i acc, __m256i c, __m256i s) {  // |c| * (s signed by c)
  return dot8_us(acc, _mm256_abs_epi8(c), _mm256_sign_epi8(s, c));
}
inline I i_dot_ss(I acc, B c, B s) { return {dot8_ss(acc.lo, c.lo, s.lo), dot8_ss(acc.hi, c.hi, s.hi)}; }

#else
// ================================================================================= AVX-512 (and VNNI)
struct F { __m512 v; };
struct I { __m512i v; };
struct B { __m512i v; };

inline F f_zero() { return {_mm512_setzero_ps()}; }
inline F f_set1(float v) { return {_mm512_set1_ps(v)}; }
inline F f_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F f_load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p)}; }
inline F f_load_bf16(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline F f_load_bf16_n(const uint16_t* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline F f_load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline F f_fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F f_add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F f_sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F f_mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F f_div(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F f_max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F f_min(F a, F b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F f_abs(F a) { return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7fffffff)))}; }
inline F f_round_even(F a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline void f_store_bf16(uint16_t* p, F a) {  // round to nearest even, NaN quieted: as f32_to_bf16
  __m512i bits = _mm512_castps_si512(a.v);
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                             _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))));
  __mmask16 is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  __m512i out = _mm512_srli_epi32(_mm512_mask_or_epi32(rounded, is_nan, bits, _mm512_set1_epi32(0x400000)), 16);
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(out));
}
inline void f_store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline void f_store_n(float* p, F a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), a.v); }
inline F f_pow2(F n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline F f_zero_below(F value, F x, float low) {  // 0 where x < low (or NaN)
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(low), _CMP_GE_OQ), value.v)};
}
inline F f_from_i(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline float f_sum_tree(F a) {
  __m256 lo = _mm512_castps512_ps256(a.v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  return sum8_tree(_mm256_add_ps(lo, hi));
}

inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm512_shuffle_ps(t[i + j], t[i + 2 + j], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 2 + j] = _mm512_shuffle_ps(t[i + j], t[i + 2 + j], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // r[4g + m], 128-bit lane k: rows 4g .. 4g + 3 of column 4k + (0, 2, 1, 3)[m]; gather the lanes
  const int column[4] = {0, 2, 1, 3};
  for (int m = 0; m < 4; ++m) {
    __m512 x0 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x44), y0 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xee);
    __m512 x1 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x44), y1 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xee);
    _mm512_storeu_ps(dst + (0 + column[m]) * dst_stride, _mm512_shuffle_f32x4(x0, x1, 0x88));
    _mm512_storeu_ps(dst + (4 + column[m]) * dst_stride, _mm512_shuffle_f32x4(x0, x1, 0xdd));
    _mm512_storeu_ps(dst + (8 + column[m]) * dst_stride, _mm512_shuffle_f32x4(y0, y1, 0x88));
    _mm512_storeu_ps(dst + (12 + column[m]) * dst_stride, _mm512_shuffle_f32x4(y0, y1, 0xdd));
  }
}

inline I i_zero() { return {_mm512_setzero_si512()}; }
inline B b_load(const uint8_t* p) { return {_mm512_loadu_si512((const void*)p)}; }
inline B b_low_nibbles(B b) { return {_mm512_and_si512(b.v, _mm512_set1_epi8(0x0f))}; }
inline B b_high_nibbles(B b) { return {_mm512_and_si512(_mm512_srli_epi16(b.v, 4), _mm512_set1_epi8(0x0f))}; }
inline B b_bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
#if MD_LANES == 4
inline I i_dot_us(I acc, B u, B s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
#else
inline I i_dot_us(I acc, B u, B s) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(u.v, s.v), _mm512_set1_epi16(1)))};
}
#endif
inline I i_dot_ss(I acc, B c, B s) {  // |c| * (s negated where c < 0)
  __mmask64 negative = _mm512_movepi8_mask(c.v);
  __m512i signed_s = _mm512_mask_sub_epi8(s.v, negative, _mm512_setzero_si512(), s.v);
  return i_dot_us(acc, B{_mm512_abs_epi8(c.v)}, B{signed_s});
}
#endif

// ---------------------------------------------------------------------------------- shared by every set
// exp of each lane: `exp_scalar`'s steps, lane by lane.
inline F f_exp(F x) {
  F clamped = f_min(f_max(x, f_set1(EXP_LOW)), f_set1(EXP_HIGH));
  F n = f_round_even(f_mul(clamped, f_set1(LOG2E)));
  F r = f_fma(n, f_set1(-LN2_HI), clamped);
  r = f_fma(n, f_set1(-LN2_LO), r);
  F y = f_fma(f_set1(P0), r, f_set1(P1));
  y = f_fma(y, r, f_set1(P2));
  y = f_fma(y, r, f_set1(P3));
  y = f_fma(y, r, f_set1(P4));
  y = f_fma(y, r, f_set1(P5));
  y = f_fma(y, f_mul(r, r), r);
  y = f_add(y, f_set1(1.0f));
  return f_zero_below(f_mul(y, f_pow2(n)), x, EXP_LOW);
}

inline F f_load_any(const float* p) { return f_load(p); }
inline F f_load_any(const uint16_t* p) { return f_load_bf16(p); }
inline F f_load_any_n(const float* p, int n) { return f_load_n(p, n); }
inline F f_load_any_n(const uint16_t* p, int n) { return f_load_bf16_n(p, n); }

// The largest lane (max is exact and order-free: any reduction order gives it).
inline float f_max_lanes(F a) {
  float tmp[LANES];
  f_store(tmp, a);
  float top = tmp[0];
  for (int l = 1; l < LANES; ++l) top = tmp[l] > top ? tmp[l] : top;
  return top;
}

inline float f_lane(F a, int l) {
  float tmp[LANES];
  f_store(tmp, a);
  return tmp[l];
}

}  // namespace
