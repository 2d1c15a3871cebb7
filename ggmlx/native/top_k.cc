// The positions of the k largest of n floats, largest first and, among equal values, the lower
// position first (the order a stable sort by descending value gives): the samplers' top-k
// (llm/sampling/samplers.py), which took ~43 us a row of SmolLM2's 49152 logits in numpy, 8 rows
// a step for 8 decoding sequences.
//
// The same selection as the numpy code: a bound from the maxima of ~8k strided groups of the
// values (the k-th largest group maximum is at most the k-th largest value, so every value of
// the top k is >= it, and at least k values are), then one pass keeps the values >= the bound
// and only those are sorted.
//
// Plain C++ called through ctypes (ggmlx.native.top_k), no XLA FFI. No NaN may be passed
// (the samplers reject a row with NaN first).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GGMLX_X86 1
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Cand {
  float v;
  int32_t i;
};

// The ranking: larger value first, then the lower position.
inline bool before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// mx[g] = the largest of x[r * groups + g] over rows r < size (each group strided, so that the
// maxima are one elementwise pass; the compiler vectorizes the inner loop).
void group_maxima(const float* x, int64_t size, int64_t groups, float* mx) {
  std::copy(x, x + groups, mx);
  for (int64_t r = 1; r < size; ++r) {
    const float* row = x + r * groups;
    for (int64_t g = 0; g < groups; ++g) mx[g] = std::max(mx[g], row[g]);
  }
}

#ifdef GGMLX_X86
__attribute__((target("avx512f"))) void group_maxima_avx512(const float* x, int64_t size, int64_t groups, float* mx) {
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 live = groups - g >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (groups - g)) - 1);
    __m512 m = _mm512_maskz_loadu_ps(live, x + g);
    for (int64_t r = 1; r < size; ++r) m = _mm512_max_ps(m, _mm512_maskz_loadu_ps(live, x + r * groups + g));
    _mm512_mask_storeu_ps(mx + g, live, m);
  }
}

// Positions i < n (from 0, 16 at a time) of x[i] >= lo (and > -inf) appended to c; returns
// where the scalar loop goes on.
__attribute__((target("avx512f"))) int64_t keep_avx512(const float* x, int64_t n, float lo, std::vector<Cand>& c) {
  const __m512 lv = _mm512_set1_ps(lo), ninf = _mm512_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    uint32_t m = _mm512_cmp_ps_mask(v, lv, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    for (; m; m &= m - 1) {
      const int b = __builtin_ctz(m);
      c.push_back({x[i + b], static_cast<int32_t>(i + b)});
    }
  }
  return i;
}
#endif

}  // namespace

extern "C" {

// out[0 .. min(k, n)): the positions, in rank order; returns how many (0 for k < 1 or n < 1).
int64_t ggmlx_top_k(const float* x, int64_t n, int64_t k, int32_t* out) {
  k = std::min(k, n);
  if (k < 1) return 0;
#ifdef GGMLX_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f");
#endif
  float lo = kNegInf;
  const int64_t size = n / (8 * k);
  if (size >= 16) {
    const int64_t groups = n / size;
    std::vector<float> mx(groups);
#ifdef GGMLX_X86
    if (avx512) group_maxima_avx512(x, size, groups, mx.data());
    else
#endif
      group_maxima(x, size, groups, mx.data());
    std::nth_element(mx.begin(), mx.begin() + (groups - k), mx.end());
    lo = mx[groups - k];
  }
  std::vector<Cand> c;
  c.reserve(4 * k);
  int64_t i = 0;
#ifdef GGMLX_X86
  if (avx512) i = keep_avx512(x, n, lo, c);
#endif
  for (; i < n; ++i)
    if (x[i] >= lo && x[i] != kNegInf) c.push_back({x[i], static_cast<int32_t>(i)});
  // fewer than k values above -inf: the -inf ones complete the list, lowest positions first
  for (int64_t j = 0; j < n && static_cast<int64_t>(c.size()) < k; ++j)
    if (x[j] == kNegInf) c.push_back({x[j], static_cast<int32_t>(j)});
  const int64_t m = std::min<int64_t>(k, static_cast<int64_t>(c.size()));
  std::partial_sort(c.begin(), c.begin() + m, c.end(), before);
  for (int64_t j = 0; j < m; ++j) out[j] = c[j].i;
  return m;
}

}  // extern "C"
