// y = x @ w.T (+ bias) in fp32 for a few rows of x, AVX2 + FMA: see cpu_gemm.py for why and what it guarantees.
//
// Every output y[m, n] is one chain of 8-lane FMAs over k in order, then the same horizontal sum and the bias,
// whatever M, the tile shape or the thread split: a row's result does not depend on the other rows (batch
// invariance), so a tree verify gives each token exactly its one-token decode result.
#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int MB = 3;  // rows of x per tile: 3 x 4 accumulators + 3 x vectors fit the 16 ymm registers
constexpr int NB = 4;  // rows of w per tile
constexpr int64_t SLICE = 64;  // rows of x per pass over the weights: 64 x 1536 fp32 is 384 KiB
constexpr int PREFETCH_BYTES = 512;  // how far ahead in the next tile's weight rows (measured: 0 is slower)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// y[m, n] for m < R, n < C of one tile; x rows at stride K, y rows at stride N. `prefetch`: pull the next tile's
// weight rows toward L1 while this one computes (the first pass over a weight tile only: later ones hit L1).
template <int R, int C>
inline void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, bool prefetch) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < C; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[R];
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 4
    for (int n = 0; n < C; ++n) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (n + C) * K + k) + PREFETCH_BYTES, _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(w + n * K + k);
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < C; ++n) y[m * N + n] = hsum(acc[m][n]) + (bias ? bias[n] : 0.0f);
}

// Every row of x against C weight rows starting at n0.
template <int C>
void columns(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  const float* wn = w + n0 * K;
  const float* bn = bias ? bias + n0 : nullptr;
  int64_t m = 0;
  for (; m + MB <= M; m += MB) tile<MB, C>(x + m * K, wn, bn, y + m * N + n0, K, N, m == 0);
  if (M - m == 2) tile<2, C>(x + m * K, wn, bn, y + m * N + n0, K, N, m == 0);
  if (M - m == 1) tile<1, C>(x + m * K, wn, bn, y + m * N + n0, K, N, m == 0);
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(1) % 8 == 0, "small_linear: contiguous, K % 8 == 0");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == w.size(0)),
              "small_linear: bias must be contiguous fp32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += SLICE) {  // many rows (a prefill) go in slices that stay in L2
    const int64_t rows = std::min(SLICE, M - m0);
    const float* xs = xp + m0 * K;
    float* ys = yp + m0 * N;
    at::parallel_for(0, N / NB, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) columns<NB>(xs, wp, bp, ys, rows, K, N, b * NB);
    });
    for (int64_t n = N / NB * NB; n < N; ++n) columns<1>(xs, wp, bp, ys, rows, K, N, n);  // N % 4 leftover rows of w
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(draftsmith_cpu, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", small_linear);
}
