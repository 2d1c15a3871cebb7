// y[n, m] = dot(x[n, :], w[m, :]) for a weight held as its GGUF blocks (uint8 [M, row_bytes]),
// with ggml-cpu's numerics (numerics="ggml"): each activation row is quantized to the weight
// type's vec_dot_type as ggml-cpu does (Q8_0 for Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4; Q8_1 for
// Q4_1, Q5_1; Q8_K for Q2_K ... Q6_K and IQ4_XS) and the products are integer dot products,
// scaled per block.
//
// The weights' values are taken as unsigned 8-bit integers (a type's signed values shifted up:
// Q4_0's q - 8 is used as q, Q8_0's as q + 128, Q3_K's as q + 4) with, for the 256-element
// types, a 16-bit scale and offset multiplier per 16 elements; the shift comes back as an
// integer term from the activations' block sums, so every integer dot is exactly ggml's.
// IQ4_XS keeps its values signed (shifted up they would reach 241, and a vpmaddubsw pair
// 2 * 241 * 127 would saturate): its products take ggml's sign trick (|w| times x with w's sign).
// The float combination of the per-block integer sums follows ggml's formulas, not its exact
// order of additions.
//
// Paths, the widest the CPU has and GGMLX_BLOCK_ISA allows (the Python side passes `isa`):
// - AVX-512 VNNI, 1-16 activation rows (decode, batched decode, speculative verification):
//   straight from the blocks, each weight row unpacked in registers once per 8 rows, in kernels
//   specialized per type; per 64 elements one vpdpbusd (32-element types) or vpmaddubsw +
//   vpdpwssd by the scales (k-quants; no pair reaches the s16 limit: 2 * 63 * 127), one FMA per
//   block;
// - AMX-INT8, more rows (prefill), where Linux grants the tile state: 32 x 32 tiles, one TDPBSUD
//   per scale group, the integer sums scaled by AVX-512;
// - AVX-512 VNNI without AMX, more rows: a weight in the lanes format (below) read in place
//   by the few-row kernels, a few activation rows per pass over L2-sized runs of its groups (all
//   row counts for Q4_0, Q4_1, Q8_0, Q4_K; the other types take the tiles from 17 rows); GGUF rows,
//   16 unpacked and interleaved across the lanes (run_rows_lanes), one vpdpbusd by broadcast
//   activations per 4 values of all 16;
// - otherwise (and IQ4_XS's signed values) each weight row is unpacked into a small buffer and
//   dotted with every activation row, kRows weight rows at a time: AVX-512 VNNI, AVX2
//   (vpmaddubsw + vpmaddwd, ggml's AVX2 forms) or plain loops (any CPU; the same integers).
// The weight rows are split into chunks over XLA's intra-op pool (parallel.h); activations are
// quantized once per call before that (over the pool too from 64 rows).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GGMLX_X86 1
#endif

#include <sys/syscall.h>
#include <unistd.h>

#include "half.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using ggmlx_native::f16_to_f32;

// ggml_type ids (ggml.h)
enum Type : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39,
};

constexpr int kQK = 256;      // k-quant super-block
constexpr int kRows = 4;      // weight rows per tile
constexpr int kFusedN = 16;   // most activation rows the few-row kernels take
// Products of at most this many weight bytes times activation rows run on the calling thread:
// waking a pool thread cost ~2 us a call. Zen 4, lanes format, N = 1 from DRAM: 576x576 Q4_1
// (0.2 MB) 18.7 -> 16.8 us, 960x576 27.2 -> 25.7; 576x1536 (0.55 MB) 32.5 -> 41.9 on one thread.
constexpr int64_t kOneThreadBytes = 384 << 10;
// The few-row kernels leave the weight rows to the hardware prefetcher: rows prefetched 8 ahead
// (_MM_HINT_T0 or T1) streamed Q4_K / Q6_K rows from DRAM at 25-29 GB/s on a 2-core Zen 4 against
// 28-35 GB/s without (and measured the same as none on a Xeon whose L3 held the weights).

// f32 -> IEEE binary16 bits, round to nearest even (ggml's GGML_FP32_TO_FP16), and back.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);   // rounds past 65504
  if (ax < 0x38800000u) {                                                  // subnormal or zero
    float a;
    std::memcpy(&a, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;
  return static_cast<uint16_t>(sign | (r >> 13));
}
inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

// ---- what each weight type is --------------------------------------------------------------

struct TypeInfo {
  int64_t block;       // elements per block
  int64_t bytes;       // bytes per block
  bool kquant;         // 256-element super-blocks, Q8_K activations
  bool q8_1;           // Q8_1 activations (a float offset: min * s_x)
  int shift;           // 32-element types: the unsigned values are the signed ones + shift
  int group;           // elements per weight scale (16 or 32): AMX's scale group
  bool sgn;            // values held signed (IQ4_XS), multiplied by the sign trick
};

bool type_info(int64_t t, TypeInfo* info) {
  switch (t) {
    case Q4_0: *info = {32, 18, false, false, 8, 32, false}; return true;
    case Q4_1: *info = {32, 20, false, true, 0, 32, false}; return true;
    case Q5_0: *info = {32, 22, false, false, 16, 32, false}; return true;
    case Q5_1: *info = {32, 24, false, true, 0, 32, false}; return true;
    case Q8_0: *info = {32, 34, false, false, 128, 32, false}; return true;
    case IQ4_NL: *info = {32, 18, false, false, 128, 32, false}; return true;
    case MXFP4: *info = {32, 17, false, false, 12, 32, false}; return true;
    case Q2_K: *info = {256, 84, true, false, 0, 16, false}; return true;
    case Q3_K: *info = {256, 110, true, false, 0, 16, false}; return true;
    case Q4_K: *info = {256, 144, true, false, 0, 32, false}; return true;
    case Q5_K: *info = {256, 176, true, false, 0, 32, false}; return true;
    case Q6_K: *info = {256, 210, true, false, 0, 16, false}; return true;
    case IQ4_XS: *info = {256, 136, true, false, 0, 32, true}; return true;
    default: return false;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// GGML_E8M0_TO_FP32_HALF: MXFP4's scale 2^(e - 128) (its values are kept doubled); the two
// smallest exponents are f32 subnormals.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A 32-element block's scale: MXFP4's E8M0 exponent, the others' f16 d.
inline float unit_d(int64_t t, const uint8_t* blk) { return t == MXFP4 ? e8m0_half(blk[0]) : half_at(blk); }

// ---- quantized activations -----------------------------------------------------------------

// One call's activations, quantized: qs int8 [N, Kp] (Kp: K rounded up to 64, zero padded), and
// per block d (f32; the f16-rounded value ggml multiplies by for Q8_0 / Q8_1), and
//   Q8_K: bs, the int16 sums of each 16 qs, [N, K / 16];
//   Q8_0 / Q8_1: off, shift * (sum of the block's qs) as s32 lanes for the 32-element dot
//   (lanes 0 and 8 of each 64-element chunk's 16, [N, Kp / 64 * 16]), and for Q8_1 s, the
//   f16-rounded d * sum(qs), [N, K / 32].
struct XQ {
  int64_t N, K, Kp, nb;
  int64_t pad_rows = 1;   // qs and the per-block arrays hold N rounded up to this, zero past N
  std::vector<int8_t> qs, qt;    // qt: qs in AMX order, [N / 32][K / G][32][G] (run_rows_amx)
  std::vector<float> d, s, dv, sv;   // dv: d per lane of each 64-element chunk (32-element types); sv: s / 8
  std::vector<int16_t> bs;
  std::vector<int32_t> off;
};

// ggml's quantize_row_q8_K_ref: d = max / -127 by the element of largest magnitude.
void quantize_q8_K(const float* x, int64_t K, int8_t* qs, float* d, int16_t* bs) {
  for (int64_t b = 0; b < K / kQK; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.f, max = 0.f;
    for (int j = 0; j < kQK; ++j) {
      const float ax = std::fabs(xb[j]);
      if (ax > amax) { amax = ax; max = xb[j]; }
    }
    int8_t* q = qs + b * kQK;
    if (amax == 0.f) {
      d[b] = 0.f;
      std::memset(q, 0, kQK);
      for (int g = 0; g < kQK / 16; ++g) bs[b * 16 + g] = 0;
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < kQK; ++j) q[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * xb[j]))));
    for (int g = 0; g < kQK / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += q[g * 16 + j];
      bs[b * 16 + g] = static_cast<int16_t>(sum);
    }
    d[b] = 1.f / iscale;
  }
}

// ggml-cpu's x86 quantize_row_q8_0 / q8_1: d = amax / 127, values rounded to nearest even by
// 127 / amax; d kept as f16 (and for Q8_1, s = d * sum(qs) as f16).
void quantize_q8_0(const float* x, int64_t K, int8_t* qs, float* d, float* s, int32_t* sums) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.f;
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));
      qs[b * 32 + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = round_f16(db);
    if (s) s[b] = round_f16(db * static_cast<float>(sum));
    sums[b] = sum;
  }
}

using QuantK = void (*)(const float*, int64_t, int8_t*, float*, int16_t*);
using Quant0 = void (*)(const float*, int64_t, int8_t*, float*, float*, int32_t*);

// Into xq, whose vectors keep their capacity from call to call (one per calling thread), by
// qk / q0 (the plain quantizers or the AVX-512 ones: the same values).
// The activation buffers sized (and zeroed) for N rows of K.
void size_x(int64_t N, int64_t K, const TypeInfo& ti, XQ& xq) {
  xq.N = N;
  xq.K = K;
  xq.Kp = (K + 63) / 64 * 64;
  xq.nb = K / ti.block;
  const int64_t Np = (N + xq.pad_rows - 1) / xq.pad_rows * xq.pad_rows;
  xq.qs.assign(Np * xq.Kp, 0);
  xq.d.assign(Np * xq.nb, 0.f);
  if (ti.kquant) {
    xq.bs.assign(Np * (K / 16), 0);
    return;
  }
  const int64_t nc = xq.Kp / 64;
  if (ti.q8_1) {
    xq.s.assign(Np * xq.nb, 0.f);
    xq.sv.assign(Np * nc * 16, 0.f);
  }
  xq.off.assign(Np * nc * 16, 0);
  xq.dv.assign(Np * nc * 16, 0.f);
}

// Activation rows [n0, n1) quantized into buffers size_x made (rows are independent: callers
// split them over threads).
void quantize_rows(const float* x, int64_t n0, int64_t n1, const TypeInfo& ti, XQ& xq, QuantK qk, Quant0 q0) {
  const int64_t K = xq.K;
  if (ti.kquant) {
    for (int64_t n = n0; n < n1; ++n)
      qk(x + n * K, K, xq.qs.data() + n * xq.Kp, xq.d.data() + n * xq.nb, xq.bs.data() + n * (K / 16));
    return;
  }
  const int64_t nc = xq.Kp / 64;
  thread_local std::vector<int32_t> sums;
  sums.assign(xq.nb, 0);
  for (int64_t n = n0; n < n1; ++n) {
    q0(x + n * K, K, xq.qs.data() + n * xq.Kp, xq.d.data() + n * xq.nb, ti.q8_1 ? xq.s.data() + n * xq.nb : nullptr,
       sums.data());
    for (int64_t b = 0; b < xq.nb; ++b) {
      xq.off[(n * nc + b / 2) * 16 + (b % 2) * 8] = -ti.shift * sums[b];
      for (int l = 0; l < 8; ++l) xq.dv[(n * nc + b / 2) * 16 + (b % 2) * 8 + l] = xq.d[n * xq.nb + b];
      if (ti.q8_1)   // s over the block's 8 lanes (an exact division: their sum is s)
        for (int l = 0; l < 8; ++l) xq.sv[(n * nc + b / 2) * 16 + (b % 2) * 8 + l] = 0.125f * xq.s[n * xq.nb + b];
    }
  }
}

// ---- weight rows unpacked ------------------------------------------------------------------

// One weight row: q the unsigned values [Kp]; for 32-element types dw the block's d per lane of
// each 64-element chunk [Kp / 64 * 16] and mf its min (Q4_1, Q5_1) [nb]; for k-quants sc16 the
// scale of each pair of elements [Kp / 2], mo the offset multiplier per 16 [K / 16], and per
// super-block dw (d) and dm (the offsets' factor: -dmin, or d where the offset is a shift).
struct Row {
  uint8_t* q;
  float* dw;
  float* dm;
  float* mf;
  int16_t* sc16;
  int16_t* mo;
};

// get_scale_min_k4 of ggml: the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q3_K's 16 six-bit scales, packed in 12 bytes: the low nibbles of bytes 0-7 then their high
// nibbles, each with two bits of bytes 8-11 on top.
inline int q3_k_scale(const uint8_t* s, int j) {
  const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
  return lo | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}

// IQ4_XS's scale of 32-element sub-block ib: 4 bits of scales_l, 2 of scales_h, less 32.
inline int iq4_xs_scale(const uint8_t* blk, int ib) {
  const int h = blk[2] | (blk[3] << 8);
  return (((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((h >> (2 * ib)) & 3) << 4)) - 32;
}

void unpack_row(int64_t t, const TypeInfo& ti, const uint8_t* w, int64_t K, const Row& r) {
  const int64_t nb = K / ti.block;
  if (!ti.kquant) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * ti.bytes;
      uint8_t* q = r.q + b * 32;
      const float d = unit_d(t, blk);
      float* dl = r.dw + (b / 2) * 16 + (b % 2) * 8;
      for (int l = 0; l < 8; ++l) dl[l] = d;
      r.mf[b] = 0.f;
      switch (t) {
        case Q4_0:
          for (int j = 0; j < 16; ++j) { q[j] = blk[2 + j] & 15; q[j + 16] = blk[2 + j] >> 4; }
          break;
        case IQ4_NL:
          for (int j = 0; j < 16; ++j) {
            q[j] = static_cast<uint8_t>(kIQ4NL[blk[2 + j] & 15] + 128);
            q[j + 16] = static_cast<uint8_t>(kIQ4NL[blk[2 + j] >> 4] + 128);
          }
          break;
        case MXFP4:
          for (int j = 0; j < 16; ++j) {
            q[j] = static_cast<uint8_t>(kMXFP4[blk[1 + j] & 15] + 12);
            q[j + 16] = static_cast<uint8_t>(kMXFP4[blk[1 + j] >> 4] + 12);
          }
          break;
        case Q4_1:
          r.mf[b] = half_at(blk + 2);
          for (int j = 0; j < 16; ++j) { q[j] = blk[4 + j] & 15; q[j + 16] = blk[4 + j] >> 4; }
          break;
        case Q5_0:
        case Q5_1: {
          const int o = t == Q5_1 ? 4 : 2;
          if (t == Q5_1) r.mf[b] = half_at(blk + 2);
          uint32_t qh;
          std::memcpy(&qh, blk + o, 4);
          for (int j = 0; j < 16; ++j) {
            q[j] = static_cast<uint8_t>((blk[o + 4 + j] & 15) | (((qh >> j) << 4) & 0x10));
            q[j + 16] = static_cast<uint8_t>((blk[o + 4 + j] >> 4) | ((qh >> (j + 12)) & 0x10));
          }
          break;
        }
        case Q8_0:
          for (int j = 0; j < 32; ++j) q[j] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + j]) + 128);
          break;
      }
    }
    return;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * ti.bytes;
    uint8_t* q = r.q + b * kQK;
    int16_t* sc = r.sc16 + b * kQK / 2;
    int16_t* mo = r.mo + b * 16;
    int scg[16], mog[16];
    if (t == Q4_K || t == Q5_K) {
      r.dw[b] = half_at(blk);
      r.dm[b] = -half_at(blk + 2);
      const uint8_t* scales = blk + 4;
      const uint8_t* qh = blk + 16;
      const uint8_t* ql = blk + (t == Q5_K ? 48 : 16);
      for (int j = 0; j < 4; ++j) {
        int s0, m0, s1, m1;
        scale_min_k4(2 * j, scales, &s0, &m0);
        scale_min_k4(2 * j + 1, scales, &s1, &m1);
        scg[4 * j] = scg[4 * j + 1] = s0;
        scg[4 * j + 2] = scg[4 * j + 3] = s1;
        mog[4 * j] = mog[4 * j + 1] = m0;
        mog[4 * j + 2] = mog[4 * j + 3] = m1;
        for (int l = 0; l < 32; ++l) {
          int lo = ql[32 * j + l] & 15, hi = ql[32 * j + l] >> 4;
          if (t == Q5_K) {
            lo |= ((qh[l] >> (2 * j)) & 1) << 4;
            hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          q[64 * j + l] = static_cast<uint8_t>(lo);
          q[64 * j + 32 + l] = static_cast<uint8_t>(hi);
        }
      }
    } else if (t == Q2_K || t == Q3_K) {
      // Q2_K: scales[16] (a 4-bit scale, a 4-bit min above it), qs[64], d, dmin. Q3_K: hmask[32],
      // qs[64], scales[12], d. Element 128 h + 32 j + l: bits 2j of qs[32 h + l] (Q3_K: and bit
      // 4h + j of hmask[l] above them, the value less 4).
      const bool k3 = t == Q3_K;
      const uint8_t* qs = blk + (k3 ? 32 : 16);
      if (k3) {
        r.dw[b] = r.dm[b] = half_at(blk + 108);
        for (int g = 0; g < 16; ++g) { scg[g] = q3_k_scale(blk + 96, g) - 32; mog[g] = -4 * scg[g]; }
      } else {
        r.dw[b] = half_at(blk + 80);
        r.dm[b] = -half_at(blk + 82);
        for (int g = 0; g < 16; ++g) { scg[g] = blk[g] & 15; mog[g] = blk[g] >> 4; }
      }
      for (int e = 0; e < kQK; ++e) {
        const int h = e / 128, j = (e % 128) / 32, l = e % 32;
        int v = (qs[32 * h + l] >> (2 * j)) & 3;
        if (k3) v |= ((blk[l] >> (4 * h + j)) & 1) << 2;
        q[e] = static_cast<uint8_t>(v);
      }
    } else if (t == IQ4_XS) {   // d, scales_h, scales_l[4], qs[128]: the values signed, no offset
      r.dw[b] = half_at(blk);
      r.dm[b] = 0.f;
      for (int ib = 0; ib < 8; ++ib) {
        scg[2 * ib] = scg[2 * ib + 1] = iq4_xs_scale(blk, ib);
        mog[2 * ib] = mog[2 * ib + 1] = 0;
        for (int j = 0; j < 16; ++j) {
          q[32 * ib + j] = static_cast<uint8_t>(kIQ4NL[blk[8 + 16 * ib + j] & 15]);
          q[32 * ib + 16 + j] = static_cast<uint8_t>(kIQ4NL[blk[8 + 16 * ib + j] >> 4]);
        }
      }
    } else {   // Q6_K: ql[128], qh[64], scales[16] (int8), d
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = half_at(blk + 208);
      r.dw[b] = d;
      r.dm[b] = d;
      for (int g = 0; g < 16; ++g) { scg[g] = scales[g]; mog[g] = -32 * scales[g]; }
      for (int h = 0; h < 2; ++h) {
        const uint8_t* l8 = ql + 64 * h;
        const uint8_t* h8 = qh + 32 * h;
        uint8_t* o = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
          o[l] = static_cast<uint8_t>((l8[l] & 15) | (((h8[l] >> 0) & 3) << 4));
          o[l + 32] = static_cast<uint8_t>((l8[l + 32] & 15) | (((h8[l] >> 2) & 3) << 4));
          o[l + 64] = static_cast<uint8_t>((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4));
          o[l + 96] = static_cast<uint8_t>((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4));
        }
      }
    }
    for (int g = 0; g < 16; ++g) {
      mo[g] = static_cast<int16_t>(mog[g]);
      for (int i = 0; i < 8; ++i) sc[g * 8 + i] = static_cast<int16_t>(scg[g]);
    }
  }
}

// ---- dots ----------------------------------------------------------------------------------

// Instruction sets, each including the ones below it: the widest a call may use is the
// smaller of what the caller allows (GGMLX_BLOCK_ISA) and what the CPU has.
enum Isa : int64_t { kPlain = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

struct Problem {
  int64_t isa;
  int64_t type, M, K, Kp, nb, row_bytes;
  TypeInfo ti;
  const uint8_t* w;   // weight row row0 (GGUF blocks), or the whole weight in the lanes format
  const XQ* xq;
  float* y;   // [N, M]
  bool lanes = false;   // w is held in the lanes format (see lane_pieces)
  int64_t row0 = 0;
};

// Weight row m's GGUF blocks.
inline const uint8_t* row_at(const Problem& p, int64_t m) { return p.w + (m - p.row0) * p.row_bytes; }

// ---- the lanes format: 16 weight rows packed across the vector lanes -----------------------
//
// Under numerics="ggml" on AVX-512 the matrices of mul_mat are held in the lanes format
// (ggmlx.weights.FORMAT_LANES): the file's bytes, each group of 16 rows re-ordered block by
// block as a sequence of pieces, a piece being the same bytes [off, off + elem) of the block in
// each of the 16 rows ([16 rows][elem]). The pieces run over each field of the block in turn
// (d, m, qh, qs, scales, 4 quant bytes at a time), so that one 64-byte load holds the same 4
// quant bytes of all 16 rows (lane r: row r) and one vpdpbusd by 4 broadcast activations feeds
// 16 outputs with no horizontal sums, as ggml's repacked q4_K_8x8 tiles; Q6_K interleaves the
// pieces of its low and high bits in the order its kernel reads them (from DRAM, several
// interleaved streams per block halved the rate). ggmlx.weights.lane_pieces makes the same
// list. A group's 16 x row_bytes bytes stay contiguous (block b at 16 * bytes * b), so fusing
// rows keeps the format.
struct LanePiece {
  int off, elem;   // bytes into the block, bytes
};

constexpr int kMaxPieces = 64;

// The pieces of type t's block in their order (0 for a type without a lane layout).
int lane_pieces(int64_t t, LanePiece* out) {
  int n = 0;
  auto field = [&](int off, int elem, int count) {
    for (int c = 0; c < count; ++c) out[n++] = {off + c * elem, elem};
  };
  switch (t) {
    case Q4_0: case IQ4_NL: field(0, 2, 1); field(2, 4, 4); break;
    case Q4_1: field(0, 2, 1); field(2, 2, 1); field(4, 4, 4); break;
    case Q5_0: field(0, 2, 1); field(2, 4, 1); field(6, 4, 4); break;
    case Q5_1: field(0, 2, 1); field(2, 2, 1); field(4, 4, 1); field(8, 4, 4); break;
    case Q8_0: field(0, 2, 1); field(2, 4, 8); break;
    case MXFP4: field(0, 1, 1); field(1, 4, 4); break;
    case Q4_K: field(0, 2, 1); field(2, 2, 1); field(4, 4, 3); field(16, 4, 32); break;
    case Q5_K: field(0, 2, 1); field(2, 2, 1); field(4, 4, 3); field(16, 4, 8); field(48, 4, 32); break;
    case Q6_K:   // per half h and t: ql[64h + 4t ..], ql[64h + 32 + 4t ..], qh[32h + 4t ..]; then scales, d
      for (int h = 0; h < 2; ++h)
        for (int t4 = 0; t4 < 8; ++t4) {
          field(64 * h + 4 * t4, 4, 1);
          field(64 * h + 32 + 4 * t4, 4, 1);
          field(128 + 32 * h + 4 * t4, 4, 1);
        }
      field(192, 2, 8);
      field(208, 2, 1);
      break;
    default: break;
  }
  return n;
}

constexpr int kLanes = 16;   // weight rows per lane group (and per interleaved tile)

// The 16 rows of lane group g as GGUF blocks, into out [16][row_bytes].
void lanes_rows(const Problem& p, int64_t g, uint8_t* out) {
  LanePiece pc[kMaxPieces];
  const int np = lane_pieces(p.type, pc);
  const int64_t bytes = p.ti.bytes;
  const uint8_t* grp = p.w + g * kLanes * p.row_bytes;
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* seg = grp + b * kLanes * bytes;
    for (int i = 0; i < np; seg += kLanes * pc[i++].elem)
      for (int r = 0; r < kLanes; ++r)
        std::memcpy(out + r * p.row_bytes + b * bytes + pc[i].off, seg + r * pc[i].elem, pc[i].elem);
  }
}

// Rows [m, m + nm) (whole lane groups) of a lanes-format weight taken back as GGUF rows into
// buf [nm][row_bytes]: the Problem that reads them there (for the paths that read GGUF rows).
Problem group_rows(const Problem& p, int64_t m, int64_t nm, uint8_t* buf) {
  for (int64_t g = m / kLanes; g * kLanes < m + nm; ++g) lanes_rows(p, g, buf + (g * kLanes - m) * p.row_bytes);
  Problem q = p;
  q.lanes = false;
  q.w = buf;
  q.row0 = m;
  return q;
}

// Buffers for n (at most 32) unpacked weight rows.
struct Buffers {
  std::vector<uint8_t> q;
  std::vector<float> dw, dm, mf;
  std::vector<int16_t> sc16, mo;
  Row rows[32];

  Buffers(const Problem& p, int n) {
    const int64_t Kp = p.Kp, ndw = std::max<int64_t>(Kp / 64 * 16, p.nb);
    q.assign(n * Kp, 0);
    dw.assign(n * ndw, 0.f);
    dm.assign(n * p.nb, 0.f);
    mf.assign(n * p.nb, 0.f);
    sc16.assign(n * Kp / 2, 0);
    mo.assign(n * (p.K / 16 + 1), 0);
    for (int r = 0; r < n; ++r)
      rows[r] = Row{q.data() + r * Kp, dw.data() + r * ndw, dm.data() + r * p.nb, mf.data() + r * p.nb,
                    sc16.data() + r * Kp / 2, mo.data() + r * (p.K / 16 + 1)};
  }
};

// The plain-loop dot of one unpacked row and activation row n.
float dot_generic(const Problem& p, const Row& r, int64_t n) {
  const XQ& x = *p.xq;
  const int8_t* xs = x.qs.data() + n * x.Kp;
  float sum = 0.f;
  if (!p.ti.kquant) {
    for (int64_t b = 0; b < p.nb; ++b) {
      int32_t acc = 0;
      for (int j = 0; j < 32; ++j) acc += static_cast<int32_t>(r.q[b * 32 + j]) * xs[b * 32 + j];
      acc += x.off[(n * (x.Kp / 64) + b / 2) * 16 + (b % 2) * 8];
      sum += static_cast<float>(acc) * (x.d[n * p.nb + b] * r.dw[(b / 2) * 16 + (b % 2) * 8]);
      if (p.ti.q8_1) sum += r.mf[b] * x.s[n * p.nb + b];
    }
    return sum;
  }
  for (int64_t b = 0; b < p.nb; ++b) {
    int32_t main = 0, off = 0;
    for (int g = 0; g < 16; ++g) {
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) {
        const uint8_t w = r.q[b * kQK + g * 16 + j];
        s += (p.ti.sgn ? static_cast<int32_t>(static_cast<int8_t>(w)) : static_cast<int32_t>(w)) * xs[b * kQK + g * 16 + j];
      }
      main += s * r.sc16[b * kQK / 2 + g * 8];
      off += static_cast<int32_t>(r.mo[b * 16 + g]) * x.bs[n * (p.K / 16) + b * 16 + g];
    }
    const float dx = x.d[n * p.nb + b];
    sum += dx * r.dw[b] * static_cast<float>(main) + dx * r.dm[b] * static_cast<float>(off);
  }
  return sum;
}

void rows_generic(const Problem& p, const Buffers& buf, int nrows, int64_t m) {
  for (int64_t n = 0; n < p.xq->N; ++n)
    for (int r = 0; r < nrows; ++r) p.y[n * p.M + m + r] = dot_generic(p, buf.rows[r], n);
}

#ifdef GGMLX_X86
#define GGMLX_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define GGMLX_AVX2 __attribute__((target("avx2,fma,f16c")))

GGMLX_AVX2 inline float hsum8(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// A k-quant row's dot product: the 16 lanes of the scaled sums folded to 8, the mins' 8 lanes
// added, then summed.
GGMLX_VNNI inline float ksum(__m512 acc, __m256 accm) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  return hsum8(_mm256_add_ps(h, accm));
}

// A block's f16 field as f32 by F16C (the plain-loop half_at converts in software).
GGMLX_VNNI inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The pairs of w * x of 64 elements as vpmaddubsw gives them, w signed: |w| times x with w's
// sign (AVX-512 has no vpsignb: x negated where w < 0).
GGMLX_VNNI inline __m512i signed_pairs512(__m512i w, __m512i x) {
  return _mm512_maddubs_epi16(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x));
}

// IQ4_XS (its signed values are the lane kernel's exception): per 64 elements vpmaddubsw by the
// sign trick then vpdpwssd by the pair scales; per super-block the offsets sum(mo * bsums) in
// 16-bit pairs, and two FMAs. C activation rows at a time, so that each weight chunk and its
// scales are loaded once for all C.
template <int R, int C>
GGMLX_VNNI inline void k_vnni_block(const Problem& p, const Buffers& buf, int64_t m, int64_t n) {
  const XQ& x = *p.xq;
  const int64_t K16 = p.K / 16;
  __m512 acc[C][R];
  __m256 accm[C][R];
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r) { acc[j][r] = _mm512_setzero_ps(); accm[j][r] = _mm256_setzero_ps(); }
  for (int64_t b = 0; b < p.nb; ++b) {
    __m512i s[C][R];
    for (int j = 0; j < C; ++j)
      for (int r = 0; r < R; ++r) s[j][r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i xv[C];
      for (int j = 0; j < C; ++j) xv[j] = _mm512_loadu_si512(x.qs.data() + (n + j) * x.Kp + b * kQK + c * 64);
      for (int r = 0; r < R; ++r) {
        const Row& row = buf.rows[r];
        const __m512i wq = _mm512_loadu_si512(row.q + b * kQK + c * 64);
        const __m512i sc = _mm512_loadu_si512(row.sc16 + b * kQK / 2 + c * 32);
        for (int j = 0; j < C; ++j) s[j][r] = _mm512_dpwssd_epi32(s[j][r], signed_pairs512(wq, xv[j]), sc);
      }
    }
    for (int j = 0; j < C; ++j) {
      const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bs.data() + (n + j) * K16 + b * 16));
      const float dx = x.d[(n + j) * p.nb + b];
      for (int r = 0; r < R; ++r) {
        const Row& row = buf.rows[r];
        const __m256i o = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.mo + b * 16)), bv);
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[j][r]), _mm512_set1_ps(dx * row.dw[b]), acc[j][r]);
        accm[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(dx * row.dm[b]), accm[j][r]);
      }
    }
  }
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r) p.y[(n + j) * p.M + m + r] = ksum(acc[j][r], accm[j][r]);
}

// The unpacked-row AVX-512 kernel: only IQ4_XS reaches it (use_lanes takes every other type).
template <int R>
GGMLX_VNNI void tile_vnni(const Problem& p, const Buffers& buf, int64_t m) {
  const int64_t N = p.xq->N;
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) k_vnni_block<R, 2>(p, buf, m, n);
  if (n < N) k_vnni_block<R, 1>(p, buf, m, n);
}

// ---- k-quants for a few activation rows: straight from the blocks -------------------------

// One super-block of a k-quant row as the fused kernel needs it: the four 64-element chunks'
// unsigned values, the 16 group scales and offset multipliers (s16), and d, dm.
struct KBlock {
  __m512i q[4];
  __m256i sc, mo;
  float dw, dm;
};

GGMLX_VNNI inline void kblock_q4_k(const uint8_t* blk, bool q5, KBlock* kb) {
  // The 12 scale bytes as three words: sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales)
  // and 4-7 (mins); 4-7 take a nibble of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7.
  uint32_t a[3];
  std::memcpy(a, blk + 4, 12);
  const uint32_t six = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, two = 0x03030303u;
  const uint32_t sc_lo = a[0] & six, sc_hi = (a[2] & nib) | (((a[0] >> 6) & two) << 4);
  const uint32_t m_lo = a[1] & six, m_hi = ((a[2] >> 4) & nib) | (((a[1] >> 6) & two) << 4);
  const __m128i v = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), static_cast<int>(m_lo),
                                   static_cast<int>(m_hi));
  // each sub-block's value twice (its two groups of 16), widened to s16
  kb->sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
  kb->mo = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
  kb->dw = h2f(blk);
  kb->dm = -h2f(blk + 2);
  const __m256i low4 = _mm256_set1_epi8(15);
  const uint8_t* ql = blk + (q5 ? 48 : 16);
  __m256i qh = q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
  const __m256i one = _mm256_set1_epi8(1);
  for (int j = 0; j < 4; ++j) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * j));
    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    if (q5) {   // bit 2j of qh[l] over the low nibbles, bit 2j + 1 over the high ones
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
      qh = _mm256_srli_epi16(qh, 2);
    }
    kb->q[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

GGMLX_VNNI inline void kblock_q6_k(const uint8_t* blk, KBlock* kb) {
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  kb->sc = _mm256_cvtepi8_epi16(s8);
  kb->mo = _mm256_mullo_epi16(kb->sc, _mm256_set1_epi16(-32));
  kb->dw = kb->dm = h2f(blk + 208);
  const __m512i low4 = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(blk + 64 * h);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
    kb->q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, low4), _mm512_slli_epi16(_mm512_and_si512(hz, three), 4));
    kb->q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hz, 4), three), 4));
  }
}

GGMLX_VNNI inline void kblock_q2_k(const uint8_t* blk, KBlock* kb) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m128i low4 = _mm_set1_epi8(15);
  kb->sc = _mm256_cvtepu8_epi16(_mm_and_si128(s, low4));
  kb->mo = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), low4));
  kb->dw = h2f(blk + 80);
  kb->dm = -h2f(blk + 82);
  const __m256i three = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {   // chunk 2h + i: the bit pairs at 4i and 4i + 2 of qs[32 h ..]
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * h));
    for (int i = 0; i < 2; ++i) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 4 * i), three);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4 * i + 2), three);
      kb->q[2 * h + i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  }
}

GGMLX_VNNI inline void kblock_q3_k(const uint8_t* blk, KBlock* kb) {
  // the 16 scales as four words, as q3_k_scale reads them
  uint32_t a[3];
  std::memcpy(a, blk + 96, 12);
  const uint32_t nib = 0x0f0f0f0fu, two = 0x03030303u;
  const __m128i s6 = _mm_setr_epi32(static_cast<int>((a[0] & nib) | ((a[2] & two) << 4)),
                                    static_cast<int>((a[1] & nib) | (((a[2] >> 2) & two) << 4)),
                                    static_cast<int>(((a[0] >> 4) & nib) | (((a[2] >> 4) & two) << 4)),
                                    static_cast<int>(((a[1] >> 4) & nib) | (((a[2] >> 6) & two) << 4)));
  kb->sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(s6, _mm_set1_epi8(32)));
  kb->mo = _mm256_mullo_epi16(kb->sc, _mm256_set1_epi16(-4));
  kb->dw = kb->dm = h2f(blk + 108);
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * h));
    __m256i part[4];
    for (int j = 0; j < 4; ++j)   // elements 128 h + 32 j ..: bits 2j of qs, bit 4h + j of hmask
      part[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * j), three),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one), 2));
    kb->q[2 * h] = _mm512_inserti64x4(_mm512_castsi256_si512(part[0]), part[1], 1);
    kb->q[2 * h + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(part[2]), part[3], 1);
  }
}

GGMLX_VNNI inline void kblock_iq4_xs(const uint8_t* blk, KBlock* kb) {
  alignas(32) int16_t sc[16];
  for (int ib = 0; ib < 8; ++ib) sc[2 * ib] = sc[2 * ib + 1] = static_cast<int16_t>(iq4_xs_scale(blk, ib));
  kb->sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc));
  kb->mo = _mm256_setzero_si256();
  kb->dw = h2f(blk);
  kb->dm = 0.f;
  const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NL)));
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {   // sub-blocks 2c, 2c + 1: [lo, hi] nibbles of 16 bytes each
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + 32 * c));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    kb->q[c] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), low4));
  }
}

template <int64_t T>
GGMLX_VNNI inline void kblock(const uint8_t* blk, KBlock* kb) {
  if constexpr (T == Q2_K) kblock_q2_k(blk, kb);
  else if constexpr (T == Q3_K) kblock_q3_k(blk, kb);
  else if constexpr (T == Q6_K) kblock_q6_k(blk, kb);
  else if constexpr (T == IQ4_XS) kblock_iq4_xs(blk, kb);
  else kblock_q4_k(blk, T == Q5_K, kb);
}

// Weight rows [m0, m1) times NR activation rows, one weight row at a time, each super-block
// unpacked in registers once for all NR (two weight rows per pass for one or two activation
// rows measured slower: a 1B-shaped Q4_K_M decoded 15.9 against 17.5 tok/s).
template <int NR, int64_t T>
GGMLX_VNNI void rows_k_fused(const Problem& p, const XQ& x, int64_t n0, int64_t m0, int64_t m1) {
  constexpr bool kSigned = T == IQ4_XS;
  const int64_t K16 = p.K / 16;
  // s16 lane i of chunk c's scales is group 4c + i / 8
  __m512i idx[4];
  for (int c = 0; c < 4; ++c) {
    alignas(64) int16_t v[32];
    for (int i = 0; i < 32; ++i) v[i] = static_cast<int16_t>(4 * c + i / 8);
    idx[c] = _mm512_load_si512(v);
  }
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* row = row_at(p, m);
    __m512 acc[NR];
    __m256 accm[NR];
    for (int n = 0; n < NR; ++n) { acc[n] = _mm512_setzero_ps(); accm[n] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < p.nb; ++b) {
      KBlock kb;
      kblock<T>(row + b * p.ti.bytes, &kb);
      __m512i s[NR];
      for (int n = 0; n < NR; ++n) s[n] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i scv = _mm512_permutexvar_epi16(idx[c], _mm512_castsi256_si512(kb.sc));
        __m512i wq = kb.q[c];
        __mmask64 neg = 0;
        if constexpr (kSigned) {   // the sign trick, w's part once for all NR
          neg = _mm512_movepi8_mask(wq);
          wq = _mm512_abs_epi8(wq);
        }
        for (int n = 0; n < NR; ++n) {
          __m512i xv = _mm512_loadu_si512(x.qs.data() + (n0 + n) * x.Kp + b * kQK + c * 64);
          if constexpr (kSigned) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
          s[n] = _mm512_dpwssd_epi32(s[n], _mm512_maddubs_epi16(wq, xv), scv);
        }
      }
      for (int n = 0; n < NR; ++n) {
        const float dx = x.d[(n0 + n) * p.nb + b];
        acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[n]), _mm512_set1_ps(dx * kb.dw), acc[n]);
        if constexpr (!kSigned) {   // IQ4_XS has no offsets
          const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bs.data() + (n0 + n) * K16 + b * 16));
          accm[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(kb.mo, bv)), _mm256_set1_ps(dx * kb.dm), accm[n]);
        }
      }
    }
    for (int n = 0; n < NR; ++n) p.y[(n0 + n) * p.M + m] = ksum(acc[n], accm[n]);
  }
}

// ---- 32-element types for a few activation rows: straight from the blocks -----------------

// Blocks 2c and 2c + 1 of a row (b0, b1) as 64 unsigned bytes: the type's values + its shift.
template <int64_t T>
GGMLX_VNNI inline __m512i unit_q(const uint8_t* b0, const uint8_t* b1) {
  if constexpr (T == Q8_0) {
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int64_t qs = T == MXFP4 ? 1 : T == Q4_0 || T == IQ4_NL ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
    // [q0 | q1] nibbles -> [lo0, hi0, lo1, hi1]: elements 0-15, 16-31 of each block in order
    const __m256i q = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + qs))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + qs)), 1);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    __m512i v = _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(15));
    if constexpr (T == IQ4_NL || T == MXFP4) {   // the codebook's values + the type's shift
      alignas(16) uint8_t tab[16];
      for (int i = 0; i < 16; ++i) tab[i] = static_cast<uint8_t>(T == MXFP4 ? kMXFP4[i] + 12 : kIQ4NL[i] + 128);
      return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(tab))), v);
    }
    if constexpr (T == Q5_0 || T == Q5_1) {   // the fifth bits: bit j of qh is element j's
      constexpr int64_t o = T == Q5_0 ? 2 : 4;
      uint32_t h0, h1;
      std::memcpy(&h0, b0 + o, 4);
      std::memcpy(&h1, b1 + o, 4);
      const __mmask64 hb = static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32);
      v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(hb, _mm512_set1_epi8(16)));
    }
    return v;
  }
}

// The two blocks' d in lanes 0-7 and 8-15, and (Q4_1, Q5_1) their mins likewise in *mv: the f16
// fields converted together, then spread by one permute each.
template <int64_t T>
GGMLX_VNNI inline __m512 chunk_d(const uint8_t* b0, const uint8_t* b1, __m512* mv) {
  if constexpr (T == MXFP4) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(e8m0_half(b0[0])), _mm512_set1_ps(e8m0_half(b1[0])));
  } else {
    uint32_t h0, h1;   // [d, m] of each block (m: the first quants' bytes where the type has none)
    std::memcpy(&h0, b0, 4);
    std::memcpy(&h1, b1, 4);
    const __m512 f = _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(h1), static_cast<int>(h0))));   // d0, m0, d1, m1
    const __m512i idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    if constexpr (T == Q4_1 || T == Q5_1) *mv = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(1)), f);
    return _mm512_permutexvar_ps(idx, f);
  }
}

// Weight rows [m0, m1) of a 32-element type T times NR activation rows, one weight row at a time,
// each 64-element chunk unpacked once for all NR: one vpdpbusd (started from the shift term) and
// one FMA by d_x * d_w per row, and for Q4_1 / Q5_1 one FMA of the mins by the activation's s / 8
// in each of the block's 8 lanes.
template <int NR, int64_t T>
GGMLX_VNNI void rows_unit_fused(const Problem& p, const XQ& x, int64_t n0, int64_t m0, int64_t m1) {
  constexpr bool kMins = T == Q4_1 || T == Q5_1;
  const int64_t nc = x.Kp / 64, bytes = p.ti.bytes;
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* row = row_at(p, m);
    __m512 acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t b = 2 * c;
      const bool odd = b + 1 >= p.nb;       // K % 64 == 32: the last chunk holds one block
      const uint8_t* b0 = row + b * bytes;
      const uint8_t* b1 = row + (odd ? b : b + 1) * bytes;
      __m512 mv = _mm512_setzero_ps();
      __m512 dw = chunk_d<T>(b0, b1, &mv);
      __m512i wv = unit_q<T>(b0, b1);
      if (odd) {
        wv = _mm512_maskz_mov_epi8(0xFFFFFFFFull, wv);
        dw = _mm512_maskz_mov_ps(0x00FF, dw);
        mv = _mm512_maskz_mov_ps(0x00FF, mv);
      }
      for (int n = 0; n < NR; ++n) {
        const int64_t xr = (n0 + n) * nc + c;
        const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.off.data() + xr * 16), wv,
                                              _mm512_loadu_si512(x.qs.data() + (n0 + n) * x.Kp + c * 64));
        acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_loadu_ps(x.dv.data() + xr * 16), dw), acc[n]);
        if constexpr (kMins) acc[n] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(x.sv.data() + xr * 16), acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) p.y[(n0 + n) * p.M + m] = _mm512_reduce_add_ps(acc[n]);
  }
}

// The few-row kernels by activation-row count (1-8): an activation group of up to kGroup rows per pass.
using FusedFn = void (*)(const Problem&, const XQ&, int64_t, int64_t, int64_t);
constexpr int kGroup = 8;   // activation rows per pass
template <int64_t T>
constexpr FusedFn kFusedUnit[kGroup] = {rows_unit_fused<1, T>, rows_unit_fused<2, T>, rows_unit_fused<3, T>,
                                        rows_unit_fused<4, T>, rows_unit_fused<5, T>, rows_unit_fused<6, T>,
                                        rows_unit_fused<7, T>, rows_unit_fused<8, T>};
template <int64_t T>
constexpr FusedFn kFusedK[kGroup] = {rows_k_fused<1, T>, rows_k_fused<2, T>, rows_k_fused<3, T>, rows_k_fused<4, T>,
                                     rows_k_fused<5, T>, rows_k_fused<6, T>, rows_k_fused<7, T>, rows_k_fused<8, T>};

// The few-row kernel table of type t.
const FusedFn* fused_fns(int64_t t) {
  switch (t) {
    case Q4_0: return kFusedUnit<Q4_0>;
    case Q4_1: return kFusedUnit<Q4_1>;
    case Q5_0: return kFusedUnit<Q5_0>;
    case Q5_1: return kFusedUnit<Q5_1>;
    case Q8_0: return kFusedUnit<Q8_0>;
    case IQ4_NL: return kFusedUnit<IQ4_NL>;
    case MXFP4: return kFusedUnit<MXFP4>;
    case Q2_K: return kFusedK<Q2_K>;
    case Q3_K: return kFusedK<Q3_K>;
    case Q4_K: return kFusedK<Q4_K>;
    case Q5_K: return kFusedK<Q5_K>;
    case Q6_K: return kFusedK<Q6_K>;
    default: return kFusedK<IQ4_XS>;
  }
}

void rows_fused(const Problem& p, int64_t m0, int64_t m1) {
  const XQ& x = *p.xq;
  const FusedFn* fns = fused_fns(p.type);
  for (int64_t n0 = 0; n0 < x.N; n0 += kGroup) fns[std::min<int64_t>(kGroup, x.N - n0) - 1](p, x, n0, m0, m1);
}

// ---- many activation rows without AMX: 16 weight rows across the lanes --------------------

// 16 unpacked weight rows interleaved so that one vector holds 4 consecutive values of each row
// (lane r: row r), as ggml's repacked GEMM tiles do: one vpdpbusd by 4 broadcast activations
// takes 64 products into 16 outputs, and the per-block scaling is one vector operation for all
// 16 rows instead of a horizontal reduction per (row, activation) pair.

struct Interleaved {
  std::vector<uint8_t> q;          // [K / 4][16][4]
  std::vector<float> d, m;         // [nb][16]: d, and the mins (Q4_1, Q5_1) or dm (k-quants)
  std::vector<int32_t> sc;         // k-quants: [K / 16][16], each 16 elements' scale
  std::vector<int32_t> mo;         // k-quants: [K / 32][16], two 16-bit offset multipliers per lane
};

// Rows m .. m + nrows - 1 (nrows <= 16; the missing lanes zero) unpacked in registers as the
// few-row kernels do (kblock, unit_q), and each 4 values stored to their row's lane.
template <int64_t T>
GGMLX_VNNI void interleave_rows(const Problem& p, int64_t m, int nrows, Interleaved& t) {
  constexpr bool kK = T == Q2_K || T == Q3_K || T == Q4_K || T == Q5_K || T == Q6_K;
  const int64_t K = p.K, nb = p.nb;
  t.q.assign(K * kLanes, 0);
  t.d.assign(nb * kLanes, 0.f);
  t.m.assign(nb * kLanes, 0.f);
  if constexpr (kK) {
    t.sc.assign(K / 16 * kLanes, 0);
    t.mo.assign(K / 32 * kLanes, 0);
  }
  alignas(64) uint8_t v[kQK];
  for (int r = 0; r < nrows; ++r) {
    const uint8_t* row = row_at(p, m + r);
    if constexpr (kK) {
      for (int64_t b = 0; b < nb; ++b) {
        KBlock kb;
        kblock<T>(row + b * p.ti.bytes, &kb);
        for (int c = 0; c < 4; ++c) _mm512_store_si512(v + 64 * c, kb.q[c]);
        for (int k4 = 0; k4 < kQK / 4; ++k4) std::memcpy(&t.q[((b * kQK / 4 + k4) * kLanes + r) * 4], v + 4 * k4, 4);
        alignas(32) int16_t sc[16], mo[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sc), kb.sc);
        _mm256_store_si256(reinterpret_cast<__m256i*>(mo), kb.mo);
        for (int g = 0; g < 16; ++g) t.sc[(b * 16 + g) * kLanes + r] = sc[g];
        for (int h = 0; h < 8; ++h)
          t.mo[(b * 8 + h) * kLanes + r] = static_cast<int32_t>(static_cast<uint16_t>(mo[2 * h]) |
                                                                (static_cast<uint32_t>(static_cast<uint16_t>(mo[2 * h + 1])) << 16));
        t.d[b * kLanes + r] = kb.dw;
        t.m[b * kLanes + r] = kb.dm;
      }
    } else {
      for (int64_t b = 0; b < nb; b += 2) {
        const uint8_t* b0 = row + b * p.ti.bytes;
        const bool odd = b + 1 >= nb;   // K % 64 == 32: the last chunk holds one block
        const uint8_t* b1 = odd ? b0 : b0 + p.ti.bytes;
        _mm512_store_si512(v, unit_q<T>(b0, b1));
        for (int k4 = 0; k4 < (odd ? 8 : 16); ++k4) std::memcpy(&t.q[((b * 8 + k4) * kLanes + r) * 4], v + 4 * k4, 4);
        for (int64_t i = 0; i < (odd ? 1 : 2); ++i) {
          const uint8_t* blk = b0 + i * p.ti.bytes;
          t.d[(b + i) * kLanes + r] = T == MXFP4 ? e8m0_half(blk[0]) : h2f(blk);
          if constexpr (T == Q4_1 || T == Q5_1) t.m[(b + i) * kLanes + r] = h2f(blk + 2);
        }
      }
    }
  }
}

using InterleaveFn = void (*)(const Problem&, int64_t, int, Interleaved&);

InterleaveFn interleave_fn(int64_t t) {
  switch (t) {
    case Q4_0: return interleave_rows<Q4_0>;
    case Q4_1: return interleave_rows<Q4_1>;
    case Q5_0: return interleave_rows<Q5_0>;
    case Q5_1: return interleave_rows<Q5_1>;
    case Q8_0: return interleave_rows<Q8_0>;
    case IQ4_NL: return interleave_rows<IQ4_NL>;
    case MXFP4: return interleave_rows<MXFP4>;
    case Q2_K: return interleave_rows<Q2_K>;
    case Q3_K: return interleave_rows<Q3_K>;
    case Q4_K: return interleave_rows<Q4_K>;
    case Q5_K: return interleave_rows<Q5_K>;
    default: return interleave_rows<Q6_K>;
  }
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 32-element types: per block 8 vpdpbusd from the shift term, then one FMA by d_w * d_x (and for
// Q4_1 / Q5_1 one by the mins times s) for 16 outputs; C activation rows per pass.
template <int C, bool Mins>
GGMLX_VNNI void unit_lanes(const Problem& p, const Interleaved& t, int64_t m, int nrows, int64_t n) {
  const XQ& x = *p.xq;
  const int64_t nc = x.Kp / 64;
  __m512 acc[C];
  for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b) {
    __m512i si[C];
    for (int j = 0; j < C; ++j) si[j] = _mm512_set1_epi32(x.off[((n + j) * nc + b / 2) * 16 + (b % 2) * 8]);
    for (int k4 = 0; k4 < 8; ++k4) {
      const __m512i w = _mm512_loadu_si512(&t.q[((b * 8 + k4) * kLanes) * 4]);
      for (int j = 0; j < C; ++j)
        si[j] = _mm512_dpbusd_epi32(si[j], w, _mm512_set1_epi32(load_i32(x.qs.data() + (n + j) * x.Kp + b * 32 + 4 * k4)));
    }
    const __m512 dw = _mm512_loadu_ps(&t.d[b * kLanes]);
    for (int j = 0; j < C; ++j) {
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si[j]), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(n + j) * p.nb + b])), acc[j]);
      if constexpr (Mins) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(&t.m[b * kLanes]), _mm512_set1_ps(x.s[(n + j) * p.nb + b]), acc[j]);
    }
  }
  const __mmask16 k = static_cast<__mmask16>((1u << nrows) - 1);
  for (int j = 0; j < C; ++j) _mm512_mask_storeu_ps(p.y + (n + j) * p.M + m, k, acc[j]);
}

// k-quants: per 16 elements 4 vpdpbusd, the sums times the 16 rows' scales (vpmulld); per pair of
// 16s one vpdpwssd of the offset multipliers by the activations' sums; per super-block two FMAs.
template <int C>
GGMLX_VNNI void k_lanes(const Problem& p, const Interleaved& t, int64_t m, int nrows, int64_t n) {
  const XQ& x = *p.xq;
  const int64_t K16 = p.K / 16;
  __m512 acc[C];
  for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b) {
    __m512i isum[C], msum[C];
    for (int j = 0; j < C; ++j) { isum[j] = _mm512_setzero_si512(); msum[j] = _mm512_setzero_si512(); }
    for (int g = 0; g < 16; ++g) {
      const int64_t g16 = b * 16 + g;
      __m512i gs[C];
      for (int j = 0; j < C; ++j) gs[j] = _mm512_setzero_si512();
      for (int k4 = 0; k4 < 4; ++k4) {
        const __m512i w = _mm512_loadu_si512(&t.q[((g16 * 4 + k4) * kLanes) * 4]);
        for (int j = 0; j < C; ++j)
          gs[j] = _mm512_dpbusd_epi32(gs[j], w, _mm512_set1_epi32(load_i32(x.qs.data() + (n + j) * x.Kp + g16 * 16 + 4 * k4)));
      }
      const __m512i sc = _mm512_loadu_si512(&t.sc[g16 * kLanes]);
      for (int j = 0; j < C; ++j) isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(gs[j], sc));
      if (g % 2) {
        const __m512i mo = _mm512_loadu_si512(&t.mo[(g16 / 2) * kLanes]);
        for (int j = 0; j < C; ++j)
          msum[j] = _mm512_dpwssd_epi32(msum[j], mo, _mm512_set1_epi32(load_i32(x.bs.data() + (n + j) * K16 + g16 - 1)));
      }
    }
    const __m512 dw = _mm512_loadu_ps(&t.d[b * kLanes]), dm = _mm512_loadu_ps(&t.m[b * kLanes]);
    for (int j = 0; j < C; ++j) {
      const __m512 dx = _mm512_set1_ps(x.d[(n + j) * p.nb + b]);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(dw, dx), acc[j]);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum[j]), _mm512_mul_ps(dm, dx), acc[j]);
    }
  }
  const __mmask16 k = static_cast<__mmask16>((1u << nrows) - 1);
  for (int j = 0; j < C; ++j) _mm512_mask_storeu_ps(p.y + (n + j) * p.M + m, k, acc[j]);
}

template <int CU, int CK>
GGMLX_VNNI void lanes(const Problem& p, const Interleaved& t, int64_t m, int nrows, int64_t n) {
  if (p.ti.kquant) k_lanes<CK>(p, t, m, nrows, n);
  else if (p.ti.q8_1) unit_lanes<CU, true>(p, t, m, nrows, n);
  else unit_lanes<CU, false>(p, t, m, nrows, n);
}

// Weight rows [m0, m1) 16 at a time, each tile dotted with every activation row, 8 (32-element
// types) or 6 (k-quants) at a time (4 and 4: 3-5% slower on a Zen 4; 6 k-quant rows still fit
// the 32 vector registers).
constexpr int kLaneRowsUnit = 8, kLaneRowsK = 6;
InterleaveFn interleave_packed_fn(int64_t t);

void run_rows_lanes(const Problem& p, int64_t m0, int64_t m1) {
  const InterleaveFn interleave = p.lanes ? interleave_packed_fn(p.type) : interleave_fn(p.type);
  thread_local Interleaved t;
  const int64_t N = p.xq->N;
  for (int64_t m = m0; m < m1; m += kLanes) {
    const int nrows = static_cast<int>(std::min<int64_t>(kLanes, m1 - m));
    interleave(p, m, nrows, t);
    const int64_t step = p.ti.kquant ? kLaneRowsK : kLaneRowsUnit;
    int64_t n = 0;
    for (; n + step <= N; n += step) lanes<kLaneRowsUnit, kLaneRowsK>(p, t, m, nrows, n);
    for (; n < N; ++n) lanes<1, 1>(p, t, m, nrows, n);
  }
}

// Does the lane kernel take this problem? Many rows, AVX-512, values unsigned (IQ4_XS's are not).
bool use_lanes(const Problem& p) {
  return p.isa >= kAvx512 && p.xq->N > kFusedN && !p.ti.sgn;
}

// ---- few activation rows from the lanes format ---------------------------------------------

// Lane group rows' f16 fields (16 x 2 bytes) as f32 lanes.
GGMLX_VNNI inline __m512 lanes_h(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A 32-element type's quant units in the lanes format as unsigned values (the type's shift
// added, as unit_q): unit u of a 4-bit type holds values 4u .. 4u + 3 of each row in its low
// nibbles and 16 + 4u .. in its high ones; Q8_0's unit u values 4u .. 4u + 3.
template <int64_t T>
struct LaneUnits {
  static constexpr bool kQ5 = T == Q5_0 || T == Q5_1;
  // the fields' places in a block's 16-row segment: 16 x their offsets in the block
  static constexpr int kQh = 16 * (T == Q5_0 ? 2 : 4);
  static constexpr int kQs = 16 * (T == MXFP4 ? 1 : T == Q4_0 || T == IQ4_NL || T == Q8_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8);
  static constexpr int kUnits = T == Q8_0 ? 8 : 4;
  __m512i low4, tab, sixteen, spread[4], bit[2];

  GGMLX_VNNI LaneUnits() {
    low4 = _mm512_set1_epi8(15);
    sixteen = _mm512_set1_epi8(16);
    alignas(16) uint8_t v[16];
    for (int i = 0; i < 16; ++i)   // the codebook's values + the type's shift
      v[i] = static_cast<uint8_t>(T == MXFP4 ? kMXFP4[i] + 12 : T == IQ4_NL ? kIQ4NL[i] + 128 : 0);
    tab = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(v)));
    // Q5_0 / Q5_1: byte k of each row's 32-bit qh spread over its lane's 4 bytes (pshufb), then
    // bit i of that byte tested for lane byte i (nibble h of the byte: bits 4h + i)
    for (int k = 0; k < 4; ++k) {
      alignas(16) int8_t c[16];
      for (int i = 0; i < 16; ++i) c[i] = static_cast<int8_t>(i / 4 * 4 + k);
      spread[k] = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(c)));
    }
    for (int h = 0; h < 2; ++h) bit[h] = _mm512_set1_epi32(static_cast<int>(0x08040201u << (4 * h)));
  }

  // Unit u of block segment s (qh: the segment's qh field, Q5_0 / Q5_1); Q8_0 leaves *hi alone.
  GGMLX_VNNI void get(const uint8_t* s, int u, __m512i qh, __m512i* lo, __m512i* hi) const {
    const __m512i v = _mm512_loadu_si512(s + kQs + 64 * u);
    if constexpr (T == Q8_0) {
      *lo = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
      return;
    }
    *lo = _mm512_and_si512(v, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (kQ5) {   // bits 4u + i and 16 + 4u + i of qh
      *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, spread[u / 2]), bit[u % 2]), *lo, sixteen);
      *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, spread[2 + u / 2]), bit[u % 2]), *hi, sixteen);
    }
    if constexpr (T == IQ4_NL || T == MXFP4) {
      *lo = _mm512_shuffle_epi8(tab, *lo);
      *hi = _mm512_shuffle_epi8(tab, *hi);
    }
  }

  GGMLX_VNNI __m512i qh(const uint8_t* s) const {
    if constexpr (kQ5) return _mm512_loadu_si512(s + kQh);
    return _mm512_setzero_si512();
  }

  // The 16 rows' d (MXFP4: e8m0_half of its exponent byte).
  GGMLX_VNNI __m512 d(const uint8_t* s) const {
    if constexpr (T == MXFP4) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
      const __mmask16 sub = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
      return _mm512_castsi512_ps(_mm512_mask_blend_epi32(sub, _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23),
                                                         _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e)));
    }
    return lanes_h(s);
  }
};

// 32-element types: per block 8 vpdpbusd (4-bit types: each 64-byte unit's low and high nibbles;
// Q8_0: 8 units) from the shift term, then one FMA by d_w * d_x (and for Q4_1 / Q5_1 one by the
// mins, at 16 x 2, times s) for the 16 rows; NR activation rows per pass.
template <int NR, int64_t T>
GGMLX_VNNI void packed_unit(const Problem& p, const XQ& x, int64_t n0, int64_t g0, int64_t g1) {
  constexpr bool kMins = T == Q4_1 || T == Q5_1;
  const LaneUnits<T> lu;
  const int64_t seg = kLanes * p.ti.bytes, nc = x.Kp / 64;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* grp = p.w + g * kLanes * p.row_bytes;
    __m512 acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* s = grp + b * seg;
      __m512i si[NR];
      const int8_t* xb[NR];
      for (int n = 0; n < NR; ++n) {
        si[n] = _mm512_set1_epi32(x.off[((n0 + n) * nc + b / 2) * 16 + (b % 2) * 8]);
        xb[n] = x.qs.data() + (n0 + n) * x.Kp + b * 32;
      }
      // two accumulators per row (low and high nibbles; Q8_0: even and odd units), so that a
      // row's chain of dependent vpdpbusd per block is 4 long, not 8 (N = 64: 4-5% faster)
      const __m512i qh = lu.qh(s);
      __m512i sh[NR];
      for (int n = 0; n < NR; ++n) sh[n] = _mm512_setzero_si512();
      for (int u = 0; u < lu.kUnits; ++u) {
        __m512i lo, hi;
        lu.get(s, u, qh, &lo, &hi);
        for (int n = 0; n < NR; ++n) {
          const __m512i xl = _mm512_set1_epi32(load_i32(xb[n] + 4 * u));
          if constexpr (T == Q8_0) {
            if (u % 2) sh[n] = _mm512_dpbusd_epi32(sh[n], lo, xl);
            else si[n] = _mm512_dpbusd_epi32(si[n], lo, xl);
          } else {
            si[n] = _mm512_dpbusd_epi32(si[n], lo, xl);
            sh[n] = _mm512_dpbusd_epi32(sh[n], hi, _mm512_set1_epi32(load_i32(xb[n] + 16 + 4 * u)));
          }
        }
      }
      for (int n = 0; n < NR; ++n) si[n] = _mm512_add_epi32(si[n], sh[n]);
      const __m512 dw = lu.d(s);
      for (int n = 0; n < NR; ++n) {
        acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si[n]), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(n0 + n) * p.nb + b])), acc[n]);
        if constexpr (kMins) acc[n] = _mm512_fmadd_ps(lanes_h(s + 32), _mm512_set1_ps(x.s[(n0 + n) * p.nb + b]), acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(p.y + (n0 + n) * p.M + g * kLanes, acc[n]);
  }
}

// pshufb controls over a lane's 4 bytes: byte k zero-extended to the dword (kByte), or to both
// 16-bit halves (kPair: a vpdpwssd pair of equal values).
GGMLX_VNNI inline __m512i byte_ctrl(int k, bool pair) {
  alignas(16) int8_t c[16];
  for (int r = 0; r < 4; ++r) {
    c[4 * r] = static_cast<int8_t>(4 * r + k);
    c[4 * r + 1] = c[4 * r + 3] = -1;
    c[4 * r + 2] = pair ? static_cast<int8_t>(4 * r + k) : -1;
  }
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(c)));
}

// Q4_K / Q5_K: per sub-block of 32, 8 vpdpbusd by broadcast activations, the sum times the
// sub-block's scale (vpmulld) into an integer accumulator; the mins' sum(m * bsums) by vpdpwssd
// over each 16-element pair of bsums; per super-block two FMAs (d and dmin by d_x).
// A Q4_K / Q5_K segment's 16 x 12 scale bytes (three dwords per row) decoded as kblock_q4_k does,
// 16 rows at once: sc[0] the scales of sub-blocks 0-3 (a byte each), sc[1] of 4-7; m likewise.
GGMLX_VNNI inline void q4k_scales(const uint8_t* s, __m512i* sc, __m512i* m) {
  const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), nib = _mm512_set1_epi32(0x0f0f0f0f), two = _mm512_set1_epi32(0x03030303);
  const __m512i a0 = _mm512_loadu_si512(s + 64), a1 = _mm512_loadu_si512(s + 128), a2 = _mm512_loadu_si512(s + 192);
  sc[0] = _mm512_and_si512(a0, six);
  sc[1] = _mm512_or_si512(_mm512_and_si512(a2, nib), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a0, 6), two), 4));
  m[0] = _mm512_and_si512(a1, six);
  m[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a2, 4), nib),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a1, 6), two), 4));
}

// Chunk c's (64 values) q unit of a Q4_K / Q5_K segment: lo the values 64c + 4q + i of the
// 16 rows, hi 64c + 32 + 4q + i.
template <bool Q5>
GGMLX_VNNI inline void q4k_unit(const uint8_t* s, int c, int q, __m512i* lo, __m512i* hi) {
  constexpr int kQh = 16 * 16, kQs = 16 * (Q5 ? 48 : 16);
  const __m512i low4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
  const __m512i v = _mm512_loadu_si512(s + kQs + 64 * (8 * c + q));
  *lo = _mm512_and_si512(v, low4);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (Q5) {   // bits 2c and 2c + 1 of qh[4q + i]
    const __m512i h = _mm512_loadu_si512(s + kQh + 64 * q);
    *lo = _mm512_or_si512(*lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * c), one), 4));
    *hi = _mm512_or_si512(*hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * c + 1), one), 4));
  }
}

template <int NR, bool Q5>
GGMLX_VNNI void packed_q4k(const Problem& p, const XQ& x, int64_t n0, int64_t g0, int64_t g1) {
  const int64_t seg = kLanes * p.ti.bytes, K16 = p.K / 16;
  __m512i sel[4], pair[4];
  for (int k = 0; k < 4; ++k) {
    sel[k] = byte_ctrl(k, false);
    pair[k] = byte_ctrl(k, true);
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* grp = p.w + g * kLanes * p.row_bytes;
    __m512 acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* s = grp + b * seg;
      __m512i scw[2], mw[2];
      q4k_scales(s, scw, mw);
      __m512i iacc[NR], mi[NR];
      const int8_t* xb[NR];
      const int16_t* bs[NR];
      for (int n = 0; n < NR; ++n) {
        iacc[n] = mi[n] = _mm512_setzero_si512();
        xb[n] = x.qs.data() + (n0 + n) * x.Kp + b * kQK;
        bs[n] = x.bs.data() + (n0 + n) * K16 + b * 16;
      }
      for (int c = 0; c < 4; ++c) {   // sub-blocks 2c (low nibbles) and 2c + 1 (high)
        __m512i sl[NR], sh[NR];
        for (int n = 0; n < NR; ++n) sl[n] = sh[n] = _mm512_setzero_si512();
        for (int q = 0; q < 8; ++q) {
          __m512i lo, hi;
          q4k_unit<Q5>(s, c, q, &lo, &hi);
          for (int n = 0; n < NR; ++n) {
            sl[n] = _mm512_dpbusd_epi32(sl[n], lo, _mm512_set1_epi32(load_i32(xb[n] + 64 * c + 4 * q)));
            sh[n] = _mm512_dpbusd_epi32(sh[n], hi, _mm512_set1_epi32(load_i32(xb[n] + 64 * c + 32 + 4 * q)));
          }
        }
        const int j = 2 * c;   // sub-block j's scale and min: byte j % 4 of word j / 4
        const __m512i scl = _mm512_shuffle_epi8(scw[j / 4], sel[j % 4]), sch = _mm512_shuffle_epi8(scw[j / 4], sel[j % 4 + 1]);
        const __m512i ml = _mm512_shuffle_epi8(mw[j / 4], pair[j % 4]), mh = _mm512_shuffle_epi8(mw[j / 4], pair[j % 4 + 1]);
        for (int n = 0; n < NR; ++n) {
          iacc[n] = _mm512_add_epi32(iacc[n], _mm512_add_epi32(_mm512_mullo_epi32(sl[n], scl), _mm512_mullo_epi32(sh[n], sch)));
          mi[n] = _mm512_dpwssd_epi32(mi[n], ml, _mm512_set1_epi32(load_i32(bs[n] + 2 * j)));
          mi[n] = _mm512_dpwssd_epi32(mi[n], mh, _mm512_set1_epi32(load_i32(bs[n] + 2 * j + 2)));
        }
      }
      const __m512 d = lanes_h(s), dmin = lanes_h(s + 32);
      for (int n = 0; n < NR; ++n) {
        const __m512 dx = _mm512_set1_ps(x.d[(n0 + n) * p.nb + b]);
        acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[n]), _mm512_mul_ps(d, dx), acc[n]);
        acc[n] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mi[n]), _mm512_mul_ps(dmin, dx), acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(p.y + (n0 + n) * p.M + g * kLanes, acc[n]);
  }
}

// Q6_K: per 4 values of the 16 rows one ql unit (low or high nibbles) and two bits of a qh unit;
// per group of 16, 4 vpdpbusd and the sum times the group's scale (vpmulld); the -32 offset as
// sum(sc * bsums) by vpdpwssd over the scale pairs; one FMA per super-block.
// The Q6_K values 128h + 32a + 4t + i of the 16 rows (a = 0..3), unsigned (q + 32), from the
// pieces ql[64h + 4t], ql[64h + 32 + 4t] and qh[32h + 4t] (lane_pieces keeps them together).
GGMLX_VNNI inline void q6k_units(const uint8_t* s, int h, int t, __m512i* v) {
  const __m512i low4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
  const uint8_t* u = s + 64 * 3 * (8 * h + t);
  const __m512i A = _mm512_loadu_si512(u), B = _mm512_loadu_si512(u + 64), QH = _mm512_loadu_si512(u + 128);
  v[0] = _mm512_or_si512(_mm512_and_si512(A, low4), _mm512_and_si512(_mm512_slli_epi16(QH, 4), hi2));
  v[1] = _mm512_or_si512(_mm512_and_si512(B, low4), _mm512_and_si512(_mm512_slli_epi16(QH, 2), hi2));
  v[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), low4), _mm512_and_si512(QH, hi2));
  v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), low4), _mm512_and_si512(_mm512_srli_epi16(QH, 2), hi2));
}

template <int NR>
GGMLX_VNNI void packed_q6k(const Problem& p, const XQ& x, int64_t n0, int64_t g0, int64_t g1) {
  constexpr int kSc = 16 * 192, kD = 16 * 208;
  const int64_t seg = kLanes * p.ti.bytes, K16 = p.K / 16;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* grp = p.w + g * kLanes * p.row_bytes;
    __m512 acc[NR];
    for (int n = 0; n < NR; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* s = grp + b * seg;
      __m512i iacc[NR], oi[NR];
      const int8_t* xb[NR];
      const int16_t* bs[NR];
      for (int n = 0; n < NR; ++n) {
        iacc[n] = oi[n] = _mm512_setzero_si512();
        xb[n] = x.qs.data() + (n0 + n) * x.Kp + b * kQK;
        bs[n] = x.bs.data() + (n0 + n) * K16 + b * 16;
      }
      __m512i sc2[8];   // scale pairs (2p, 2p + 1) as s16 halves of each lane
      for (int h = 0; h < 2; ++h) {
        for (int tt = 0; tt < 2; ++tt) {   // values 128 h + 32 a + 16 tt + 4 t4 + i: group 8 h + 2 a + tt
          __m512i si[4][NR];
          for (int a = 0; a < 4; ++a)
            for (int n = 0; n < NR; ++n) si[a][n] = _mm512_setzero_si512();
          for (int t4 = 0; t4 < 4; ++t4) {
            const int t = 4 * tt + t4;
            __m512i v[4];
            q6k_units(s, h, t, v);
            for (int a = 0; a < 4; ++a)
              for (int n = 0; n < NR; ++n)
                si[a][n] = _mm512_dpbusd_epi32(si[a][n], v[a], _mm512_set1_epi32(load_i32(xb[n] + 128 * h + 32 * a + 4 * t)));
          }
          if (tt == 0)
            for (int a = 0; a < 4; ++a) {
              const int q = 4 * h + a;
              sc2[q] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kSc + 32 * q)));
              for (int n = 0; n < NR; ++n) oi[n] = _mm512_dpwssd_epi32(oi[n], sc2[q], _mm512_set1_epi32(load_i32(bs[n] + 2 * q)));
            }
          for (int a = 0; a < 4; ++a) {   // scale 8 h + 2 a + tt: half tt of pair 4 h + a
            const __m512i P = sc2[4 * h + a];
            const __m512i sc = tt ? _mm512_srai_epi32(P, 16) : _mm512_srai_epi32(_mm512_slli_epi32(P, 16), 16);
            for (int n = 0; n < NR; ++n) iacc[n] = _mm512_add_epi32(iacc[n], _mm512_mullo_epi32(si[a][n], sc));
          }
        }
      }
      const __m512 d = lanes_h(s + kD);
      for (int n = 0; n < NR; ++n) {
        const __m512i sum = _mm512_sub_epi32(iacc[n], _mm512_slli_epi32(oi[n], 5));
        acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x.d[(n0 + n) * p.nb + b])), acc[n]);
      }
    }
    for (int n = 0; n < NR; ++n) _mm512_storeu_ps(p.y + (n0 + n) * p.M + g * kLanes, acc[n]);
  }
}

// A lane group of the lanes format as the lane kernel's tile (what interleave_rows makes from
// GGUF rows): the units unpacked in registers and stored in value order, the scales per lane.
template <int64_t T>
GGMLX_VNNI void interleave_packed(const Problem& p, int64_t m, int nrows, Interleaved& t) {
  constexpr bool kK = T == Q4_K || T == Q5_K || T == Q6_K;
  const int64_t K = p.K, nb = p.nb, seg = kLanes * p.ti.bytes;
  const uint8_t* grp = p.w + m / kLanes * kLanes * p.row_bytes;   // nrows is 16: M is whole groups
  (void)nrows;
  t.q.resize(K * kLanes);
  t.d.resize(nb * kLanes);
  t.m.resize(nb * kLanes);
  auto q_at = [&](int64_t k4) { return &t.q[k4 * kLanes * 4]; };
  if constexpr (kK) {
    t.sc.resize(K / 16 * kLanes);
    t.mo.resize(K / 32 * kLanes);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = grp + b * seg;
      const int64_t k0 = b * kQK / 4;   // the super-block's first group of 4 values
      if constexpr (T == Q6_K) {
        for (int h = 0; h < 2; ++h)
          for (int u = 0; u < 8; ++u) {
            __m512i v[4];
            q6k_units(s, h, u, v);
            for (int a = 0; a < 4; ++a) _mm512_storeu_si512(q_at(k0 + 32 * h + 8 * a + u), v[a]);
          }
        for (int q = 0; q < 8; ++q) {   // groups 2q, 2q + 1: scales, and offset multipliers -32 sc
          const __m512i P = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * 192 + 32 * q)));
          _mm512_storeu_si512(&t.sc[(b * 16 + 2 * q) * kLanes], _mm512_srai_epi32(_mm512_slli_epi32(P, 16), 16));
          _mm512_storeu_si512(&t.sc[(b * 16 + 2 * q + 1) * kLanes], _mm512_srai_epi32(P, 16));
          _mm512_storeu_si512(&t.mo[(b * 8 + q) * kLanes], _mm512_mullo_epi16(P, _mm512_set1_epi16(-32)));
        }
        const __m512 d = lanes_h(s + 16 * 208);
        _mm512_storeu_ps(&t.d[b * kLanes], d);
        _mm512_storeu_ps(&t.m[b * kLanes], d);
      } else {
        for (int c = 0; c < 4; ++c)
          for (int q = 0; q < 8; ++q) {
            __m512i lo, hi;
            q4k_unit<T == Q5_K>(s, c, q, &lo, &hi);
            _mm512_storeu_si512(q_at(k0 + 16 * c + q), lo);
            _mm512_storeu_si512(q_at(k0 + 16 * c + 8 + q), hi);
          }
        __m512i scw[2], mw[2];
        q4k_scales(s, scw, mw);
        for (int j = 0; j < 8; ++j) {   // sub-block j: groups 2j, 2j + 1 take its scale; its min twice
          const __m512i sc = _mm512_shuffle_epi8(scw[j / 4], byte_ctrl(j % 4, false));
          _mm512_storeu_si512(&t.sc[(b * 16 + 2 * j) * kLanes], sc);
          _mm512_storeu_si512(&t.sc[(b * 16 + 2 * j + 1) * kLanes], sc);
          _mm512_storeu_si512(&t.mo[(b * 8 + j) * kLanes], _mm512_shuffle_epi8(mw[j / 4], byte_ctrl(j % 4, true)));
        }
        _mm512_storeu_ps(&t.d[b * kLanes], lanes_h(s));
        _mm512_storeu_ps(&t.m[b * kLanes], _mm512_sub_ps(_mm512_setzero_ps(), lanes_h(s + 32)));
      }
    }
  } else {
    const LaneUnits<T> lu;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = grp + b * seg;
      const __m512i qh = lu.qh(s);
      for (int u = 0; u < lu.kUnits; ++u) {
        __m512i lo, hi;
        lu.get(s, u, qh, &lo, &hi);
        _mm512_storeu_si512(q_at(b * 8 + u), lo);
        if constexpr (T != Q8_0) _mm512_storeu_si512(q_at(b * 8 + 4 + u), hi);
      }
      _mm512_storeu_ps(&t.d[b * kLanes], lu.d(s));
      if constexpr (T == Q4_1 || T == Q5_1) _mm512_storeu_ps(&t.m[b * kLanes], lanes_h(s + 32));
    }
  }
}

InterleaveFn interleave_packed_fn(int64_t t) {
  switch (t) {
    case Q4_0: return interleave_packed<Q4_0>;
    case Q4_1: return interleave_packed<Q4_1>;
    case Q5_0: return interleave_packed<Q5_0>;
    case Q5_1: return interleave_packed<Q5_1>;
    case Q8_0: return interleave_packed<Q8_0>;
    case IQ4_NL: return interleave_packed<IQ4_NL>;
    case MXFP4: return interleave_packed<MXFP4>;
    case Q4_K: return interleave_packed<Q4_K>;
    case Q5_K: return interleave_packed<Q5_K>;
    default: return interleave_packed<Q6_K>;
  }
}

// The lanes-format kernels by activation-row count (1..kPackedN) and their pass width.
using PackedFn = void (*)(const Problem&, const XQ&, int64_t, int64_t, int64_t);
constexpr int kPackedN = 4;
template <int64_t T>
constexpr PackedFn kPackedUnit[kPackedN] = {packed_unit<1, T>, packed_unit<2, T>, packed_unit<3, T>, packed_unit<4, T>};
template <bool Q5>
constexpr PackedFn kPackedQ4K[kPackedN] = {packed_q4k<1, Q5>, packed_q4k<2, Q5>, packed_q4k<2, Q5>, packed_q4k<2, Q5>};
constexpr PackedFn kPackedQ6K[kPackedN] = {packed_q6k<1>, packed_q6k<2>, packed_q6k<2>, packed_q6k<2>};

// Lane groups of at most this many bytes take every activation pass before the next ones are
// read, so that the passes find them in L2 (Zen 4's 1 MB; a thread's chunk of a 49152 x 576
// Q8_0 output head is 3.7 MB): 512 rows of that head 89 -> 78 ms.
constexpr int64_t kPackedBlockBytes = 256 << 10;

// Weight rows [m0, m1) (whole lane groups) times every activation row, from the lanes format.
void rows_packed(const Problem& p, int64_t m0, int64_t m1) {
  const PackedFn* fns;
  int width = kPackedN;   // activation rows per pass (k-quants: 2, their registers)
  switch (p.type) {
    case Q4_0: fns = kPackedUnit<Q4_0>; break;
    case Q4_1: fns = kPackedUnit<Q4_1>; break;
    case Q5_0: fns = kPackedUnit<Q5_0>; break;
    case Q5_1: fns = kPackedUnit<Q5_1>; break;
    case Q8_0: fns = kPackedUnit<Q8_0>; break;
    case IQ4_NL: fns = kPackedUnit<IQ4_NL>; break;
    case MXFP4: fns = kPackedUnit<MXFP4>; break;
    case Q4_K: fns = kPackedQ4K<false>; width = 2; break;
    case Q5_K: fns = kPackedQ4K<true>; width = 2; break;
    default: fns = kPackedQ6K; width = 2; break;
  }
  const XQ& x = *p.xq;
  const int64_t g1 = m1 / kLanes, per = std::max<int64_t>(1, kPackedBlockBytes / (kLanes * p.row_bytes));
  for (int64_t g = m0 / kLanes; g < g1; g += per)
    for (int64_t n0 = 0; n0 < x.N; n0 += width) fns[std::min<int64_t>(width, x.N - n0) - 1](p, x, n0, g, std::min(g + per, g1));
}

// Does rows_packed take this many activation rows? On AVX-512 the few-row kernels beat the
// interleaved tiles (run_rows_lanes) at every row count for Q4_0, Q4_1, Q8_0 and Q4_K (Zen 4, us
// per row, few-row vs tiles: 1536 x 576 Q4_1 at 64 rows 3.3 vs 4.4, at 512 3.2 vs 3.7; 8192 x 2048
// Q4_K 61 vs 74 and 64 vs 69); from 17 rows the others take the tiles, which unpack each group
// once for all rows: the few-row passes unpack it again per few rows, and Q5_0's high bits, Q6_K's
// two-row passes (4096 x 640 Q5_0 at 512 rows 9.8-10.6 vs 9.3-9.6; 2048 x 8192 Q6_K 86 vs 59) lose.
bool packed_takes(const Problem& p) {
  const bool many = p.type == Q4_0 || p.type == Q4_1 || p.type == Q8_0 || p.type == Q4_K;
  return p.isa >= kAvx512 && (p.xq->N <= kFusedN || many);
}

// quantize_q8_K and quantize_q8_0 in AVX-512, the same values: the first element of largest
// magnitude found by a compare and a bit scan, products rounded to nearest even by vcvtps2dq.
GGMLX_VNNI void quantize_q8_K_avx512(const float* x, int64_t K, int8_t* qs, float* d, int16_t* bs) {
  for (int64_t b = 0; b < K / kQK; ++b) {
    const float* xb = x + b * kQK;
    __m512 vmax = _mm512_setzero_ps();
    for (int j = 0; j < kQK; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
    const float amax = _mm512_reduce_max_ps(vmax);
    int8_t* q = qs + b * kQK;
    if (amax == 0.f) {
      d[b] = 0.f;
      std::memset(q, 0, kQK);
      for (int g = 0; g < kQK / 16; ++g) bs[b * 16 + g] = 0;
      continue;
    }
    float max = 0.f;
    for (int j = 0; j < kQK; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (hit) { max = xb[j + __builtin_ctz(hit)]; break; }
    }
    const float iscale = -127.f / max;
    const __m512 is = _mm512_set1_ps(iscale);
    for (int g = 0; g < kQK / 16; ++g) {
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(is, _mm512_loadu_ps(xb + g * 16)));
      v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * 16), _mm512_cvtepi32_epi8(v));
      bs[b * 16 + g] = static_cast<int16_t>(_mm512_reduce_add_epi32(v));
    }
    d[b] = 1.f / iscale;
  }
}

GGMLX_VNNI void quantize_q8_0_avx512(const float* x, int64_t K, int8_t* qs, float* d, float* s, int32_t* sums) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float db = amax / 127.f;
    const __m512 id = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + b * 32), _mm512_cvtepi32_epi8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + b * 32 + 16), _mm512_cvtepi32_epi8(v1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
    d[b] = _cvtsh_ss(_cvtss_sh(db, _MM_FROUND_TO_NEAREST_INT));
    if (s) s[b] = _cvtsh_ss(_cvtss_sh(db * static_cast<float>(sum), _MM_FROUND_TO_NEAREST_INT));
    sums[b] = sum;
  }
}


// ---- AVX2: the unpacked rows, 32 elements per vector (GGMLX_AVX2, hsum8: above) -------------

// 32-element types, one block per vector: vpmaddubsw and vpmaddwd by ones, as ggml's AVX2
// dots. Q8_0 and IQ4_NL (values + 128, up to 255) would overflow vpmaddubsw's 16-bit pairs, so
// their values go back to signed and take ggml's sign trick; that dot already is the signed one
// (the shift term is not added again).
template <int R>
GGMLX_AVX2 void tile_unit_avx2(const Problem& p, const Buffers& buf, int64_t m) {
  const XQ& x = *p.xq;
  const int64_t nc = x.Kp / 64;
  const bool wide = p.ti.shift == 128;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t n = 0; n < x.N; ++n) {
    const int8_t* xs = x.qs.data() + n * x.Kp;
    __m256 acc[R];
    float accm[R] = {};
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + b * 32));
      const float dx = x.d[n * p.nb + b];
      const int32_t off = wide ? 0 : x.off[(n * nc + b / 2) * 16 + (b % 2) * 8];
      for (int r = 0; r < R; ++r) {
        const Row& row = buf.rows[r];
        __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.q + b * 32));
        __m256i pairs;
        if (wide) {
          q = _mm256_xor_si256(q, flip);
          pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
        } else {
          pairs = _mm256_maddubs_epi16(q, xv);
        }
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_setr_epi32(off, 0, 0, 0, 0, 0, 0, 0));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx * row.dw[(b / 2) * 16 + (b % 2) * 8]), acc[r]);
        if (p.ti.q8_1) accm[r] += row.mf[b] * x.s[n * p.nb + b];
      }
    }
    for (int r = 0; r < R; ++r) p.y[n * p.M + m + r] = hsum8(acc[r]) + accm[r];
  }
}

// k-quants: per 32 elements vpmaddubsw and vpmaddwd by the pair scales, summed over the
// super-block in 32 bits, then the two FMAs as the AVX-512 kernel (IQ4_XS's signed values by
// ggml's sign trick).
template <int R, bool Sgn>
GGMLX_AVX2 void tile_k_avx2(const Problem& p, const Buffers& buf, int64_t m) {
  const XQ& x = *p.xq;
  const int64_t K16 = p.K / 16;
  for (int64_t n = 0; n < x.N; ++n) {
    const int8_t* xs = x.qs.data() + n * x.Kp;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + b * kQK + c * 32));
        for (int r = 0; r < R; ++r) {
          const Row& row = buf.rows[r];
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.q + b * kQK + c * 32));
          const __m256i prod = Sgn ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                                   : _mm256_maddubs_epi16(w, xv);
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(
              prod, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.sc16 + b * kQK / 2 + c * 16))));
        }
      }
      const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bs.data() + n * K16 + b * 16));
      const float dx = x.d[n * p.nb + b];
      for (int r = 0; r < R; ++r) {
        const Row& row = buf.rows[r];
        const __m256i o = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.mo + b * 16)), bv);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_set1_ps(dx * row.dw[b]), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(dx * row.dm[b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) p.y[n * p.M + m + r] = hsum8(acc[r]);
  }
}

template <int R>
void tile_avx2(const Problem& p, const Buffers& buf, int64_t m) {
  if (p.ti.sgn) tile_k_avx2<R, true>(p, buf, m);
  else if (p.ti.kquant) tile_k_avx2<R, false>(p, buf, m);
  else tile_unit_avx2<R>(p, buf, m);
}

// The unpacked-row kernels by weight-row count (1..kRows).
using TileFn = void (*)(const Problem&, const Buffers&, int64_t);
constexpr TileFn kTileVnni[kRows] = {tile_vnni<1>, tile_vnni<2>, tile_vnni<3>, tile_vnni<4>};
constexpr TileFn kTileAvx2[kRows] = {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>};

bool has_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}


// ---- prefill with AMX: 16 x 16 tiles of int8 products ---------------------------------------
//
// Where the CPU has AMX-INT8 and Linux grants its tile state (arch_prctl), products of more
// rows than the few-row kernels take run as tiles: 16 activation rows (A: their quantized
// bytes, read in place) by 16 weight rows (B: unpacked, then laid out as AMX's 4-byte column
// groups), one TDPBSUD (TDPBSSD for IQ4_XS's signed values) per scale group of G elements (32,
// or 16 for Q2_K, Q3_K, Q6_K) gives the 256 integer dots of that group, and an AVX-512 pass scales them into 16 float accumulators (one vector
// per activation row, the lanes the 16 weight rows). The k-quants' offsets sum(mo * bsums) are
// VPDPWSSD over pairs of groups; the 32-element types' shift and Q8_1 terms are per block.

#define GGMLX_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_granted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512vnni")) return false;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;     // AMX-TILE, AMX-INT8
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// The widest instruction set this CPU (and kernel) gives block_matmul.
int64_t cpu_isa() {
  static const int64_t isa = amx_granted() ? kAmx
                             : has_vnni() ? kAvx512
                             : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c")) ? kAvx2 : kPlain;
  return isa;
}

// 32 weight rows (two B tiles), ready for the tiles: B [n_groups][2][G / 4][64], each group's
// float scale per row [n_groups][32], and per block: the offsets' factor dm [nb][32] and
// multipliers mo as pairs of groups [nb][2][8][16 rows][2] (k-quants), or the mins (Q4_1,
// Q5_1) [nb][32].
struct WTile {
  int G = 32;
  std::vector<uint8_t> B;
  std::vector<float> ws, dm, mf;
  std::vector<int16_t> mo;
};

void make_wtile(const Problem& p, const Buffers& buf, int nrows, WTile& wt) {
  const int G = p.ti.group;
  const int64_t ng = p.K / G;
  wt.G = G;
  wt.B.assign(ng * 2 * G * 16, 0);
  wt.ws.assign(ng * 32, 0.f);
  wt.dm.assign(p.nb * 32, 0.f);
  wt.mf.assign(p.nb * 32, 0.f);
  wt.mo.assign(p.ti.kquant ? p.nb * 512 : 0, 0);
  for (int r = 0; r < nrows; ++r) {
    const Row& row = buf.rows[r];
    const int half = r / 16, col = r % 16;
    for (int64_t g = 0; g < ng; ++g) {
      uint8_t* B = wt.B.data() + (g * 2 + half) * G * 16;
      for (int kk = 0; kk < G / 4; ++kk) std::memcpy(B + kk * 64 + col * 4, row.q + g * G + kk * 4, 4);
      wt.ws[g * 32 + r] = p.ti.kquant ? row.dw[g * G / kQK] * row.sc16[g * G / 2] : row.dw[(g / 2) * 16 + (g % 2) * 8];
    }
    for (int64_t b = 0; b < p.nb; ++b) {
      if (p.ti.kquant) {
        wt.dm[b * 32 + r] = row.dm[b];
        for (int g = 0; g < 16; ++g) wt.mo[b * 512 + half * 256 + (g / 2) * 32 + col * 2 + g % 2] = row.mo[b * 16 + g];
      } else {
        wt.mf[b * 32 + r] = row.mf[b];
      }
    }
  }
}

// Group g's integer sums Cg (the four tiles) scaled into acc: d_x * (d_w * scale) per row and lane.
GGMLX_AMX inline void amx_scale(const Problem& p, const WTile& wt, const int32_t (*Cg)[16][16], float (*acc)[32],
                                int64_t n0, int64_t g) {
  const XQ& x = *p.xq;
  const int G = wt.G;
  const int64_t nc = x.Kp / 64;
  const int64_t b = g * G / p.ti.block;
  const __m512 ws0 = _mm512_loadu_ps(wt.ws.data() + g * 32), ws1 = _mm512_loadu_ps(wt.ws.data() + g * 32 + 16);
  for (int r = 0; r < 32; ++r) {
    const int64_t xr = n0 + r;
    const __m512 dx = _mm512_set1_ps(x.d[xr * p.nb + b]);
    __m512i c0 = _mm512_load_si512(Cg[(r / 16) * 2][r % 16]), c1 = _mm512_load_si512(Cg[(r / 16) * 2 + 1][r % 16]);
    if (!p.ti.kquant) {
      const __m512i o = _mm512_set1_epi32(x.off[(xr * nc + b / 2) * 16 + (b % 2) * 8]);
      c0 = _mm512_add_epi32(c0, o);
      c1 = _mm512_add_epi32(c1, o);
    }
    _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), _mm512_mul_ps(ws0, dx), _mm512_load_ps(acc[r])));
    _mm512_store_ps(acc[r] + 16,
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), _mm512_mul_ps(ws1, dx), _mm512_load_ps(acc[r] + 16)));
  }
}

// The 32 x 32 outputs of activation rows n0.. and weight rows m0.. (nn, nm of them real; the
// activations' padding rows are zero): four C tiles (tmm0-3) from two A (tmm4-5) and two B
// (tmm6-7) per group, so four TDPBSUDs run independently; their sums are scaled into acc.
GGMLX_AMX void amx_block(const Problem& p, const WTile& wt, int64_t n0, int nn, int64_t m0, int nm) {
  const XQ& x = *p.xq;
  const int G = wt.G;
  const int64_t ng = p.K / G, K16 = p.K / 16;
  alignas(64) int32_t C[2][4][16][16];
  alignas(64) float acc[32][32] = {};
  const int8_t* A = x.qt.data() + n0 * p.K;
  // the tiles of group g run while group g - 1 is scaled
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* B = wt.B.data() + g * 2 * G * 16;
    _tile_loadd(4, A + g * 32 * G, G);
    _tile_loadd(5, A + g * 32 * G + 16 * G, G);
    _tile_loadd(6, B, 64);
    _tile_loadd(7, B + G * 16, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (p.ti.sgn) {   // signed weights (IQ4_XS)
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbsud(0, 4, 6);
      _tile_dpbsud(1, 4, 7);
      _tile_dpbsud(2, 5, 6);
      _tile_dpbsud(3, 5, 7);
    }
    auto& Cg = C[g & 1];
    _tile_stored(0, Cg[0], 64);
    _tile_stored(1, Cg[1], 64);
    _tile_stored(2, Cg[2], 64);
    _tile_stored(3, Cg[3], 64);
    if (g > 0) amx_scale(p, wt, C[(g - 1) & 1], acc, n0, g - 1);
  }
  amx_scale(p, wt, C[(ng - 1) & 1], acc, n0, ng - 1);
  for (int64_t b = 0; b < p.nb; ++b) {
    for (int h = 0; h < 2; ++h) {
      if (p.ti.kquant) {
        const __m512 dm = _mm512_loadu_ps(wt.dm.data() + b * 32 + h * 16);
        const int16_t* mo = wt.mo.data() + b * 512 + h * 256;
        for (int r = 0; r < 32; ++r) {
          const int32_t* bs = reinterpret_cast<const int32_t*>(x.bs.data() + (n0 + r) * K16 + b * 16);
          __m512i o = _mm512_setzero_si512();
          for (int g2 = 0; g2 < 8; ++g2) o = _mm512_dpwssd_epi32(o, _mm512_loadu_si512(mo + g2 * 32), _mm512_set1_epi32(bs[g2]));
          _mm512_store_ps(acc[r] + h * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(o),
                                                           _mm512_mul_ps(dm, _mm512_set1_ps(x.d[(n0 + r) * p.nb + b])),
                                                           _mm512_load_ps(acc[r] + h * 16)));
        }
      } else if (p.ti.q8_1) {
        const __m512 mf = _mm512_loadu_ps(wt.mf.data() + b * 32 + h * 16);
        for (int r = 0; r < 32; ++r)
          _mm512_store_ps(acc[r] + h * 16, _mm512_fmadd_ps(mf, _mm512_set1_ps(x.s[(n0 + r) * p.nb + b]),
                                                           _mm512_load_ps(acc[r] + h * 16)));
      }
    }
  }
  const uint32_t bits = nm >= 32 ? 0xFFFFFFFFu : ((1u << nm) - 1);
  for (int r = 0; r < nn; ++r) {
    _mm512_mask_storeu_ps(p.y + (n0 + r) * p.M + m0, static_cast<__mmask16>(bits & 0xFFFF), _mm512_load_ps(acc[r]));
    _mm512_mask_storeu_ps(p.y + (n0 + r) * p.M + m0 + 16, static_cast<__mmask16>(bits >> 16), _mm512_load_ps(acc[r] + 16));
  }
}

// Weight rows [m0, m1) (whole blocks of 32 but the last) by every activation row.
GGMLX_AMX void run_rows_amx(const Problem& p, int64_t m0, int64_t m1) {
  const int G = p.ti.group;
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  for (int t : {4, 5}) { cfg.rows[t] = 16; cfg.colsb[t] = static_cast<uint16_t>(G); }
  for (int t : {6, 7}) { cfg.rows[t] = static_cast<uint8_t>(G / 4); cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  Buffers buf(p, 32);
  WTile wt;
  const int64_t N = p.xq->N;
  std::vector<uint8_t> rows(p.lanes ? 32 * p.row_bytes : 0);
  for (int64_t m = m0; m < m1; m += 32) {
    const int nm = static_cast<int>(std::min<int64_t>(32, m1 - m));
    // a lanes-format weight's groups taken back first (m a multiple of 32, M of 16: whole groups)
    const Problem q = p.lanes ? group_rows(p, m, nm, rows.data()) : p;
    for (int r = 0; r < nm; ++r) unpack_row(p.type, p.ti, row_at(q, m + r), p.K, buf.rows[r]);
    make_wtile(p, buf, nm, wt);
    for (int64_t n0 = 0; n0 < N; n0 += 32) amx_block(p, wt, n0, static_cast<int>(std::min<int64_t>(32, N - n0)), m, nm);
  }
  _tile_release();
}
#else
int64_t cpu_isa() { return kPlain; }
#endif  // GGMLX_X86

void run_rows(const Problem& p, int64_t m0, int64_t m1);

// Weight rows [m0, m1) (whole lane groups) held in the lanes format: a few activation rows read
// it in place (AVX-512); every other path takes each group's rows back as GGUF blocks.
void run_rows_packed(const Problem& p, int64_t m0, int64_t m1) {
#ifdef GGMLX_X86
  if (packed_takes(p)) return rows_packed(p, m0, m1);
  if (use_lanes(p)) return run_rows_lanes(p, m0, m1);   // tiles straight from the lane groups
#endif
  thread_local std::vector<uint8_t> rows;
  rows.resize(kLanes * p.row_bytes);
  for (int64_t m = m0; m < m1; m += kLanes) run_rows(group_rows(p, m, kLanes, rows.data()), m, std::min(m + kLanes, m1));
}

// Weight rows [m0, m1): unpacked kRows at a time, each tile dotted with every activation row.
void run_rows(const Problem& p, int64_t m0, int64_t m1) {
  if (p.lanes) return run_rows_packed(p, m0, m1);
#ifdef GGMLX_X86
  if (p.xq->N <= kFusedN && p.isa >= kAvx512) return rows_fused(p, m0, m1);
  if (use_lanes(p)) return run_rows_lanes(p, m0, m1);
#endif
  Buffers buf(p, kRows);
  for (int64_t m = m0; m < m1; m += kRows) {
    const int nrows = static_cast<int>(std::min<int64_t>(kRows, m1 - m));
    for (int r = 0; r < nrows; ++r) unpack_row(p.type, p.ti, row_at(p, m + r), p.K, buf.rows[r]);
#ifdef GGMLX_X86
    if (p.isa >= kAvx2) {
      (p.isa >= kAvx512 ? kTileVnni : kTileAvx2)[nrows - 1](p, buf, m);
      continue;
    }
#endif
    rows_generic(p, buf, nrows, m);
  }
}

ffi::Error BlockMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t type, int64_t isa, int64_t lanes) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("block_matmul: x, w and y must be 2-d");
  TypeInfo ti;
  if (!type_info(type, &ti)) return ffi::Error::InvalidArgument("block_matmul: unsupported type " + std::to_string(type));
  const int64_t N = xd[0], K = xd[1], M = wd[0];
  if (K % ti.block || wd[1] != K / ti.block * ti.bytes || yd[0] != N || yd[1] != M)
    return ffi::Error::InvalidArgument("block_matmul: shapes of x [N, K], w [M, K / block * bytes], y [N, M] disagree");
  LanePiece lp[kMaxPieces];
  if (lanes && (M % kLanes || lane_pieces(type, lp) == 0))
    return ffi::Error::InvalidArgument("block_matmul: the lanes format takes " + std::to_string(kLanes) +
                                       "-row groups of a type with a lane layout, got type " + std::to_string(type) +
                                       " and " + std::to_string(M) + " rows");
  isa = std::min(isa, cpu_isa());
  thread_local XQ xq;
  QuantK qk = quantize_q8_K;
  Quant0 q0 = quantize_q8_0;
#ifdef GGMLX_X86
  const bool amx = isa == kAmx && N > kFusedN;
  xq.pad_rows = amx ? 32 : 1;
  if (isa >= kAvx512) {
    qk = quantize_q8_K_avx512;
    q0 = quantize_q8_0_avx512;
  }
#endif
  size_x(N, K, ti, xq);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // prefill's activations quantized on every thread (a 1B model's pp512 spent ~3% here on one)
  const int64_t x_rows = N >= 64 ? (N + 2 * threads - 1) / (2 * threads) : N;
  const float* xs = x.typed_data();
  XQ* xp = &xq;   // this thread's buffers (xq named inside the lambda would be the pool thread's)
  ggmlx_native::parallel_for(pool, threads, (N + x_rows - 1) / x_rows, [=, &ti](int64_t c) {
    quantize_rows(xs, c * x_rows, std::min(N, (c + 1) * x_rows), ti, *xp, qk, q0);
  });
  Problem p{isa, type, M, K, xq.Kp, K / ti.block, wd[1], ti, w.typed_data(), &xq, y->typed_data(), lanes != 0};
  int64_t chunk = std::max<int64_t>(16, (M + 4 * threads - 1) / (4 * threads));
#ifdef GGMLX_X86
  const int64_t align = p.lanes || (!amx && use_lanes(p)) ? kLanes : kRows;
#else
  const int64_t align = p.lanes ? kLanes : kRows;
#endif
  chunk = (chunk + align - 1) / align * align;
  const int64_t n_chunks = (M + chunk - 1) / chunk;
#ifdef GGMLX_X86
  if (amx) {   // the activations in tile order: each A tile 512 contiguous bytes
    const int64_t G = ti.group, ng = K / G, nblk = (N + 31) / 32;
    xq.qt.resize(nblk * 32 * K);
    for (int64_t xb = 0; xb < nblk; ++xb)
      for (int r = 0; r < 32; ++r)
        for (int64_t g = 0; g < ng; ++g)
          std::memcpy(xq.qt.data() + ((xb * ng + g) * 32 + r) * G, xq.qs.data() + (xb * 32 + r) * xq.Kp + g * G, G);
    const int64_t tiles = (M + 31) / 32, per = std::max<int64_t>(1, (tiles + 4 * threads - 1) / (4 * threads));
    ggmlx_native::parallel_for(pool, threads, (tiles + per - 1) / per, [&p, per, M](int64_t c) {
      run_rows_amx(p, c * per * 32, std::min(M, (c + 1) * per * 32));
    });
    return ffi::Error::Success();
  }
#endif
  if (M * p.row_bytes * N <= kOneThreadBytes) {   // a pool handoff would cost more than it saves
    run_rows(p, 0, M);
    return ffi::Error::Success();
  }
  ggmlx_native::parallel_for(pool, threads, n_chunks, [&p, chunk, M](int64_t c) {
    run_rows(p, c * chunk, std::min(M, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GgmlxBlockMatmul, BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type")
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("lanes"));

// GGUF blocks uint8 [M, row_bytes] of type t into the lanes format (dst, the same size), for
// ggmlx.weights.pack_lanes at load. Returns 0, or -1 when t has no lane layout or M is not
// whole 16-row groups (nothing written).
extern "C" int64_t ggmlx_pack_lanes(const uint8_t* src, uint8_t* dst, int64_t M, int64_t row_bytes, int64_t t) {
  LanePiece pc[kMaxPieces];
  const int np = lane_pieces(t, pc);
  TypeInfo ti;
  if (np == 0 || M % kLanes || !type_info(t, &ti) || row_bytes % ti.bytes) return -1;
  const int64_t bytes = ti.bytes, nb = row_bytes / bytes;
  for (int64_t g = 0; g < M / kLanes; ++g) {
    const uint8_t* rows = src + g * kLanes * row_bytes;
    uint8_t* out = dst + g * kLanes * row_bytes;
    for (int64_t b = 0; b < nb; ++b)
      for (int i = 0; i < np; ++i) {
        const uint8_t* in = rows + b * bytes + pc[i].off;
        if (pc[i].elem == 4) {
          for (int r = 0; r < kLanes; ++r, out += 4) std::memcpy(out, in + r * row_bytes, 4);
        } else if (pc[i].elem == 2) {
          for (int r = 0; r < kLanes; ++r, out += 2) std::memcpy(out, in + r * row_bytes, 2);
        } else {
          for (int r = 0; r < kLanes; ++r, out += pc[i].elem) std::memcpy(out, in + r * row_bytes, pc[i].elem);
        }
      }
  }
  return 0;
}

// The widest instruction set block_matmul finds on this CPU (BLOCK_ISAS' index), for the Python
// side's choice of held format (the lanes format where AVX-512 VNNI reads it in place).
extern "C" int64_t ggmlx_block_cpu_isa() { return cpu_isa(); }
