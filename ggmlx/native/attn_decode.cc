// ggml's flash_attn_ext for a few query rows (decode, batched decode, speculative
// verification), read straight from the KV cache buffers: an XLA FFI custom call.
//
// Why: the XLA path receives K and V as a slice of the first n_kv cells of the cache, with the
// heads moved in front, and XLA:CPU copies both before its dots (1.6-1.8 ms of a 12-14 ms
// decode step of SmolLM2 and Gemma3). Here K and V are read in place through ggml's strides
// (cell stride, head stride, an element offset into the whole cache), and cells the mask
// hides (-inf) are skipped, so a step reads only the cells in use.
//
// K and V are f32, f16 or one of ggml's blocks of 32 (Q8_0: an f16 scale d, 32 int8 q, element
// d * q; Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL: 4-bit quants, a fifth bit in qh for Q5, a minimum
// m for the _1 types, kvalues_iq4nl for IQ4_NL), both of one type; a block row is read block by
// block, 16 (AVX-512) or 8 (AVX2) quants widened and scaled in registers, so a quantized cache
// costs no dequantized copy and a fraction of f16's bytes.
//
// Numerics, per query row and head, all in f32: s = (q . k) * scale, then softcap *
// tanh(s / softcap) when softcap > 0, then + mask; out = sum_k exp(s_k - max) v_k / sum_k
// exp(s_k - max). The XLA path computes the same terms with its own exp (both within a few
// ULP); the sums run in another order: blocks of cells with a running maximum, and runs of
// cells merged by their maxima (flash-decoding). A row whose every cell is masked gives zeros.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GGMLX_X86 1
#endif

#include "half.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The element types of the cache rows (the `kv_type` attribute: ggml's type ids).
struct F32 {
  static constexpr int64_t id = 0;
};
struct F16 {
  static constexpr int64_t id = 1;
};
struct Q8_0 {
  static constexpr int64_t id = 8;
  static constexpr int64_t block = 34;  // f16 d, int8 qs[32]
};
// The 4-bit blocks: f16 d, [f16 m,] [u32 qh,] qs[16] (element j < 16 in the low nibble of qs[j],
// j + 16 in its high nibble; Q5's bit 4 of element j is bit j of qh).
template <int64_t ID, bool MIN, bool HIGH, bool NL>
struct Nibbles {
  static constexpr int64_t id = ID;
  static constexpr bool min = MIN, high = HIGH, nl = NL;
  static constexpr int64_t qh = MIN ? 4 : 2;
  static constexpr int64_t qs = qh + (HIGH ? 4 : 0);
  static constexpr int64_t block = qs + 16;
  static constexpr float bias = MIN || NL ? 0.f : HIGH ? 16.f : 8.f;   // q - bias, times d (+ m)
};
using Q4_0 = Nibbles<2, false, false, false>;
using Q4_1 = Nibbles<3, true, false, false>;
using Q5_0 = Nibbles<6, false, true, false>;
using Q5_1 = Nibbles<7, true, true, false>;
using IQ4_NL = Nibbles<20, false, false, true>;

template <typename T>
constexpr bool is_nibbles = T::id == Q4_0::id || T::id == Q4_1::id || T::id == Q5_0::id || T::id == Q5_1::id ||
                            T::id == IQ4_NL::id;

alignas(64) constexpr float kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

// Bytes of a row of n elements.
template <typename T>
constexpr int64_t row_bytes(int64_t n) {
  if constexpr (std::is_same_v<T, F16>) return 2 * n;
  else if constexpr (std::is_same_v<T, F32>) return 4 * n;
  else return n / 32 * T::block;
}

struct Attn {
  const float* q;       // [n_q, H, D]
  const uint8_t* k;     // the K cache's memory
  const uint8_t* v;     // the V cache's memory
  const float* mask;    // [n_q, n_kv]
  const int32_t* cells;  // [n_q, n_kv]: row i's cells whose mask is not -inf, first in its row
  int64_t H, Hkv, D, Dv, n_kv;
  int64_t k_off, k_cell, k_head;  // byte offset and strides of K (cell, KV head)
  int64_t v_off, v_cell, v_head;
  float scale, softcap;
};

// ---- one row of K or V as f32, dotted with q or added to an accumulator ------------------

using ggmlx_native::f16_to_f32;

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}

// element i of the row at p
template <typename T>
inline float load(const uint8_t* p, int64_t i) {
  if constexpr (is_nibbles<T>) {
    const uint8_t* b = p + (i / 32) * T::block;
    const int64_t j = i % 32;
    int q = (b[T::qs + j % 16] >> (j / 16 * 4)) & 0xF;
    if constexpr (T::high) {
      uint32_t qh;
      std::memcpy(&qh, b + T::qh, sizeof qh);
      q |= ((qh >> j) & 1) << 4;
    }
    const float d = f16_to_f32(u16_at(b));
    if constexpr (T::nl) return kvalues_iq4nl[q] * d;
    else if constexpr (T::min) return static_cast<float>(q) * d + f16_to_f32(u16_at(b + 2));
    else return (static_cast<float>(q) - T::bias) * d;
  } else if constexpr (std::is_same_v<T, Q8_0>) {
    const uint8_t* b = p + (i / 32) * Q8_0::block;
    return f16_to_f32(u16_at(b)) * static_cast<float>(static_cast<int8_t>(b[2 + i % 32]));
  } else if constexpr (std::is_same_v<T, F16>) {
    return f16_to_f32(u16_at(p + 2 * i));
  } else {
    float f;
    std::memcpy(&f, p + 4 * i, sizeof f);
    return f;
  }
}

template <typename T>
float dot_generic(const float* q, const uint8_t* k, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += q[i] * load<T>(k, i);
  return s;
}

template <typename T>
void axpy_generic(float* acc, float a, const uint8_t* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * load<T>(v, i);
}

#ifdef GGMLX_X86
// elements i .. i + 15 of the row at p (i a multiple of 16)
template <typename T>
__attribute__((target("avx512f,f16c"))) inline __m512 load16_avx512(const uint8_t* p, int64_t i) {
  if constexpr (is_nibbles<T>) {
    const uint8_t* b = p + (i / 32) * T::block;
    const int64_t half = (i % 32) / 16;
    __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + T::qs));
    if (half) q8 = _mm_srli_epi16(q8, 4);
    __m512i q = _mm512_cvtepu8_epi32(_mm_and_si128(q8, _mm_set1_epi8(0x0F)));
    if constexpr (T::high) {
      uint32_t qh;
      std::memcpy(&qh, b + T::qh, sizeof qh);
      q = _mm512_mask_add_epi32(q, static_cast<__mmask16>(qh >> (16 * half)), q, _mm512_set1_epi32(16));
    }
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(u16_at(b)));
    if constexpr (T::nl) return _mm512_mul_ps(_mm512_permutexvar_ps(q, _mm512_load_ps(kvalues_iq4nl)), d);
    else if constexpr (T::min)
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, _mm512_set1_ps(_cvtsh_ss(u16_at(b + 2))));
    else return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(T::bias)), d);
  } else if constexpr (std::is_same_v<T, Q8_0>) {
    const uint8_t* b = p + (i / 32) * Q8_0::block;
    const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + i % 32));
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8));
    return _mm512_mul_ps(q, _mm512_set1_ps(_cvtsh_ss(u16_at(b))));
  } else if constexpr (std::is_same_v<T, F16>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
  }
}

template <typename T>
__attribute__((target("avx512f,f16c"))) float dot_avx512(const float* q, const uint8_t* k, int64_t n) {
  __m512 a = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16_avx512<T>(k, i), a);
  return _mm512_reduce_add_ps(a);
}

// The 16 partial-sum vectors a[0..15] reduced to one vector whose lane j is the sum of a[j]:
// pairs of vectors are interleaved and added level by level (45 instructions for 16 sums,
// against about 8 per _mm512_reduce_add_ps).
__attribute__((target("avx512f,f16c"))) inline __m512 hsum16_avx512(const __m512* a) {
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j)   // per 128-bit lane: a[2j] x, a[2j+1] x, a[2j] y, a[2j+1] y
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: one partial of a[4j] .. a[4j+3]
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * j]), _mm512_castps_pd(b[2 * j + 1]));
    c[j] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// q . k[idx[j] * cell] for the 16 cells idx[0..15] at once, into out[0..15]
template <typename T>
__attribute__((target("avx512f,f16c"))) void dot16_avx512(const float* q, const uint8_t* k, int64_t cell,
                                                     const int32_t* idx, int64_t n, float* out) {
  __m512 a[16];
  const uint8_t* row[16];
  for (int j = 0; j < 16; ++j) {
    a[j] = _mm512_setzero_ps();
    row[j] = k + idx[j] * cell;
  }
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, load16_avx512<T>(row[j], i), a[j]);
  }
  _mm512_storeu_ps(out, hsum16_avx512(a));
}

// o[0 .. 16 NV) += sum over j < n with e[j] != 0 of e[j] * v[idx[j] * cell + ...], the NV
// accumulators kept in registers across the cells
template <typename T, int NV>
__attribute__((target("avx512f,f16c"))) void weigh_avx512(const float* e, const uint8_t* v, int64_t cell,
                                                     const int32_t* idx, int64_t n, float* o) {
  __m512 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm512_loadu_ps(o + 16 * j);
  for (int64_t c = 0; c < n; ++c) {
    if (e[c] == 0.f) continue;
    const __m512 ev = _mm512_set1_ps(e[c]);
    const uint8_t* row = v + idx[c] * cell;
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(ev, load16_avx512<T>(row, 16 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, acc[j]);
}

template <typename T>
__attribute__((target("avx512f,f16c"))) void weigh_rows_avx512(const float* e, const uint8_t* v, int64_t cell,
                                                          const int32_t* idx, int64_t n, int64_t dv, float* o) {
  using Fn = void (*)(const float*, const uint8_t*, int64_t, const int32_t*, int64_t, float*);
  static constexpr Fn fns[16] = {weigh_avx512<T, 1>,  weigh_avx512<T, 2>,  weigh_avx512<T, 3>,  weigh_avx512<T, 4>,
                                 weigh_avx512<T, 5>,  weigh_avx512<T, 6>,  weigh_avx512<T, 7>,  weigh_avx512<T, 8>,
                                 weigh_avx512<T, 9>,  weigh_avx512<T, 10>, weigh_avx512<T, 11>, weigh_avx512<T, 12>,
                                 weigh_avx512<T, 13>, weigh_avx512<T, 14>, weigh_avx512<T, 15>, weigh_avx512<T, 16>};
  for (int64_t d0 = 0; d0 < dv; d0 += 256) {   // 16 vectors of 16 at most per pass over the cells
    const int64_t nv = std::min<int64_t>(16, (dv - d0) / 16);
    fns[nv - 1](e, v + row_bytes<T>(d0), cell, idx, n, o + d0);
  }
}

// elements i .. i + 7 of the row at p (i a multiple of 8)
template <typename T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8_avx2(const uint8_t* p, int64_t i) {
  if constexpr (is_nibbles<T>) {
    const uint8_t* b = p + (i / 32) * T::block;
    const int64_t half = (i % 32) / 16, t0 = i % 16;
    int64_t raw;
    std::memcpy(&raw, b + T::qs + t0, sizeof raw);
    __m128i q8 = _mm_cvtsi64_si128(raw);
    if (half) q8 = _mm_srli_epi16(q8, 4);
    __m256i q = _mm256_cvtepu8_epi32(_mm_and_si128(q8, _mm_set1_epi8(0x0F)));
    if constexpr (T::high) {
      uint32_t qh;
      std::memcpy(&qh, b + T::qh, sizeof qh);
      const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const int hb = static_cast<int>((qh >> (16 * half + t0)) & 0xFF);
      const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(hb), lanes);
      q = _mm256_add_epi32(q, _mm256_and_si256(_mm256_cmpeq_epi32(bits, lanes), _mm256_set1_epi32(16)));
    }
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(u16_at(b)));
    if constexpr (T::nl) {
      const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(kvalues_iq4nl), q);
      const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(kvalues_iq4nl + 8), q);
      const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(q, _mm256_set1_epi32(7)));
      return _mm256_mul_ps(_mm256_blendv_ps(lo, hi, upper), d);
    } else if constexpr (T::min) {
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, _mm256_set1_ps(_cvtsh_ss(u16_at(b + 2))));
    } else {
      return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(T::bias)), d);
    }
  } else if constexpr (std::is_same_v<T, Q8_0>) {
    const uint8_t* b = p + (i / 32) * Q8_0::block;
    int64_t q8;
    std::memcpy(&q8, b + 2 + i % 32, sizeof q8);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(q8)));
    return _mm256_mul_ps(q, _mm256_set1_ps(_cvtsh_ss(u16_at(b))));
  } else if constexpr (std::is_same_v<T, F16>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
  }
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const float* q, const uint8_t* k, int64_t n) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_avx2<T>(k, i), a);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// q . k[idx[j] * cell] for the 8 cells idx[0..7] at once, into out[0..7]: 8 independent FMA
// chains (one cell's dot alone waits on its own chain of D / 8 FMAs), then one transposing
// reduction (lane j of the result is the sum of a[j]).
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void dot8_avx2(const float* q, const uint8_t* k, int64_t cell,
                                                        const int32_t* idx, int64_t n, float* out) {
  __m256 a[8];
  const uint8_t* row[8];
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm256_setzero_ps();
    row[j] = k + idx[j] * cell;
  }
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8_avx2<T>(row[j], i), a[j]);
  }
  const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31)));
}

// o[0 .. 8 NV) += sum over j < n with e[j] != 0 of e[j] * v[idx[j] * cell + ...], the NV
// accumulators kept in registers across the cells (an axpy per cell stored and reloaded them)
template <typename T, int NV>
__attribute__((target("avx2,fma,f16c"))) void weigh_avx2(const float* e, const uint8_t* v, int64_t cell,
                                                         const int32_t* idx, int64_t n, float* o) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_loadu_ps(o + 8 * j);
  for (int64_t c = 0; c < n; ++c) {
    if (e[c] == 0.f) continue;
    const __m256 ev = _mm256_set1_ps(e[c]);
    const uint8_t* row = v + idx[c] * cell;
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(ev, load8_avx2<T>(row, 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(o + 8 * j, acc[j]);
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void weigh_rows_avx2(const float* e, const uint8_t* v, int64_t cell,
                                                              const int32_t* idx, int64_t n, int64_t dv, float* o) {
  using Fn = void (*)(const float*, const uint8_t*, int64_t, const int32_t*, int64_t, float*);
  static constexpr Fn fns[8] = {weigh_avx2<T, 1>, weigh_avx2<T, 2>, weigh_avx2<T, 3>, weigh_avx2<T, 4>,
                                weigh_avx2<T, 5>, weigh_avx2<T, 6>, weigh_avx2<T, 7>, weigh_avx2<T, 8>};
  for (int64_t d0 = 0; d0 < dv; d0 += 64) {   // 8 vectors of 8 at most per pass over the cells
    const int64_t nv = std::min<int64_t>(8, (dv - d0) / 8);
    fns[nv - 1](e, v + row_bytes<T>(d0), cell, idx, n, o + d0);
  }
}

// exp(x) as Cephes' expf: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by a
// degree-7 polynomial, times 2^n; within 2 ULP of the exact value for x in [-87, 0] (every
// argument here is s - max <= 0). glibc's scalar expf was most of the time of a step.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

__attribute__((target("avx512f,f16c"))) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n: n + 127 in the exponent bits (n >= -126 after the clamp)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// s[c] = s[c] * scale + mb[c] (the product rounded first, as the scalar loop does); returns
// their maximum
__attribute__((target("avx512f"))) float score_avx512(float* s, const float* mb, int64_t n, float scale) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm512_set1_ps(scale);
  __m512 mx = ninf;
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 live = n - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + c), sc), _mm512_maskz_loadu_ps(live, mb + c));
    _mm512_mask_storeu_ps(s + c, live, x);
    mx = _mm512_mask_max_ps(mx, live, mx, x);
  }
  return _mm512_reduce_max_ps(mx);
}

// s[c] = exp(s[c] - mx), and exactly 0 where s[c] is -inf (a masked cell); returns their sum
__attribute__((target("avx512f,f16c"))) float exp_shift_avx512(float* s, int64_t n, float mx) {
  const __m512 m = _mm512_set1_ps(mx), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sum = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 x = _mm512_loadu_ps(s + c);
    const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_avx512(_mm512_sub_ps(x, m)));
    _mm512_storeu_ps(s + c, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (c < n) {   // the last cells under a lane mask (the masked-off lanes read as -inf)
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(ninf, tail, s + c);
    const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_avx512(_mm512_sub_ps(x, m)));
    _mm512_mask_storeu_ps(s + c, tail, e);
    sum = _mm512_add_ps(sum, e);
    c = n;
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; c < n; ++c) total += s[c] = s[c] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s[c] - mx);
  return total;
}

__attribute__((target("avx2,fma"))) float exp_shift_avx2(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sum = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 x = _mm256_loadu_ps(s + c);
    const __m256 live = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(live, exp_avx2(_mm256_sub_ps(x, m)));
    _mm256_storeu_ps(s + c, e);
    sum = _mm256_add_ps(sum, e);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  float total = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  for (; c < n; ++c) total += s[c] = s[c] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s[c] - mx);
  return total;
}
#endif  // GGMLX_X86

float exp_shift_generic(float* s, int64_t n, float mx) {
  float total = 0.f;
  for (int64_t c = 0; c < n; ++c)
    total += s[c] = s[c] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s[c] - mx);
  return total;
}

// The widest vector code this CPU runs for head sizes D and Dv (0: plain loops).
int simd_level(int64_t D, int64_t Dv) {
#ifdef GGMLX_X86
  static const int level = __builtin_cpu_supports("avx512f") ? 2
                           : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                              __builtin_cpu_supports("f16c")) ? 1 : 0;
  if (level == 2 && D % 16 == 0 && Dv % 16 == 0) return 2;
  if (level >= 1 && D % 8 == 0 && Dv % 8 == 0) return 1;
#endif
  return 0;
}

// ---- one query row and KV head over a run of its cells -----------------------------------

// A row's softmax so far, per query head r of a KV head: the largest score m[r], l[r] = sum of
// exp(s - m[r]) and o[r * Dv ..] = sum of exp(s - m[r]) v over the cells seen.
struct Running {
  float* o;
  float* m;
  float* l;
};

// Cells whose K and V rows one pass over a KV head's query heads keeps in L1 (64 against 128 and
// 256: 289 / 307 / 322 us per layer, 9 heads x 4096 f16 cells streamed), and runs of cells wanted
// per thread (so a slow thread's share is small).
constexpr int64_t kBlock = 64;
constexpr int64_t kRunsPerThread = 4;

// The rows (bytes each) of cells idx[0 .. n) asked into L2 ahead of their use.
inline void prefetch_rows(const uint8_t* base, int64_t cell, int64_t bytes, const int32_t* idx, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(base + idx[j] * cell + b, 0, 2);
}

// One thread's buffers for a block of cells: scores s and mask values mb.
struct Scratch {
  float* s;
  float* mb;
};

// One query head q over n cells (K row j at k + idx[j] * k_cell, V likewise, mask value mb[j])
// into its running softmax (o, *m_run, *l_run).
template <typename T, int LEVEL>
void attend_block(const Attn& p, const float* q, const uint8_t* k, int64_t k_cell, const uint8_t* v, int64_t v_cell,
                  const int32_t* idx, const float* mb, int64_t n, float* o, float* m_run, float* l_run, float* s) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  int64_t j16 = 0;   // cells before j16 have their dot product in s already
#ifdef GGMLX_X86
  if constexpr (LEVEL == 2)
    for (; j16 + 16 <= n; j16 += 16) dot16_avx512<T>(q, k, k_cell, idx + j16, p.D, s + j16);
  if constexpr (LEVEL == 1)
    for (; j16 + 8 <= n; j16 += 8) dot8_avx2<T>(q, k, k_cell, idx + j16, p.D, s + j16);
  if constexpr (LEVEL >= 1) {
    // the last cells as one more group, its index list padded with a cell in use: one group
    // call costs less than as many single dots from 5 cells on, and a prompt chunk's rows have
    // few cells each (with the vector tails below and each row's single run written by its unit:
    // 64 causal prompt rows 190 -> 154 us a layer, 8 decode rows of 100 cells 49 -> 44 us)
    constexpr int64_t G = LEVEL == 2 ? 16 : 8;
    if (n - j16 > G / 4) {
      int32_t pad[G];
      float d[G];
      for (int64_t j = 0; j < G; ++j) pad[j] = idx[j16 + std::min(j, n - 1 - j16)];
      if constexpr (LEVEL == 2) dot16_avx512<T>(q, k, k_cell, pad, p.D, d);
      else dot8_avx2<T>(q, k, k_cell, pad, p.D, d);
      std::memcpy(s + j16, d, (n - j16) * sizeof(float));
      j16 = n;
    }
  }
#endif
  for (int64_t j = j16; j < n; ++j) {
    const uint8_t* kc = k + idx[j] * k_cell;
#ifdef GGMLX_X86
    if constexpr (LEVEL == 2) s[j] = dot_avx512<T>(q, kc, p.D);
    else if constexpr (LEVEL == 1) s[j] = dot_avx2<T>(q, kc, p.D);
    else s[j] = dot_generic<T>(q, kc, p.D);
#else
    s[j] = dot_generic<T>(q, kc, p.D);
#endif
  }
#ifdef GGMLX_X86
  if (LEVEL == 2 && p.softcap <= 0.f) {
    mx = score_avx512(s, mb, n, p.scale);
  } else
#endif
  for (int64_t j = 0; j < n; ++j) {
    float x = s[j] * p.scale;
    if (p.softcap > 0.f) x = p.softcap * std::tanh(x / p.softcap);
    x += mb[j];
    s[j] = x;
    mx = std::max(mx, x);
  }
  if (mx == ninf) return;
  if (mx > *m_run) {   // a new maximum: what was summed so far is rescaled to it
    if (*m_run != ninf) {
      const float f = std::exp(*m_run - mx);
      *l_run *= f;
      for (int64_t d = 0; d < p.Dv; ++d) o[d] *= f;
    }
    *m_run = mx;
  }
#ifdef GGMLX_X86
  if constexpr (LEVEL == 2) {
    *l_run += exp_shift_avx512(s, n, *m_run);
    return weigh_rows_avx512<T>(s, v, v_cell, idx, n, p.Dv, o);
  } else if constexpr (LEVEL == 1) {
    *l_run += exp_shift_avx2(s, n, *m_run);
    return weigh_rows_avx2<T>(s, v, v_cell, idx, n, p.Dv, o);
  }
#endif
  *l_run += exp_shift_generic(s, n, *m_run);
  for (int64_t j = 0; j < n; ++j)
    if (s[j] != 0.f) axpy_generic<T>(o, s[j], v + idx[j] * v_cell, p.Dv);   // 0: too far below the max
}

// Cells idx[c0 .. c1) of query row i, for the query heads of KV head g, into r, kBlock cells at a
// time: each of those heads attends to a block before the next block is read, so the block's K
// and V rows come from memory once for all of them (a pass per head over all the cells read them
// once per head: 528 against 254 us per layer for 9 heads x 4096 f16 cells, streamed against
// hot), and the next block's rows are asked for while this one is computed (same case: 379 ->
// 319 us per layer).
template <typename T, int LEVEL>
void attend(const Attn& p, int64_t i, int64_t g, int64_t c0, int64_t c1, Running r, Scratch t) {
  const float* m = p.mask + i * p.n_kv;
  const int64_t rep = p.H / p.Hkv;
  const uint8_t* k = p.k + p.k_off + g * p.k_head;
  const uint8_t* v = p.v + p.v_off + g * p.v_head;
  // the first block's rows asked for all at once too (rows of a few hundred cells from memory:
  // 8 rows x ~125 interleaved cells x 9 heads, cold, 101 -> 98 us per layer; 1 row 19.7 -> 17.5)
  prefetch_rows(k, p.k_cell, row_bytes<T>(p.D), p.cells + i * p.n_kv + c0, std::min(kBlock, c1 - c0));
  prefetch_rows(v, p.v_cell, row_bytes<T>(p.Dv), p.cells + i * p.n_kv + c0, std::min(kBlock, c1 - c0));
  for (int64_t b0 = c0; b0 < c1; b0 += kBlock) {
    const int32_t* idx = p.cells + i * p.n_kv + b0;
    const int64_t n = std::min(kBlock, c1 - b0), next = std::min(kBlock, c1 - b0 - n);
    prefetch_rows(k, p.k_cell, row_bytes<T>(p.D), idx + n, next);
    prefetch_rows(v, p.v_cell, row_bytes<T>(p.Dv), idx + n, next);
    for (int64_t j = 0; j < n; ++j) t.mb[j] = m[idx[j]];
    for (int64_t h = 0; h < rep; ++h)
      attend_block<T, LEVEL>(p, p.q + (i * p.H + g * rep + h) * p.D, k, p.k_cell, v, p.v_cell, idx, t.mb, n,
                             r.o + h * p.Dv, r.m + h, r.l + h, t.s);
  }
}

// out[h] = the merge of the runs' softmaxes: sum_r exp(m_r - M) o_r / sum_r exp(m_r - M) l_r
// with M the largest m_r, for the H heads of the runs; zeros for a head whose every cell is masked.
void merge(const Running* runs, int64_t n_runs, int64_t H, int64_t Dv, float* out) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < H; ++h) {
    float M = ninf;
    for (int64_t r = 0; r < n_runs; ++r) M = std::max(M, runs[r].m[h]);
    float* o = out + h * Dv;
    std::fill(o, o + Dv, 0.f);
    if (M == ninf) continue;
    float L = 0.f;
    for (int64_t r = 0; r < n_runs; ++r) {
      if (runs[r].m[h] == ninf) continue;
      const float f = std::exp(runs[r].m[h] - M);
      L += f * runs[r].l[h];
      const float* ro = runs[r].o + h * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] += f * ro[d];
    }
    const float inv = 1.f / L;
    for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
  }
}

// The positions c < n of m[c] != -inf, written to out; returns how many.
#ifdef GGMLX_X86
// The whole 16-cell runs of live_cells (AVX-512 compress); returns the cells it looked at.
__attribute__((target("avx512f"))) int64_t live_cells16(const float* m, int64_t n, int32_t* out, int64_t* k) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i step = _mm512_set1_epi32(16);
  __m512i c = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, c = _mm512_add_epi32(c, step)) {
    const __mmask16 live = _mm512_cmp_ps_mask(_mm512_loadu_ps(m + i), ninf, _CMP_NEQ_OQ);
    // compressed in a register and stored whole (out + *k + 15 < out + i + 16 <= out + n): the
    // compress-to-memory form is microcoded on Zen 4 (this scan was 12% of 8 rows' attention)
    _mm512_storeu_si512(out + *k, _mm512_maskz_compress_epi32(live, c));
    *k += __builtin_popcount(live);
  }
  return i;
}
#endif

int64_t live_cells(const float* m, int64_t n, int32_t* out) {
  int64_t k = 0, i = 0;
#ifdef GGMLX_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) i = live_cells16(m, n, out, &k);
#endif
  for (; i < n; ++i)
    if (m[i] != -std::numeric_limits<float>::infinity()) out[k++] = static_cast<int32_t>(i);
  return k;
}

using UnitFn = void (*)(const Attn&, int64_t, int64_t, int64_t, int64_t, Running, Scratch);

template <typename T>
UnitFn pick(int level) {
  return level == 2 ? attend<T, 2> : level == 1 ? attend<T, 1> : attend<T, 0>;
}

ffi::Error AttnDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> mask, ffi::ResultBuffer<ffi::F32> out, int64_t kv_type, int64_t n_kv,
                      int64_t n_head_kv, int64_t k_off, int64_t k_cell, int64_t k_head, int64_t v_off,
                      int64_t v_cell, int64_t v_head, float scale, float softcap) {
  auto qd = q.dimensions(), md = mask.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || md.size() != 2 || od.size() != 3)
    return ffi::Error::InvalidArgument("attn_decode: q [n_q, H, D], mask [n_q, n_kv], out [n_q, H, Dv]");
  const int64_t n_q = qd[0], H = qd[1], D = qd[2], Dv = od[2];
  if (md[0] != n_q || md[1] != n_kv || od[0] != n_q || od[1] != H)
    return ffi::Error::InvalidArgument("attn_decode: shapes of q, mask and out disagree");
  if (n_head_kv < 1 || H % n_head_kv)
    return ffi::Error::InvalidArgument("attn_decode: the heads of q are not a multiple of the KV heads");
  const auto kt = k.element_type();
  const int64_t block = kv_type == Q8_0::id     ? Q8_0::block
                        : kv_type == Q4_0::id   ? Q4_0::block
                        : kv_type == Q4_1::id   ? Q4_1::block
                        : kv_type == Q5_0::id   ? Q5_0::block
                        : kv_type == Q5_1::id   ? Q5_1::block
                        : kv_type == IQ4_NL::id ? IQ4_NL::block
                                                : 0;
  const bool typed = (kv_type == F32::id && kt == ffi::DataType::F32) ||
                     (kv_type == F16::id && kt == ffi::DataType::F16) ||
                     (block && kt == ffi::DataType::U8 && D % 32 == 0 && Dv % 32 == 0);
  if (kt != v.element_type() || !typed)
    return ffi::Error::InvalidArgument("attn_decode: K and V must both be f32, both f16 or both the bytes of one "
                                       "block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; head sizes multiples of 32)");
  // the last byte read must lie inside each cache buffer
  const auto rb = [kv_type, block](int64_t n) { return block ? n / 32 * block : kv_type == F16::id ? 2 * n : 4 * n; };
  const int64_t k_rb = rb(D), v_rb = rb(Dv);
  const int64_t k_last = k_off + (n_kv - 1) * k_cell + (n_head_kv - 1) * k_head + k_rb;
  const int64_t v_last = v_off + (n_kv - 1) * v_cell + (n_head_kv - 1) * v_head + v_rb;
  if (n_kv < 1 || k_off < 0 || v_off < 0 || k_last > static_cast<int64_t>(k.size_bytes()) ||
      v_last > static_cast<int64_t>(v.size_bytes()))
    return ffi::Error::InvalidArgument("attn_decode: the strides reach outside the K or V buffer");
  // Each row's cells the mask lets through, as a list: a step's n_kv is a bucket (256 cells and
  // up), and the cells of a batched decode's sequences interleave, so a row may use a few of the
  // cells between its first and last one; every pass (dots, exponentials, V) then runs over those only.
  thread_local std::vector<int32_t> cells;
  cells.resize(n_q * n_kv);
  std::vector<int64_t> n_cells(n_q);
  for (int64_t i = 0; i < n_q; ++i) n_cells[i] = live_cells(mask.typed_data() + i * n_kv, n_kv, cells.data() + i * n_kv);
  const Attn p{q.typed_data(), static_cast<const uint8_t*>(k.untyped_data()),
               static_cast<const uint8_t*>(v.untyped_data()),
               mask.typed_data(), cells.data(), H, n_head_kv, D, Dv, n_kv,
               k_off, k_cell, k_head, v_off, v_cell, v_head, scale, softcap};
  const int level = simd_level(D, Dv);
  const UnitFn fn = kv_type == Q8_0::id     ? pick<Q8_0>(level)
                    : kv_type == Q4_0::id   ? pick<Q4_0>(level)
                    : kv_type == Q4_1::id   ? pick<Q4_1>(level)
                    : kv_type == Q5_0::id   ? pick<Q5_0>(level)
                    : kv_type == Q5_1::id   ? pick<Q5_1>(level)
                    : kv_type == IQ4_NL::id ? pick<IQ4_NL>(level)
                    : kv_type == F16::id    ? pick<F16>(level)
                                            : pick<F32>(level);
  // Work units: a query row's heads of one KV head over a run of the row's cells (flash-decoding:
  // a few rows split their cells, in runs of at least 64, so every thread has a share). Each
  // run's softmax is merged into the row's output after.
  const int64_t n_macs = [&] {
    int64_t t = 0;
    for (int64_t i = 0; i < n_q; ++i) t += n_cells[i];
    return t * H * D;
  }();
  // Helper threads pay off from about 64K multiply-adds in the cells in use (9 heads x 128
  // cells x 64: 8.4 -> 7.4 us; x 576 cells 33 -> 20 us, attn_decode alone); below, one thread.
  const int64_t threads = n_macs >= (1 << 16) ? std::max<int64_t>(1, pool.num_threads()) : 1;
  const int64_t rows = n_q * n_head_kv, rep = H / n_head_kv;
  const int64_t per_row = threads > 1 ? (kRunsPerThread * threads + rows - 1) / rows : 1;   // runs per (row, KV head)
  struct Unit {
    int64_t row, g, c0, c1;
  };
  std::vector<Unit> units;
  std::vector<int64_t> first(rows + 1);   // the runs of (row i, KV head g) are units[first[i Hkv + g] ..]
  for (int64_t i = 0; i < n_q; ++i) {
    const int64_t runs = std::max<int64_t>(1, std::min(per_row, n_cells[i] / 64));
    const int64_t len = std::max<int64_t>(16, (n_cells[i] / runs + 15) / 16 * 16);   // whole 16-cell blocks
    for (int64_t g = 0; g < n_head_kv; ++g) {
      first[i * n_head_kv + g] = static_cast<int64_t>(units.size());
      for (int64_t c0 = 0; c0 < n_cells[i] || c0 == 0; c0 += len)
        units.push_back({i, g, c0, std::min(c0 + len, n_cells[i])});
    }
  }
  first[rows] = static_cast<int64_t>(units.size());
  const int64_t n_units = first[rows];
  // each unit's running softmax: o [rep, Dv], m [rep], l [rep]
  const int64_t stride = rep * (Dv + 2);
  thread_local std::vector<float> state;
  state.resize(n_units * stride);
  float* const base = state.data();   // (a pool thread's name `state` is its own vector)
  const auto running = [base, stride, rep, Dv](int64_t u) {
    float* b = base + u * stride;
    return Running{b, b + rep * Dv, b + rep * Dv + rep};
  };
  ggmlx_native::parallel_for(pool, std::min(threads, n_units), n_units, [&](int64_t u) {
    thread_local std::vector<float> scratch;
    scratch.resize(2 * kBlock);
    const Running r = running(u);
    std::fill(r.o, r.o + rep * Dv, 0.f);
    std::fill(r.m, r.m + rep, -std::numeric_limits<float>::infinity());
    std::fill(r.l, r.l + rep, 0.f);
    fn(p, units[u].row, units[u].g, units[u].c0, units[u].c1, r, Scratch{scratch.data(), scratch.data() + kBlock});
    const int64_t j = units[u].row * n_head_kv + units[u].g;
    if (first[j + 1] - first[j] == 1)   // the row's only run: its softmax is final, written here
      merge(&r, 1, rep, Dv, out->typed_data() + j * rep * Dv);
  });
  std::vector<Running> runs;
  for (int64_t j = 0; j < rows; ++j) {   // j = i Hkv + g: query heads g rep .. of row i, at out + j rep Dv
    if (first[j + 1] - first[j] == 1) continue;
    runs.clear();
    for (int64_t u = first[j]; u < first[j + 1]; ++u) runs.push_back(running(u));
    merge(runs.data(), static_cast<int64_t>(runs.size()), rep, Dv, out->typed_data() + j * rep * Dv);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgmlxAttnDecode, AttnDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kv_type")
                                  .Attr<int64_t>("n_kv")
                                  .Attr<int64_t>("n_head_kv")
                                  .Attr<int64_t>("k_off")
                                  .Attr<int64_t>("k_cell")
                                  .Attr<int64_t>("k_head")
                                  .Attr<int64_t>("v_off")
                                  .Attr<int64_t>("v_cell")
                                  .Attr<int64_t>("v_head")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
