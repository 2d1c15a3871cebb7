// The positions of the k largest of n floats, largest first and, among equal values, the lower
// position first (the order a stable sort by descending value gives): the samplers' top-k
// (llm/sampling/samplers.py), which took ~43 us a row of SmolLM2's 49152 logits in numpy, 8 rows
// a step for 8 decoding sequences.
//
// The selection of the numpy code with contiguous groups: a bound from the maxima of ~8k groups
// of the values (the k-th largest group maximum is at most the k-th largest value, so every
// value of the top k is >= it, and at least k values are), then the groups that reach the bound
// are scanned again for the values >= it, and only those are sorted.
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

// mx[g] = the largest of the size values x[g * size ..] (size a multiple of 16).
void group_maxima(const float* x, int64_t size, int64_t groups, float* mx) {
  for (int64_t g = 0; g < groups; ++g) mx[g] = *std::max_element(x + g * size, x + (g + 1) * size);
}

// Positions i in [i0, i1) of x[i] >= lo and > -inf appended to c.
void keep_range(const float* x, int64_t i0, int64_t i1, float lo, std::vector<Cand>& c) {
  for (int64_t i = i0; i < i1; ++i)
    if (x[i] >= lo && x[i] != kNegInf) c.push_back({x[i], static_cast<int32_t>(i)});
}

#ifdef GGMLX_X86
__attribute__((target("avx512f"))) void group_maxima_avx512(const float* x, int64_t size, int64_t groups, float* mx) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * size;
    __m512 m = _mm512_loadu_ps(xg);
    for (int64_t j = 16; j < size; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(xg + j));
    mx[g] = _mm512_reduce_max_ps(m);
  }
}

// keep_range, 16 at a time (i1 - i0 a multiple of 16).
__attribute__((target("avx512f"))) void keep_avx512(const float* x, int64_t i0, int64_t i1, float lo,
                                                    std::vector<Cand>& c) {
  const __m512 lv = _mm512_set1_ps(lo), ninf = _mm512_set1_ps(kNegInf);
  for (int64_t i = i0; i < i1; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    uint32_t m = _mm512_cmp_ps_mask(v, lv, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    for (; m; m &= m - 1) {
      const int b = __builtin_ctz(m);
      c.push_back({x[i + b], static_cast<int32_t>(i + b)});
    }
  }
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
  std::vector<Cand> c;
  c.reserve(4 * k);
  // contiguous groups of `size` values (a multiple of 16), about 8k of them; only the groups whose
  // maximum reaches the bound (about k) and the values after the last group are scanned again
  const int64_t size = n / (8 * k) / 16 * 16;
  if (size >= 16) {
    const int64_t groups = n / size;
    std::vector<float> mx(groups), sel;
#ifdef GGMLX_X86
    if (avx512) group_maxima_avx512(x, size, groups, mx.data());
    else
#endif
      group_maxima(x, size, groups, mx.data());
    sel = mx;
    std::nth_element(sel.begin(), sel.begin() + (groups - k), sel.end());
    const float lo = sel[groups - k];
    for (int64_t g = 0; g < groups; ++g) {
      if (mx[g] < lo) continue;
#ifdef GGMLX_X86
      if (avx512) keep_avx512(x, g * size, (g + 1) * size, lo, c);
      else
#endif
        keep_range(x, g * size, (g + 1) * size, lo, c);
    }
    keep_range(x, groups * size, n, lo, c);
  } else {
    keep_range(x, 0, n, kNegInf, c);
  }
  // fewer than k values above -inf: the -inf ones complete the list, lowest positions first
  for (int64_t j = 0; j < n && static_cast<int64_t>(c.size()) < k; ++j)
    if (x[j] == kNegInf) c.push_back({x[j], static_cast<int32_t>(j)});
  const int64_t m = std::min<int64_t>(k, static_cast<int64_t>(c.size()));
  std::partial_sort(c.begin(), c.begin() + m, c.end(), before);
  for (int64_t j = 0; j < m; ++j) out[j] = c[j].i;
  return m;
}

}  // extern "C"
