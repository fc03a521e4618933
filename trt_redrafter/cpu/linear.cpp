// The CPU linear layer y = x W^T (+ b) over a weight packed once into 16-column panels, for AVX-512 CPUs.
//
// A decode step multiplies a few rows (bs for an AR step, bs * tree tokens to verify a tree) by every weight, so it
// is bound by reading the weights. Packed as panels [ceil(N / 16), K, 16] (fp32) or [ceil(N / 16), ceil(K / 2), 16, 2]
// (bf16: pairs of k for VDPBF16PS), each panel is one contiguous stream; eight panels are read at once, each 64-byte
// load of W feeding one FMA per row of x, with x broadcast from L1.
//
// Every output element y[m, n] is one fp32 accumulator chain over k in ascending order (bf16: over k pairs), then
// + b[n], then rounded to the output dtype. Nothing else enters it: not the number of rows M, not the tiling, not
// the thread count. So a token's logits have the same bits in an AR step (M = bs) as at the root of a draft tree
// (M = bs * T), which greedy ReDrafter == greedy AR needs, with no row padding (model/linear.py).
//
// Built at first use by torch.utils.cpp_extension (trt_redrafter/cpu/__init__.py: ops()); the ops are registered in the
// trt_redrafter_cpu namespace, their fake (meta) functions in Python so that torch.compile traces them.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using trt_redrafter_cpu::load16;
using trt_redrafter_cpu::store16;
using trt_redrafter_cpu::tail_mask;

constexpr int64_t kCols = 16;   // output columns per panel: one zmm of fp32
constexpr int64_t kGroup = 8;   // panels streamed together by one thread
constexpr int64_t kGrain = 8;   // panels: below 2 * kGrain a call stays on one thread
constexpr int64_t kRows = 6;    // rows of x per pass over a group's weights (a tree of 1 x 4 drafts has 5)

// How far ahead of its loads each panel stream is prefetched, in bytes (0: none): TRT_REDRAFTER_PREFETCH when the
// kernels load, else 1 KB (cpu/__init__.py: DEFAULT_PREFETCH_BYTES); `set_prefetch_bytes` changes it
// (scripts/bench_linear.py --prefetch times the values in turn). A tile of several rows spends MR multiply-adds on
// each 64 bytes of weights, so fewer of its loads are in flight at once, and the hardware prefetcher alone left the
// memory idle: 5 rows cost 1.2-1.3x one row. Prefetched 1 KB ahead in each of the NP streams, they cost 1.0-1.1x, and
// one row no more (docs/perf-history.md, 2026-12-02).
int64_t g_ahead = [] {
  const char* v = std::getenv("TRT_REDRAFTER_PREFETCH");
  return v && *v ? std::max<int64_t>(0, std::atoll(v)) : int64_t{1024};
}();

// one prefetch per panel stream, g_ahead bytes past `at` (the stream's next load); panels `stride` bytes apart
template <int NP>
inline void prefetch_ahead(const void* at, int64_t stride) {
  const int64_t ahead = g_ahead;
  if (ahead == 0) return;
  const char* c = static_cast<const char*>(at) + ahead;
  for (int p = 0; p < NP; ++p) _mm_prefetch(c + p * stride, _MM_HINT_T0);
}

int64_t prefetch_bytes() { return g_ahead; }

// -> the previous distance
int64_t set_prefetch_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "set_prefetch_bytes: the distance must be >= 0 bytes, got ", bytes);
  const int64_t old = g_ahead;
  g_ahead = bytes;
  return old;
}

// the tile's outputs: y[m, n0 + 16 p + c] = acc[m][p][c] (+ b), the panels past N left out
template <int MR, int NP, typename T>
inline void store_tile(__m512 (&acc)[MR][NP], int64_t n0, int64_t N, const T* bias, T* y, int64_t ldy) {
  for (int p = 0; p < NP; ++p) {
    const int64_t n = n0 + p * kCols;
    if (n >= N) break;
    const __mmask16 mk = tail_mask(N - n);
    const __m512 b = bias ? load16(bias + n, mk) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) store16(y + m * ldy + n, bias ? _mm512_add_ps(acc[m][p], b) : acc[m][p], mk);
  }
}

template <int MR, int NP>
inline void zero(__m512 (&acc)[MR][NP]) {
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
}

// ---- fp32: panels [P, K, 16] ----------------------------------------------------------------------------------
template <int MR, int NP>
inline void tile_f32(const float* x, int64_t ldx, int64_t K, const float* wp, int64_t n0, int64_t N,
                     const float* bias, float* y, int64_t ldy) {
  __m512 acc[MR][NP];
  zero(acc);
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
    for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_ps(wp + (p * K + k) * kCols);
    prefetch_ahead<NP>(wp + k * kCols, K * kCols * sizeof(float));
    for (int m = 0; m < MR; ++m) {
      __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xv, w[p], acc[m][p]);
    }
  }
  store_tile(acc, n0, N, bias, y, ldy);
}

// ---- bf16: panels [P, ceil(K / 2), 16, 2], VDPBF16PS over k pairs ---------------------------------------------
template <int MR, int NP>
__attribute__((target("avx512bf16,avx512bw,avx512vl"))) void tile_bf16(
    const c10::BFloat16* x, int64_t ldx, int64_t K, const c10::BFloat16* wp, int64_t n0, int64_t N,
    const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  const int64_t K2 = (K + 1) / 2;
  __m512 acc[MR][NP];
  zero(acc);
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh w[NP];
    for (int p = 0; p < NP; ++p) w[p] = (__m512bh)_mm512_loadu_si512(wp + (p * K2 + k2) * kCols * 2);
    prefetch_ahead<NP>(wp + k2 * kCols * 2, K2 * kCols * 2 * sizeof(c10::BFloat16));
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      const c10::BFloat16* xp = x + m * ldx + 2 * k2;
      if (2 * k2 + 1 < K) {
        std::memcpy(&pair, xp, 4);
      } else {  // odd K: the last k pairs with a zero (its packed weight is zero too)
        uint16_t lo;
        std::memcpy(&lo, xp, 2);
        pair = lo;
      }
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], xv, w[p]);
    }
  }
  store_tile(acc, n0, N, bias, y, ldy);
}

template <typename T>
struct Tiles;

template <>
struct Tiles<float> {
  static constexpr int64_t panel_elems(int64_t K) { return K * kCols; }
  template <int MR, int NP>
  static void tile(const float* x, int64_t ldx, int64_t K, const float* wp, int64_t n0, int64_t N, const float* b,
                   float* y, int64_t ldy) {
    tile_f32<MR, NP>(x, ldx, K, wp, n0, N, b, y, ldy);
  }
};

template <>
struct Tiles<c10::BFloat16> {
  static constexpr int64_t panel_elems(int64_t K) { return (K + 1) / 2 * 2 * kCols; }
  template <int MR, int NP>
  static void tile(const c10::BFloat16* x, int64_t ldx, int64_t K, const c10::BFloat16* wp, int64_t n0, int64_t N,
                   const c10::BFloat16* b, c10::BFloat16* y, int64_t ldy) {
    tile_bf16<MR, NP>(x, ldx, K, wp, n0, N, b, y, ldy);
  }
};

// panels [p0, p0 + np) against MR rows of x, NP panels at a time
template <typename T, int MR, int NP>
void panels(const T* x, int64_t K, const T* wp, int64_t p0, int64_t np, int64_t N, const T* b, T* y) {
  const int64_t pe = Tiles<T>::panel_elems(K);
  int64_t p = p0;
  for (; p + NP <= p0 + np; p += NP) Tiles<T>::template tile<MR, NP>(x, K, K, wp + p * pe, p * kCols, N, b, y, N);
  for (; p < p0 + np; ++p) Tiles<T>::template tile<MR, 1>(x, K, K, wp + p * pe, p * kCols, N, b, y, N);
}

// Tile widths by rows: NP panels for MR rows (index MR - 1), so the accumulators stay in registers.
struct TileWidths {  // MR NP accumulators + NP weights: MR * NP <= 24 of the 32 zmm registers
  static constexpr int rows = kRows;
  static constexpr int np[kRows] = {8, 8, 6, 4, 4, 4};
};
struct GroupedTileWidths {  // 2 MR NP accumulators (group sums and totals) + NP weights
  static constexpr int rows = kRows;
  static constexpr int np[kRows] = {8, 6, 4, 3, 2, 2};
};

template <int V>
using Int = std::integral_constant<int, V>;

// The schedule every kernel here shares: the N / 16 panels split across threads, each group of kGroup panels
// against every chunk of up to Widths::rows (<= kRows) rows of x, so the group's weights are read from memory once.
// run(Int<MR>, Int<NP>, m, g, np) computes rows [m, m + MR) of panels [g, g + np), NP panels at a time.
template <typename Widths, typename Run>
void schedule(int64_t M, int64_t N, const Run& run) {
  const int64_t P = (N + kCols - 1) / kCols;
  at::parallel_for(0, P, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += kGroup) {
      const int64_t np = std::min(kGroup, end - g);
      for (int64_t m = 0; m < M; m += Widths::rows) {
        switch (std::min<int64_t>(Widths::rows, M - m)) {
          case 1: run(Int<1>(), Int<Widths::np[0]>(), m, g, np); break;
          case 2: run(Int<2>(), Int<Widths::np[1]>(), m, g, np); break;
          case 3: run(Int<3>(), Int<Widths::np[2]>(), m, g, np); break;
          case 4: run(Int<4>(), Int<Widths::np[3]>(), m, g, np); break;
          case 5: if constexpr (Widths::rows >= 5) run(Int<5>(), Int<Widths::np[4]>(), m, g, np); break;
          default: if constexpr (Widths::rows >= 6) run(Int<6>(), Int<Widths::np[5]>(), m, g, np); break;
        }
      }
    }
  });
}

template <typename T>
void linear(const T* x, int64_t M, int64_t K, const T* wp, int64_t N, const T* b, T* y) {
  schedule<TileWidths>(M, N, [&](auto mr, auto nw, int64_t m, int64_t g, int64_t np) {
    panels<T, decltype(mr)::value, decltype(nw)::value>(x + m * K, K, wp, g, np, N, b, y + m * N);
  });
}

void check_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "cpu_linear: ", what, " must be float32 or bfloat16, got ", t.scalar_type());
}

// w [N, K] -> panels (fp32 [P, K, 16], bf16 [P, ceil(K / 2), 16, 2]), zero-padded past N and K
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "cpu_linear_pack: w must be a 2-D CPU tensor");
  check_dtype(w, "w");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  if (w.scalar_type() == at::kFloat) {
    at::Tensor padded = at::zeros({P * kCols, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    return padded.view({P, kCols, K}).transpose(1, 2).contiguous();  // [P, K, 16]
  }
  const int64_t K2 = (K + 1) / 2;
  at::Tensor padded = at::zeros({P * kCols, K2 * 2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({P, kCols, K2, 2}).permute({0, 2, 1, 3}).contiguous();  // [P, K2, 16, 2]
}

at::Tensor linear_op(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2, "cpu_linear: x must be [M, K]");
  check_dtype(x_in, "x");
  TORCH_CHECK(packed.scalar_type() == x_in.scalar_type(), "cpu_linear: x is ", x_in.scalar_type(),
              " but the packed weight is ", packed.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = (N + kCols - 1) / kCols;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.is_contiguous() && packed.size(0) == P && packed.numel() == P * kCols * (bf16 ? (K + 1) / 2 * 2 : K),
              "cpu_linear: the packed weight does not match x [", M, ", ", K, "] and ", N, " outputs");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "cpu_linear: bias must be [", N, "] ",
                x.scalar_type());
    b = bias->contiguous();
  }
  if (bf16) {
    using T = c10::BFloat16;
    linear<T>(x.data_ptr<T>(), M, K, packed.data_ptr<T>(), N, b ? b->data_ptr<T>() : nullptr, y.data_ptr<T>());
  } else {
    linear<float>(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), N, b ? b->data_ptr<float>() : nullptr,
                  y.data_ptr<float>());
  }
  return y;
}

// ---- weight-only int8 / int4: y = x (q s)^T (+ b) -------------------------------------------------------------
// q is packed in 16-column panels of bytes: int8 [P, K, 16]; int4 [P, K / 2, 16], each byte holding k = 2 j (low
// nibble) and k = 2 j + 1 (high nibble), two's complement. s [P, G, 16] fp32, one scale per column and group of
// `gs` k (G = K / gs; gs = K: per channel). Each y[m, n] is, per group in ascending order, an fp32 chain over k
// ascending of x[m, k] * q[n, k] (x widened to fp32 for bf16; bf16 on AVX512-BF16: over k pairs, `tile_wo_pairs`),
// folded into the running sum as fma(chain, s, sum) (per channel: chain * s), then + b[n], then rounded: one fixed
// order whatever M, the tiling and the threads, as for the float kernels.
// The integer weights become floats in registers: int8 by sign extension, int4 through a 16-entry vpermps table
// (vpermps reads only the low 4 bits of each index, so the low nibble needs no mask).
inline __m512 int8x16(const int8_t* q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))); }

// 16 int4 bytes of a panel: k's 16 columns (low nibbles) and k + 1's (high nibbles), as fp32
inline void int4x16x2(const uint8_t* q, __m512 table, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  lo = _mm512_permutexvar_ps(b, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

// group g's chains `part` folded into the outputs with their scales: fma(part, s, acc) (GROUPED), else part * s
template <bool GROUPED, int MR, int NP>
inline void fold_group(__m512 (&acc)[MR][NP], const __m512 (&part)[MR][NP], const float* sp, int64_t G, int64_t g) {
  for (int p = 0; p < NP; ++p) {
    const __m512 s = _mm512_loadu_ps(sp + (p * G + g) * kCols);
    for (int m = 0; m < MR; ++m)
      acc[m][p] = GROUPED ? _mm512_fmadd_ps(part[m][p], s, acc[m][p]) : _mm512_mul_ps(part[m][p], s);
  }
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// GROUPED: G > 1, each group's chain folded into a running sum (2 MR NP accumulators); else one chain per output
// scaled at the end, acc * s (the same value as fma(acc, s, 0)), with MR NP accumulators and so larger tiles
template <int BITS, bool GROUPED, int MR, int NP, typename T>
void tile_wo(const T* x, int64_t ldx, int64_t K, const uint8_t* qp, const float* sp, int64_t gs, int64_t n0,
             int64_t N, const T* bias, T* y, int64_t ldy) {
  const int64_t G = K / gs;
  const int64_t panel = BITS == 8 ? K * kCols : K / 2 * kCols;  // bytes per panel
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  __m512 acc[MR][NP], part[MR][NP];
  if constexpr (GROUPED) zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    zero(part);
    if constexpr (BITS == 8) {
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
        __m512 w[NP];
        for (int p = 0; p < NP; ++p) w[p] = int8x16((const int8_t*)qp + p * panel + k * kCols);
        if (k % 4 == 0) prefetch_ahead<NP>(qp + k * kCols, panel);  // a 64-byte line holds 4 k
        for (int m = 0; m < MR; ++m) {
          const __m512 xv = _mm512_set1_ps(widen(x[m * ldx + k]));
          for (int p = 0; p < NP; ++p) part[m][p] = _mm512_fmadd_ps(xv, w[p], part[m][p]);
        }
      }
    } else {
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
        __m512 lo[NP], hi[NP];
        for (int p = 0; p < NP; ++p) int4x16x2(qp + p * panel + k / 2 * kCols, table, lo[p], hi[p]);
        if (k % 8 == 0) prefetch_ahead<NP>(qp + k / 2 * kCols, panel);  // a 64-byte line holds 8 k
        for (int m = 0; m < MR; ++m) {
          const __m512 x0 = _mm512_set1_ps(widen(x[m * ldx + k])), x1 = _mm512_set1_ps(widen(x[m * ldx + k + 1]));
          for (int p = 0; p < NP; ++p) part[m][p] = _mm512_fmadd_ps(x1, hi[p], _mm512_fmadd_ps(x0, lo[p], part[m][p]));
        }
      }
    }
    fold_group<GROUPED>(acc, part, sp, G, g);
  }
  store_tile(acc, n0, N, bias, y, ldy);
}

// bf16 inputs on AVX512-BF16 CPUs (`pairs`): each group's chain runs over k pairs with VDPBF16PS, as the bf16 float
// kernel's does, on the weights widened to bf16 in registers. That is exact (an int8 or int4 value has at most 8
// significant bits) and costs a shift and a select per 16 pairs beyond the widening to fp32; a row then costs one
// VDPBF16PS per 32 weights where two FMAs took 32. So each row a tree adds costs about what it costs in a bf16 engine,
// for the bytes of int8 or int4. Needs an even group size (k pairs inside a group); one instruction for every row
// count, so a row's bits still do not depend on M.
template <int BITS, bool GROUPED, int MR, int NP>
__attribute__((target("avx512bf16,avx512bw,avx512vl"))) void tile_wo_pairs(
    const c10::BFloat16* x, int64_t ldx, int64_t K, const uint8_t* qp, const float* sp, int64_t gs, int64_t n0,
    int64_t N, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  const int64_t G = K / gs;
  const int64_t panel = BITS == 8 ? K * kCols : K / 2 * kCols;  // bytes per panel
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[MR][NP], part[MR][NP];
  if constexpr (GROUPED) zero(acc);
  for (int64_t g = 0; g < G; ++g) {
    zero(part);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
      __m512bh w[NP];
      if (k % (BITS == 8 ? 4 : 8) == 0) prefetch_ahead<NP>(qp + k * BITS / 8 * kCols, panel);  // 4 or 8 k a line
      for (int p = 0; p < NP; ++p) {
        __m512 lo, hi;  // k and k + 1 of the panel's 16 columns, as fp32 (exact)
        if constexpr (BITS == 8) {
          lo = int8x16((const int8_t*)qp + p * panel + k * kCols);
          hi = int8x16((const int8_t*)qp + p * panel + (k + 1) * kCols);
        } else {
          int4x16x2(qp + p * panel + k / 2 * kCols, table, lo, hi);
        }
        // each lane: k's bf16 (the high half of its fp32) in the low word, k + 1's in the high word (0xCA: a ? b : c)
        w[p] = (__m512bh)_mm512_ternarylogic_epi32(high, _mm512_castps_si512(hi),
                                                   _mm512_srli_epi32(_mm512_castps_si512(lo), 16), 0xCA);
      }
      for (int m = 0; m < MR; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * ldx + k, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int p = 0; p < NP; ++p) part[m][p] = _mm512_dpbf16_ps(part[m][p], xv, w[p]);
      }
    }
    fold_group<GROUPED>(acc, part, sp, G, g);
  }
  store_tile(acc, n0, N, bias, y, ldy);
}

template <int BITS, bool GROUPED, bool PAIRS, typename T, int MR, int NP>
void panels_wo(const T* x, int64_t K, const uint8_t* qp, const float* sp, int64_t gs, int64_t p0, int64_t np,
               int64_t N, const T* b, T* y) {
  const int64_t pb = BITS == 8 ? K * kCols : K / 2 * kCols, ps = K / gs * kCols;
  auto tile = [&](auto nw, int64_t p) {
    if constexpr (PAIRS) {
      tile_wo_pairs<BITS, GROUPED, MR, decltype(nw)::value>(x, K, K, qp + p * pb, sp + p * ps, gs, p * kCols, N, b,
                                                            y, N);
    } else {
      tile_wo<BITS, GROUPED, MR, decltype(nw)::value>(x, K, K, qp + p * pb, sp + p * ps, gs, p * kCols, N, b, y, N);
    }
  };
  int64_t p = p0;
  for (; p + NP <= p0 + np; p += NP) tile(Int<NP>(), p);
  for (; p < p0 + np; ++p) tile(Int<1>(), p);
}

template <int BITS, bool GROUPED, bool PAIRS, typename T>
void run_wo(const T* x, int64_t M, int64_t K, const uint8_t* qp, const float* sp, int64_t gs, int64_t N, const T* b,
            T* y) {
  using Widths = std::conditional_t<GROUPED, GroupedTileWidths, TileWidths>;  // per channel: the float kernels'
  schedule<Widths>(M, N, [&](auto mr, auto nw, int64_t m, int64_t g, int64_t np) {
    panels_wo<BITS, GROUPED, PAIRS, T, decltype(mr)::value, decltype(nw)::value>(x + m * K, K, qp, sp, gs, g, np, N,
                                                                                  b, y + m * N);
  });
}

bool has_bf16() { return __builtin_cpu_supports("avx512bf16"); }

// bf16 inputs run k pairs (`tile_wo_pairs`) where the CPU has VDPBF16PS and the groups have an even size; the rest
// widen to fp32 FMAs (`tile_wo`)
template <int BITS, bool GROUPED, typename T>
void linear_wo(const T* x, int64_t M, int64_t K, const uint8_t* qp, const float* sp, int64_t gs, int64_t N,
               const T* b, T* y) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    static const bool pairs = has_bf16();
    if (pairs && gs % 2 == 0) return run_wo<BITS, GROUPED, true>(x, M, K, qp, sp, gs, N, b, y);
  }
  run_wo<BITS, GROUPED, false>(x, M, K, qp, sp, gs, N, b, y);
}

at::Tensor linear_wo_op(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales, int64_t bits,
                        int64_t group_size, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2, "cpu_linear_wo: x must be [M, K]");
  check_dtype(x_in, "x");
  TORCH_CHECK(bits == 8 || bits == 4, "cpu_linear_wo: bits must be 8 or 4, got ", bits);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = (N + kCols - 1) / kCols;
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && (bits == 8 || group_size % 2 == 0),
              "cpu_linear_wo: group size ", group_size, " must divide K = ", K, " (and be even for int4)");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.numel() == P * kCols * (bits == 8 ? K : K / 2),
              "cpu_linear_wo: the packed weight does not match x [", M, ", ", K, "] and ", N, " outputs");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == P * kCols * (K / group_size),
              "cpu_linear_wo: the packed scales do not match ", N, " outputs and groups of ", group_size);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(), "cpu_linear_wo: bias must be [", N,
                "] ", x.scalar_type());
    b = bias->contiguous();
  }
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* bp = b ? b->data_ptr<T>() : nullptr;
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const bool grouped = group_size < K;
    if (bits == 8) {
      if (grouped) linear_wo<8, true, T>(xp, M, K, qp, sp, group_size, N, bp, yp);
      else linear_wo<8, false, T>(xp, M, K, qp, sp, group_size, N, bp, yp);
    } else {
      if (grouped) linear_wo<4, true, T>(xp, M, K, qp, sp, group_size, N, bp, yp);
      else linear_wo<4, false, T>(xp, M, K, qp, sp, group_size, N, bp, yp);
    }
  };
  if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else run(float());
  return y;
}

// ---- int8 (or int4) weights and int8 activations (the drafter on VNNI CPUs): y = sx sw (xq . q) (+ b) ----------
// A drafter only proposes (the base verifies every token), so its layers may trade exactness for speed. Here the
// input is quantized per row, symmetric: sx = max|x| / 127, xq = round(x / sx) in [-127, 127], stored as u = xq + 128
// (VPDPBUSD multiplies unsigned by signed bytes); q is int8 per output channel (scale sw), packed in panels
// [P, ceil(K / 4), 16, 4] (four consecutive k of one column per 32-bit lane), zero-padded. Each output is the exact
// int32 sum over k of u q (at most 255 * 127 * K, well inside int32 for K < 66,000), minus 128 * colsum(q), times
// sx * sw in fp32, + b: integer sums do not depend on order, so a row's result does not depend on the other rows,
// the tiling or the threads. VPDPBUSD does 64 byte products per instruction, VDPBF16PS 32 bf16 ones, and the bytes
// read are half of bf16's.
//
// int4 weights (q in [-8, 7], the drafter's head under `w4a8`) are the same products from half the bytes: panels
// [P, ceil(K / 8), 16, 4] of bytes whose low nibble holds q + 8 of k = 8 j + c and whose high nibble that of
// k = 8 j + 4 + c (c = 0..3), each block of 64 bytes unpacked into two blocks of int8 q in registers. The sums are the
// same exact integers, so the result is `w8a8_reference`'s over the int4 values, bit for bit. A layer reads half its
// int8 bytes: the drafter's 8192 x 512 head, 2 MB a core in int8 and read at every drafted token, fits in a 2 MB L2
// at 1 MB a core.
template <int MR, int NP, int BITS, typename T>
__attribute__((target("avx512vnni,avx512bw,avx512vl"))) void tile_w8a8(
    const uint8_t* u, int64_t ldu, int64_t KB, const int8_t* qp, const int32_t* colsum, const float* sw,
    const float* sx, int64_t n0, int64_t N, const float* bias, T* y, int64_t ldy) {
  __m512i acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_si512();
  if constexpr (BITS == 8) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      __m512i w[NP];
      for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(qp + (p * KB + kb) * kCols * 4);
      prefetch_ahead<NP>(qp + kb * kCols * 4, KB * kCols * 4);  // a 64-byte line per panel each kb
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, u + m * ldu + 4 * kb, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbusd_epi32(acc[m][p], xv, w[p]);
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t kb = 0; kb < KB; ++kb) {
      __m512i x0[MR], x1[MR];
      for (int m = 0; m < MR; ++m) {
        int32_t quad[2];
        std::memcpy(quad, u + m * ldu + 8 * kb, 8);
        x0[m] = _mm512_set1_epi32(quad[0]);
        x1[m] = _mm512_set1_epi32(quad[1]);
      }
      prefetch_ahead<NP>(qp + kb * kCols * 4, KB * kCols * 4);
      for (int p = 0; p < NP; ++p) {
        const __m512i v = _mm512_loadu_si512(qp + (p * KB + kb) * kCols * 4);
        const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, low), eight);
        const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight);
        for (int m = 0; m < MR; ++m) acc[m][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[m][p], x0[m], lo), x1[m], hi);
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t n = n0 + p * kCols;
    if (n >= N) break;
    const __mmask16 mk = tail_mask(N - n);
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(colsum + n), 7);  // 128 * colsum
    const __m512 s = _mm512_loadu_ps(sw + n);  // padded to whole panels
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + n) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][p], off));
      // rounded product, then + b: the explicit rounding keeps the compiler from contracting the two into an FMA
      const __m512 scaled = _mm512_mul_round_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(sx[m])),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store16(y + m * ldy + n, _mm512_add_ps(scaled, b), mk);
    }
  }
}

// k values per 64-byte block of a panel: 4 (int8), 8 (int4)
inline int64_t block_k(int64_t bits) { return bits == 4 ? 8 : 4; }

// q [N, K] int8 (bits 4: values in [-8, 7]) -> (panels [P, ceil(K / kb), 16, 4] bytes, column sums [P * 16] int32),
// zero-padded past N and K; kb = block_k(bits), int4 as the nibbles tile_w8a8 unpacks
std::vector<at::Tensor> pack_w8a8(const at::Tensor& q, int64_t bits) {
  TORCH_CHECK(q.dim() == 2 && q.device().is_cpu() && q.scalar_type() == at::kChar,
              "cpu_pack_w8a8: q must be a 2-D CPU int8 tensor");
  TORCH_CHECK(bits == 8 || bits == 4, "cpu_pack_w8a8: bits must be 8 or 4, got ", bits);
  const int64_t N = q.size(0), K = q.size(1), P = (N + kCols - 1) / kCols, kb = block_k(bits),
                KB = (K + kb - 1) / kb;
  at::Tensor padded = at::zeros({P * kCols, KB * kb}, q.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  if (bits == 4)
    TORCH_CHECK(padded.min().item<int8_t>() >= -8 && padded.max().item<int8_t>() <= 7,
                "cpu_pack_w8a8: int4 values must lie in [-8, 7]");
  at::Tensor colsum = padded.sum(1, /*keepdim=*/false, at::kInt).contiguous();
  if (bits == 8) return {padded.view({P, kCols, KB, 4}).permute({0, 2, 1, 3}).contiguous(), colsum};
  // [P, 16, KB, 2 (low, high), 4] -> nibbles q + 8, low | high << 4 -> [P, KB, 16, 4]
  at::Tensor biased = (padded.view({P, kCols, KB, 2, 4}) + 8).to(at::kByte);
  at::Tensor both = biased.select(3, 0).bitwise_or(biased.select(3, 1).__lshift__(4));
  return {both.permute({0, 2, 1, 3}).contiguous().view(at::kChar), colsum};
}

// one row of x [K] -> u [Kp] (padding k at 128, i.e. 0) and its scale sx (see tile_w8a8); round to nearest even
template <typename T>
__attribute__((target("avx512vnni,avx512bw,avx512vl"))) float quantize_row(const T* x, int64_t K, int64_t Kp,
                                                                             uint8_t* u) {
  using trt_redrafter_cpu::load16;
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < K; k += kCols) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + k, tail_mask(K - k))));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  const __m512i off = _mm512_set1_epi32(128);
  for (k = 0; k < K; k += kCols) {
    const __mmask16 mk = tail_mask(K - k);
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load16(x + k, mk), inv)), off);
    _mm_mask_storeu_epi8(u + k, mk, _mm512_cvtusepi32_epi8(v));
  }
  for (k = K; k < Kp; ++k) u[k] = 128;
  return s;
}

// At most 4 rows a pass: the 5- and 6-row tiles (20 and 24 accumulators, NP weights, a broadcast input) run at about
// 0.65 VPDPBUSD a cycle where 4 x 4 runs one, so from 5 rows on a pass of 4 rows is faster even though it reads the
// group's weights again (from L1/L2). A drafter head of 8192 x 512 on one Zen 5 core: 32 rows in 351 us against 747.
// The same for int4 weights (MR NP accumulators + 2 MR broadcast inputs + the unpacked pair): the drafter's whole
// search at batch 8 in 0.89-0.91 of its time with an int8 head, where its 5- and 6-row tiles took 0.95-0.99.
struct W4A8TileWidths {
  static constexpr int rows = 4;
  static constexpr int np[kRows] = {8, 8, 6, 4};  // no 5- or 6-row tile is built
};
struct W8A8TileWidths {
  static constexpr int rows = 4;
  static constexpr int np[kRows] = {8, 8, 6, 4};  // no 5- or 6-row tile is built
};

template <int BITS, typename T>
__attribute__((target("avx512vnni,avx512bw,avx512vl"))) void linear_w8a8(
    const T* x, int64_t M, int64_t K, const int8_t* qp, const int32_t* cs, const float* swp, int64_t N,
    const float* bp, T* y) {
  const int64_t kb = block_k(BITS), KB = (K + kb - 1) / kb, ldu = kb * KB, pe = KB * kCols * 4;  // bytes per panel
  std::vector<uint8_t> u(M * ldu);
  std::vector<float> sx(M);
  for (int64_t m = 0; m < M; ++m) sx[m] = quantize_row(x + m * K, K, ldu, u.data() + m * ldu);
  using Widths = std::conditional_t<BITS == 8, W8A8TileWidths, W4A8TileWidths>;
  schedule<Widths>(M, N, [&](auto mr, auto nw, int64_t m, int64_t g, int64_t np) {
    constexpr int MR = decltype(mr)::value, NP = decltype(nw)::value;
    int64_t p = g;
    for (; p + NP <= g + np; p += NP)
      tile_w8a8<MR, NP, BITS>(u.data() + m * ldu, ldu, KB, qp + p * pe, cs, swp, sx.data() + m, p * kCols, N, bp,
                              y + m * N, N);
    for (; p < g + np; ++p)
      tile_w8a8<MR, 1, BITS>(u.data() + m * ldu, ldu, KB, qp + p * pe, cs, swp, sx.data() + m, p * kCols, N, bp,
                             y + m * N, N);
  });
}

// x [M, K] float32 or bfloat16 -> y [M, N] of its dtype (see tile_w8a8); sw [P * 16] fp32 (padded), bias [N] fp32;
// `bits`: the packed weight's, 8 or 4 (pack_w8a8).
at::Tensor linear_w8a8_op(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& colsum,
                          const at::Tensor& sw, int64_t N, const std::optional<at::Tensor>& bias, int64_t bits) {
  TORCH_CHECK(x_in.dim() == 2, "cpu_linear_w8a8: x must be [M, K]");
  TORCH_CHECK(bits == 8 || bits == 4, "cpu_linear_w8a8: bits must be 8 or 4, got ", bits);
  check_dtype(x_in, "x");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = (N + kCols - 1) / kCols, kb = block_k(bits), KB = (K + kb - 1) / kb;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == P * kCols * KB * 4,
              "cpu_linear_w8a8: the packed weight does not match x [", M, ", ", K, "], ", N, " outputs and ", bits,
              " bits");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == P * kCols &&
                  sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == P * kCols,
              "cpu_linear_w8a8: column sums and scales must be [", P * kCols, "]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, "cpu_linear_w8a8: bias must be [", N,
                "] float32");
    b = bias->contiguous();
  }
  const int8_t* qp = packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* swp = sw.data_ptr<float>();
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    if (bits == 4) linear_w8a8<4, T>(x.data_ptr<T>(), M, K, qp, cs, swp, N, bp, y.data_ptr<T>());
    else linear_w8a8<8, T>(x.data_ptr<T>(), M, K, qp, cs, swp, N, bp, y.data_ptr<T>());
  };
  if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16());
  else run(float());
  return y;
}

bool has_vnni() { return __builtin_cpu_supports("avx512vnni"); }

}  // namespace

namespace trt_redrafter_cpu {

template <typename T>
void linear_packed(const T* x, int64_t M, int64_t K, const T* wp, int64_t N, const T* b, T* y) {
  if (M > 0) linear<T>(x, M, K, wp, N, b, y);
}
template void linear_packed<float>(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*);
template void linear_packed<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t,
                                           const c10::BFloat16*, c10::BFloat16*);

template <typename T>
void linear_int8_inputs(const T* x, int64_t M, int64_t K, const int8_t* qp, const int32_t* colsum, const float* sw,
                        int64_t N, const float* b, T* y, int64_t bits) {
  if (M == 0) return;
  if (bits == 4) ::linear_w8a8<4, T>(x, M, K, qp, colsum, sw, N, b, y);
  else ::linear_w8a8<8, T>(x, M, K, qp, colsum, sw, N, b, y);
}
template void linear_int8_inputs<float>(const float*, int64_t, int64_t, const int8_t*, const int32_t*, const float*,
                                        int64_t, const float*, float*, int64_t);
template void linear_int8_inputs<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, const int8_t*,
                                                const int32_t*, const float*, int64_t, const float*, c10::BFloat16*,
                                                int64_t);

}  // namespace trt_redrafter_cpu

TORCH_LIBRARY(trt_redrafter_cpu, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_wo(Tensor x, Tensor qweight, Tensor scales, int bits, int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("pack_w8a8(Tensor q, int bits=8) -> Tensor[]");
  m.def("linear_w8a8(Tensor x, Tensor packed, Tensor colsum, Tensor scales, int out_features, Tensor? bias, int bits=8) -> Tensor");
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("has_bf16() -> bool", &has_bf16);
  m.def("prefetch_bytes() -> int", &prefetch_bytes);
  m.def("set_prefetch_bytes(int bytes) -> int", &set_prefetch_bytes);
}

TORCH_LIBRARY_IMPL(trt_redrafter_cpu, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear_op);
  m.impl("linear_wo", &linear_wo_op);
  m.impl("pack_w8a8", &pack_w8a8);
  m.impl("linear_w8a8", &linear_w8a8_op);
}
