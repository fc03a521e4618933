// The kernels one source file of this extension calls in another's (draft.cpp runs the drafter's layers and top-k
// without a dispatcher call each): the same functions the registered ops run.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace trt_redrafter_cpu {

// y [M, N] = x [M, K] W^T (+ b) over W packed by `pack` (linear.cpp); T float or c10::BFloat16
template <typename T>
void linear_packed(const T* x, int64_t M, int64_t K, const T* wp, int64_t N, const T* b, T* y);

// the same over int8 (bits 8) or int4 (bits 4) weights packed by `pack_w8a8`, each row of x quantized to int8
// (linear.cpp, linear_w8a8); sw [P * 16] and b [N] fp32 (b may be null)
template <typename T>
void linear_int8_inputs(const T* x, int64_t M, int64_t K, const int8_t* qp, const int32_t* colsum, const float* sw,
                        int64_t N, const float* b, T* y, int64_t bits);

// the k largest values of each of R rows of x [R, V] (row stride ldx), the first `sorted` of them descending, equal
// values in ascending index order, the rest of the k after them in any order (topk.cpp); rows split across threads
// where there are enough of them
void topk_rows(const float* x, int64_t R, int64_t V, int64_t ldx, int64_t k, int64_t sorted, float* vals,
               int64_t* idx);

}  // namespace trt_redrafter_cpu
