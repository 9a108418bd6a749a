// y = x @ w.T (+ bias) with w in int4 (groups of G along k, a scale and a minimum each) and x quantised to int8 per
// row: see int4_gemm.py for the layout and why it is ours.
//
// Each panel of 16 output columns is one stream: per group, G/8 blocks of 64 bytes (8 k's x 16 columns as nibbles:
// byte 4c + i holds k = 8b + i in its low nibble and k = 8b + 4 + i in its high one, for column c), then 64 bytes of
// fp16 scales [16] and minimums [16]. A block's 16 columns are multiplied by 4 of the row's int8 values at once; a
// group's integer sums are then scaled in fp32:
//   y[m, c] = xs[m] * sum_g (scale[g, c] * sum_k q[c, k] xq[m, k] + min[g, c] * sum_k xq[m, k]) + bias[c].
// Built with AVX-512 VNNI (one vpdpbusd per 16 columns) or AVX2 (vpmaddubsw then vpmaddwd per 8 columns: codes of
// 0..15 times |xq| <= 127 never saturate its int16 pairs). Both sum the same integers and scale them in the same
// fp32 order, so by construction both builds give the same bits.
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int NR = 16;  // output columns per panel: one 16-lane vector
constexpr int64_t AHEAD = 8192;  // bytes of the panel stream prefetched ahead into L2
#if defined(__AVX512VNNI__)
constexpr int MR = 6;   // rows of x per tile: 6 x 2 accumulators + codes, nibbles and scales well inside 32 registers

// y rows [R] for one panel: `stream` the panel's groups, xq rows at stride K (int8), sums [R, groups] (int32)
template <int R>
inline void tile(const int8_t* xq, const int32_t* sums, const float* xs, const uint8_t* stream, const float* bias,
                 float* y, int64_t K, int64_t G, int64_t N, int cols) {
  const int64_t groups = K / G, blocks = G / 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R];
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) dot[m] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * G;
    for (int64_t b = 0; b < blocks; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(stream) + b * 64 + AHEAD, _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(stream + b * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 6
      for (int m = 0; m < R; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(xg + m * K + b * 8);
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x4[0]));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x4[1]));
      }
    }
    stream += blocks * 64;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(stream)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(stream + 32)));
    stream += 64;
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      acc[m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot[m]), acc[m]);
      acc[m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(static_cast<float>(sums[m * groups + g])), acc[m]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) {
    alignas(64) float out[NR];
    _mm512_store_ps(out, _mm512_mul_ps(acc[m], _mm512_set1_ps(xs[m])));
    for (int c = 0; c < cols; ++c) y[m * N + c] = out[c] + (bias ? bias[c] : 0.0f);
  }
}

#else
constexpr int MR = 4;   // rows of x per tile: faster than 2 from 4 rows on, as fast at one (the sums spill a little)

// as the AVX-512 tile, each 64-byte block taken as two halves of 8 columns
template <int R>
inline void tile(const int8_t* xq, const int32_t* sums, const float* xs, const uint8_t* stream, const float* bias,
                 float* y, int64_t K, int64_t G, int64_t N, int cols) {
  const int64_t groups = K / G, blocks = G / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][2];
    for (int m = 0; m < R; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    const int8_t* xg = xq + g * G;
    for (int64_t b = 0; b < blocks; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(stream) + b * 64 + AHEAD, _MM_HINT_T1);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stream + b * 64 + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < R; ++m) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xg + m * K + b * 8);
          const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[0])), ones);
          const __m256i u = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[1])), ones);
          dot[m][h] = _mm256_add_epi32(_mm256_add_epi32(dot[m][h], l), u);
        }
      }
    }
    stream += blocks * 64;
    for (int h = 0; h < 2; ++h) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(stream + 16 * h)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(stream + 32 + 16 * h)));
      for (int m = 0; m < R; ++m) {
        acc[m][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot[m][h]), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(static_cast<float>(sums[m * groups + g])), acc[m][h]);
      }
    }
    stream += 64;
  }
  for (int m = 0; m < R; ++m) {
    alignas(32) float out[NR];
    for (int h = 0; h < 2; ++h) _mm256_store_ps(out + 8 * h, _mm256_mul_ps(acc[m][h], _mm256_set1_ps(xs[m])));
    for (int c = 0; c < cols; ++c) y[m * N + c] = out[c] + (bias ? bias[c] : 0.0f);
  }
}
#endif

void panel_rows(const int8_t* xq, const int32_t* sums, const float* xs, const uint8_t* stream, const float* bias,
                float* y, int64_t M, int64_t K, int64_t G, int64_t N, int cols) {
  const int64_t groups = K / G, tiles = (M + MR - 1) / MR;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = (M - m + tiles - t - 1) / (tiles - t);  // near-equal tiles: 7 rows as 4 + 3
    const int8_t* xm = xq + m * K;
    const int32_t* sm = sums + m * groups;
    switch (r) {
      case 6: tile<6>(xm, sm, xs + m, stream, bias, y + m * N, K, G, N, cols); break;
      case 5: tile<5>(xm, sm, xs + m, stream, bias, y + m * N, K, G, N, cols); break;
      case 4: tile<4>(xm, sm, xs + m, stream, bias, y + m * N, K, G, N, cols); break;
      case 3: tile<3>(xm, sm, xs + m, stream, bias, y + m * N, K, G, N, cols); break;
      case 2: tile<2>(xm, sm, xs + m, stream, bias, y + m * N, K, G, N, cols); break;
      default: tile<1>(xm, sm, xs + m, stream, bias, y + m * N, K, G, N, cols); break;
    }
    m += r;
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, int64_t G,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "int4_linear: x [M, K] fp32");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte && panels.is_contiguous(),
              "int4_linear: panels [P, K / G, G * 8 + 64] uint8 expected");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(G % 8 == 0 && K % G == 0 && panels.size(1) == K / G && panels.size(2) == G * 8 + 64,
              "int4_linear: panels do not match x's K and the group size");
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == P, "int4_linear: n does not match the panel count");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N),
              "int4_linear: bias must be contiguous fp32 [n]");
  const int64_t groups = K / G;
  // each row to int8, symmetric over its own absolute maximum, with its per-group sums (for the minimums)
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor sums = at::empty({M, groups}, x.options().dtype(at::kInt));
  at::Tensor xs = at::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  int32_t* sp = sums.data_ptr<int32_t>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[m * K + k]));
    const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    xsp[m] = scale;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t s = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(xp[m * K + k] / scale));
        qp[m * K + k] = q;
        s += q;
      }
      sp[m * groups + g] = s;
    }
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = panels.size(1) * panels.size(2);
  at::parallel_for(0, P, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      panel_rows(qp, sp, xsp, pp + p * panel_bytes, bp ? bp + p * NR : nullptr, yp + p * NR, M, K, G, N, cols);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(draftsmith_int4, m) {
  m.def("int4_linear(Tensor x, Tensor panels, int n, int group, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_int4, CPU, m) {
  m.impl("int4_linear", int4_linear);
}
