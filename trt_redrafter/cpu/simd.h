// AVX-512 loads and stores of 16 float32 or bfloat16 values, as float32 vectors, their tail masks and e^x; shared by
// linear.cpp, attention.cpp and draft.cpp. A mask selects the lanes (tails); bfloat16 stores round to nearest even, as
// c10::BFloat16(float).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace trt_redrafter_cpu {

constexpr __mmask16 kAll = (__mmask16)0xFFFF;

// the first n lanes (all 16 from n = 16 on)
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? kAll : (__mmask16)((1u << n) - 1); }

inline __m512 load16(const float* p, __mmask16 m = kAll) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 m = kAll) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x, 16 at a time: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by its Taylor series to r^7 (error
// below 1e-8 relative), times 2^n. Below -87.3 the result is 0; above 88.7 it is +inf (for finite x).
inline __m512 exp16(__m512 x) {
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

inline void store16(float* p, __m512 v, __mmask16 m = kAll) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = kAll) {
  __m512i i = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

}  // namespace trt_redrafter_cpu
