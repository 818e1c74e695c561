// bf16 linear layers on Intel AMX for decoding: y = x @ w.T (+ bias), fp32 accumulation in the AMX
// tiles, one rounding to bf16. Built at first use by peagle_train/accel/cpu/amx_linear.py.
//
// Weights are packed once into groups of 64 output features, k in VNNI pairs:
//   packed[g, p, j, t] = w[64 g + j, 2 p + t]   (zero padded to 64 features and to k a multiple of 32)
// so that the B tile of 16 pairs x 16 features is 16 rows of 64 bytes with a 256-byte stride.
// Every group's weights (64 x K bf16, 72 KiB for K = 576) are read from memory once per call and
// reused from cache by every 16-row chunk of x (prefetching never faults past the end). Each output row depends on its input row only, in
// the same order whatever the number of rows: a 1-row forward and the same row in a (K+1)-row
// verify round identically.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

namespace {

constexpr int64_t kGroup = 64;  // output features per group: 4 C tiles of 16
constexpr int64_t kChunk = 32;  // k per A / B tile (16 VNNI pairs)
constexpr int64_t kRows = 16;   // rows of x per A tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }  // C0..3: rows x 16 fp32; A: rows x 32 bf16
  for (int t = 5; t < 7; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }    // B: 16 pairs x 16 features x 2
  _tile_loadconfig(&cfg);
}

}  // namespace

// Asks the kernel for the AMX tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool available() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.device().is_cpu(),
              "pack: a bf16 CPU weight [out, in]");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), groups = (N + kGroup - 1) / kGroup;
  const int64_t pairs = (K + kChunk - 1) / kChunk * (kChunk / 2);
  auto out = torch::zeros({groups, pairs, kGroup, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = 0; j < kGroup && g * kGroup + j < N; ++j)
        for (int64_t k = 0; k < K; ++k)
          dst[((g * pairs + k / 2) * kGroup + j) * 2 + (k & 1)] = src[(g * kGroup + j) * K + k];
  });
  return out;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(available(), "linear: this CPU or kernel gives no AMX tile state");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && packed.dim() == 4,
              "linear: bf16 CPU input and a packed weight");
  const int64_t groups = packed.size(0), pairs = packed.size(1), K = x.size(-1), Kpad = 2 * pairs, N = out_features;
  TORCH_CHECK(K <= Kpad && Kpad - K < kChunk && groups * kGroup >= N && (groups - 1) * kGroup < N,
              "linear: input features or out_features do not match the packed weight");
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto x2 = x.reshape({-1, K});
  if (Kpad != K) x2 = at::constant_pad_nd(x2, {0, Kpad - K});
  x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out.reshape(shape);
  torch::Tensor bias32;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias32 = bias->to(at::kFloat).contiguous();
    b = bias32.data_ptr<float>();
  }
  const char* xp = reinterpret_cast<const char*>(x2.data_ptr<at::BFloat16>());
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  c10::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t group_bytes = pairs * kGroup * 4, x_stride = Kpad * 2, b_stride = kGroup * 4;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[kRows * kGroup];
    int configured = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const char* wg = wp + g * group_bytes;
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        const int rows = static_cast<int>(std::min(kRows, M - r0));
        if (rows != configured) { configure(rows); configured = rows; }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const char* xr = xp + r0 * x_stride;
        for (int64_t kc = 0; kc < pairs / 16; ++kc) {
          const char* bt = wg + kc * 16 * b_stride;
          // the packed weights are one stream: prefetch the next 4 KiB block (the hardware
          // prefetcher alone leaves ~25% of the memory's bandwidth unused here)
          for (int l = 0; l < 4096; l += 64) _mm_prefetch(bt + 4096 + l, _MM_HINT_T0);
          _tile_loadd(4, xr + kc * 64, x_stride);
          _tile_loadd(5, bt, b_stride);       _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, bt + 64, b_stride);  _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, bt + 128, b_stride); _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, bt + 192, b_stride); _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, c, b_stride); _tile_stored(1, c + 16, b_stride);
        _tile_stored(2, c + 32, b_stride); _tile_stored(3, c + 48, b_stride);
        for (int t = 0; t < 4; ++t) {
          const int64_t n = g * kGroup + t * 16;
          if (n >= N) break;
          const __mmask16 m = N - n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1u);
          const __m512 bv = b ? _mm512_maskz_loadu_ps(m, b + n) : _mm512_setzero_ps();
          for (int r = 0; r < rows; ++r) {
            const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + r * kGroup + t * 16), bv));
            _mm256_mask_storeu_epi16(op + (r0 + r) * N + n, m, reinterpret_cast<const __m256i&>(y));
          }
        }
      }
    }
    if (configured) _tile_release();
  });
  return out.reshape(shape);
}

// csrc/amx_attention.cpp
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& lane_mask, double scale);

// csrc/amx_norm.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("attention", &attention);
  m.def("rms_norm", &rms_norm);
}
