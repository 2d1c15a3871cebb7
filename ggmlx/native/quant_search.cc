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
// Layout: the scale searches take x, w and L elements first, as the numpy code holds them ([n, m]:
// element i of group g at i * m + g), and give scale (and neg_min) one value per group.
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

// best_index_int8 over 16 sorted integer levels in -128..127: the nearer of the two around v (the
// upper one on a tie), 0 at or below the first, 15 at or above the last and for NaN. The levels
// are integers, so the upper one is found from floor(v) in a table (no branchy binary search).
struct Levels16 {
  float value[16];
  int8_t upper[256];       // by floor(v) + 128: the index of the first level above floor(v), in 1..15

  explicit Levels16(const float* levels) {
    for (int i = 0; i < 16; ++i) value[i] = levels[i];
    for (int c = 0; c < 256; ++c) {
      int k = 0;
      while (k < 16 && levels[k] <= static_cast<float>(c - 128)) ++k;
      upper[c] = static_cast<int8_t>(k < 1 ? 1 : k > 15 ? 15 : k);
    }
  }

  int best_index(float v) const {
    if (v != v) return 15;
    float f = std::floor(v);
    int cell = f < -128.0f ? 0 : f > 127.0f ? 255 : static_cast<int>(f) + 128;
    int hi = upper[cell];
    return v - value[hi - 1] < value[hi] - v ? hi - 1 : hi;
  }
};

// quantize_row_iq4_nl_impl's scale search for one group: 2 * ntry + 2 trial scales.
float iq4_group_scale(int64_t n, const float* x, const float* w, const Levels16& lv, int ntry) {
  const float* levels = lv.value;
  float amax = 0.0f, max = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float ax = std::fabs(x[i]);
    if (ax > amax) { amax = ax; max = x[i]; }
  }
  auto trial = [&](float iscale, float* sumqx, float* sumq2) {
    float sx = 0.0f, s2 = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      float q = levels[lv.best_index(iscale * x[i])];
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

// One group of the elements-first layout ([n, m]: element i of group g at i * m + g, as the numpy
// code holds it) copied into contiguous buffers, so no transposes are needed around the calls.
struct Group {
  static constexpr int64_t kMax = 256;
  float x[kMax], w[kMax], L[kMax];

  static bool fits(int64_t n) { return n <= kMax; }

  void load(int64_t n, int64_t m, int64_t g, const float* xs, const float* ws) {
    for (int64_t i = 0; i < n; ++i) x[i] = xs[i * m + g];
    if (ws)
      for (int64_t i = 0; i < n; ++i) w[i] = ws[i * m + g];
  }

  void store(int64_t n, int64_t m, int64_t g, float* Ls) const {
    for (int64_t i = 0; i < n; ++i) Ls[i * m + g] = L[i];
  }
};

}  // namespace

extern "C" {

// iq2_find_best_neighbour / iq1_find_best_neighbour2 / iq3_find_best_neighbour for n off-grid
// groups of D values: among the count[code] neighbours of each group's code, the first with the
// least sum over i of (w_i * diff_i) * diff_i, diff_i = scale * (base + v_i) - x_i (base 0 where
// null), summed from i = 0. values holds the neighbours' values as planes [K, D, n_codes]. The
// numpy versions run this over all groups a neighbour rank at a time, gathering each rank's values.
void ggmlx_best_neighbours(int64_t n, int32_t D, int32_t K, int64_t n_codes, const int64_t* codes, const float* xv,
                           const float* wv, const float* scale, const float* base, const float* values,
                           const int64_t* count, int64_t* pick) {
  for (int64_t g = 0; g < n; ++g) {
    const int64_t code = codes[g];
    const float* x = xv + g * D;
    const float* w = wv + g * D;
    const float s = scale[g], b = base ? base[g] : 0.0f;
    float best = 3.40282347e+38f;
    int64_t best_j = 0;
    for (int64_t j = 0; j < count[code]; ++j) {
      const float* v = values + j * D * n_codes + code;
      float d2 = 0.0f;
      for (int i = 0; i < D; ++i) {
        float q = base ? b + v[i * n_codes] : v[i * n_codes];
        float diff = s * q - x[i];
        float t = (w[i] * diff) * diff;
        d2 = i == 0 ? t : d2 + t;
      }
      if (d2 < best) { best = d2; best_j = j; }
    }
    pick[g] = best_j;
  }
}


// IQ1's scale choice over each group's candidates in C's order: the running best of
// `sumq2 > 0 && sumqx^2 > best * sumq2` from -FLT_MAX, best = scale * sumqx with scale =
// sumqx / sumq2. pick gets the last candidate taken (-1 for none), scale its scale.
void ggmlx_running_best(int64_t m, int64_t n, const float* sumqx, const float* sumq2, int64_t* pick,
                        float* scale) {
  for (int64_t g = 0; g < m; ++g) {
    const float* a = sumqx + g * n;
    const float* b = sumq2 + g * n;
    float best = -3.40282347e+38f, s = 0.0f;
    int64_t p = -1;
    for (int64_t j = 0; j < n; ++j) {
      if (b[j] > 0.0f && a[j] * a[j] > best * b[j]) {
        s = a[j] / b[j];
        best = s * a[j];
        p = j;
      }
    }
    pick[g] = p;
    scale[g] = s;
  }
}

void ggmlx_iq4_scales(int64_t m, int64_t n, const float* x, const float* w, const float* levels, int32_t ntry,
                      float* d) {
  const Levels16 lv(levels);
  Group gr;
  if (!gr.fits(n)) return;
  for (int64_t g = 0; g < m; ++g) {
    gr.load(n, m, g, x, w);
    d[g] = iq4_group_scale(n, gr.x, gr.w, lv, ntry);
  }
}

void ggmlx_make_qx_quants(int64_t m, int64_t n, const float* x, const float* w, int32_t nmax, float* L,
                          float* scale) {
  Group gr;
  if (!gr.fits(n)) return;
  for (int64_t g = 0; g < m; ++g) {
    gr.load(n, m, g, x, w);
    qx_group(n, gr.x, w ? gr.w : nullptr, nmax, gr.L, scale + g);
    gr.store(n, m, g, L);
  }
}

void ggmlx_make_qkx_quants(int64_t m, int64_t n, const float* x, const float* w, int32_t nmax, float rmin,
                           float rdelta, int32_t nstep, int32_t use_mad, int32_t qkx3, float* L, float* scale,
                           float* neg_min) {
  Group gr;
  float laux[Group::kMax];
  if (!gr.fits(n)) return;
  for (int64_t g = 0; g < m; ++g) {
    gr.load(n, m, g, x, w);
    qkx_group(n, gr.x, gr.w, nmax, rmin, rdelta, nstep, use_mad != 0, qkx3 != 0, gr.L, laux, scale + g,
              neg_min + g);
    gr.store(n, m, g, L);
  }
}

}  // extern "C"
