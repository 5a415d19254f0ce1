// y = x @ w.T for float32 rows x [rows, in] and a bfloat16 weight stored in blocks of 16 outputs,
// w [out / 16, in, 16], on a CPU with AVX2 and FMA. Within a block the 16 values of an input are interleaved:
// position 2j holds output j and 2j + 1 output 8 + j, so the 32-bit word j is (output j, output 8 + j) and one
// 256-bit load widens to both halves with a shift (outputs 0-7) and a mask (outputs 8-15).
//
// Each output lane is one chain of fused multiply-adds over the inputs in order, whatever the number of
// rows: a row's values do not depend on the rows computed beside it (batch invariant), and widening a
// bfloat16 to float32 is exact, so the product is float32 arithmetic on the weight's own values. The
// weight is read from memory once per call, one slice of KC inputs of a block (or of a group of blocks) at a
// time, every pass going over the slice while it is in the first-level cache. Rows go in passes of at most 6
// (6 x 16 accumulators in registers), the passes of near-equal size. A multiply-add's result is ready 4 cycles
// after it starts and two can start each cycle, so a pass needs 8 or more independent chains to keep the
// units busy: a pass of 1 or 2 rows takes 4 or 2 blocks at once (8 chains each), where one block would leave a
// decoding step's single row bound by the latency of its 2 chains, not by memory. A pass of 3 rows takes one
// block (6 chains): two blocks' 12 accumulators, 4 weight registers and the rows' 3 broadcasts (shared by the
// blocks) are 19 of AVX2's 16 registers, and the spills made 3 rows slower than 4.
// Built and loaded by specdec/models/bf16_product.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK = 16;   // outputs per block of the weight
constexpr int64_t ROWS = 6;     // rows one pass keeps in registers
constexpr int64_t KC = 256;     // inputs per slice of a block: 8 KB of bfloat16, in the first-level cache
constexpr int64_t PREFETCH = 128;  // inputs ahead (4 KB) that a pass of one block prefetches its weights

// The 16 weights of one input, interleaved bfloat16 widened to float32 (exact): outputs 0-7 in lo, 8-15 in hi.
inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y[r, 16 j : 16 j + 16] (+)= sum over i < k of x[i, r] * w_j[i, 0:16], for R rows and NB blocks j (block j's
// weights at w + j * ldw); x holds ROWS values per input. 2 x R x NB accumulator chains in registers.
template <int R, int NB>
void pass(const float* x, int64_t k, const uint16_t* w, int64_t ldw, float* y, int64_t ldy, bool first) {
  __m256 lo[NB][R], hi[NB][R];
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[j][r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + j * BLOCK);
      hi[j][r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + j * BLOCK + 8);
    }
  }
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      __m256 w0, w1;
      if constexpr (NB == 1) {  // 3-6 rows (or blocks left over): the multiply-adds keep the core busy, so
        // ask for the weights early
        if ((i & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (i + PREFETCH) * BLOCK), _MM_HINT_T0);
      }
      load16(w + j * ldw + i * BLOCK, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + i * ROWS + r);
        lo[j][r] = _mm256_fmadd_ps(w0, xv, lo[j][r]);
        hi[j][r] = _mm256_fmadd_ps(w1, xv, hi[j][r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * ldy + j * BLOCK, lo[j][r]);
      _mm256_storeu_ps(y + r * ldy + j * BLOCK + 8, hi[j][r]);
    }
  }
}

// Blocks that one pass of `rows` rows takes together (2 x rows x blocks accumulator chains: 8 for 1 or 2 rows,
// 6 to 12 for 3 to 6).
inline int64_t blocks_per_pass(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

void rows_pass(int64_t rows, int64_t nb, const float* x, int64_t k, const uint16_t* w, int64_t ldw, float* y,
               int64_t ldy, bool first) {
  if (nb == 1) {
    switch (rows) {
      case 1: pass<1, 1>(x, k, w, ldw, y, ldy, first); return;
      case 2: pass<2, 1>(x, k, w, ldw, y, ldy, first); return;
      case 3: pass<3, 1>(x, k, w, ldw, y, ldy, first); return;
      case 4: pass<4, 1>(x, k, w, ldw, y, ldy, first); return;
      case 5: pass<5, 1>(x, k, w, ldw, y, ldy, first); return;
      default: pass<6, 1>(x, k, w, ldw, y, ldy, first); return;
    }
  }
  switch (rows) {  // only a pass of 1 or 2 rows takes several blocks (blocks_per_pass)
    case 1: pass<1, 4>(x, k, w, ldw, y, ldy, first); return;
    default: pass<2, 2>(x, k, w, ldw, y, ldy, first); return;
  }
}

}  // namespace

torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be float32 [rows, in] on the CPU");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 3 && w.size(2) == BLOCK &&
              w.is_contiguous(), "w must be a contiguous bfloat16 [out / 16, in, 16] on the CPU");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " inputs, w ", w.size(1));
  const int64_t rows = x.size(0), in = x.size(1), blocks = w.size(0), out = blocks * BLOCK;
  auto y = torch::empty({rows, out}, x.options());
  if (rows == 0 || in == 0) return rows == 0 ? y : y.zero_();
  // rows in passes of near-equal size, at most ROWS each: pass p holds rows starts[p] .. starts[p] + sizes[p]
  const int64_t passes = (rows + ROWS - 1) / ROWS;
  std::vector<int64_t> sizes(passes), starts(passes);
  for (int64_t p = 0, r = 0; p < passes; ++p) {
    sizes[p] = rows / passes + (p < rows % passes ? 1 : 0);
    starts[p] = r;
    r += sizes[p];
  }
  // x as passes, each [in, ROWS] (the rows past a pass's size are zeros, never stored)
  auto padded = torch::zeros({passes, ROWS, in}, x.options());
  for (int64_t p = 0; p < passes; ++p) padded[p].narrow(0, 0, sizes[p]).copy_(x.narrow(0, starts[p], sizes[p]));
  const auto xt = padded.transpose(1, 2).contiguous();
  const float* xp = xt.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  // blocks go through in groups of the smallest pass's blocks_per_pass (the last pass is the smallest)
  const int64_t group = blocks_per_pass(sizes[passes - 1]);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const int64_t nb = b + group <= b1 ? group : 1;
      const uint16_t* wb = wp + b * in * BLOCK;
      for (int64_t k0 = 0; k0 < in; k0 += KC) {
        const int64_t k = std::min(KC, in - k0);
        for (int64_t p = 0; p < passes; ++p) {
          const int64_t g = std::min(blocks_per_pass(sizes[p]), nb);
          for (int64_t j = 0; j < nb; j += g) {
            rows_pass(sizes[p], g, xp + (p * in + k0) * ROWS, k, wb + (j * in + k0) * BLOCK, in * BLOCK,
                      yp + starts[p] * out + (b + j) * BLOCK, out, k0 == 0);
          }
        }
      }
      b += nb;
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocked_linear", &blocked_linear, "float32 rows times a blocked bfloat16 weight, float32 out");
}
