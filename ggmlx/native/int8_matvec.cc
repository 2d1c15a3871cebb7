// y[n, m] = sum_k x[n, k] * (scale[m, k / sub] * q[m, k] + offset[m, k / sub]) for the "int8"
// weight format (ggmlx/weights.py), read straight from the int8 arrays: an XLA FFI custom call
// for decode-sized N, where the pure-XLA path writes each dequantized f32 chunk and reads it
// back for the dot.
//
// Numerics: the AVX-512 and plain-loop kernels dequantize each weight in f32 as XLA does
// (scale * q, then + offset; both exact for every type the int8 format holds) and sum the
// products in f32, so they differ from dequantize-then-dot only by the order of the f32
// additions. The AVX2 kernels (int8 for 1-2 activation rows, int4) sum scale * sum(x * q) +
// offset * sum(x) per sub-block, as ggml's own dots do (their error against float64 stays within
// the pure-XLA path's, tests/test_native.py).
// Activations are never quantized. Scales and offsets are f32, or f16 for the types whose
// block fields they are (Q8_0, Q4_1, Q5_0, ...: the same values in half the bytes), widened
// to f32 once per sub-block.
//
// The "int4" format's kernel (Int4Matvec) is the same product read from packed nibbles: per
// sub-block of 32 elements 16 bytes, byte j holding element j in its low and element j + 16
// in its high nibble, and an f32 scale and offset. Its weights are dequantized with one FMA,
// scale * q + offset: for the types it holds (Q4_0, Q4_1, Q4_K) scale * q is exact in f32,
// so that is the value of the multiply-then-add, bit for bit. The AVX2 kernel instead sums
// scale * sum(x * q) + offset * sum(x) per sub-block, as ggml's own Q4_1 dot does (fewer
// instructions per weight; its error against float64 stays within the pure-XLA path's).
// The AVX-512 kernel for 32 or more x rows (rows_int4_panel_avx512) forms the same weight
// values and sums each output as partial sums of 32 products added in order of k.
//
// The M rows are split into chunks run by parallel_for (parallel.h); the calling thread takes
// chunks too, so the call finishes even when no helper is free.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
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

constexpr int kGroupN = 8;  // rows of x one kernel pass handles; more are done in groups of 8
constexpr int kMaxN = 64;   // rows of x one call takes (the Python side checks it: native.MAX_N)
constexpr int kRowTile = 4; // chunks of M are multiples of this (every tile height divides it)

// AVX-512 weight rows per tile for NR activation rows: the ROWS x NR accumulators, the NR x
// vectors and the weight vector must fit the 32 zmm registers, or they spill (N = 8 with 4 rows
// ran 4x slower per row than N = 4). The AVX2 kernels run one weight row at a time.
constexpr int RowsAvx512(int nr) { return nr <= 4 ? 4 : 2; }
// Weight rows ahead that the SIMD kernels prefetch: the hardware prefetcher alone left a
// 262144 x 640 matvec (cold) at ~45 ms on one core, 32 rows ahead ~30 ms (16: ~33, 64: ~33).
constexpr int64_t kPrefetchRows = 32;

struct Problem {
  const float* x;       // [N, K]
  const int8_t* q;      // [M, K]; int4: the nibbles, uint8 [M, K / 2]
  const void* scale;    // [M, K / sub], f32 or (half) f16
  const void* offset;   // [M, K / sub] or null, as scale
  float* y;             // [N, M]
  int64_t N, M, K, sub;
  bool half;            // scale and offset are f16: the types whose fields are f16 (Q8_0, Q4_1, ...)
  const float* xsum = nullptr;  // [N, K / sub] sums of x over each sub-block (the AVX2 kernels' offset term)
};

// Element i of a scale or offset array, f16 (IEEE binary16 bits) or f32.
using ggmlx_native::f16_to_f32;

inline float at_generic(const Problem& p, const void* a, int64_t i) {
  return p.half ? f16_to_f32(static_cast<const uint16_t*>(a)[i]) : static_cast<const float*>(a)[i];
}

// A pointer to element i of a scale or offset array (for prefetching).
inline const char* addr(const Problem& p, const void* a, int64_t i) {
  return static_cast<const char*>(a) + i * (p.half ? 2 : 4);
}

// ---- portable kernel: plain loops ------------------------------------------------------------

// The plain loops keep kLanes partial sums per output, as a vector kernel does: one running
// sum over K = 512 products drifted past the error bound of the tests (4.3e-7 against 4e-7).
constexpr int kLanes = 8;

inline float lanes_sum(const float* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

void rows_generic(const Problem& p, int64_t m0, int64_t m1) {
  const int64_t nb = p.K / p.sub;
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* q = p.q + m * p.K;
    float acc[kMaxN][kLanes] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const float s = at_generic(p, p.scale, m * nb + b);
      const float o = p.offset ? at_generic(p, p.offset, m * nb + b) : 0.f;
      for (int64_t t = 0; t < p.sub; ++t) {
        const int64_t k = b * p.sub + t;
        float w = s * static_cast<float>(q[k]);
        if (p.offset) w = w + o;
        for (int64_t n = 0; n < p.N; ++n) acc[n][k % kLanes] += p.x[n * p.K + k] * w;
      }
    }
    for (int64_t n = 0; n < p.N; ++n) p.y[n * p.M + m] = lanes_sum(acc[n]);
  }
}

// int4: the row's packed bytes (K / 2 per row).
inline const uint8_t* nibbles(const Problem& p, int64_t row) {
  return reinterpret_cast<const uint8_t*>(p.q) + row * (p.K / 2);
}

void rows_generic_int4(const Problem& p, int64_t m0, int64_t m1) {
  const int64_t nb = p.K / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* q = nibbles(p, m);
    float acc[kMaxN][kLanes] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const float s = at_generic(p, p.scale, m * nb + b), o = at_generic(p, p.offset, m * nb + b);
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t k = b * 32 + j;
        const float lo = s * static_cast<float>(q[b * 16 + j] & 15) + o;
        const float hi = s * static_cast<float>(q[b * 16 + j] >> 4) + o;
        for (int64_t n = 0; n < p.N; ++n) {
          acc[n][j % kLanes] += p.x[n * p.K + k] * lo;
          acc[n][j % kLanes] += p.x[n * p.K + k + 16] * hi;
        }
      }
    }
    for (int64_t n = 0; n < p.N; ++n) p.y[n * p.M + m] = lanes_sum(acc[n]);
  }
}

#ifdef GGMLX_X86
__attribute__((target("f16c"))) inline float at(const Problem& p, const void* a, int64_t i) {
  return p.half ? _cvtsh_ss(static_cast<const uint16_t*>(a)[i]) : static_cast<const float*>(a)[i];
}

// The row kPrefetchRows below `row` (the last row at the end), prefetched a cache line at a
// time as the tile walks along its own row.
inline int64_t ahead_row(const Problem& p, int64_t row) { return std::min(row + kPrefetchRows, p.M - 1); }

inline void prefetch_ahead(const Problem& p, int64_t row, int64_t k, int64_t b, int64_t nb, bool off) {
  const int64_t ahead = ahead_row(p, row);
  _mm_prefetch(reinterpret_cast<const char*>(p.q + ahead * p.K + k), _MM_HINT_T0);
  if (b % 16 == 0) {   // 16 floats: one cache line of scales (and offsets)
    _mm_prefetch(addr(p, p.scale, ahead * nb + b), _MM_HINT_T0);
    if (off) _mm_prefetch(addr(p, p.offset, ahead * nb + b), _MM_HINT_T0);
  }
}

// int4: prefetch the row kPrefetchRows ahead, each 32 bytes of nibbles and 16 scales/offsets.
inline void prefetch_int4(const Problem& p, int64_t row, int64_t b, int64_t nb) {
  const int64_t ahead = ahead_row(p, row);
  if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(nibbles(p, ahead) + b * 16), _MM_HINT_T0);
  if (b % 16 == 0) {
    _mm_prefetch(addr(p, p.scale, ahead * nb + b), _MM_HINT_T0);
    _mm_prefetch(addr(p, p.offset, ahead * nb + b), _MM_HINT_T0);
  }
}

// Every loop bound below is a template parameter, so the compiler unrolls the tiles and keeps
// the ROWS x NR accumulators in registers (a runtime row count spilled them: 3x slower).

// ---- AVX-512: 16 weights per vector, ROWS weight rows x NR activation rows per pass --------

template <int SUB, int NR, bool OFF, int ROWS>
__attribute__((target("avx512f,f16c"))) void tile_avx512(const Problem& p, int64_t m) {
  const int64_t nb = p.K / SUB;
  __m512 acc[ROWS][NR];
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < SUB / 16; ++h) {
      const int64_t k = b * SUB + h * 16;
      __m512 xv[NR];
      for (int n = 0; n < NR; ++n) xv[n] = _mm512_loadu_ps(p.x + n * p.K + k);
      for (int r = 0; r < ROWS; ++r) {
        const int64_t row = m + r;
        if (h == 0) prefetch_ahead(p, row, k, b, nb, OFF);
        __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + row * p.K + k));
        __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qb)), _mm512_set1_ps(at(p, p.scale, row * nb + b)));
        if (OFF) w = _mm512_add_ps(w, _mm512_set1_ps(at(p, p.offset, row * nb + b)));
        for (int n = 0; n < NR; ++n) acc[r][n] = _mm512_fmadd_ps(xv[n], w, acc[r][n]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NR; ++n) p.y[n * p.M + m + r] = _mm512_reduce_add_ps(acc[r][n]);
}

template <int SUB, int NR, bool OFF>
__attribute__((target("avx512f,f16c"))) void rows_avx512(const Problem& p, int64_t m0, int64_t m1) {
  int64_t m = m0;
  constexpr int R = RowsAvx512(NR);
  for (; m + R <= m1; m += R) tile_avx512<SUB, NR, OFF, R>(p, m);
  for (; m < m1; ++m) tile_avx512<SUB, NR, OFF, 1>(p, m);
}

// Scales (or offsets) i0 .. i0 + n - 1 (n <= 32) as f32 in out: f16 ones converted 16 at a time.
// A scalar conversion and broadcast per block and row took port 5 from the FMAs (vpinsrw,
// vcvtph2ps, vbroadcastss): broadcasts from memory are loads only.
__attribute__((target("avx512f,f16c"))) inline void scales_f32(const Problem& p, const void* a, int64_t i0, int64_t n,
                                                             float* out) {
  if (!p.half) {
    std::memcpy(out, static_cast<const float*>(a) + i0, n * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(a) + i0;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    _mm512_storeu_ps(out + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + c))));
  for (; c < n; ++c) out[c] = _cvtsh_ss(h[c]);
}

// int4: sub-block b of a row as f32, elements 0..15 in *lo and 16..31 in *hi. Its 16 bytes are
// widened to 16 dwords and its 16 possible values scale * i + offset put in one vector: each
// weight is a permute of that table by its nibble (vpermps reads an index's low 4 bits: the
// widened byte is the low nibble's index, the byte shifted by 4 the high one's).
__attribute__((target("avx512f"))) inline void int4_block_avx512(const Problem& p, int64_t row, int64_t b, float s,
                                                               float o, __m512* lo, __m512* hi) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i nib = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles(p, row) + b * 16)));
  const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s), _mm512_set1_ps(o));
  *lo = _mm512_permutexvar_ps(nib, table);
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(nib, 4), table);
}

template <int NR, int ROWS>
__attribute__((target("avx512f,f16c"))) void tile_int4_avx512(const Problem& p, int64_t m) {
  const int64_t nb = p.K / 32;
  __m512 acc[ROWS][NR];
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm512_setzero_ps();
  alignas(64) float sc[ROWS][32], of[ROWS][32];
  for (int64_t b0 = 0; b0 < nb; b0 += 32) {
    const int64_t nc = std::min<int64_t>(32, nb - b0);
    for (int r = 0; r < ROWS; ++r) {
      scales_f32(p, p.scale, (m + r) * nb + b0, nc, sc[r]);
      scales_f32(p, p.offset, (m + r) * nb + b0, nc, of[r]);
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t b = b0 + j;
      __m512 w[2][ROWS];   // elements 0..15, 16..31
      for (int r = 0; r < ROWS; ++r) {
        prefetch_int4(p, m + r, b, nb);
        int4_block_avx512(p, m + r, b, sc[r][j], of[r][j], &w[0][r], &w[1][r]);
      }
      for (int h = 0; h < 2; ++h) {
        const int64_t k = b * 32 + h * 16;
        for (int n = 0; n < NR; ++n) {
          const __m512 xv = _mm512_loadu_ps(p.x + n * p.K + k);
          for (int r = 0; r < ROWS; ++r) acc[r][n] = _mm512_fmadd_ps(xv, w[h][r], acc[r][n]);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int n = 0; n < NR; ++n) p.y[n * p.M + m + r] = _mm512_reduce_add_ps(acc[r][n]);
}

template <int NR>
__attribute__((target("avx512f,f16c"))) void rows_int4_avx512(const Problem& p, int64_t m0, int64_t m1) {
  int64_t m = m0;
  constexpr int R = RowsAvx512(NR);
  for (; m + R <= m1; m += R) tile_int4_avx512<NR, R>(p, m);
  for (; m < m1; ++m) tile_int4_avx512<NR, 1>(p, m);
}

// int4 for many x rows (N >= kPanelMinN), AVX-512: vectors along N instead of K. The x rows are
// transposed once per call to xt [K, NP] (NP: N rounded up to 16, zero-padded); for each slab
// of k (its xt rows fit L1), a tile of PanelRows(NV) weight rows is dequantized into an f32
// panel (int4_block_avx512, as tile_int4_avx512 forms each weight), and each of its weights, broadcast
// from the panel, multiplies all N x values of its k at once: no horizontal sums, and the
// dequantization is shared by all N rows (tile_int4_avx512 repeats it for each group of 4 x
// rows, a third of the FMA ports' time in permutes). SmolLM2, 2 threads: a 1536 x 576 product
// at N = 64 561 -> 422-463 us; prefill pp32 626-645 -> 678-703, pp64 692-727 -> 782-827 tok/s.
// Below 32 rows (half-empty vectors at N = 24, reductions cheap at N <= 16) it measured slower.

// Weight rows per panel for NV vectors of x: 24 accumulators (fewer rows per tile with
// ffn_down's K = 1536 and N = 32 ran 15% slower than the kernel for groups of 4 x rows).
constexpr int PanelRows(int nv) { return nv <= 2 ? 12 : nv == 3 ? 8 : 6; }
constexpr int kPanelMinN = 32;
constexpr int kPanelK = 32;     // k per partial sum: each output is a sum of K / 32 sums of 32 products
constexpr int64_t kSlabBytes = 32 << 10;  // xt rows per slab of k: 32 KiB of L1's 48

// The panel: ROWS weight rows from m, blocks b0 .. b1 - 1 (32 k each), [ROWS, 32 * (b1 - b0)] f32.
template <int ROWS>
__attribute__((target("avx512f,f16c"))) void panel_int4_avx512(const Problem& p, int64_t m, int64_t b0, int64_t b1,
                                                             float* w) {
  const int64_t nb = p.K / 32, kc = 32 * (b1 - b0);
  alignas(64) float sc[32], of[32];
  for (int r = 0; r < ROWS; ++r) {
    const int64_t row = m + r;
    for (int64_t c0 = b0; c0 < b1; c0 += 32) {
      const int64_t nc = std::min<int64_t>(32, b1 - c0);
      scales_f32(p, p.scale, row * nb + c0, nc, sc);
      scales_f32(p, p.offset, row * nb + c0, nc, of);
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t b = c0 + j;
        __m512 lo, hi;
        int4_block_avx512(p, row, b, sc[j], of[j], &lo, &hi);
        float* out = w + r * kc + (b - b0) * 32;
        _mm512_storeu_ps(out, lo);
        _mm512_storeu_ps(out + 16, hi);
      }
    }
  }
}

// yt[r, :] += sum over the slab's kc values of k of w[r, k] * xt[k, :] for the panel's ROWS
// rows and NV vectors of x (16 rows each), one partial sum of kPanelK products at a time.
template <int ROWS, int NV>
__attribute__((target("avx512f"))) void panel_dot_avx512(const float* w, const float* xt, int64_t kc, float* yt) {
  constexpr int64_t NP = NV * 16;
  for (int64_t k0 = 0; k0 < kc; k0 += kPanelK) {
    __m512 acc[ROWS][NV];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + kPanelK; ++k) {
      __m512 xv[NV];
      for (int j = 0; j < NV; ++j) xv[j] = _mm512_loadu_ps(xt + k * NP + j * 16);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 wv = _mm512_set1_ps(w[r * kc + k]);
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(wv, xv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < NV; ++j) {
        float* out = yt + r * NP + j * 16;
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), acc[r][j]));
      }
  }
}

template <int ROWS, int NV>
__attribute__((target("avx512f,f16c"))) void panel_tile_avx512(const Problem& p, const float* xt, int64_t m,
                                                             int64_t b0, int64_t b1, float* w, float* yt) {
  panel_int4_avx512<ROWS>(p, m, b0, b1, w);
  panel_dot_avx512<ROWS, NV>(w, xt + b0 * 32 * NV * 16, 32 * (b1 - b0), yt);
}

// Weight rows m0 .. m1 - 1 against all N x rows (xt: x transposed, [K, NV * 16]). The outputs
// gather in yt [m1 - m0, NV * 16] and go to y row by row at the end: written straight into y,
// each went to its own cache line of y (a stride of M floats) and took 4x the products' time.
template <int NV>
__attribute__((target("avx512f,f16c"))) void rows_int4_panel_avx512(const Problem& p, const float* xt, int64_t m0,
                                                                  int64_t m1) {
  constexpr int64_t NP = NV * 16;
  constexpr int R = PanelRows(NV);
  const int64_t slab = std::max<int64_t>(1, kSlabBytes / (NP * 4 * 32));   // blocks of 32 k per slab
  const int64_t nb = p.K / 32;
  std::unique_ptr<float[]> w(new float[R * 32 * std::min(slab, nb)]), yt(new float[(m1 - m0) * NP]());
  for (int64_t b0 = 0; b0 < nb; b0 += slab) {
    const int64_t b1 = std::min(nb, b0 + slab);
    int64_t m = m0;
    for (; m + R <= m1; m += R)
      panel_tile_avx512<R, NV>(p, xt, m, b0, b1, w.get(), yt.get() + (m - m0) * NP);
    for (; m < m1; ++m) panel_tile_avx512<1, NV>(p, xt, m, b0, b1, w.get(), yt.get() + (m - m0) * NP);
  }
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t i = 0; i < m1 - m0; ++i) p.y[n * p.M + m0 + i] = yt[i * NP + n];
}

// ---- AVX2 + FMA: 8 weights per vector -------------------------------------------------------

__attribute__((target("avx2,fma,f16c"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Scale or offset element i broadcast to 8 lanes, f16 or f32 by the template argument (a
// run-time test per sub-block and row cost a fifth of an int4 product).
template <bool HALF>
__attribute__((target("avx2,fma,f16c"))) inline __m256 bcast8(const void* a, int64_t i) {
  if (HALF) return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<const int16_t*>(a)[i]));
  return _mm256_broadcast_ss(static_cast<const float*>(a) + i);
}

// One weight row at a time. For 1-2 activation rows, per sub-block as ggml's own dots do:
// s * sum(x * q) (+ o * sum(x), the sums of x per sub-block in p.xsum), the SUB / 8 products of
// a sub-block in two independent chains and one FMA by the scale. Dequantizing each 8 weights
// first (s * q + o, then an FMA into one accumulator per row, in tiles of 2 rows) chained every
// FMA to the one before: on Zen 3 Gemma3-270M decoded 27-31 tok/s with that kernel against
// 36-39 with this one (tg128, builds alternated in one loop). From 3 rows on, the NR
// accumulators are independent chains already, and dequantizing once for all of them takes
// fewer instructions (576 x 1536 at N = 4: 140-167 us that way, 191-216 the other).
template <int SUB, int NR, bool OFF, bool HALF>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Problem& p, int64_t m0, int64_t m1) {
  const int64_t nb = p.K / SUB;
  for (int64_t row = m0; row < m1; ++row) {
    const int8_t* q = p.q + row * p.K;
    const int64_t ahead = ahead_row(p, row);
    __m256 acc[NR];
    float acc_off[NR] = {};
    for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k = b * SUB;
      if ((k & 63) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(p.q + ahead * p.K + k), _MM_HINT_T0);
        if (b % 16 == 0) {
          _mm_prefetch(addr(p, p.scale, ahead * nb + b), _MM_HINT_T0);
          if (OFF) _mm_prefetch(addr(p, p.offset, ahead * nb + b), _MM_HINT_T0);
        }
      }
      __m256 w[SUB / 8];
      for (int h = 0; h < SUB / 8; ++h)
        w[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + h * 8))));
      const __m256 s = bcast8<HALF>(p.scale, row * nb + b);
      if constexpr (NR <= 2) {
        for (int n = 0; n < NR; ++n) {
          const float* xn = p.x + n * p.K + k;
          __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(xn), w[0]);
          __m256 t1 = _mm256_mul_ps(_mm256_loadu_ps(xn + 8), w[1]);
          if (SUB == 32) {
            t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xn + 16), w[2], t0);
            t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xn + 24), w[3], t1);
          }
          acc[n] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), s, acc[n]);
          if (OFF) acc_off[n] += at(p, p.offset, row * nb + b) * p.xsum[n * nb + b];
        }
      } else {
        const __m256 o = OFF ? bcast8<HALF>(p.offset, row * nb + b) : _mm256_setzero_ps();
        for (int h = 0; h < SUB / 8; ++h) {
          const __m256 wd = OFF ? _mm256_add_ps(_mm256_mul_ps(w[h], s), o) : _mm256_mul_ps(w[h], s);
          for (int n = 0; n < NR; ++n)
            acc[n] = _mm256_fmadd_ps(_mm256_loadu_ps(p.x + n * p.K + k + h * 8), wd, acc[n]);
        }
      }
    }
    for (int n = 0; n < NR; ++n) p.y[n * p.M + row] = hsum256(acc[n]) + acc_off[n];
  }
}

// 8 consecutive scales (or offsets) of a row as f32.
template <bool HALF>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const void* a, int64_t i) {
  if (HALF) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(a) + i);
}

// int4 on AVX2, one weight row at a time, as ggml's Q4_1 dot does: per sub-block
// s * sum(x * q) + o * sum(x), the sums of x per sub-block (p.xsum) made once per call. That
// saves the dequantizing FMA of every 8 weights, and since each sub-block's dot is independent
// of the others, one row keeps the FMA units busy; the scales and offsets of 8 sub-blocks are
// converted by one instruction each and handed out by a lane permute. A sub-block's 16 bytes go
// into both 128-bit lanes, low and high nibbles are masked once, and each run of 8 is spread to
// dwords by one byte shuffle: vectors 0..3 hold elements 0-7, 8-15 (low nibbles) and 16-23,
// 24-31 (high nibbles). Measured on Zen 3 (builds alternated, one core, N = 1): the
// dequantize-then-dot form of this kernel over 4 rows was 1.2-1.4x slower, and vpmovzxbd from
// memory per 8 weights with a branch per quarter and a run-time f16 test 2.3-2.6x slower.
template <int NR, bool HALF>
__attribute__((target("avx2,fma,f16c"))) inline void int4_block_avx2(const Problem& p, const uint8_t* q, int64_t b,
                                                                      __m256 s, __m256* acc) {
  const __m256i low = _mm256_set1_epi32(15);
  const __m256i to_dwords0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                              4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i to_dwords1 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                              12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
  const __m256i d0 = _mm256_shuffle_epi8(bytes, to_dwords0), d1 = _mm256_shuffle_epi8(bytes, to_dwords1);
  const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(d0, low));
  const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(d1, low));
  const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d0, 4));
  const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d1, 4));
  for (int n = 0; n < NR; ++n) {
    const float* xn = p.x + n * p.K + b * 32;
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xn), w0);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xn + 8), w1, t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xn + 16), w2, t);
    t = _mm256_fmadd_ps(_mm256_loadu_ps(xn + 24), w3, t);
    acc[n] = _mm256_fmadd_ps(t, s, acc[n]);
  }
}

template <int NR, bool HALF>
__attribute__((target("avx2,fma,f16c"))) void rows_int4_avx2(const Problem& p, int64_t m0, int64_t m1) {
  const int64_t nb = p.K / 32;
  for (int64_t row = m0; row < m1; ++row) {
    const uint8_t* q = nibbles(p, row);
    const uint8_t* q_ahead = nibbles(p, ahead_row(p, row));
    __m256 acc[NR], acc_off[NR];
    for (int n = 0; n < NR; ++n) acc[n] = acc_off[n] = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) {   // 8 sub-blocks: 128 bytes of nibbles, two cache lines
      _mm_prefetch(reinterpret_cast<const char*>(q_ahead + b0 * 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q_ahead + b0 * 16 + 64), _MM_HINT_T0);
      const __m256 s8 = load8<HALF>(p.scale, row * nb + b0), o8 = load8<HALF>(p.offset, row * nb + b0);
      for (int n = 0; n < NR; ++n)
        acc_off[n] = _mm256_fmadd_ps(_mm256_loadu_ps(p.xsum + n * nb + b0), o8, acc_off[n]);
      for (int j = 0; j < 8; ++j)
        int4_block_avx2<NR, HALF>(p, q, b0 + j, _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(j)), acc);
    }
    float tail_off[NR] = {};
    for (; b0 < nb; ++b0) {   // the last nb % 8 sub-blocks
      int4_block_avx2<NR, HALF>(p, q, b0, bcast8<HALF>(p.scale, row * nb + b0), acc);
      const float o = at(p, p.offset, row * nb + b0);
      for (int n = 0; n < NR; ++n) tail_off[n] += o * p.xsum[n * nb + b0];
    }
    for (int n = 0; n < NR; ++n) p.y[n * p.M + row] = hsum256(acc[n]) + (hsum256(acc_off[n]) + tail_off[n]);
  }
}
#endif  // GGMLX_X86

using RowsFn = void (*)(const Problem&, int64_t, int64_t);

#ifdef GGMLX_X86
#define GGMLX_ROW(fn, S, O) fn<S, 1, O>, fn<S, 2, O>, fn<S, 3, O>, fn<S, 4, O>, fn<S, 5, O>, fn<S, 6, O>, \
                            fn<S, 7, O>, fn<S, 8, O>
#define GGMLX_TABLE(name, fn)                                                                  \
  RowsFn name(int64_t sub, int64_t n, bool off) {                                              \
    static const RowsFn t[2][2][kGroupN] = {                                                     \
        {{GGMLX_ROW(fn, 16, false)}, {GGMLX_ROW(fn, 16, true)}},                               \
        {{GGMLX_ROW(fn, 32, false)}, {GGMLX_ROW(fn, 32, true)}}};                              \
    return t[sub == 32][off][n - 1];                                                           \
  }
GGMLX_TABLE(pick_avx512, rows_avx512)
// AVX2: the f16 or f32 scales are a template argument too.
#define GGMLX_ROW_H(S, O, H) rows_avx2<S, 1, O, H>, rows_avx2<S, 2, O, H>, rows_avx2<S, 3, O, H>, \
    rows_avx2<S, 4, O, H>, rows_avx2<S, 5, O, H>, rows_avx2<S, 6, O, H>, rows_avx2<S, 7, O, H>, rows_avx2<S, 8, O, H>
RowsFn pick_avx2(int64_t sub, int64_t n, bool off, bool half) {
  static const RowsFn t[2][2][2][kGroupN] = {
      {{{GGMLX_ROW_H(16, false, false)}, {GGMLX_ROW_H(16, true, false)}},
       {{GGMLX_ROW_H(32, false, false)}, {GGMLX_ROW_H(32, true, false)}}},
      {{{GGMLX_ROW_H(16, false, true)}, {GGMLX_ROW_H(16, true, true)}},
       {{GGMLX_ROW_H(32, false, true)}, {GGMLX_ROW_H(32, true, true)}}}};
  return t[half][sub == 32][off][n - 1];
}
RowsFn pick_int4_avx512(int64_t n) {
  static const RowsFn t[kGroupN] = {rows_int4_avx512<1>, rows_int4_avx512<2>, rows_int4_avx512<3>,
                                    rows_int4_avx512<4>, rows_int4_avx512<5>, rows_int4_avx512<6>,
                                    rows_int4_avx512<7>, rows_int4_avx512<8>};
  return t[n - 1];
}
#define GGMLX_INT4_ROW(H) rows_int4_avx2<1, H>, rows_int4_avx2<2, H>, rows_int4_avx2<3, H>, rows_int4_avx2<4, H>, \
    rows_int4_avx2<5, H>, rows_int4_avx2<6, H>, rows_int4_avx2<7, H>, rows_int4_avx2<8, H>
RowsFn pick_int4_avx2(int64_t n, bool half) {
  static const RowsFn t[2][kGroupN] = {{GGMLX_INT4_ROW(false)}, {GGMLX_INT4_ROW(true)}};
  return t[half][n - 1];
}
#undef GGMLX_INT4_ROW
#undef GGMLX_ROW_H
#undef GGMLX_TABLE
#undef GGMLX_ROW

// 2: AVX-512, 1: AVX2 + FMA, 0: neither.
int simd_level() {
  static const int level = __builtin_cpu_supports("avx512f") ? 2
                           : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                              __builtin_cpu_supports("f16c")) ? 1 : 0;
  return level;
}
#endif

// The widest kernel this CPU runs, for the int8 format's sub-blocks of 16 or 32.
RowsFn pick(const Problem& p) {
#ifdef GGMLX_X86
  if (p.sub == 16 || p.sub == 32) {
    if (simd_level() == 2) return pick_avx512(p.sub, p.N, p.offset != nullptr);
    if (simd_level() == 1) return pick_avx2(p.sub, p.N, p.offset != nullptr, p.half);
  }
#endif
  return rows_generic;
}

// The widest int4 kernel this CPU runs.
RowsFn pick_int4(const Problem& p) {
#ifdef GGMLX_X86
  if (simd_level() == 2) return pick_int4_avx512(p.N);
  if (simd_level() == 1) return pick_int4_avx2(p.N, p.half);
#endif
  return rows_generic_int4;
}

// One call's groups of x rows (at most group_n each, see Run), each a pass over a chunk's
// weight rows (then in cache), with the kernel of its row count.
struct Groups {
  Problem group[kMaxN / 4];   // groups of 4 rows at the fewest (the AVX-512 int4 kernel's)
  RowsFn fn[kMaxN / 4];
  int n_groups = 0;

  void run(int64_t m0, int64_t m1) const {
    for (int g = 0; g < n_groups; ++g) fn[g](group[g], m0, m1);
  }
};

// fn(m0, m1) over the M weight rows in chunks, on the threads (parallel.h): ~4 chunks per
// thread for balance, each at least 64 rows (a multiple of the row tile).
template <typename Fn>
void for_chunks(ffi::ThreadPool& pool, int64_t M, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunk = std::max<int64_t>(64, (M + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + kRowTile - 1) / kRowTile * kRowTile;
  const int64_t n_chunks = (M + chunk - 1) / chunk;
  ggmlx_native::parallel_for(pool, threads, n_chunks, [&fn, chunk, M](int64_t c) {
    fn(c * chunk, std::min(M, (c + 1) * chunk));
  });
}

// Run the product p: the x rows in groups of group_n, each with the kernel pick_fn chooses, the
// weight rows in chunks over the threads (parallel.h).
ffi::Error Run(ffi::ThreadPool& pool, const Problem& p, RowsFn (*pick_fn)(const Problem&), int group_n = kGroupN) {
  const int64_t N = p.N, M = p.M, K = p.K;
  Groups groups;
  for (int64_t n0 = 0; n0 < N; n0 += group_n) {
    Problem g = p;
    g.x = p.x + n0 * K;
    g.y = p.y + n0 * M;
    g.N = std::min<int64_t>(group_n, N - n0);
    if (p.xsum) g.xsum = p.xsum + n0 * (K / p.sub);
    groups.group[groups.n_groups] = g;
    groups.fn[groups.n_groups] = pick_fn(g);
    ++groups.n_groups;
  }
  for_chunks(pool, M, [&groups](int64_t m0, int64_t m1) { groups.run(m0, m1); });
  return ffi::Error::Success();
}

#ifdef GGMLX_X86
// The int4 product p on AVX-512 for N >= kPanelMinN: x transposed once (rows_int4_panel_avx512).
ffi::Error RunPanelInt4(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t NV = (p.N + 15) / 16, NP = NV * 16;
  std::vector<float> xt(p.K * NP, 0.f);
  for (int64_t k0 = 0; k0 < p.K; k0 += 16)   // 16 k at a time: the lines written stay in L1 (5x faster)
    for (int64_t n = 0; n < p.N; ++n)
      for (int64_t k = k0; k < k0 + 16; ++k) xt[k * NP + n] = p.x[n * p.K + k];
  using Fn = void (*)(const Problem&, const float*, int64_t, int64_t);
  static constexpr Fn by_nv[kMaxN / 16] = {rows_int4_panel_avx512<1>, rows_int4_panel_avx512<2>,
                                           rows_int4_panel_avx512<3>, rows_int4_panel_avx512<4>};
  const Fn fn = by_nv[NV - 1];
  const float* x = xt.data();
  for_chunks(pool, p.M, [&p, fn, x](int64_t m0, int64_t m1) { fn(p, x, m0, m1); });
  return ffi::Error::Success();
}
#endif

// Scale and offset arrays are f32 or f16, both the same: true for f16.
bool half_scales(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& offset, const char** why) {
  const auto t = scale.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::F16) || offset.element_type() != t)
    *why = "scale and offset must both be f32 or both f16";
  return t == ffi::DataType::F16;
}

// Sums of x [N, K] over each run of `sub` elements, [N, K / sub], for the offset terms.
std::vector<float> sub_sums(const float* x, int64_t N, int64_t K, int64_t sub) {
  std::vector<float> sums(N * (K / sub));
  for (int64_t i = 0; i < N * (K / sub); ++i) {
    float acc = 0.f;
    for (int64_t t = 0; t < sub; ++t) acc += x[i * sub + t];
    sums[i] = acc;
  }
  return sums;
}

template <bool OFF>
ffi::Error Int8MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("int8_matvec: x, q, scale and y must be 2-d");
  const int64_t N = xd[0], K = xd[1], M = qd[0];
  if (qd[1] != K || sd[0] != M || sd[1] <= 0 || K % sd[1] || yd[0] != N || yd[1] != M)
    return ffi::Error::InvalidArgument("int8_matvec: shapes of x [N, K], q [M, K], scale [M, K/sub], y [N, M] disagree");
  if (N < 1 || N > kMaxN) return ffi::Error::InvalidArgument("int8_matvec: N must be 1..64");
  if (OFF && (offset.dimensions().size() != 2 || offset.dimensions()[0] != M || offset.dimensions()[1] != sd[1]))
    return ffi::Error::InvalidArgument("int8_matvec: offset must have the shape of scale");
  const char* why = nullptr;
  const bool half = half_scales(scale, offset, &why);
  if (why) return ffi::Error::InvalidArgument(std::string("int8_matvec: ") + why);
  const int64_t sub = K / sd[1];
  const std::vector<float> xsum = OFF ? sub_sums(x.typed_data(), N, K, sub) : std::vector<float>();
  Problem p{x.typed_data(), q.typed_data(), scale.untyped_data(), OFF ? offset.untyped_data() : nullptr,
            y->typed_data(), N, M, K, sub, half, OFF ? xsum.data() : nullptr};
  return Run(pool, p, pick);
}

ffi::Error Int8Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::AnyBuffer scale, ffi::ResultBuffer<ffi::F32> y) {
  return Int8MatvecImpl<false>(pool, x, q, scale, scale, y);
}

ffi::Error Int8MatvecOffset(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                            ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y) {
  return Int8MatvecImpl<true>(pool, x, q, scale, offset, y);
}

ffi::Error Int4Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                      ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), od = offset.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || od.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("int4_matvec: x, q, scale, offset and y must be 2-d");
  const int64_t N = xd[0], K = xd[1], M = qd[0];
  if (K % 32 || qd[1] * 2 != K || sd[0] != M || sd[1] * 32 != K || od[0] != M || od[1] != sd[1] ||
      yd[0] != N || yd[1] != M)
    return ffi::Error::InvalidArgument(
        "int4_matvec: shapes of x [N, K], q [M, K/2], scale and offset [M, K/32], y [N, M] disagree");
  if (N < 1 || N > kMaxN) return ffi::Error::InvalidArgument("int4_matvec: N must be 1..64");
  const char* why = nullptr;
  const bool half = half_scales(scale, offset, &why);
  if (why) return ffi::Error::InvalidArgument(std::string("int4_matvec: ") + why);
  const float* xp = x.typed_data();
  Problem p{xp, reinterpret_cast<const int8_t*>(q.typed_data()), scale.untyped_data(),
            offset.untyped_data(), y->typed_data(), N, M, K, 32, half};
#ifdef GGMLX_X86
  if (simd_level() == 2 && N >= kPanelMinN) return RunPanelInt4(pool, p);
#endif
  const std::vector<float> xsum = sub_sums(xp, N, K, 32);
  p.xsum = xsum.data();
#ifdef GGMLX_X86
  // AVX-512: x rows in groups of 4 (four weight rows per pass, 16 accumulators and no spills:
  // 55 GMAC/s per core against 41 for groups of 8, which hold only two weight rows)
  const int group_n = simd_level() == 2 ? 4 : kGroupN;
#else
  const int group_n = kGroupN;
#endif
  return Run(pool, p, pick_int4, group_n);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgmlxInt8Matvec, Int8Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgmlxInt8MatvecOffset, Int8MatvecOffset,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgmlxInt4Matvec, Int4Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
