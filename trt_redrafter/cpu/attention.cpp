// Tree attention over the paged KV cache on the CPU: the contract of model/attention.py (its oracle,
// torch_tree_attention, gathers every key of the block table, builds a dense mask and calls SDPA), computed here by
// reading each request's keys in place through its block table, only the ones a query row may see.
//
// Query row t of request b (head h, KV head h / (nh / nkv)) sees the ctx_len[b] committed positions and the new
// tokens q with tree_mask[b, t, q] (at positions ctx_len[b] + q). Its output is one fp32 computation in a fixed
// order: scores in position order, their max, then sum_j exp(s_j - max) v_j and sum_j exp(s_j - max) accumulated in
// position order (exp: a vectorized polynomial, simd.h exp16), the quotient rounded once to the output dtype. Nothing
// else enters it: not the number of new tokens T, not the batch, not the threads. So the token an AR step feeds (T = 1)
// and the same token at the root of a draft tree get the same bits, without the oracle's extra query rows
// (attention.PAD_QUERY_ROWS).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using trt_redrafter_cpu::load16;
using trt_redrafter_cpu::store16;
using trt_redrafter_cpu::exp16;

// The 16 sums across lanes of d[0..15] as one vector, each added in the grouping of _mm512_reduce_add_ps (lanes
// i + i+8, then + i+4, + i+2, + i+1; a sum's bits are the same, since a + b == b + a): 45 shuffles and adds for 16
// sums, against 8 per sum. Lane 4b + g holds the sum of d[4g + b]: put key c in slot sum16_slot(c).
inline constexpr int sum16_slot(int c) { return 4 * (c % 4) + c / 4; }

inline __m512 sum16(const __m512* d) {
  __m512 w[8], z[4], u[2];
  for (int m = 0; m < 8; ++m)  // lanes i + i+8: [d2m 0-3, d2m 4-7, d2m+1 0-3, d2m+1 4-7]
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(d[2 * m], d[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(d[2 * m], d[2 * m + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // + i+4: 128-bit block b holds d(4k + b)'s 4 sums
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int l = 0; l < 2; ++l)  // + i+2: block b holds 2 sums of d(8l + b) and 2 of d(8l + 4 + b)
    u[l] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * l], z[2 * l + 1], 0x44),
                         _mm512_shuffle_ps(z[2 * l], z[2 * l + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));  // + i+1
}

// The query rows of one request that read one KV head: its `group` heads at new tokens t0 .. t1 - 1. They share every
// key and value row they load (the committed positions: all of them; the tree's: each row its own), so a step reads
// the cache once per KV head whatever the number of heads and new tokens. Each row's arithmetic is still the one
// fixed sequence of the header (a row's scores, their max, exp, then sum and the weighted values in position
// order); rows only share loads, so their bits do not depend on which rows share a call.
template <typename T, int ND>
struct RowGroup {
  static constexpr int64_t D = 16 * ND;
  static constexpr int RC = ND >= 6 ? 2 : (ND >= 4 ? 4 : (ND == 3 ? 5 : 8));  // rows per register block of values
  std::vector<float> scores;    // [R, stride]: committed positions, then the visible tree positions
  std::vector<int64_t> tree;    // [R, Tn]: each row's visible tree positions, in order
  std::vector<int64_t> ntree;   // [R]
  std::vector<float> acc;       // [R, D]
  std::vector<float> sums;      // [R]
  alignas(64) float kblock[16 * D];  // 16 committed keys as float32, in sum16's slots

  void run(const T* const* qrows, T* const* orows, const bool* const* masks, int64_t R, const T* kc, const T* vc,
           const int64_t* key_off, const int64_t* tree_off, int64_t n, int64_t Tn, float scale) {
    const int64_t stride = (n + Tn + 15) / 16 * 16;
    scores.assign(R * stride, -INFINITY);
    tree.resize(R * Tn);
    ntree.assign(R, 0);
    acc.assign(R * D, 0.f);
    sums.assign(R, 0.f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < Tn; ++j)
        if (masks[r][j]) tree[r * Tn + ntree[r]++] = j;
    auto dot = [&](const T* qrow, const __m512* kr) {
      __m512 d = _mm512_mul_ps(load16(qrow), kr[0]);
      for (int i = 1; i < ND; ++i) d = _mm512_fmadd_ps(load16(qrow + 16 * i), kr[i], d);
      return _mm512_reduce_add_ps(d) * scale;
    };
    // scores of the committed keys, 16 keys at a time: a block's keys as float32 once, then each row (its q in
    // registers) takes its 16 lane-wise products and sums them across lanes together (sum16, in the grouping of
    // _mm512_reduce_add_ps: every score has the bits `dot` gives it, as the tree keys' scores below); then each
    // row's own tree keys
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int nk = (int)std::min<int64_t>(16, n - j0);
      for (int c = 0; c < 16; ++c)  // key c in slot sum16_slot(c), so that lane c of the sums is key c's
        for (int i = 0; i < ND; ++i)
          _mm512_store_ps(kblock + sum16_slot(c) * D + 16 * i,
                          c < nk ? load16(kc + key_off[j0 + c] + 16 * i) : _mm512_setzero_ps());
      for (int64_t r = 0; r < R; ++r) {
        __m512 qr[ND], d[16];
        for (int i = 0; i < ND; ++i) qr[i] = load16(qrows[r] + 16 * i);
        for (int c = 0; c < 16; ++c) {
          d[c] = _mm512_mul_ps(qr[0], _mm512_load_ps(kblock + c * D));
          for (int i = 1; i < ND; ++i) d[c] = _mm512_fmadd_ps(qr[i], _mm512_load_ps(kblock + c * D + 16 * i), d[c]);
        }
        _mm512_mask_storeu_ps(scores.data() + r * stride + j0, (__mmask16)((1u << nk) - 1),
                              _mm512_mul_ps(sum16(d), vscale));
      }
    }
    __m512 kr[ND];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < ntree[r]; ++c) {
        for (int i = 0; i < ND; ++i) kr[i] = load16(kc + tree_off[tree[r * Tn + c]] + 16 * i);
        scores[r * stride + n + c] = dot(qrows[r], kr);
      }
    // e^(s - max) per row (padding lanes stay e^-inf = 0 and are never summed)
    for (int64_t r = 0; r < R; ++r) {
      float* sr = scores.data() + r * stride;
      const int64_t S = n + ntree[r];
      __m512 vmax = _mm512_set1_ps(-INFINITY);  // lanes past S hold -inf
      for (int64_t j = 0; j < S; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sr + j));
      const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
      for (int64_t j = 0; j < S; j += 16)
        _mm512_storeu_ps(sr + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vmx)));
    }
    // values: blocks of committed positions (in L1 while RC rows at a time use them), in position order per row
    constexpr int64_t KB = 64;
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
      const int64_t j1 = std::min(n, j0 + KB);
      for (int64_t r0 = 0; r0 < R; r0 += RC) {
        const int rc = (int)std::min<int64_t>(RC, R - r0);
        __m512 a[RC][ND];
        float sum[RC];
        for (int r = 0; r < rc; ++r) {
          for (int i = 0; i < ND; ++i) a[r][i] = _mm512_loadu_ps(acc.data() + (r0 + r) * D + 16 * i);
          sum[r] = sums[r0 + r];
        }
        for (int64_t j = j0; j < j1; ++j) {
          __m512 v[ND];
          for (int i = 0; i < ND; ++i) v[i] = load16(vc + key_off[j] + 16 * i);
          for (int r = 0; r < rc; ++r) {
            const float p = scores[(r0 + r) * stride + j];
            sum[r] += p;
            const __m512 pv = _mm512_set1_ps(p);
            for (int i = 0; i < ND; ++i) a[r][i] = _mm512_fmadd_ps(pv, v[i], a[r][i]);
          }
        }
        for (int r = 0; r < rc; ++r) {
          for (int i = 0; i < ND; ++i) _mm512_storeu_ps(acc.data() + (r0 + r) * D + 16 * i, a[r][i]);
          sums[r0 + r] = sum[r];
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      __m512 a[ND];
      for (int i = 0; i < ND; ++i) a[i] = _mm512_loadu_ps(acc.data() + r * D + 16 * i);
      float sum = sums[r];
      for (int64_t c = 0; c < ntree[r]; ++c) {
        const float p = scores[r * stride + n + c];
        sum += p;
        const __m512 pv = _mm512_set1_ps(p);
        const T* vrow = vc + tree_off[tree[r * Tn + c]];
        for (int i = 0; i < ND; ++i) a[i] = _mm512_fmadd_ps(pv, load16(vrow + 16 * i), a[i]);
      }
      const int64_t S = n + ntree[r];
      const __m512 inv = _mm512_set1_ps(S ? 1.f / sum : 0.f);
      for (int i = 0; i < ND; ++i) store16(orows[r] + 16 * i, _mm512_mul_ps(a[i], inv));
    }
  }
};

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
  // work items: (request, KV head, a run of new tokens); the new tokens are split only as far as the threads need
  // work (which rows share an item never changes a row's bits)
  const int64_t per_kv = bs * nkv;
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(Tn, (2 * at::get_num_threads() + per_kv - 1) / per_kv));
  const int64_t tlen = (Tn + chunks - 1) / chunks;
  at::parallel_for(0, per_kv * chunks, 1, [&](int64_t begin, int64_t end) {
    RowGroup<T, ND> rows;
    std::vector<const T*> qrows;
    std::vector<T*> orows;
    std::vector<const bool*> masks;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % chunks, kvh = (item / chunks) % nkv, b = item / (chunks * nkv);
      const int64_t t0 = c * tlen, t1 = std::min(Tn, t0 + tlen);
      if (t0 >= t1) continue;
      qrows.clear();
      orows.clear();
      masks.clear();
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kvh * group + g;
          qrows.push_back(q + ((b * Tn + t) * nh + h) * D);
          orows.push_back(out + ((b * Tn + t) * nh + h) * D);
          masks.push_back(tree_mask + (b * Tn + t) * Tn);
        }
      const int64_t n = ctx_len[b];
      const int64_t* key_off = offs[b].data();
      rows.run(qrows.data(), orows.data(), masks.data(), (int64_t)qrows.size(), kc + kvh * D, vc + kvh * D, key_off,
               key_off + n, n, Tn, scale);
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

// The KV rewind of every layer cache in one call (the contract of runtime/step.py: move_kv, its oracle): cache[dst[i]] =
// cache[src[i]] for each cache [slots, ...], every source row read before any destination row is written (a path's
// rows may move onto each other). A plain copy of bytes, so the result is the oracle's bit for bit; a row moved onto
// itself (a position past the accepted path: most of a step's rows) is not copied, which is the same where no two
// rows share a destination (a rewind's destinations are distinct positions). The step calls it
// instead of the oracle's two indexing ops per cache (60 for a 30-layer model: ~0.2 ms of dispatch per eager tree
// step); compiled, inductor calls it in place (the schema marks the caches mutated), ~0.15 ms per step less than
// the rewind it fuses from the oracle.
void kv_move(at::TensorList caches, const at::Tensor& src_in, const at::Tensor& dst_in) {
  TORCH_CHECK(src_in.scalar_type() == at::kLong && dst_in.scalar_type() == at::kLong && src_in.numel() == dst_in.numel(),
              "kv_move: src and dst must be int64 tensors of one size");
  const at::Tensor src = src_in.contiguous(), dst = dst_in.contiguous();
  const int64_t n = src.numel();
  if (n == 0 || caches.empty()) return;
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.dim() >= 1, "kv_move: every cache must be a contiguous "
                "CPU tensor");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(0 <= s[i] && s[i] < c.size(0) && 0 <= d[i] && d[i] < c.size(0), "kv_move: row ", s[i], " -> ", d[i],
                  " outside a cache of ", c.size(0), " rows");
  }
  at::parallel_for(0, (int64_t)caches.size(), 8, [&](int64_t begin, int64_t end) {
    std::vector<char> rows;
    for (int64_t j = begin; j < end; ++j) {
      const at::Tensor& c = caches[j];
      const int64_t row = c.stride(0) * c.element_size();
      char* base = static_cast<char*>(c.data_ptr());
      rows.resize(n * row);
      for (int64_t i = 0; i < n; ++i)
        if (s[i] != d[i]) std::memcpy(rows.data() + i * row, base + s[i] * row, row);
      for (int64_t i = 0; i < n; ++i)
        if (s[i] != d[i]) std::memcpy(base + d[i] * row, rows.data() + i * row, row);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trt_redrafter_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor ctx_len, "
        "Tensor tree_mask, int block_size, float scale) -> Tensor");
  m.def("kv_move(Tensor(a!)[] caches, Tensor src, Tensor dst) -> ()");
}

TORCH_LIBRARY_IMPL(trt_redrafter_cpu, CPU, m) {
  m.impl("tree_attention", &tree_attention);
  m.impl("kv_move", &kv_move);
}
