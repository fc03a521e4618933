// The drafter's whole beam search in one call, on a CPU rank that holds the whole drafter (decoding/beam_search.py,
// `beam_search` with `select_beams_topk`, is the oracle; runtime/drafter.py calls this where it applies).
//
// Why: at a few rows a drafted token's work is small (SmolLM2's drafter: six linear layers and a top-50 per beam),
// and in a compiled step each depth of the search was about a dozen calls (the linear layers and top-k as external
// kernels, inductor's pointwise kernels between them, each an OpenMP region), a few microseconds each: on a small base
// that was most of what drafting cost. Here the layers run the same kernels as the registered ops (linear.cpp,
// topk.cpp), and the rest (the state update, the residual blocks' SiLU, the beams' selection and bookkeeping) runs in
// place.
//
// Per depth t (rows: one per request at t = 0, every request's nb beams after it):
//   state  <- silu(rnn_w e + rnn_u state)            (t = 0 from Apple's zero state: rnn_w e + rnn_u's bias)
//   x      <- [h ; state], input_proj (optional), then x + silu(W x + b) per residual block
//   logits <- lm_head x, in fp32; over a draft vocabulary's K columns when the drafter has one
//   select <- each live beam's top K (K = max(bound, warp): Apple's top-50 warp); the log-normalizer over those K
//             values; the nb best of the live beams' score + log-prob candidates; the beams, their score history and
//             their states gathered from the parents
// Each pointwise result is rounded to the drafter's dtype where the eager torch code rounds it (a sum, then the
// SiLU of the rounded sum), so the drafts are the oracle's up to its exp's last bit.
// A search that stops at depth d < dl (the oracle's `depth_rows`: the first empty one ends it) runs no layer after
// depth d: there every beam keeps itself, repeats its last token and scores LOG_ZERO, as the oracle's beams do.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using trt_redrafter_cpu::exp16;
using trt_redrafter_cpu::tail_mask;

constexpr float kLogZero = -50000.f;  // decoding/beam_search.py LOG_ZERO

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }  // bfloat16: round to nearest even

// silu(v) = v / (1 + e^-v) in place over f [n] (padded to whole vectors); e^-v capped below overflow's +inf
inline void silu_inplace(float* f, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, f + i);
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), v), _mm512_set1_ps(88.8f)));
    _mm512_mask_storeu_ps(f + i, m, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  }
}

// y = round(silu(round(a + b))) elementwise; a, b, y [n] of T
template <typename T>
void add_silu(const T* a, const T* b, int64_t n, T* y, std::vector<float>& f) {
  f.resize((n + 15) / 16 * 16);
  for (int64_t i = 0; i < n; ++i) f[i] = to_float(from_float<T>(to_float(a[i]) + to_float(b[i])));
  silu_inplace(f.data(), n);
  for (int64_t i = 0; i < n; ++i) y[i] = from_float<T>(f[i]);
}

// x = round(x + round(silu(y))): a residual block's output
template <typename T>
void residual_silu(T* x, const T* y, int64_t n, std::vector<float>& f) {
  f.resize((n + 15) / 16 * 16);
  for (int64_t i = 0; i < n; ++i) f[i] = to_float(y[i]);
  silu_inplace(f.data(), n);
  for (int64_t i = 0; i < n; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(from_float<T>(f[i])));
}

// y [n] = x [n] in fp32, 16 at a time, across threads
inline void widen(const c10::BFloat16* x, int64_t n, float* y) {
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += 16) {
      const __mmask16 m = tail_mask(end - i);
      trt_redrafter_cpu::store16(y + i, trt_redrafter_cpu::load16(x + i, m), m);
    }
  });
}

// One of the drafter's linear layers, as model/linear.py `Linear` holds it for the avx512 kernels.
struct Layer {
  int64_t bits = 0;                 // 0: float panels (`linear`); 8 or 4: int8 inputs (`linear_w8a8`)
  at::Tensor packed, bias;          // bias in the drafter's dtype (the float path's)
  at::Tensor colsum, scales, bias32;  // int8 inputs: column sums, padded scales, fp32 bias
  int64_t N = 0, K = 0;

  template <typename T>
  void operator()(const T* x, int64_t M, T* y) const {
    if (bits == 0) {
      const T* b = bias.defined() ? bias.data_ptr<T>() : nullptr;
      return trt_redrafter_cpu::linear_packed<T>(x, M, K, packed.data_ptr<T>(), N, b, y);
    }
    trt_redrafter_cpu::linear_int8_inputs<T>(x, M, K, packed.data_ptr<int8_t>(), colsum.data_ptr<int32_t>(),
                                             scales.data_ptr<float>(), N,
                                             bias32.defined() ? bias32.data_ptr<float>() : nullptr, y, bits);
  }
};

inline at::Tensor present(const at::Tensor& t) { return t.defined() && t.numel() > 0 ? t.contiguous() : at::Tensor(); }

struct Search {
  int64_t bs, nb, bound, dl, warp, V, H, E, ldl;  // ldl: the head's row stride (its padded outputs)
  int64_t depth;                                   // depths drafted (<= dl); the rest pad
  const int64_t* ids;  // draft vocabulary: token id of each head column (null: column = token id)
};

template <typename T, typename TM>
std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& h_in, const at::Tensor& tok_in, const at::Tensor& emb_in,
                                       const std::vector<Layer>& layers, bool has_proj, const Search& s) {
  const int64_t bs = s.bs, nb = s.nb, B = s.bound, H = s.H, E = s.E, dl = s.dl;
  const Layer& rnn_w = layers[0];
  const Layer& rnn_u = layers[1];
  const Layer* proj = has_proj ? &layers[2] : nullptr;
  const Layer& head = layers.back();
  const std::vector<Layer> blocks(layers.begin() + (has_proj ? 3 : 2), layers.end() - 1);
  const at::Tensor h = h_in.contiguous(), emb = emb_in.contiguous();
  const TM* hp = h.data_ptr<TM>();
  const TM* ep = emb.data_ptr<TM>();
  const int64_t* tok = tok_in.contiguous().data_ptr<int64_t>();

  const int64_t K = std::max(B, s.warp);  // candidates ranked per live beam: the warp's top values (warp < V)
  const int64_t kk = B;                    // of which kept
  const int64_t R = bs * nb;  // rows from depth 1 on
  std::vector<T> e(R * H), a(R * H), state(R * H), next(R * H), x(R * 2 * H), y(R * E), xe(R * E);
  std::vector<T> logit_t(std::is_same_v<T, float> ? 0 : R * s.ldl);
  std::vector<float> logits(R * s.ldl), f, vals(R * K), cand(nb * kk);
  std::vector<int64_t> idx(R * K), order(nb * kk), parent(R), token(R), old_beams(nb * (dl + 1));
  std::vector<float> old_hist(nb * dl);
  at::Tensor beams = at::empty({bs, nb, dl + 1}, tok_in.options());
  at::Tensor hist = at::empty({bs, nb, dl}, h_in.options().dtype(at::kFloat));
  int64_t* bp = beams.data_ptr<int64_t>();
  float* sp = hist.data_ptr<float>();
  std::vector<float> score(R, kLogZero), new_score(R);
  for (int64_t b = 0; b < bs; ++b) {
    score[b * nb] = 0.f;
    for (int64_t i = 0; i < nb; ++i) bp[(b * nb + i) * (dl + 1)] = tok[b];
  }

  for (int64_t t = 0; t < s.depth; ++t) {
    const int64_t n = t == 0 ? bs : R;    // drafter rows this depth
    const int64_t live = t == 0 ? 1 : nb;  // rows per request
    for (int64_t r = 0; r < n; ++r) {       // the embeddings of the beams' last tokens, in the drafter's dtype
      const int64_t id = t == 0 ? tok[r] : bp[r * (dl + 1) + t];
      for (int64_t j = 0; j < H; ++j) e[r * H + j] = from_float<T>(to_float(ep[id * H + j]));
    }
    rnn_w(e.data(), n, a.data());
    if (t == 0) {  // rnn_u(0) is its bias
      const T* ub = rnn_u.bias.data_ptr<T>();
      for (int64_t r = 0; r < n; ++r) add_silu<T>(a.data() + r * H, ub, H, state.data() + r * H, f);
    } else {
      rnn_u(state.data(), n, next.data());
      add_silu<T>(a.data(), next.data(), n * H, state.data(), f);
    }
    for (int64_t r = 0; r < n; ++r) {  // [h ; state]
      const TM* hr = hp + (r / live) * H;
      for (int64_t j = 0; j < H; ++j) x[r * 2 * H + j] = from_float<T>(to_float(hr[j]));
      std::memcpy(x.data() + r * 2 * H + H, state.data() + r * H, H * sizeof(T));
    }
    T* cur = x.data();
    if (proj) {
      (*proj)(x.data(), n, xe.data());
      cur = xe.data();
    }
    for (const Layer& blk : blocks) {
      blk(cur, n, y.data());
      residual_silu<T>(cur, y.data(), n * E, f);
    }
    if constexpr (std::is_same_v<T, float>) {
      head(cur, n, logits.data());
    } else {
      head(cur, n, logit_t.data());
      widen(logit_t.data(), n * s.ldl, logits.data());
    }
    // each beam's K best, of which only the kk candidates need their order: the normalizer sums all K
    trt_redrafter_cpu::topk_rows(logits.data(), n, s.V, s.ldl, K, kk, vals.data(), idx.data());
    for (int64_t b = 0; b < bs; ++b) {
      const int64_t nc = live * kk;
      for (int64_t i = 0; i < live; ++i) {
        const int64_t r = b * live + i;
        const float* v = vals.data() + r * K;
        const float top = v[0];
        double sum = 0;  // the log-normalizer of the max-subtracted row, over the warp's K values
        for (int64_t j = 0; j < K; ++j) sum += std::exp(v[j] - top);
        const float lse = static_cast<float>(std::log(sum));
        const float base = t == 0 ? 0.f : score[b * nb + i];
        for (int64_t j = 0; j < kk; ++j) cand[i * kk + j] = base + ((v[j] - top) - lse);
      }
      // the nb best candidates, equal values in index order (cpu topk's order)
      std::iota(order.begin(), order.begin() + nc, 0);
      std::partial_sort(order.begin(), order.begin() + nb, order.begin() + nc, [&](int64_t p, int64_t q) {
        return cand[p] > cand[q] || (cand[p] == cand[q] && p < q);
      });
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t c = order[i], par = c / kk, r = b * live + par;
        new_score[b * nb + i] = cand[c];
        parent[b * nb + i] = par;
        const int64_t col = idx[r * K + c % kk];
        token[b * nb + i] = s.ids ? s.ids[col] : col;
      }
    }
    // gather the beams, their score histories and states from their parents, then append this depth's
    for (int64_t b = 0; b < bs; ++b) {
      std::copy(bp + b * nb * (dl + 1), bp + (b + 1) * nb * (dl + 1), old_beams.begin());
      std::copy(sp + b * nb * dl, sp + (b + 1) * nb * dl, old_hist.begin());
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t row = b * nb + i, par = parent[row];
        std::memcpy(bp + row * (dl + 1), old_beams.data() + par * (dl + 1), (t + 1) * sizeof(int64_t));
        bp[row * (dl + 1) + t + 1] = token[row];
        std::memcpy(sp + row * dl, old_hist.data() + par * dl, t * sizeof(float));
        sp[row * dl + t] = new_score[row];
        std::memcpy(next.data() + row * H, state.data() + (b * live + par) * H, H * sizeof(T));
      }
    }
    std::swap(state, next);
    std::copy(new_score.begin(), new_score.end(), score.begin());
  }
  for (int64_t t = s.depth; t < dl; ++t) {  // past the search's depth (no layer runs there): each beam pads
    for (int64_t r = 0; r < R; ++r) {
      bp[r * (dl + 1) + t + 1] = bp[r * (dl + 1) + s.depth];
      sp[r * dl + t] = kLogZero;
    }
  }
  return {beams, hist};
}

// h [bs, H] and the embedding table [V, H] in the base's dtype; `weights`: per layer (rnn_w, rnn_u, input_proj if
// `has_proj`, the residual blocks, lm_head) five tensors, empty where absent: packed weight, bias (drafter dtype),
// column sums, padded scales, fp32 bias; `bits[l]` 0 for a float layer. Returns beams
// [bs, nb, dl + 1] (column 0 the true token) and the score history [bs, nb, dl].
std::tuple<at::Tensor, at::Tensor> beam_draft(const at::Tensor& h, const at::Tensor& true_token,
                                              const at::Tensor& embedding, at::TensorList weights,
                                              at::IntArrayRef bits, at::IntArrayRef out_features, bool has_proj,
                                              bool bf16, int64_t num_beams, int64_t max_beams, int64_t draft_len,
                                              int64_t warp_top_k, int64_t vocab, const std::optional<at::Tensor>& ids,
                                              at::TensorList depth_rows) {
  const int64_t L = bits.size();
  TORCH_CHECK(L >= 3 && (int64_t)weights.size() == 5 * L && (int64_t)out_features.size() == L,
              "beam_draft: five tensors, a bits value and an output size per layer");
  TORCH_CHECK(h.dim() == 2 && h.device().is_cpu() && true_token.dim() == 1 && true_token.size(0) == h.size(0) &&
                  true_token.scalar_type() == at::kLong && embedding.dim() == 2 &&
                  embedding.scalar_type() == h.scalar_type(),
              "beam_draft: h [bs, H], true_token [bs] int64 and an embedding table of h's dtype on the CPU");
  TORCH_CHECK(num_beams >= 1 && num_beams <= max_beams && draft_len >= 1, "beam_draft: 1 <= num_beams <= max_beams");
  TORCH_CHECK(depth_rows.empty() || (int64_t)depth_rows.size() == draft_len - 1,
              "beam_draft: depth_rows holds draft_len - 1 tensors (or none: every depth)");
  const int64_t H = h.size(1);
  std::vector<Layer> layers(L);
  for (int64_t l = 0; l < L; ++l) {
    Layer& ly = layers[l];
    ly.bits = bits[l];
    ly.packed = weights[5 * l].contiguous();
    ly.bias = present(weights[5 * l + 1]);
    ly.colsum = present(weights[5 * l + 2]);
    ly.scales = present(weights[5 * l + 3]);
    ly.bias32 = present(weights[5 * l + 4]);
    ly.N = out_features[l];
    TORCH_CHECK(ly.bits == 0 || (ly.colsum.defined() && ly.scales.defined()), "beam_draft: layer ", l,
                " has int8 inputs but no column sums or scales");
  }
  layers[0].K = H;
  layers[1].K = H;
  TORCH_CHECK(layers[0].N == H && layers[1].N == H && layers[1].bias.defined(),
              "beam_draft: rnn_w and rnn_u map H to H, rnn_u with a bias");
  int64_t E = 2 * H;
  if (has_proj) {
    layers[2].K = 2 * H;
    E = layers[2].N;
  }
  for (int64_t l = has_proj ? 3 : 2; l < L; ++l) layers[l].K = E;
  for (int64_t l = has_proj ? 3 : 2; l < L - 1; ++l)
    TORCH_CHECK(layers[l].N == E, "beam_draft: a residual block maps ", E, " to ", E);
  Search s{};
  s.bs = h.size(0);
  s.nb = num_beams;
  s.bound = max_beams;
  s.dl = draft_len;
  s.warp = warp_top_k;
  s.H = H;
  s.E = E;
  s.ldl = layers.back().N;
  s.depth = draft_len;  // the first depth whose rows are empty ends the search
  for (size_t i = 0; i < depth_rows.size(); ++i)
    if (depth_rows[i].numel() == 0) {
      s.depth = i + 1;
      break;
    }
  at::Tensor id_t;
  if (ids.has_value() && ids->defined()) {
    id_t = ids->contiguous();
    TORCH_CHECK(id_t.scalar_type() == at::kLong && id_t.numel() <= s.ldl, "beam_draft: ids must be int64 [head rows]");
    s.V = id_t.numel();
    s.ids = id_t.data_ptr<int64_t>();
  } else {
    s.V = std::min(vocab, s.ldl);
    s.ids = nullptr;
  }
  TORCH_CHECK(max_beams <= warp_top_k && warp_top_k < s.V,
              "beam_draft: Apple's warp keeps its top ", warp_top_k, " of ", s.V, " tokens, which must be at least ",
              "max_beams (", max_beams, ") and fewer than all; use decoding.beam_search");
  if (s.bs == 0)
    return {at::empty({0, num_beams, draft_len + 1}, true_token.options()),
            at::empty({0, num_beams, draft_len}, h.options().dtype(at::kFloat))};
  const bool hb = h.scalar_type() == at::kBFloat16;
  TORCH_CHECK(hb || h.scalar_type() == at::kFloat, "beam_draft: h must be float32 or bfloat16");
  using BF = c10::BFloat16;
  if (bf16) return hb ? run<BF, BF>(h, true_token, embedding, layers, has_proj, s)
                      : run<BF, float>(h, true_token, embedding, layers, has_proj, s);
  return hb ? run<float, BF>(h, true_token, embedding, layers, has_proj, s)
            : run<float, float>(h, true_token, embedding, layers, has_proj, s);
}

}  // namespace

// num_beams is a SymInt: a compiled step drafts a count that is an unbacked size (runtime/drafter.py)
TORCH_LIBRARY_FRAGMENT(trt_redrafter_cpu, m) {
  m.def("beam_draft(Tensor h, Tensor true_token, Tensor embedding, Tensor[] weights, int[] bits, "
        "int[] out_features, bool has_proj, bool bf16, SymInt num_beams, int max_beams, int draft_len, "
        "int warp_top_k, int vocab, Tensor? ids, Tensor[] depth_rows) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trt_redrafter_cpu, CPU, m) { m.impl("beam_draft", &beam_draft); }
