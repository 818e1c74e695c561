// RMSNorm of bf16 rows for decoding (AVX-512): one call instead of the ~9 tensor ops of the
// transformers module: y = w * bf16(x * rsqrt(mean(x^2) + eps)), in fp32 with the two bf16
// roundings of LlamaRMSNorm. Each row is reduced by itself in a fixed order (16 lanes, then the
// lanes in order), so its output does not depend on the other rows. Built with amx_linear.cpp by
// peagle_train/accel/cpu/amx_linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m) {
  const __m256bh y = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<const __m256i&>(y));
}

inline __m512 round_bf16(__m512 v) {  // to the nearest bf16 (ties to even), back in fp32
  const __m256bh y = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(y)), 16));
}

}  // namespace

// x [..., H] bf16, weight [H] bf16 -> [..., H] bf16.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: bf16 CPU rows [..., H] and a bf16 weight [H]");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t H = x.size(-1), rows = H ? xc.numel() / H : 0;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + r * H;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = H - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (H - i)) - 1u);
        const __m512 v = load_bf16(xr + i, m);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc);
      float sum = 0.0f;
      for (int l = 0; l < 16; ++l) sum += lanes[l];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + feps);
      const __m512 s = _mm512_set1_ps(inv);
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = H - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (H - i)) - 1u);
        const __m512 y = load_bf16(xr + i, m);
        // round x * inv to bf16 first (the module's hidden_states.to(input_dtype)), then times w
        store_bf16(op + r * H + i, _mm512_mul_ps(load_bf16(wp + i, m), round_bf16(_mm512_mul_ps(y, s))), m);
      }
    }
  });
  return out;
}
