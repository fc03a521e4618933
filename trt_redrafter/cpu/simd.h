// AVX-512 loads and stores of 16 float32 or bfloat16 values, as float32 vectors; shared by linear.cpp and
// attention.cpp. A mask selects the lanes (tails); bfloat16 stores round to nearest even, as c10::BFloat16(float).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace trt_redrafter_cpu {

constexpr __mmask16 kAll = (__mmask16)0xFFFF;

inline __m512 load16(const float* p, __mmask16 m = kAll) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 m = kAll) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* p, __m512 v, __mmask16 m = kAll) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = kAll) {
  __m512i i = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

}  // namespace trt_redrafter_cpu
