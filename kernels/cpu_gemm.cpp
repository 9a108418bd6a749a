// y = x @ w.T (+ bias) in fp32 for a few rows of x, AVX2 + FMA: see cpu_gemm.py for why and what it guarantees.
//
// The weight comes packed in panels of 16 output columns, k-major (cpu_gemm.pack: panels[p, k, c] = w[16p + c, k]),
// so each k reads one 64-byte line of the panel and a tile of rows broadcasts its x[m, k] against it, with no
// horizontal sums. Every output y[m, n] is one FMA chain over k = 0..K-1 in order, then the bias, whatever M, the
// tile shape or the thread split: a row's result does not depend on the other rows (batch invariance), so a tree
// verify gives each token exactly its one-token decode result.
#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int NR = 16;  // output columns per panel: two 8-lane vectors
constexpr int MR = 6;   // rows of x per tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast = 15 ymm registers
constexpr int64_t SLICE = 64;  // rows of x per pass over the weights (a prefill goes in slices)

// y[m, c] for m < R, c < cols, from one panel; x rows at stride K, y rows at stride N. While it computes, the tile
// pulls every `stride`-th line of the `next` panel (from line `phase` on) toward L2: the row tiles of one panel
// together fetch all of the next one, so its weights stream in while this one computes rather than after it
// (measured: 6..16-row products 10-20% faster than fetching each panel when its first tile reads it).
template <int R>
inline void tile(const float* x, const float* panel, const float* bias, float* y, int64_t K, int64_t N, int cols,
                 const float* next, int64_t phase, int64_t stride) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  int64_t fetch = next ? phase : K;
  for (int64_t k = 0; k < K; ++k) {
    const float* line = panel + k * NR;
    if (k == fetch) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NR), _MM_HINT_T1);
      fetch += stride;
    }
    const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);
#pragma GCC unroll 6
    for (int m = 0; m < R; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < R; ++m) {
    alignas(32) float out[NR];
    _mm256_store_ps(out, acc[m][0]);
    _mm256_store_ps(out + 8, acc[m][1]);
    for (int c = 0; c < cols; ++c) y[m * N + c] = out[c] + (bias ? bias[c] : 0.0f);
  }
}

// Every row of x against one panel, in tiles of near-equal size: 7 rows as 4 + 3, not 6 + 1, since a tile of fewer
// than 4 rows waits on the FMA latency and two small tiles cost more than one big and one small.
void panel_rows(const float* x, const float* panel, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                int cols, const float* next) {
  const int64_t tiles = (M + MR - 1) / MR;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = (M - m + tiles - t - 1) / (tiles - t);
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (r) {
      case 6: tile<6>(xm, panel, bias, ym, K, N, cols, next, t, tiles); break;
      case 5: tile<5>(xm, panel, bias, ym, K, N, cols, next, t, tiles); break;
      case 4: tile<4>(xm, panel, bias, ym, K, N, cols, next, t, tiles); break;
      case 3: tile<3>(xm, panel, bias, ym, K, N, cols, next, t, tiles); break;
      case 2: tile<2>(xm, panel, bias, ym, K, N, cols, next, t, tiles); break;
      default: tile<1>(xm, panel, bias, ym, K, N, cols, next, t, tiles); break;
    }
    m += r;
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR && x.size(1) == panels.size(1),
              "small_linear: x [M, K] and panels [P, K, 16] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "small_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous(), "small_linear: contiguous x and panels expected");
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == panels.size(0), "small_linear: n does not match the panel count");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N),
              "small_linear: bias must be contiguous fp32 [n]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += SLICE) {
    const int64_t rows = std::min(SLICE, M - m0);
    at::parallel_for(0, P, 2, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
        const float* next = p + 1 < p1 ? pp + (p + 1) * K * NR : nullptr;
        panel_rows(xp + m0 * K, pp + p * K * NR, bp ? bp + p * NR : nullptr, yp + m0 * N + p * NR, rows, K, N, cols,
                   next);
      }
    });
  }
  return y;
}

}  // namespace

// a CPU kernel, not a composite one, so that a fake (shape-only) kernel can stand in for it under torch.compile
TORCH_LIBRARY(draftsmith_cpu, m) {
  m.def("small_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_cpu, CPU, m) {
  m.impl("small_linear", small_linear);
}
