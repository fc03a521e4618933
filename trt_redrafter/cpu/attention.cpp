// Tree attention over the paged KV cache on the CPU: the contract of model/attention.py (its oracle,
// torch_tree_attention, gathers every key of the block table, builds a dense mask and calls SDPA), computed here by
// reading each request's keys in place through its block table, only the ones a query row may see.
//
// Query row t of request b (head h, KV head h / (nh / nkv)) sees the ctx_len[b] committed positions and the new
// tokens q with tree_mask[b, t, q] (at positions ctx_len[b] + q). Its output is one fp32 computation in a fixed
// order: scores in position order, their max, then sum_j exp(s_j - max) v_j and sum_j exp(s_j - max) accumulated in
// position order (exp: a vectorized polynomial, exp_nonpos), the quotient rounded once to the output dtype. Nothing else enters it: not the number of new
// tokens T, not the batch, not the threads. So the token an AR step feeds (T = 1) and the same token at the root
// of a draft tree get the same bits, without the oracle's extra query rows (attention.PAD_QUERY_ROWS).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using trt_redrafter_cpu::load16;
using trt_redrafter_cpu::store16;

// e^x for x <= 0 (scores minus their max), 16 at a time: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts),
// e^r by its Taylor series to r^7 (error below 1e-8 relative), times 2^n. Below -87.3 the result is 0.
inline __m512 exp_nonpos(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(p, n));
}

// One query row against the keys it sees (ND * 16 = D; q and the output accumulator stay in registers).
template <typename T, int ND>
void attend_row(const T* qrow, const T* kc, const T* vc, const int64_t* key_off, const int64_t* tree_off,
                const bool* mask, int64_t n, int64_t Tn, float scale, std::vector<float>& scores,
                std::vector<const T*>& vrows, T* orow) {
  __m512 qv[ND], acc[ND];
  for (int i = 0; i < ND; ++i) qv[i] = load16(qrow + 16 * i);
  scores.clear();
  vrows.clear();
  auto visit = [&](int64_t off) {
    __m512 d = _mm512_mul_ps(qv[0], load16(kc + off));
    for (int i = 1; i < ND; ++i) d = _mm512_fmadd_ps(qv[i], load16(kc + off + 16 * i), d);
    scores.push_back(_mm512_reduce_add_ps(d) * scale);
    vrows.push_back(vc + off);
  };
  for (int64_t j = 0; j < n; ++j) visit(key_off[j]);
  for (int64_t j = 0; j < Tn; ++j)
    if (mask[j]) visit(tree_off[j]);
  const int64_t S = (int64_t)scores.size();
  float mx = -INFINITY;
  for (float v : scores) mx = std::max(mx, v);
  scores.resize((S + 15) / 16 * 16, -INFINITY);  // padding lanes: e^-inf = 0, never summed below
  const __m512 vmx = _mm512_set1_ps(mx);
  for (int64_t j = 0; j < S; j += 16)
    _mm512_storeu_ps(scores.data() + j, exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + j), vmx)));
  for (int i = 0; i < ND; ++i) acc[i] = _mm512_setzero_ps();
  float sum = 0.f;
  for (int64_t j = 0; j < S; ++j) {
    sum += scores[j];
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int i = 0; i < ND; ++i) acc[i] = _mm512_fmadd_ps(p, load16(vrows[j] + 16 * i), acc[i]);
  }
  const __m512 inv = _mm512_set1_ps(S ? 1.f / sum : 0.f);
  for (int i = 0; i < ND; ++i) store16(orow + 16 * i, _mm512_mul_ps(acc[i], inv));
}

template <typename T, int ND>
void attend(const T* q, const T* kc, const T* vc, const int64_t* block_table, const int64_t* ctx_len,
            const bool* tree_mask, T* out, int64_t bs, int64_t Tn, int64_t nh, int64_t nkv, int64_t nblk,
            int64_t block_size, float scale) {
  constexpr int64_t D = 16 * ND;
  const int64_t group = nh / nkv;
  // each request's key offsets (slot * nkv * D) for positions 0 .. ctx_len + T - 1, through its block table
  std::vector<std::vector<int64_t>> offs(bs);
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = ctx_len[b] + Tn;
    offs[b].resize(len);
    for (int64_t pos = 0; pos < len; ++pos)
      offs[b][pos] = (block_table[b * nblk + pos / block_size] * block_size + pos % block_size) * nkv * D;
  }
  at::parallel_for(0, bs * Tn * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> vrows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % nh, t = (item / nh) % Tn, b = item / (nh * Tn);
      const int64_t n = ctx_len[b], kv = (h / group) * D;
      const int64_t* key_off = offs[b].data();
      attend_row<T, ND>(q + ((b * Tn + t) * nh + h) * D, kc + kv, vc + kv, key_off, key_off + n,
                        tree_mask + (b * Tn + t) * Tn, n, Tn, scale, scores, vrows, out + ((b * Tn + t) * nh + h) * D);
    }
  });
}

template <typename T>
void attend_d(int64_t D, const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* cl, const bool* tm,
              T* out, int64_t bs, int64_t Tn, int64_t nh, int64_t nkv, int64_t nblk, int64_t bsz, float scale) {
  switch (D) {  // head sizes 16 .. 128 in steps of 16 (cpu.attention_supports)
    case 16: return attend<T, 1>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 32: return attend<T, 2>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 48: return attend<T, 3>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 64: return attend<T, 4>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 80: return attend<T, 5>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 96: return attend<T, 6>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 112: return attend<T, 7>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    case 128: return attend<T, 8>(q, kc, vc, bt, cl, tm, out, bs, Tn, nh, nkv, nblk, bsz, scale);
    default: TORCH_CHECK(false, "cpu tree_attention: head size ", D, " is not a multiple of 16 from 16 to 128");
  }
}

at::Tensor tree_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table_in, const at::Tensor& ctx_len_in, const at::Tensor& tree_mask_in,
                          int64_t block_size, double scale) {
  TORCH_CHECK(q_in.dim() == 4, "cpu tree_attention: q must be [bs, T, nh, D]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "cpu tree_attention: caches must be contiguous [slots, nkv, D]");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16),
              "cpu tree_attention: q and the caches must share one dtype, float32 or bfloat16");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor block_table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor ctx_len = ctx_len_in.to(at::kLong).contiguous();
  const at::Tensor tree_mask = tree_mask_in.to(at::kBool).contiguous();
  const int64_t bs = q.size(0), Tn = q.size(1), nh = q.size(2), D = q.size(3), nkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "cpu tree_attention: q's head size ", D, " is not the cache's ", k_cache.size(2));
  TORCH_CHECK(nh % nkv == 0, "cpu tree_attention: ", nh, " heads over ", nkv, " KV heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == bs && ctx_len.numel() == bs &&
                  tree_mask.sizes() == at::IntArrayRef({bs, Tn, Tn}), "cpu tree_attention: block_table [bs, nblk], ctx_len [bs], tree_mask [bs, T, T]");
  const int64_t nblk = block_table.size(1);
  TORCH_CHECK(bs == 0 || ctx_len.max().item<int64_t>() + Tn <= nblk * block_size,
              "cpu tree_attention: the block table covers ", nblk * block_size, " positions, fewer than ctx_len + T");
  at::Tensor out = at::empty_like(q);
  const float sc = (float)scale;
  if (q.scalar_type() == at::kFloat) {
    attend_d<float>(D, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                    block_table.data_ptr<int64_t>(), ctx_len.data_ptr<int64_t>(), tree_mask.data_ptr<bool>(),
                    out.data_ptr<float>(), bs, Tn, nh, nkv, nblk, block_size, sc);
  } else {
    using T = c10::BFloat16;
    attend_d<T>(D, q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_table.data_ptr<int64_t>(),
                ctx_len.data_ptr<int64_t>(), tree_mask.data_ptr<bool>(), out.data_ptr<T>(), bs, Tn, nh, nkv, nblk,
                block_size, sc);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trt_redrafter_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor ctx_len, "
        "Tensor tree_mask, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(trt_redrafter_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
