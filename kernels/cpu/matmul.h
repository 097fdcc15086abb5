// Dense matrix-vector / matrix-matrix products against (possibly quantized)
// weights: y[t][r] = sum_i W[r][i] * x[t][i] for every token row t.
//
// The vectorized path (AVX2/FMA, chosen at run time) quantizes activations to
// 8 bits per 32-element block for the quantized weight types, as llama.cpp
// does, and works on integer dot products; the reference path dequantizes
// weights and accumulates in float with plain loops.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/thread_pool.h"
#include "kernels/dtype.h"

namespace kvserve::kernels {

// A quantized weight repacked into 16-row panels (matmul_panels.h) for the
// AVX-512 VNNI and AMX kernels; made by PackWeight, owned by the caller.
struct PackedWeight;

// A row-major weight matrix of `rows` output features by `cols` input
// features; row r starts at data + r * RowBytes(type, cols). `packed`, when
// set, is the same matrix as PackWeight made it: the VNNI and AMX kernels
// then read it instead of `data` (the other paths keep reading `data`).
struct WeightView {
  DType type;
  const void* data;
  int64_t rows;
  int64_t cols;
  const PackedWeight* packed = nullptr;
};

// Repacks a weight into 16-row panels when the AVX-512 VNNI kernels will
// run (UseAvx512Vnni()): every quantized type (internal::CanPackPanels);
// null for the float types or other CPUs. Every matmul through a packed view
// computes each output with one expression (matmul_panels.h; for the
// 32-value formats, per block: the exact int32 dot, then
// acc = fma(float(isum), d_w * d_a, acc); acc = fma(m_w, s_a, acc), blocks in
// order), whichever of the VNNI and AMX kernels runs and whatever the batch,
// so the two are bit-identical.
//
// With an arena, the panels are cut from its chunks (one model's matrices
// packed one after another share huge pages; see PanelArena); without, each
// weight gets its own allocation.
class PanelArena;
std::shared_ptr<const PackedWeight> PackWeight(const WeightView& w, PanelArena* arena = nullptr);

// Storage for the panel copies of one model's weights: 2 MB-aligned chunks
// advised for transparent huge pages, cut in order into 64-byte aligned
// pieces. A batch-1 decode streams every panel once per token; a layer's
// matrices (0.1-1.3 MB each in the small models) are each smaller than a
// huge page, so allocated one by one they sat on 4 KB pages, paying a page
// walk per 4 KB and stopping the hardware prefetchers at each page
// boundary. A chunk stays alive while any weight cut from it does (the
// packed weight holds it), so the arena itself may go away after packing.
// Not thread-safe: one loader packs into an arena at a time.
class PanelArena {
 public:
  // 64-byte aligned bytes (not zeroed); *owner keeps their chunk alive.
  // Null if the memory is not there.
  uint8_t* Allocate(size_t bytes, std::shared_ptr<void>* owner);

 private:
  std::shared_ptr<void> chunk_;
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

// Bytes a packed weight holds (the extra memory next to the mapped file).
int64_t PackedBytes(const PackedWeight& p);

// The quantized-matmul kernels this process uses, for the start-up log:
// e.g. "amx-int8 for >= 16 tokens, avx512-vnni below".
std::string MatMulPathDescription();

// x: n_tokens rows of `cols` floats, x_stride floats apart.
// y: n_tokens rows of `rows` floats, y_stride floats apart.
// pool may be null (single-threaded).
void MatMul(const WeightView& w, const float* x, int64_t n_tokens, int64_t x_stride, float* y,
            int64_t y_stride, ThreadPool* pool);

// Plain-loop reference with the same contract. Single-threaded.
void MatMulReference(const WeightView& w, const float* x, int64_t n_tokens, int64_t x_stride,
                     float* y, int64_t y_stride);

// Several products of the same input, y_i = W_i x (Q/K/V, or gate/up): the
// activations are quantized once and the rows of all weights are split over
// the pool in a single dispatch. REQUIRES: every ws[i].cols is the same;
// types may differ. ys[i] has y_strides[i] as its token stride.
void MatMulMany(const WeightView* ws, int n_weights, const float* x, int64_t n_tokens,
                int64_t x_stride, float* const* ys, const int64_t* y_strides, ThreadPool* pool);

// Dequantizes n elements (n % BlockElems(type) == 0) of a row.
void DequantizeRow(DType type, const void* src, float* dst, int64_t n);

// Reference quantizers (round-to-nearest, ggml's formulas) for tests and for
// writing model fixtures: n % BlockElems(type) == 0; dst holds RowBytes.
void QuantizeRowReference(DType type, const float* src, void* dst, int64_t n);

}  // namespace kvserve::kernels
