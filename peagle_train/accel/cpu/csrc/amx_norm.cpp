// RMSNorm and rotary embedding of bf16 rows for decoding (AVX-512). RMSNorm: one call instead of the ~9 tensor ops of the
// transformers module: y = w * bf16(x * rsqrt(mean(x^2) + eps)), in fp32 with the two bf16
// roundings of LlamaRMSNorm. Each row is reduced by itself in a fixed order (16 lanes, then the
// lanes in order), so its output does not depend on the other rows. Built with amx_linear.cpp by
// peagle_train/decoding/amx_linear.py.
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

// Rotary position embedding of bf16 q [B, H, n, d] and k [B, kv_heads, n, d] (any strides, last dim
// contiguous) with cos, sin [B|1, n, d] bf16, as transformers' apply_rotary_pos_emb computes it in
// bf16: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1]. Every
// element is rounded as there, so the outputs are the same bits. Returns contiguous tensors.
std::vector<torch::Tensor> rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                                const torch::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes(),
              "rope: bf16 q, k [B, heads, n, d] and cos, sin [B|1, n, d]");
  const int64_t B = q.size(0), n = q.size(2), d = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == n && k.size(3) == d && cos.size(1) == n && cos.size(2) == d &&
                  (cos.size(0) == B || cos.size(0) == 1) && d % 32 == 0 && q.stride(3) == 1 && k.stride(3) == 1,
              "rope: matching shapes, head_dim a multiple of 32");
  auto cc = cos.contiguous(), sc = sin.contiguous();
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cc.data_ptr<at::BFloat16>());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const int64_t cb = cos.size(0) == 1 ? 0 : n * d, half = d / 2;
  std::vector<torch::Tensor> outs;
  for (const auto* x : {&q, &k}) {
    const int64_t H = x->size(1);
    auto out = torch::empty({B, H, n, d}, x->options());
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x->data_ptr<at::BFloat16>());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const int64_t s0 = x->stride(0), s1 = x->stride(1), s2 = x->stride(2);
    at::parallel_for(0, B * H * n, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / (H * n), h = (r / n) % H, i = r % n;
        const uint16_t* xr = xp + b * s0 + h * s1 + i * s2;
        const uint16_t* c = cp + b * cb + i * d;
        const uint16_t* s = sp + b * cb + i * d;
        uint16_t* o = op + r * d;
        for (int64_t j = 0; j < half; j += 16) {
          const __m512 x1 = load_bf16(xr + j, 0xFFFF), x2 = load_bf16(xr + half + j, 0xFFFF);
          // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (each product rounded to bf16)
          const __m512 a1 = round_bf16(_mm512_mul_ps(x1, load_bf16(c + j, 0xFFFF)));
          const __m512 b1 = round_bf16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN))), load_bf16(s + j, 0xFFFF)));
          store_bf16(o + j, _mm512_add_ps(a1, b1), 0xFFFF);
          const __m512 a2 = round_bf16(_mm512_mul_ps(x2, load_bf16(c + half + j, 0xFFFF)));
          const __m512 b2 = round_bf16(_mm512_mul_ps(x1, load_bf16(s + half + j, 0xFFFF)));
          store_bf16(o + half + j, _mm512_add_ps(a2, b2), 0xFFFF);
        }
      }
    });
    outs.push_back(out);
  }
  return outs;
}
