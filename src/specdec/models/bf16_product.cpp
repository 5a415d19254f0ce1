// y = x @ w.T for float32 rows x [rows, in] and a bfloat16 weight stored in blocks of 16 outputs,
// w [out / 16, in, 16], on a CPU with AVX2 and FMA. Within a block the 16 values of an input are interleaved:
// position 2j holds output j and 2j + 1 output 8 + j, so the 32-bit word j is (output j, output 8 + j) and one
// 256-bit load widens to both halves with a shift (outputs 0-7) and a mask (outputs 8-15).
//
// Each output lane is one chain of fused multiply-adds over the inputs in order, whatever the number of
// rows: a row's values do not depend on the rows computed beside it (batch invariant), and widening a
// bfloat16 to float32 is exact, so the product is float32 arithmetic on the weight's own values. The
// weight is read once per call: rows go through a block 6 at a time (6 x 16 accumulators in registers);
// beyond 6 rows, each slice of KC inputs of a block is widened once into a buffer the passes share.
// Built and loaded by specdec/models/bf16_product.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t BLOCK = 16;   // outputs per block of the weight
constexpr int64_t ROWS = 6;     // rows one pass keeps in registers
constexpr int64_t KC = 256;     // inputs per slice of a block: 16 KB of float32, in the first-level cache

// The 16 weights of one input: outputs 0-7 in lo, 8-15 in hi.
inline void load16(const float* p, __m256& lo, __m256& hi) {  // a widened slice: natural order
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

inline void load16(const uint16_t* p, __m256& lo, __m256& hi) {  // 16 interleaved bfloat16 -> float32, exact
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// y[r, 0:16] (+)= sum over i < k of x[i, r] * w[i, 0:16], for R rows; x holds ROWS values per input.
template <int R, typename W>
void pass(const float* x, int64_t k, const W* w, float* y, int64_t ldy, bool first) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy);
    hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8);
  }
  for (int64_t i = 0; i < k; ++i) {
    __m256 w0, w1;
    load16(w + i * BLOCK, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ROWS + r);
      lo[r] = _mm256_fmadd_ps(w0, xv, lo[r]);
      hi[r] = _mm256_fmadd_ps(w1, xv, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, lo[r]);
    _mm256_storeu_ps(y + r * ldy + 8, hi[r]);
  }
}

template <typename W>
void rows_pass(int64_t rows, const float* x, int64_t k, const W* w, float* y, int64_t ldy, bool first) {
  switch (rows) {
    case 1: pass<1>(x, k, w, y, ldy, first); break;
    case 2: pass<2>(x, k, w, y, ldy, first); break;
    case 3: pass<3>(x, k, w, y, ldy, first); break;
    case 4: pass<4>(x, k, w, y, ldy, first); break;
    case 5: pass<5>(x, k, w, y, ldy, first); break;
    default: pass<6>(x, k, w, y, ldy, first); break;
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
  // x as passes of ROWS rows, each [in, ROWS] (the rows past the last are zeros, never stored)
  const int64_t passes = (rows + ROWS - 1) / ROWS;
  auto padded = torch::zeros({passes * ROWS, in}, x.options());
  padded.narrow(0, 0, rows).copy_(x);
  const auto xt = padded.view({passes, ROWS, in}).transpose(1, 2).contiguous();
  const float* xp = xt.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(32) float slice[KC * BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* wb = wp + b * in * BLOCK;
      for (int64_t k0 = 0; k0 < in; k0 += KC) {
        const int64_t k = std::min(KC, in - k0);
        const bool first = k0 == 0;
        if (passes == 1) {
          rows_pass(rows, xp + k0 * ROWS, k, wb + k0 * BLOCK, yp + b * BLOCK, out, first);
          continue;
        }
        for (int64_t j = 0; j < k * BLOCK; j += BLOCK) {
          __m256 lo, hi;
          load16(wb + k0 * BLOCK + j, lo, hi);
          _mm256_store_ps(slice + j, lo);
          _mm256_store_ps(slice + j + 8, hi);
        }
        for (int64_t p = 0; p < passes; ++p) {
          const int64_t r = p * ROWS;
          rows_pass(std::min(ROWS, rows - r), xp + (p * in + k0) * ROWS, k, static_cast<const float*>(slice),
                    yp + r * out + b * BLOCK, out, first);
        }
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocked_linear", &blocked_linear, "float32 rows times a blocked bfloat16 weight, float32 out");
}
