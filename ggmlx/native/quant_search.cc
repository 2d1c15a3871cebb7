// The scale searches of ggml's quantizers (ggml-quants.c: make_qx_quants, make_qkx2_quants,
// make_qkx3_quants, quantize_row_iq4_nl_impl's), for `llm quantize`. The numpy versions in ggmlx/quants/kquants.py and nlquants.py run
// the same searches over many groups at once, one array pass per operation and trial scale: 19 to 37
// trials of 6-10 passes each over every weight, several times the time of ggml's loops, which
// keep a group in registers. These are those loops, group by group, with the float32 operations
// in the numpy code's (and ggml's) order, so the bytes are the same.
//
// Plain C++ called through ctypes (ggmlx/native/search.py), no XLA FFI. Built without -march
// and without -ffast-math: no FMA contraction, no reassociation of the sequential sums.
//
// Layout: x and w hold m groups of n floats, each group contiguous ([m, n] row-major); L gets
// the levels as float32, scale (and neg_min) one value per group.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr float kGroupMaxEps = 1e-15f;
constexpr float kRoundMagic = 12582912.0f;   // 1.5 * 2**23

// ggml's nearest_int: round half to even through the float32 mantissa.
inline int nearest_int(float v) {
  float f = v + kRoundMagic;
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return (i & 0x007fffff) - 0x00400000;
}

// nearest_int as a float for |v| <= 2**22, as the numpy code writes it (without -ffast-math the
// compiler keeps both roundings).
inline float round_in_range(float v) { return (v + kRoundMagic) - kRoundMagic; }

// A clip that keeps NaN, as numpy's minimum / maximum do.
inline float clip(float v, float lo, float hi) {
  v = v < lo ? lo : v;
  return v > hi ? hi : v;
}

// make_qx_quants (rmse_type 1): symmetric levels -nmax..nmax-1, 19 trial scales around
// -nmax / max; weights w, or x * x where w is null.
void qx_group(int64_t n, const float* x, const float* w, int nmax, float* L, float* scale_out) {
  float amax = 0.0f, max = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float ax = std::fabs(x[i]);
    if (ax > amax) { amax = ax; max = x[i]; }
  }
  if (amax < kGroupMaxEps) {
    for (int64_t i = 0; i < n; ++i) L[i] = 0.0f;
    *scale_out = 0.0f;
    return;
  }
  const float lo = static_cast<float>(-nmax), hi = static_cast<float>(nmax - 1);
  auto trial = [&](float iscale, float* sumlx, float* suml2) {
    float sx = 0.0f, s2 = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float wi = w ? w[i] : x[i] * x[i];
      float q = clip(round_in_range(iscale * x[i]), lo, hi);
      sx += (wi * x[i]) * q;
      s2 += (wi * q) * q;
    }
    *sumlx = sx;
    *suml2 = s2;
  };
  float best_iscale = static_cast<float>(-nmax) / max;
  float sumlx, suml2;
  trial(best_iscale, &sumlx, &suml2);
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    float iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(step)) / max;
    trial(iscale, &sumlx, &suml2);
    if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
      best_iscale = iscale;
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  for (int64_t i = 0; i < n; ++i) L[i] = clip(round_in_range(best_iscale * x[i]), lo, hi) + static_cast<float>(nmax);
  *scale_out = scale;
}

// clip(nearest_int(iscale * (x - mn)), 0, nmax): make_qkx2_quants' levels.
inline float qkx2_level(float x, float mn, float iscale, int nmax) {
  int l = nearest_int(iscale * (x - mn));
  return clip(static_cast<float>(l), 0.0f, static_cast<float>(nmax));
}

// v > 0 ? nearest_int(MIN(v, nmax)) : 0: make_qkx3_quants' trial levels.
inline float qkx3_level(float x, float mn, float iscale, int nmax) {
  float v = iscale * (x - mn);
  if (!(v > 0.0f)) return 0.0f;
  float c = static_cast<float>(nmax);
  return round_in_range(v < c ? v : c);
}

inline float weighted_error(int64_t n, const float* x, const float* w, const float* l, float scale, float mn,
                            bool use_mad) {
  float err = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float diff = (scale * l[i] + mn) - x[i];
    err += w[i] * (use_mad ? std::fabs(diff) : diff * diff);
  }
  return err;
}

// make_qkx2_quants (qkx3 = false) and make_qkx3_quants (qkx3 = true, squared error): an affine
// (scale, min) fit with levels 0..nmax over nstep + 1 trial scales; the min found by one trial
// moves the next trial's levels and scale, as in ggml. laux is scratch of n floats.
void qkx_group(int64_t n, const float* x, const float* w, int nmax, float rmin, float rdelta, int nstep,
               bool use_mad, bool qkx3, float* L, float* laux, float* scale_out, float* neg_min_out) {
  float lo_x = x[0], mx = x[0];
  for (int64_t i = 1; i < n; ++i) {
    if (x[i] < lo_x) lo_x = x[i];
    if (x[i] > mx) mx = x[i];
  }
  float mn = lo_x > 0.0f ? 0.0f : lo_x;
  if (qkx3 ? mx <= mn : mx == mn) {
    for (int64_t i = 0; i < n; ++i) L[i] = 0.0f;
    *scale_out = 0.0f;
    *neg_min_out = -mn;
    return;
  }
  float sum_w = 0.0f, sum_x = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  float iscale = static_cast<float>(nmax) / (mx - mn);
  float scale = 1.0f / iscale;
  for (int64_t i = 0; i < n; ++i) L[i] = qkx2_level(x[i], mn, iscale, nmax);
  float best = weighted_error(n, x, w, L, scale, mn, use_mad);
  for (int step = 0; step <= nstep; ++step) {
    iscale = ((rmin + rdelta * static_cast<float>(step)) + static_cast<float>(nmax)) / (mx - mn);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float l = qkx3 ? qkx3_level(x[i], mn, iscale, nmax) : qkx2_level(x[i], mn, iscale, nmax);
      laux[i] = l;
      float wl = w[i] * l;
      sum_l += wl;
      sum_l2 += wl * l;
      sum_xl += wl * x[i];
    }
    float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0.0f)) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0.0f) {
      this_min = 0.0f;
      this_scale = sum_xl / sum_l2;
    }
    float err = weighted_error(n, x, w, laux, this_scale, this_min, use_mad);
    if (err < best) {
      std::memcpy(L, laux, sizeof(float) * n);
      best = err;
      scale = this_scale;
      mn = this_min;
    }
  }
  *scale_out = scale;
  *neg_min_out = -mn;
}

// best_index_int8 over 16 sorted levels: the nearer of the two around v (the upper one on a tie),
// 0 at or below the first, 15 at or above the last and for NaN.
inline int best_index_16(const float* levels, float v) {
  if (v <= levels[0]) return 0;
  if (v >= levels[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (v < levels[mid]) hi = mid; else lo = mid;
  }
  return v - levels[hi - 1] < levels[hi] - v ? hi - 1 : hi;
}

// quantize_row_iq4_nl_impl's scale search for one group: 2 * ntry + 2 trial scales.
float iq4_group_scale(int64_t n, const float* x, const float* w, const float* levels, int ntry) {
  float amax = 0.0f, max = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float ax = std::fabs(x[i]);
    if (ax > amax) { amax = ax; max = x[i]; }
  }
  auto trial = [&](float iscale, float* sumqx, float* sumq2) {
    float sx = 0.0f, s2 = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float q = levels[best_index_16(levels, iscale * x[i])];
      float wq = w[i] * q;
      sx += wq * x[i];
      s2 += wq * q;
    }
    *sumqx = sx;
    *sumq2 = s2;
  };
  float sumqx, sumq2;
  trial(1.0f / (-max / levels[0]), &sumqx, &sumq2);
  float d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
  float best = d * sumqx;
  for (int itry = -ntry; itry <= ntry; ++itry) {
    trial(static_cast<float>(itry + static_cast<int>(levels[0])) / max, &sumqx, &sumq2);
    if (sumq2 > 0.0f && sumqx * sumqx > best * sumq2) {
      d = sumqx / sumq2;
      best = d * sumqx;
    }
  }
  return amax < kGroupMaxEps ? 0.0f : d;
}

}  // namespace

extern "C" {

void ggmlx_iq4_scales(int64_t m, int64_t n, const float* x, const float* w, const float* levels, int32_t ntry,
                      float* d) {
  for (int64_t g = 0; g < m; ++g) d[g] = iq4_group_scale(n, x + g * n, w + g * n, levels, ntry);
}


void ggmlx_make_qx_quants(int64_t m, int64_t n, const float* x, const float* w, int32_t nmax, float* L,
                          float* scale) {
  for (int64_t g = 0; g < m; ++g)
    qx_group(n, x + g * n, w ? w + g * n : nullptr, nmax, L + g * n, scale + g);
}

void ggmlx_make_qkx_quants(int64_t m, int64_t n, const float* x, const float* w, int32_t nmax, float rmin,
                           float rdelta, int32_t nstep, int32_t use_mad, int32_t qkx3, float* L, float* scale,
                           float* neg_min) {
  float laux[256];
  if (n > 256) return;
  for (int64_t g = 0; g < m; ++g)
    qkx_group(n, x + g * n, w + g * n, nmax, rmin, rdelta, nstep, use_mad != 0, qkx3 != 0, L + g * n, laux,
              scale + g, neg_min + g);
}

}  // extern "C"
