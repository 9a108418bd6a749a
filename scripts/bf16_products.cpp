// Two bf16 product kernels for scripts/bf16_products.py, a study of one-row decode on CPUs with AMX: not used by the
// runtime. Both read the weight in panels of 16 output columns, k-pair-major (panels[p, j, c, i] = w[16p + c, 2j + i],
// one 64-byte line per pair of k), and give each output the same order of sums: chunk q of 16 k-pairs goes to chain
// q % 4, the pairs in order, the chains added (0 + 1) + (2 + 3), then the bias, rounded to bf16 once. Rows never mix,
// so each kernel alone is batch-invariant; the study asks whether the two agree bit for bit.
#include <algorithm>
#include <cstring>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int NR = 16;        // output columns per panel
constexpr int PAIRS = 16;     // k-pairs per chunk: the rows of an AMX B tile
constexpr int CHAINS = 4;
constexpr int64_t AHEAD = 8192;  // bytes of the panel stream prefetched ahead into L2 (the distance: docs/qwen.md)

void finish(const float* const* acc, const float* bias, at::BFloat16* y, int cols) {
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(acc[0]), _mm512_loadu_ps(acc[1])),
                           _mm512_add_ps(_mm512_loadu_ps(acc[2]), _mm512_loadu_ps(acc[3])));
  if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias));
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(s));
}

// AVX-512: vdpbf16ps, a tile of R rows broadcasting each (x[m, 2j], x[m, 2j + 1]) against the pair's line
template <int R>
void avx512_tile(const at::BFloat16* x, const at::BFloat16* panel, const float* bias, at::BFloat16* y, int64_t K,
                 int64_t N, int cols, bool fetch) {
  __m512 acc[R][CHAINS];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < CHAINS; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t chunks = K / (2 * PAIRS);
  for (int64_t g = 0; g < chunks; g += CHAINS)
    for (int q = 0; q < PAIRS; ++q)
      for (int c = 0; c < CHAINS; ++c) {
        const int64_t j = (g + c) * PAIRS + q;
        const at::BFloat16* line = panel + j * 2 * NR;
        if (fetch) _mm_prefetch(reinterpret_cast<const char*>(line) + AHEAD, _MM_HINT_T1);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(line);
        for (int m = 0; m < R; ++m) {
          int32_t v;
          std::memcpy(&v, x + m * K + 2 * j, 4);
          acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_set1_epi32(v), w);
        }
      }
  for (int m = 0; m < R; ++m) {
    alignas(64) float out[CHAINS][NR];
    for (int c = 0; c < CHAINS; ++c) _mm512_store_ps(out[c], acc[m][c]);
    const float* parts[CHAINS] = {out[0], out[1], out[2], out[3]};
    finish(parts, bias, y + m * N, cols);
  }
}

void avx512_panel(const at::BFloat16* x, const at::BFloat16* panel, const float* bias, at::BFloat16* y, int64_t M,
                  int64_t K, int64_t N, int cols) {
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t r = std::min<int64_t>(4, M - m);
    const bool f = m == 0;
    if (r == 4) avx512_tile<4>(x + m * K, panel, bias, y + m * N, K, N, cols, f);
    else if (r == 3) avx512_tile<3>(x + m * K, panel, bias, y + m * N, K, N, cols, f);
    else if (r == 2) avx512_tile<2>(x + m * K, panel, bias, y + m * N, K, N, cols, f);
    else avx512_tile<1>(x + m * K, panel, bias, y + m * N, K, N, cols, f);
  }
}

// AMX: tdpbf16ps, blocks of up to 16 rows; C tiles 0-3 are the chains, A tiles 4-5 and B tiles 6-7 alternate
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 6 ? rows : PAIRS;
  }
  _tile_loadconfig(&cfg);
}

#define AMX_CHUNK(C, A, B, q)                                          \
  _tile_loadd(A, x + (q) * 2 * PAIRS, K * 2);                          \
  _tile_loadd(B, panel + (q) * PAIRS * 2 * NR, 64);                    \
  _tile_dpbf16ps(C, A, B);

void amx_block(const at::BFloat16* x, const at::BFloat16* panel, const float* bias, at::BFloat16* y, int rows,
               int64_t K, int64_t N, int cols, bool fetch) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const char* stream = reinterpret_cast<const char*>(panel);
  for (int64_t g = 0; g < K / (2 * PAIRS); g += CHAINS) {
    if (fetch)
      for (int i = 0; i < CHAINS * PAIRS; ++i) _mm_prefetch(stream + g * 1024 + AHEAD + 64 * i, _MM_HINT_T1);
    AMX_CHUNK(0, 4, 6, g)
    AMX_CHUNK(1, 5, 7, g + 1)
    AMX_CHUNK(2, 4, 6, g + 2)
    AMX_CHUNK(3, 5, 7, g + 3)
  }
  alignas(64) float out[CHAINS][PAIRS * NR];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  for (int m = 0; m < rows; ++m) {
    const float* parts[CHAINS] = {out[0] + m * NR, out[1] + m * NR, out[2] + m * NR, out[3] + m * NR};
    finish(parts, bias, y + m * N, cols);
  }
}

// A prefill's rows, whose bits need not equal a decode's: 32 rows x 32 columns a step, each A and B tile read once
// for two products (C tiles 0-3: rows 0-15 and 16-31 against panels p and p + 1), one chain per output.
void amx_block_2x2(const at::BFloat16* x, const at::BFloat16* panel, int64_t panel_size, at::BFloat16* y, int64_t K,
                   int64_t N) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t q = 0; q < K / (2 * PAIRS); ++q) {
    _tile_loadd(4, x + q * 2 * PAIRS, K * 2);
    _tile_loadd(5, x + PAIRS * K + q * 2 * PAIRS, K * 2);
    _tile_loadd(6, panel + q * PAIRS * 2 * NR, 64);
    _tile_loadd(7, panel + panel_size + q * PAIRS * 2 * NR, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[4][PAIRS * NR];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  for (int t = 0; t < 4; ++t)
    for (int m = 0; m < PAIRS; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + ((t / 2) * PAIRS + m) * N + (t % 2) * NR),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out[t] + m * NR)));
}

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const std::optional<at::Tensor>& bias,
                  int64_t kernel) {
  const bool amx = kernel > 0;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == 2 && panels.is_contiguous()
              && panels.scalar_type() == at::kBFloat16 && 2 * panels.size(1) == x.size(1),
              "panels: contiguous bf16 [P, K / 2, 16, 2]");
  TORCH_CHECK(x.size(1) % (2 * PAIRS * CHAINS) == 0, "K must be a multiple of 128");
  TORCH_CHECK(!amx || amx_permitted(), "the kernel may not use AMX here");
  TORCH_CHECK(kernel != 2 || (x.size(0) % 32 == 0 && panels.size(0) % 2 == 0 && !bias),
              "the 32 x 32 blocks take whole blocks of rows and columns, and no bias");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), panel_size = K * NR;
  at::Tensor y = at::empty({M, N}, x.options());
  const at::BFloat16* xd = x.data_ptr<at::BFloat16>();
  const at::BFloat16* pd = panels.data_ptr<at::BFloat16>();
  const float* bd = bias ? bias->data_ptr<float>() : nullptr;
  at::BFloat16* yd = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, P, 2, [&](int64_t p0, int64_t p1) {
    int configured = 0;
    for (int64_t p = p0; p < p1; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      const float* b = bd ? bd + p * NR : nullptr;
      if (!amx) {
        avx512_panel(xd, pd + p * panel_size, b, yd + p * NR, M, K, N, cols);
        continue;
      }
      if (kernel == 2) {  // panels in pairs, rows in blocks of 32
        if (configured != PAIRS) configure(configured = PAIRS);
        if (p % 2 == 0)
          for (int64_t m = 0; m < M; m += 2 * PAIRS)
            amx_block_2x2(xd + m * K, pd + p * panel_size, panel_size, yd + m * N + p * NR, K, N);
        continue;
      }
      for (int64_t m = 0; m < M; m += PAIRS) {
        const int rows = static_cast<int>(std::min<int64_t>(PAIRS, M - m));
        if (rows != configured) configure(configured = rows);
        amx_block(xd + m * K, pd + p * panel_size, b, yd + m * N + p * NR, rows, K, N, cols, m == 0);
      }
    }
    if (configured) _tile_release();  // oneDNN configures its own tiles: leave none behind
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(draftsmith_bf16_study, m) {
  m.def("linear(Tensor x, Tensor panels, int n, Tensor? bias, int kernel) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_bf16_study, CPU, m) {
  m.impl("linear", linear);
}
