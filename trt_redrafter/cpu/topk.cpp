// The k largest values of each row and their indices, for the drafter's beam search on a CPU (decoding/beam_search.py
// select_beams_topk): Apple's top-50 warp and the beams' candidates over a draft vocabulary of thousands of tokens.
//
// torch.topk selects from a copy of each row; here a bound from 64 maxima (row_topk) leaves the few values that can
// rank, found 16 at a time with AVX-512 compares, and only those are ranked, each as one 64-bit key (value, then index)
// so that the selection and the sort compare integers.
//
// Result: values [..., k] descending and their indices [..., k] (int64); equal values in ascending index order (the
// first occurrence first, as an argmax), which torch.topk does not promise. NaN is selected only where a row holds
// fewer than k other values, after them. Rows are split across threads only when there are enough of them to pay
// for it.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// insert (v, i) into the best-first list vals/idx of n entries (capacity k): after every entry with a value >= v
// (earlier indices win ties, and rows are scanned in ascending index order), dropping the last when full
inline void insert(float v, int64_t i, float* vals, int64_t* idx, int64_t& n, int64_t k) {
  int64_t pos = n < k ? n : k - 1;
  while (pos > 0 && v > vals[pos - 1]) {
    vals[pos] = vals[pos - 1];
    idx[pos] = idx[pos - 1];
    --pos;
  }
  vals[pos] = v;
  idx[pos] = i;
  if (n < k) ++n;
}

// every value in order against the k-th best so far, 16 at a time
void scan_topk(const float* x, int64_t V, int64_t k, float* vals, int64_t* idx) {
  int64_t n = 0, j = 0;
  for (; j < V && n < k; ++j)  // the first k values that are not NaN
    if (x[j] == x[j]) insert(x[j], j, vals, idx, n, k);
  for (; j + 16 <= V; j += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_set1_ps(vals[k - 1]), _CMP_GT_OQ);
    while (m) {  // lanes above the k-th best when the chunk was tested; the k-th best rises as they go in
      const int lane = __builtin_ctz(m);
      m &= m - 1;
      if (x[j + lane] > vals[k - 1]) insert(x[j + lane], j + lane, vals, idx, n, k);
    }
  }
  for (; j < V; ++j)
    if (x[j] > vals[k - 1]) insert(x[j], j, vals, idx, n, k);
  for (j = 0; j < V && n < k; ++j)  // a row of fewer than k numbers: its NaNs last, in index order
    if (x[j] != x[j]) {
      vals[n] = x[j];
      idx[n++] = j;
    }
}

constexpr int kAcc = 4;                  // 16-lane running maxima over a row's vectors, in turn:
constexpr int64_t kMaxima = kAcc * 16;  // maxima each over every kMaxima-th value, at one lane

// (value, index) as one integer whose order is the ranking's: the value's bits made monotone (-0 as +0, NaN never
// gets here), then the index reversed, so that the larger key is the larger value or, of equal values, the earlier
// index
inline uint64_t rank_key(float v, int64_t i) {
  const float z = v + 0.f;  // -0 -> +0: they compare equal
  uint32_t b;
  std::memcpy(&b, &z, 4);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t{b} << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

// A bound first: kMaxima maxima over disjoint sets of the row's values (set j: the values at lane j % 16 of the vectors
// v with v % kAcc == j / 16; the tail past the whole vectors joins none). The k-th largest of them (k <= kMaxima) has
// at least k values at or above it, so the k best are among the values >= it, which are then ranked. Strided sets bound
// more tightly than contiguous blocks where neighbouring ids score alike (a draft vocabulary's sorted ids: 95 values
// against 185 a row of SmolLM2's drafter, for k = 50), and their maxima need no reduction across lanes. NaNs never
// enter a maximum (VMAXPS returns its second operand where one is NaN). Falls back to scan_topk where the bound does
// not hold k numbers (NaNs) or the row is too short. Only the first `sorted` (1 <= sorted <= k) of the k come out in
// order, the rest of the k after them in any order.
void row_topk(const float* x, int64_t V, int64_t k, int64_t sorted, float* vals, int64_t* idx,
              std::vector<uint64_t>& keys) {
  const int64_t nv = V / 16;
  if (k > kMaxima || nv < kAcc) return scan_topk(x, V, k, vals, idx);
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(-INFINITY);
  int64_t v = 0;
  for (; v + kAcc <= nv; v += kAcc)
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_max_ps(_mm512_loadu_ps(x + (v + i) * 16), acc[i]);
  for (int i = 0; v < nv; ++v, ++i) acc[i] = _mm512_max_ps(_mm512_loadu_ps(x + v * 16), acc[i]);
  float maxima[kMaxima];
  for (int i = 0; i < kAcc; ++i) _mm512_storeu_ps(maxima + i * 16, acc[i]);
  std::nth_element(maxima, maxima + (k - 1), maxima + kMaxima, [](float a, float b) { return a > b; });
  const float bound = maxima[k - 1];
  keys.clear();
  const __m512 t = _mm512_set1_ps(bound);
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), t, _CMP_GE_OQ);
    while (m) {
      const int lane = __builtin_ctz(m);
      m &= m - 1;
      keys.push_back(rank_key(x[j + lane], j + lane));
    }
  }
  for (; j < V; ++j)
    if (x[j] >= bound) keys.push_back(rank_key(x[j], j));
  if ((int64_t)keys.size() < k) return scan_topk(x, V, k, vals, idx);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint64_t>());
  if (sorted < k)
    std::nth_element(keys.begin(), keys.begin() + (sorted - 1), keys.begin() + k, std::greater<uint64_t>());
  std::sort(keys.begin(), keys.begin() + sorted, std::greater<uint64_t>());
  for (int64_t i = 0; i < k; ++i) {
    idx[i] = 0xFFFFFFFFu - static_cast<uint32_t>(keys[i]);
    vals[i] = x[idx[i]];
  }
}

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x_in, int64_t k) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "cpu topk: x must be a float32 CPU tensor, got ", x_in.scalar_type(), " on ", x_in.device());
  const int64_t V = x_in.size(-1);
  TORCH_CHECK(k >= 1 && k <= V, "cpu topk: k = ", k, " must be in [1, ", V, "] (the last dimension)");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = V ? x.numel() / V : 0;
  auto shape = x.sizes().vec();
  shape.back() = k;
  at::Tensor vals = at::empty(shape, x.options());
  at::Tensor idx = at::empty(shape, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  trt_redrafter_cpu::topk_rows(xp, R, V, V, k, k, vp, ip);
  return {vals, idx};
}

}  // namespace

void trt_redrafter_cpu::topk_rows(const float* x, int64_t R, int64_t V, int64_t ldx, int64_t k, int64_t sorted,
                                  float* vals, int64_t* idx) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(V, 1));  // ~64k values a thread at least
  const int64_t in_order = std::clamp<int64_t>(sorted, 1, k);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> keys;
    keys.reserve(1024);
    for (int64_t r = begin; r < end; ++r) row_topk(x + r * ldx, V, k, in_order, vals + r * k, idx + r * k, keys);
  });
}

// k is a SymInt: a compiled step may take it from an unbacked size (the drafter's beam count); the kernel is called
// with its value, as an int64_t
TORCH_LIBRARY_FRAGMENT(trt_redrafter_cpu, m) { m.def("topk(Tensor x, SymInt k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(trt_redrafter_cpu, CPU, m) { m.impl("topk", &topk); }
