// Decoding attention of a bf16 target on Intel AMX: q·k in the AMX tiles (fp32 accumulation),
// softmax and the weighted sum of values in fp32, the output rounded once to bf16. Built with
// amx_linear.cpp by peagle_train/accel/cpu/amx_linear.py.
//
// Every query's output depends only on its own query vector and on the keys and values of the
// slots it may see, in slot order: scores come from one tile product per (key, query), the softmax
// sums over keys one after another (a masked key adds an exact 0), and the weighted sum of values
// adds one key at a time with an fp32 FMA (a masked key's weight is exactly 0). The result is the
// same whatever the number of queries, of rows in the batch, or of masked slots (holes) between
// the visible ones: a 1-token forward and a (K+1)-token verify round each token alike.
//
// Layout: the queries of one kv head (g = heads / kv_heads query heads times n new slots, as
// lanes r = head_in_group * n + i) are processed 16 at a time; scores are kept as [key][lane] so
// that the softmax runs across lanes with a sequential reduction over keys.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct alignas(64) AttnTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// e^x for every lane (|x| clamped to the fp32 range): x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// degree-7 Taylor polynomial (relative error < 2e-7), scaled by 2^n.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 bf16_to_ps(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// res[u][t] = sum over slots j (in order) of w[j * 16 + u] * v_j[16 t .. 16 t + 15], for NQ lanes and
// DV vectors of 16 values (head_dim = 16 DV); slots whose weights are all 0 are skipped (adding
// 0 * v leaves the sums as they are). The accumulators stay in registers.
template <int DV, int NQ>
void weighted_sum(const float* w, const uint16_t* v, int64_t vs, int64_t S, float* res) {
  __m512 acc[NQ * DV];
  for (int a = 0; a < NQ * DV; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    const float* wj = w + j * 16;
    bool any = false;
    for (int u = 0; u < NQ; ++u) any |= wj[u] != 0.0f;
    if (!any) continue;
    const uint16_t* vr = v + j * vs;
    for (int t = 0; t < DV; ++t) {
      const __m512 vv = bf16_to_ps(vr + 16 * t);
      for (int u = 0; u < NQ; ++u) acc[u * DV + t] = _mm512_fmadd_ps(_mm512_set1_ps(wj[u]), vv, acc[u * DV + t]);
    }
  }
  for (int a = 0; a < NQ * DV; ++a) _mm512_store_ps(res + a * 16, acc[a]);
}

template <int DV>
void weighted_sum_nq(int nq, const float* w, const uint16_t* v, int64_t vs, int64_t S, float* res) {
  switch (nq) {
    case 1: return weighted_sum<DV, 1>(w, v, vs, S, res);
    case 2: if constexpr (2 * DV <= 24) return weighted_sum<DV, 2>(w, v, vs, S, res); break;
    case 3: if constexpr (3 * DV <= 24) return weighted_sum<DV, 3>(w, v, vs, S, res); break;
    case 4: if constexpr (4 * DV <= 24) return weighted_sum<DV, 4>(w, v, vs, S, res); break;
    case 5: if constexpr (5 * DV <= 24) return weighted_sum<DV, 5>(w, v, vs, S, res); break;
    case 6: if constexpr (6 * DV <= 24) return weighted_sum<DV, 6>(w, v, vs, S, res); break;
    default: break;
  }
  TORCH_CHECK(false, "attention: unsupported lane group");
}

void weighted_sum_dispatch(int dv, int nq, const float* w, const uint16_t* v, int64_t vs, int64_t S, float* res) {
  switch (dv) {
    case 2: return weighted_sum_nq<2>(nq, w, v, vs, S, res);
    case 4: return weighted_sum_nq<4>(nq, w, v, vs, S, res);
    case 6: return weighted_sum_nq<6>(nq, w, v, vs, S, res);
    case 8: return weighted_sum_nq<8>(nq, w, v, vs, S, res);
    case 10: return weighted_sum_nq<10>(nq, w, v, vs, S, res);
    case 12: return weighted_sum_nq<12>(nq, w, v, vs, S, res);
    case 14: return weighted_sum_nq<14>(nq, w, v, vs, S, res);
    case 16: return weighted_sum_nq<16>(nq, w, v, vs, S, res);
    default: TORCH_CHECK(false, "attention: head_dim must be a multiple of 32 up to 256");
  }
}

}  // namespace

// q [B, H, n, d] bf16; k, v [B, kv_heads, S, d] bf16 (last dim contiguous, other strides free, e.g.
// views of a preallocated cache); lane_mask: empty (causal: new slot i sees slots <= S - n + i) or
// uint8 [Bm, chunks, S, 16] (Bm = 1 or B; 1 = query lane l of chunk c sees slot j), built by
// amx_linear.py from the attention mask. Returns [B, n, H, d] bf16. A query that sees no slot
// gets zeros.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& lane_mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "attention: bf16 query, keys and values");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "attention: 4-d q, k, v");
  const int64_t B = q.size(0), H = q.size(1), n = q.size(2), d = q.size(3);
  const int64_t kvh = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == d && H % kvh == 0 && d % 32 == 0 && d <= 256 && S >= 1,
              "attention: shapes (d a multiple of 32 up to 256, heads a multiple of kv heads)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: keys and values contiguous in the last dim");
  const int64_t g = H / kvh, rows = g * n, chunks = (rows + 15) / 16;
  const bool masked = lane_mask.defined() && lane_mask.numel() > 0;
  if (masked)
    TORCH_CHECK(lane_mask.scalar_type() == at::kByte && lane_mask.dim() == 4 && lane_mask.size(1) == chunks &&
                    lane_mask.size(2) == S && lane_mask.size(3) == 16 && (lane_mask.size(0) == 1 || lane_mask.size(0) == B) &&
                    lane_mask.is_contiguous(),
                "attention: lane_mask [1|B, chunks, S, 16] uint8");
  auto qc = q.contiguous();
  auto out = torch::empty({B, n, H, d}, q.options());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const uint8_t* mp = masked ? lane_mask.data_ptr<uint8_t>() : nullptr;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t kb = k.stride(0), kh_s = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh_s = v.stride(1), vs = v.stride(2);
  const int64_t dchunks = d / 32, dv = d / 16, Spad = (S + 15) / 16 * 16;
  const float fscale = static_cast<float>(scale);
  // queries per pass of the weighted sum: their accumulators (d / 16 vectors each) fill <= 24 registers
  const int64_t qg = std::min<int64_t>(6, std::max<int64_t>(1, 24 / dv));

  at::parallel_for(0, B * kvh, 1, [&](int64_t t0, int64_t t1) {
    AttnTileConfig cfg;
    for (int t = 0; t < 3; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  // 0: C [16 keys x 16 lanes] fp32; 1: A keys; 2: B queries
    _tile_loadconfig(&cfg);
    std::vector<float> sc(Spad * 16);
    alignas(64) uint16_t qt[8 * 16 * 32];   // queries, VNNI: [d chunk][16 pairs][16 lanes][2]
    alignas(64) uint16_t tail[16 * 256];    // the last partial block of keys, zero padded
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / kvh, kh = task % kvh;
      const uint16_t* kbase = kp + b * kb + kh * kh_s;
      const uint16_t* vbase = vp + b * vb + kh * vh_s;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t lanes = std::min<int64_t>(16, rows - 16 * c);
        std::fill(qt, qt + dchunks * 16 * 32, 0);
        for (int64_t l = 0; l < lanes; ++l) {
          const int64_t r = 16 * c + l, h = kh * g + r / n, i = r % n;
          const uint16_t* src = qp + ((b * H + h) * n + i) * d;
          for (int64_t e = 0; e < d; ++e) qt[((e / 32) * 16 + (e % 32) / 2) * 32 + l * 2 + (e & 1)] = src[e];
        }
        // scores [key][lane] = k_key . q_lane
        for (int64_t j0 = 0; j0 < S; j0 += 16) {
          const int64_t nk = std::min<int64_t>(16, S - j0);
          const uint16_t* kblk = kbase + j0 * ks;
          int64_t stride = ks * 2;
          if (nk < 16) {
            std::fill(tail, tail + 16 * d, 0);
            for (int64_t j = 0; j < nk; ++j) std::copy(kblk + j * ks, kblk + j * ks + d, tail + j * d);
            kblk = tail;
            stride = d * 2;
          }
          _tile_zero(0);
          for (int64_t dc = 0; dc < dchunks; ++dc) {
            _tile_loadd(1, kblk + dc * 32, stride);
            _tile_loadd(2, qt + dc * 16 * 32, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
          _tile_stored(0, sc.data() + j0 * 16, 64);
        }
        // softmax over keys, lane by lane: the max of the visible scores, then their exps summed in slot order
        __m512i lim = _mm512_set1_epi32(0);
        if (!masked) {
          alignas(64) int32_t li[16];
          for (int l = 0; l < 16; ++l) li[l] = static_cast<int32_t>(S - n + ((16 * c + l) % n));
          lim = _mm512_load_si512(li);
        }
        const uint8_t* mrow = masked ? mp + ((lane_mask.size(0) == 1 ? 0 : b) * chunks + c) * S * 16 : nullptr;
        auto visible = [&](int64_t j) -> __mmask16 {
          if (masked) return _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mrow + j * 16)), _mm_set1_epi8(-1));
          return _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j)), lim, _MM_CMPINT_LE);
        };
        const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        __m512 mx = ninf;
        for (int64_t j = 0; j < S; ++j) {
          const __mmask16 vm = visible(j);
          const __m512 s = _mm512_mask_mov_ps(ninf, vm, _mm512_mul_ps(_mm512_loadu_ps(sc.data() + j * 16), _mm512_set1_ps(fscale)));
          _mm512_storeu_ps(sc.data() + j * 16, s);
          mx = _mm512_max_ps(mx, s);
        }
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < S; ++j) {
          const __mmask16 vm = visible(j);
          const __m512 e = _mm512_maskz_mov_ps(vm, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + j * 16), mx)));
          _mm512_storeu_ps(sc.data() + j * 16, e);
          sum = _mm512_add_ps(sum, e);
        }
        alignas(64) float sums[16];
        _mm512_store_ps(sums, sum);
        // weighted sum of values, qg lanes at a time, one key after another
        for (int64_t l0 = 0; l0 < lanes; l0 += qg) {
          const int nq = static_cast<int>(std::min<int64_t>(qg, lanes - l0));
          alignas(64) float res[24 * 16];
          weighted_sum_dispatch(static_cast<int>(dv), nq, sc.data() + l0, vbase, vs, S, res);
          for (int64_t u = 0; u < nq; ++u) {
            const int64_t r = 16 * c + l0 + u, h = kh * g + r / n, i = r % n;
            const float s = sums[l0 + u];
            uint16_t* dst = op + ((b * n + i) * H + h) * d;
            for (int64_t t = 0; t < dv; ++t) {
              const __m512 o = s > 0 ? _mm512_div_ps(_mm512_load_ps(res + (u * dv + t) * 16), _mm512_set1_ps(s)) : _mm512_setzero_ps();
              const __m256bh y = _mm512_cvtneps_pbh(o);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * t), reinterpret_cast<const __m256i&>(y));
            }
          }
        }
      }
    }
    _tile_release();
  });
  return out;
}
