// MatMul dispatch and threading, the plain-loop reference, the ggml
// quantizers, and the portable version of the quantized-activation algorithm
// (used when AVX2 is absent or disabled).

#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common/cpu_features.h"
#include "common/half.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/matmul_internal.h"
#include "kernels/cpu/matmul_panels.h"

namespace kvserve::kernels {
namespace {

using internal::QuantizedActs;

// Per-thread scratch for quantized activations: MatMul runs hundreds of times
// per token, so allocation is amortized across calls.
struct ActsScratch {
  std::vector<int8_t> qs;
  std::vector<float> ds;
  std::vector<int32_t> sums;
  std::vector<int16_t> bsums;  // Q8_K only
};

ActsScratch& Scratch() {
  thread_local ActsScratch scratch;
  return scratch;
}

// The Q8_K scratch, separate: one MatMulMany may need both kinds (a mix's
// fused Q/K/V can hold Q4_K next to Q5_0).
ActsScratch& ScratchQ8K() {
  thread_local ActsScratch scratch;
  return scratch;
}

float Scale16(uint16_t h) { return Fp16ToFp32(h); }

// Plain dot products of one weight row against one quantized token.
float DotQ8_0(const BlockQ8_0* w, const int8_t* xq, const float* xds, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t acc = 0;
    for (int j = 0; j < kQK; ++j) acc += w[b].qs[j] * xq[b * kQK + j];
    sum += static_cast<float>(acc) * Scale16(w[b].d) * xds[2 * b];
  }
  return sum;
}

// Q4_0 is Q4_1 with min = -8 * d: sum((q - 8) * x) = sum(q * x) - 8 * sum(x).
template <typename Block, bool kHasMin>
float DotQ4(const Block* w, const int8_t* xq, const float* xds, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t acc = 0;
    const int8_t* x = xq + b * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      acc += (w[b].qs[j] & 0x0F) * x[j] + (w[b].qs[j] >> 4) * x[j + kQK / 2];
    }
    const float d = Scale16(w[b].d);
    float m;
    if constexpr (kHasMin) {
      m = Scale16(w[b].m);
    } else {
      m = -8.0f * d;
    }
    sum += static_cast<float>(acc) * d * xds[2 * b] + m * xds[2 * b + 1];
  }
  return sum;
}

template <DType kType>
float LoadFloat(const void* row, int64_t i) {
  if constexpr (kType == DType::kF32) {
    return static_cast<const float*>(row)[i];
  } else if constexpr (kType == DType::kF16) {
    return Fp16ToFp32(static_cast<const uint16_t*>(row)[i]);
  } else {
    return Bf16ToFp32(static_cast<const uint16_t*>(row)[i]);
  }
}

template <DType kType>
void FloatRowsScalar(const WeightView& w, const float* x, int64_t x_stride, int64_t n_tokens,
                     int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  const int64_t row_bytes = RowBytes(kType, w.cols);
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = static_cast<const uint8_t*>(w.data) + r * row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * x_stride;
      float sum = 0.0f;
      for (int64_t i = 0; i < w.cols; ++i) sum += LoadFloat<kType>(row, i) * xt[i];
      y[t * y_stride + r] = sum;
    }
  }
}

}  // namespace

namespace internal {

void QuantizeActsScalar(const float* x, int64_t n, ActSum sum_mode, int8_t* qs, float* ds,
                        int32_t* sums) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < kQK; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * inv));
      qs[b * kQK + j] = static_cast<int8_t>(q);
      sum += q;
    }
    if (sums != nullptr) sums[b] = sum;
    const float d16 = Fp16ToFp32(Fp32ToFp16(scale));
    ds[2 * b] = d16;
    ds[2 * b + 1] = sum_mode == ActSum::kQ8_1
                        ? Fp16ToFp32(Fp32ToFp16(scale * static_cast<float>(sum)))
                        : d16 * static_cast<float>(sum);
  }
}

void MatMulRowsExtendedScalar(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                              int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  if (acts.bsums != nullptr) {
    return MatMulRowsQ8KReference(w, acts, n_tokens, r0, r1, y, y_stride);
  }
  if (!UsesQ8K(w.type)) return MatMulRowsBlock32Reference(w, acts, n_tokens, r0, r1, y, y_stride);
  // Dequantized weights against the dequantized 8-bit activations: the
  // same inputs the vector kernels see, summed in float per 32-element
  // block in element order.
  const int64_t nb = acts.n_blocks;
  const int64_t row_bytes = RowBytes(w.type, w.cols);
  std::vector<float> row(w.cols);
  for (int64_t r = r0; r < r1; ++r) {
    DequantizeRow(w.type, static_cast<const uint8_t*>(w.data) + r * row_bytes, row.data(), w.cols);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int8_t* xq = acts.qs + t * nb * kQK;
      const float* xds = acts.ds + t * 2 * nb;
      float sum = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        float part = 0.0f;
        for (int j = 0; j < kQK; ++j) part += row[b * kQK + j] * static_cast<float>(xq[b * kQK + j]);
        sum += part * xds[2 * b];
      }
      y[t * y_stride + r] = sum;
    }
  }
}

void MatMulRowsScalar(const WeightView& w, const float* x, int64_t x_stride,
                      const QuantizedActs& acts, int64_t n_tokens, int64_t r0, int64_t r1, float* y,
                      int64_t y_stride) {
  switch (w.type) {
    case DType::kF32:
      return FloatRowsScalar<DType::kF32>(w, x, x_stride, n_tokens, r0, r1, y, y_stride);
    case DType::kF16:
      return FloatRowsScalar<DType::kF16>(w, x, x_stride, n_tokens, r0, r1, y, y_stride);
    case DType::kBF16:
      return FloatRowsScalar<DType::kBF16>(w, x, x_stride, n_tokens, r0, r1, y, y_stride);
    default:
      break;
  }
  if (IsExtendedType(w.type)) return MatMulRowsExtendedScalar(w, acts, n_tokens, r0, r1, y, y_stride);
  const int64_t nb = acts.n_blocks;
  const int64_t row_bytes = RowBytes(w.type, w.cols);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int8_t* xq = acts.qs + t * nb * kQK;
      const float* xds = acts.ds + t * 2 * nb;
      float v = 0.0f;
      switch (w.type) {
        case DType::kQ8_0:
          v = DotQ8_0(reinterpret_cast<const BlockQ8_0*>(row), xq, xds, nb);
          break;
        case DType::kQ4_0:
          v = DotQ4<BlockQ4_0, false>(reinterpret_cast<const BlockQ4_0*>(row), xq, xds, nb);
          break;
        case DType::kQ4_1:
          v = DotQ4<BlockQ4_1, true>(reinterpret_cast<const BlockQ4_1*>(row), xq, xds, nb);
          break;
        default:
          break;
      }
      y[t * y_stride + r] = v;
    }
  }
}


void MatMulPanelsScalar(const WeightView& w, const QuantizedActs& acts, int64_t n_tokens,
                        int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  const int64_t nb = acts.n_blocks;
  const int64_t row_bytes = RowBytes(w.type, w.cols);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + r * row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int8_t* xq = acts.qs + t * nb * kQK;
      const float* xds = acts.ds + t * 2 * nb;
      float acc = 0.0f;
      if (w.type == DType::kQ6_K) {
        // Per super-block: exact scaled, offset 16-value dots, then one fma.
        const int16_t* xbs = acts.bsums + t * nb * 2;
        for (int64_t s = 0; s < nb / 8; ++s) {
          const auto* blk = reinterpret_cast<const BlockQ6_K*>(row) + s;
          int32_t sumi = 0;
          for (int k = 0; k < 16; ++k) {
            int32_t isum = 0;
            for (int e = 16 * k; e < 16 * k + 16; ++e) {
              isum += Q6KValue(*blk, e) * xq[s * kQK_K + e];
            }
            sumi += blk->scales[k] * (isum - 32 * xbs[16 * s + k]);
          }
          acc = std::fma(static_cast<float>(sumi), Scale16(blk->d) * xds[2 * 8 * s], acc);
        }
        y[t * y_stride + r] = acc;
        continue;
      }
      if (w.type == DType::kQ2_K || w.type == DType::kQ3_K) {
        // Per super-block: exact scaled 16-value dots (and Q2_K's mins),
        // then one fma each.
        const int16_t* xbs = acts.bsums + t * nb * 2;
        const int64_t sb_bytes = RowBytes(w.type, kQK_K);
        KSuperBlockInts k;
        for (int64_t s = 0; s < nb / 8; ++s) {
          DecodeKSuperBlock(w.type, row + s * sb_bytes, &k);
          int32_t sumi = 0;
          int32_t summ = 0;
          for (int i = 0; i < 16; ++i) {
            int32_t isum = 0;
            for (int l = 0; l < 16; ++l) isum += k.q[16 * i + l] * xq[s * kQK_K + 16 * i + l];
            sumi += k.sc[i] * isum;
            summ += k.mn[i] * xbs[16 * s + i];
          }
          const float da = xds[2 * 8 * s];
          acc = std::fma(static_cast<float>(sumi), k.d * da, acc);
          if (w.type == DType::kQ2_K) acc = std::fma(static_cast<float>(summ), -k.dmin * da, acc);
        }
        y[t * y_stride + r] = acc;
        continue;
      }
      if (w.type == DType::kIQ4_XS) {
        // Per super-block: exact signed-scaled 32-value dots, then one fma.
        for (int64_t s = 0; s < nb / 8; ++s) {
          const auto* blk = reinterpret_cast<const BlockIQ4_XS*>(row) + s;
          int32_t sumi = 0;
          for (int j = 0; j < 8; ++j) {
            const int8_t* x = xq + (8 * s + j) * kQK;
            int32_t isum = 0;
            for (int l = 0; l < kQK / 2; ++l) {
              const uint8_t q = blk->qs[16 * j + l];
              isum += kIq4nlValues[q & 0x0F] * x[l] + kIq4nlValues[q >> 4] * x[l + kQK / 2];
            }
            sumi += (IQ4XSScale(*blk, j) - 32) * isum;
          }
          acc = std::fma(static_cast<float>(sumi), Scale16(blk->d) * xds[2 * 8 * s], acc);
        }
        y[t * y_stride + r] = acc;
        continue;
      }
      if (w.type == DType::kQ4_K || w.type == DType::kQ5_K) {
        // Per super-block: exact scaled dots and mins, then two fmas.
        const bool five = w.type == DType::kQ5_K;
        const int16_t* xbs = acts.bsums + t * nb * 2;
        for (int64_t s = 0; s < nb / 8; ++s) {
          const uint8_t* sb = row + s * RowBytes(w.type, kQK_K);
          uint16_t dh;
          uint16_t dminh;
          std::memcpy(&dh, sb, 2);
          std::memcpy(&dminh, sb + 2, 2);
          const uint8_t* scales = sb + 4;
          const uint8_t* qh = five ? sb + 16 : nullptr;
          const uint8_t* qs = sb + (five ? 48 : 16);
          int32_t sumi = 0;
          int32_t summ = 0;
          for (int j = 0; j < 8; ++j) {
            int sc;
            int mn;
            KQuantScaleMin(scales, j, &sc, &mn);
            const uint8_t* q = qs + 32 * (j / 2);
            const int8_t* x = xq + (8 * s + j) * kQK;
            int32_t isum = 0;
            for (int e = 0; e < kQK; ++e) {
              const int v = ((q[e] >> (4 * (j % 2))) & 0x0F) | (five ? ((qh[e] >> j) & 1) << 4 : 0);
              isum += v * x[e];
            }
            sumi += sc * isum;
            summ += mn * (xbs[16 * s + 2 * j] + xbs[16 * s + 2 * j + 1]);
          }
          const float da = xds[2 * 8 * s];
          acc = std::fma(static_cast<float>(sumi), Scale16(dh) * da, acc);
          acc = std::fma(static_cast<float>(summ), -Scale16(dminh) * da, acc);
        }
        y[t * y_stride + r] = acc;
        continue;
      }
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        float d = 0.0f;
        float m = 0.0f;
        const int8_t* x = xq + b * kQK;
        if (w.type == DType::kQ8_0) {
          const auto* blk = reinterpret_cast<const BlockQ8_0*>(row) + b;
          for (int j = 0; j < kQK; ++j) isum += blk->qs[j] * x[j];
          d = Scale16(blk->d);
        } else if (w.type == DType::kQ5_0) {
          const auto* blk = reinterpret_cast<const BlockQ5_0*>(row) + b;
          uint32_t qh;
          std::memcpy(&qh, blk->qh, sizeof(qh));
          for (int j = 0; j < kQK / 2; ++j) {
            const int lo = (blk->qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
            const int hi = (blk->qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
            isum += (lo - 16) * x[j] + (hi - 16) * x[j + kQK / 2];
          }
          d = Scale16(blk->d);
        } else if (w.type == DType::kQ5_1) {
          const auto* blk = reinterpret_cast<const BlockQ5_1*>(row) + b;
          uint32_t qh;
          std::memcpy(&qh, blk->qh, sizeof(qh));
          for (int j = 0; j < kQK / 2; ++j) {
            const int lo = (blk->qs[j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
            const int hi = (blk->qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
            isum += lo * x[j] + hi * x[j + kQK / 2];
          }
          d = Scale16(blk->d);
          m = Scale16(blk->m);
        } else if (w.type == DType::kIQ4_NL) {
          const auto* blk = reinterpret_cast<const BlockIQ4_NL*>(row) + b;
          for (int j = 0; j < kQK / 2; ++j) {
            isum += kIq4nlValues[blk->qs[j] & 0x0F] * x[j] +
                    kIq4nlValues[blk->qs[j] >> 4] * x[j + kQK / 2];
          }
          d = Scale16(blk->d);
        } else {
          const uint8_t* qs;
          if (w.type == DType::kQ4_0) {
            const auto* blk = reinterpret_cast<const BlockQ4_0*>(row) + b;
            qs = blk->qs;
            d = Scale16(blk->d);
          } else {
            const auto* blk = reinterpret_cast<const BlockQ4_1*>(row) + b;
            qs = blk->qs;
            d = Scale16(blk->d);
            m = Scale16(blk->m);
          }
          const int off = w.type == DType::kQ4_0 ? 8 : 0;
          for (int j = 0; j < kQK / 2; ++j) {
            isum += ((qs[j] & 0x0F) - off) * x[j] + ((qs[j] >> 4) - off) * x[j + kQK / 2];
          }
        }
        acc = std::fma(static_cast<float>(isum), d * xds[2 * b], acc);
        if (PanelHasMin(w.type)) acc = std::fma(m, xds[2 * b + 1], acc);
      }
      y[t * y_stride + r] = acc;
    }
  }
}

// Asks for transparent huge pages over the 2 MB-aligned interior of a large
// allocation (before its first touch). A batch-1 decode streams every panel
// once per token, and a head like Gemma 3's (189 MB of panels) on 4 KB pages
// pays a page walk every 4 KB and stops the hardware prefetchers at each
// page boundary. Systems whose THP setting is "madvise" (the default of many
// distributions) give huge pages only to ranges advised so. Smaller
// allocations are left alone: they hold no whole 2 MB page.
void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace internal

namespace {

template <typename Block>
const Block* RowBlocks(const WeightView& w, int64_t r) {
  return reinterpret_cast<const Block*>(static_cast<const uint8_t*>(w.data) +
                                        r * RowBytes(w.type, w.cols));
}

// An empty (zeroed, 64-byte aligned) panel copy of w: ceil(rows / 16)
// panels of ceil(n_blocks / group_blocks) stored blocks of block_bytes each,
// a stored block holding group_blocks 32-value blocks of qs_bytes, qs_stride
// apart (default qs_bytes). Null if the memory is not there.
std::shared_ptr<PackedWeight> AllocatePanels(const WeightView& w, int64_t qs_bytes,
                                             int64_t group_blocks, int64_t block_bytes,
                                             PanelArena* arena, int64_t scale_bytes = 32,
                                             int64_t qs_stride = 0) {
  auto p = std::make_shared<PackedWeight>();
  p->type = w.type;
  p->rows = w.rows;
  p->cols = w.cols;
  p->n_blocks = w.cols / kQK;
  p->n_panels = (w.rows + internal::kPanelRows - 1) / internal::kPanelRows;
  p->qs_bytes = qs_bytes;
  p->group_blocks = group_blocks;
  p->block_bytes = block_bytes;
  p->scale_bytes = scale_bytes;
  p->qs_stride = qs_stride > 0 ? qs_stride : qs_bytes;
  p->panel_bytes = (p->n_blocks + group_blocks - 1) / group_blocks * block_bytes;
  const size_t total = static_cast<size_t>(p->n_panels * p->panel_bytes);
  if (arena != nullptr) {
    p->storage = {arena->Allocate(total, &p->arena_chunk), [](void*) {}};
  } else {
    p->storage = {static_cast<uint8_t*>(std::aligned_alloc(64, total)), std::free};
    if (p->storage) internal::AdviseHugePages(p->storage.get(), total);
  }
  if (!p->storage) return nullptr;
  std::memset(p->storage.get(), 0, total);
  return p;
}

// Sets row n's bits of the 8 fifth-bit masks at `masks` (Q5_0, Q5_K; see
// matmul_panels.h): mask g's bit 4n + i is bit4(e) of element e = 4g + i
// (g < 4) or 16 + 4(g - 4) + i.
template <class Bit4>
void SetFifthBitMasks(uint8_t* masks, int64_t n, Bit4 bit4) {
  for (int g = 0; g < 8; ++g) {
    uint64_t mask;
    std::memcpy(&mask, masks + 8 * g, sizeof(mask));
    for (int i = 0; i < 4; ++i) {
      const int e = (g < 4 ? 4 * g : 16 + 4 * (g - 4)) + i;
      mask |= static_cast<uint64_t>(bit4(e) & 1u) << (4 * n + i);
    }
    std::memcpy(masks + 8 * g, &mask, sizeof(mask));
  }
}

// Calls fn(sb, n, src) for every 256-value super-block of every row of a
// super-block format: sb the packed super-block of the row's panel, n the
// row's lane in it (0..15), src the row's GGUF super-block.
template <class Fn>
void ForEachSuperBlock(const WeightView& w, PackedWeight* p, Fn&& fn) {
  constexpr int64_t kP = internal::kPanelRows;
  const int64_t n_super = w.cols / kQK_K;
  const int64_t sb_bytes = RowBytes(w.type, kQK_K);
  for (int64_t pi = 0; pi < p->n_panels; ++pi) {
    uint8_t* panel = p->storage.get() + pi * p->panel_bytes;
    for (int64_t n = 0; n < kP && pi * kP + n < w.rows; ++n) {
      const uint8_t* row =
          static_cast<const uint8_t*>(w.data) + (pi * kP + n) * RowBytes(w.type, w.cols);
      for (int64_t s = 0; s < n_super; ++s) fn(panel + s * p->block_bytes, n, row + s * sb_bytes);
    }
  }
}

// Q4_K and Q5_K panels (matmul_panels.h): per super-block, the 8
// sub-blocks' nibbles as Q4_0's layout (Q5_K: and their fifth bits as Q5_0's
// masks), their scales and mins, then d and dmin.
template <class Blk>
std::shared_ptr<const PackedWeight> PackQ4KOrQ5K(const WeightView& w, PanelArena* arena) {
  constexpr bool kFive = std::is_same_v<Blk, BlockQ5_K>;
  constexpr int64_t kP = internal::kPanelRows;
  const int64_t qsb = kFive ? 5 * 64 : 4 * 64;
  // Q4_K 2,368, Q5_K 2,880: multiples of 64.
  std::shared_ptr<PackedWeight> p = AllocatePanels(w, qsb, 8, 8 * qsb + 8 * 32 + 2 * kP * 2, arena);
  if (p == nullptr) return nullptr;
  ForEachSuperBlock(w, p.get(), [&](uint8_t* sb, int64_t n, const uint8_t* src) {
    const Blk& blk = *reinterpret_cast<const Blk*>(src);
    for (int j = 0; j < 8; ++j) {
      // Element e of sub-block j: nibble (j % 2) of qs[32 (j / 2) + e]
      // (Q5_K: plus 16 times bit j of qh[e]).
      const uint8_t* q = blk.qs + 32 * (j / 2);
      auto nib = [&](int e) { return (q[e] >> (4 * (j % 2))) & 0x0F; };
      uint8_t* qs = sb + j * qsb;
      for (int e = 0; e < kQK / 2; ++e) {
        qs[(e / 4) * 64 + n * 4 + e % 4] = static_cast<uint8_t>(nib(e) | (nib(e + 16) << 4));
      }
      if constexpr (kFive) {
        SetFifthBitMasks(qs + 256, n, [&](int e) { return blk.qh[e] >> j; });
      }
      int sc;
      int mn;
      internal::KQuantScaleMin(blk.scales, j, &sc, &mn);
      sb[8 * qsb + j * 32 + n] = static_cast<uint8_t>(sc);
      sb[8 * qsb + j * 32 + 16 + n] = static_cast<uint8_t>(mn);
    }
    auto* dd = reinterpret_cast<uint16_t*>(sb + 8 * qsb + 8 * 32);
    dd[n] = blk.d;
    dd[kP + n] = blk.dmin;
  });
  return p;
}

// Q6_K panels (matmul_panels.h): per super-block, 8 blocks of nibbles and
// bit masks, the int8 scales, then d.
std::shared_ptr<const PackedWeight> PackQ6K(const WeightView& w, PanelArena* arena) {
  std::shared_ptr<PackedWeight> p =
      AllocatePanels(w, 384, 8, (8 * 384 + 256 + 32 + 63) / 64 * 64, arena);  // 3,392
  if (p == nullptr) return nullptr;
  ForEachSuperBlock(w, p.get(), [&](uint8_t* sb, int64_t n, const uint8_t* src) {
    const BlockQ6_K& blk = *reinterpret_cast<const BlockQ6_K*>(src);
    for (int j = 0; j < 8; ++j) {
      uint8_t* qs = sb + j * 384;
      auto q = [&](int e) { return internal::Q6KValue(blk, 32 * j + e); };
      for (int e = 0; e < kQK / 2; ++e) {
        qs[(e / 4) * 64 + n * 4 + e % 4] =
            static_cast<uint8_t>((q(e) & 0x0F) | ((q(e + 16) & 0x0F) << 4));
      }
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 4; ++i) {
          uint8_t top = 0;
          for (int g = 0; g < 4; ++g) top |= static_cast<uint8_t>((q(16 * h + 4 * g + i) >> 4) << (2 * g));
          qs[256 + 64 * h + 4 * n + i] = top;
        }
      }
    }
    for (int k = 0; k < 16; ++k) sb[8 * 384 + k * 16 + n] = static_cast<uint8_t>(blk.scales[k]);
    reinterpret_cast<uint16_t*>(sb + 8 * 384 + 256)[n] = blk.d;
  });
  return p;
}

// IQ4_XS panels (matmul_panels.h): per super-block, 8 sub-blocks of
// nibbles as Q4_0's layout, their int8 scales ls - 32, then d.
std::shared_ptr<const PackedWeight> PackIq4Xs(const WeightView& w, PanelArena* arena) {
  constexpr int64_t kP = internal::kPanelRows;
  std::shared_ptr<PackedWeight> p =
      AllocatePanels(w, 256, 8, (8 * 256 + 8 * 16 + 2 * kP + 63) / 64 * 64, arena);  // 2,240
  if (p == nullptr) return nullptr;
  ForEachSuperBlock(w, p.get(), [&](uint8_t* sb, int64_t n, const uint8_t* src) {
    const BlockIQ4_XS& blk = *reinterpret_cast<const BlockIQ4_XS*>(src);
    for (int j = 0; j < 8; ++j) {
      // Sub-block j: qs[16 j + l] holds elements l (low) and l + 16.
      const uint8_t* q = blk.qs + 16 * j;
      uint8_t* qs = sb + j * 256;
      for (int e = 0; e < kQK / 2; ++e) qs[(e / 4) * 64 + n * 4 + e % 4] = q[e];
      sb[8 * 256 + j * 16 + n] =
          static_cast<uint8_t>(static_cast<int8_t>(internal::IQ4XSScale(blk, j) - 32));
    }
    reinterpret_cast<uint16_t*>(sb + 8 * 256 + 8 * 16)[n] = blk.d;
  });
  return p;
}

// Q2_K and Q3_K panels (matmul_panels.h): per super-block, 8 blocks of two
// 2-bit planes (Q3_K: and the third bits as Q5_0's masks), the 16 int8
// scales, (Q2_K) the 16 mins, then d and dmin. The integer values come from
// DecodeKSuperBlock, the plain-loop decoder the references use.
std::shared_ptr<const PackedWeight> PackK16(const WeightView& w, PanelArena* arena) {
  constexpr int64_t kP = internal::kPanelRows;
  const bool q3 = w.type == DType::kQ3_K;
  const int64_t qsb = q3 ? 192 : 128;
  // Q2_K 1,600, Q3_K 1,856: multiples of 64.
  std::shared_ptr<PackedWeight> p =
      AllocatePanels(w, qsb, 8, 8 * qsb + 256 + (q3 ? 0 : 256) + 2 * kP * 2, arena);
  if (p == nullptr) return nullptr;
  internal::KSuperBlockInts k;
  ForEachSuperBlock(w, p.get(), [&](uint8_t* sb, int64_t n, const uint8_t* src) {
    internal::DecodeKSuperBlock(w.type, src, &k);
    for (int j = 0; j < 8; ++j) {
      uint8_t* qs = sb + j * qsb;
      // Unsigned values: Q2_K's q, Q3_K's q + 4 (its third bit apart).
      auto u = [&](int e) { return k.q[32 * j + e] + (q3 ? 4 : 0); };
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 4; ++i) {
          uint8_t bits = 0;
          for (int g = 0; g < 4; ++g) bits |= static_cast<uint8_t>((u(16 * h + 4 * g + i) & 3) << (2 * g));
          qs[64 * h + 4 * n + i] = bits;
        }
      }
      if (q3) SetFifthBitMasks(qs + 128, n, [&](int e) { return u(e) >> 2; });
    }
    for (int i = 0; i < 16; ++i) {
      sb[8 * qsb + i * 16 + n] = static_cast<uint8_t>(static_cast<int8_t>(k.sc[i]));
      if (!q3) sb[8 * qsb + 256 + i * 16 + n] = static_cast<uint8_t>(k.mn[i]);
    }
    // d and dmin as the file stores them (fp16 bits).
    auto* dd = reinterpret_cast<uint16_t*>(sb + 8 * qsb + 256 + (q3 ? 0 : 256));
    if (q3) {
      dd[n] = reinterpret_cast<const BlockQ3_K*>(src)->d;
    } else {
      dd[n] = reinterpret_cast<const BlockQ2_K*>(src)->d;
      dd[kP + n] = reinterpret_cast<const BlockQ2_K*>(src)->dmin;
    }
  });
  return p;
}

}  // namespace

std::shared_ptr<const PackedWeight> PackWeight(const WeightView& w, PanelArena* arena) {
  if (!internal::CanPackPanels(w.type) || !UseAvx512Vnni() || w.rows <= 0 || w.cols <= 0 ||
      w.cols % kQK != 0 || (internal::UsesQ8K(w.type) && w.cols % kQK_K != 0)) {
    return nullptr;
  }
  if (w.type == DType::kQ4_K) return PackQ4KOrQ5K<BlockQ4_K>(w, arena);
  if (w.type == DType::kQ5_K) return PackQ4KOrQ5K<BlockQ5_K>(w, arena);
  if (w.type == DType::kQ6_K) return PackQ6K(w, arena);
  if (w.type == DType::kIQ4_XS) return PackIq4Xs(w, arena);
  if (w.type == DType::kQ2_K || w.type == DType::kQ3_K) return PackK16(w, arena);
  constexpr int64_t kP = internal::kPanelRows;
  const bool five = w.type == DType::kQ5_0 || w.type == DType::kQ5_1;
  const int64_t qs_bytes = w.type == DType::kQ8_0 ? 8 * 64 : (five ? 5 * 64 : 4 * 64);
  // Q4_1 and Q5_1: one block (qs, d, m) is 320 / 384 bytes; the others
  // (IQ4_NL with Q4_0) in pairs (matmul_panels.h: qs, both d, qs), 64-byte
  // multiples with no padding.
  const int64_t scale_bytes = (internal::PanelHasMin(w.type) ? 2 : 1) * kP * 2;
  const int64_t group = internal::PanelHasMin(w.type) ? 1 : 2;
  std::shared_ptr<PackedWeight> p =
      AllocatePanels(w, qs_bytes, group, group * (qs_bytes + scale_bytes), arena, scale_bytes,
                     qs_bytes + group * scale_bytes);
  if (p == nullptr) return nullptr;
  const int64_t nb = p->n_blocks;
  for (int64_t pi = 0; pi < p->n_panels; ++pi) {
    for (int64_t n = 0; n < kP && pi * kP + n < w.rows; ++n) {
      const int64_t r = pi * kP + n;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* qs = const_cast<uint8_t*>(p->Qs(pi, b));
        auto* d = const_cast<uint16_t*>(p->D(pi, b));
        uint16_t* m = d + kP;
        if (w.type == DType::kQ8_0) {
          const BlockQ8_0& blk = RowBlocks<BlockQ8_0>(w, r)[b];
          for (int e = 0; e < kQK; ++e) {
            qs[(e / 4) * 64 + n * 4 + e % 4] = static_cast<uint8_t>(blk.qs[e] + 128);
          }
          d[n] = blk.d;
        } else if (w.type == DType::kQ5_0) {
          const BlockQ5_0& blk = RowBlocks<BlockQ5_0>(w, r)[b];
          for (int e = 0; e < kQK / 2; ++e) qs[(e / 4) * 64 + n * 4 + e % 4] = blk.qs[e];
          uint32_t qh;
          std::memcpy(&qh, blk.qh, sizeof(qh));
          SetFifthBitMasks(qs + 256, n, [&](int e) { return qh >> e; });
          d[n] = blk.d;
        } else if (w.type == DType::kQ5_1) {
          const BlockQ5_1& blk = RowBlocks<BlockQ5_1>(w, r)[b];
          for (int e = 0; e < kQK / 2; ++e) qs[(e / 4) * 64 + n * 4 + e % 4] = blk.qs[e];
          uint32_t qh;
          std::memcpy(&qh, blk.qh, sizeof(qh));
          SetFifthBitMasks(qs + 256, n, [&](int e) { return qh >> e; });
          d[n] = blk.d;
          m[n] = blk.m;
        } else {
          const uint8_t* src;
          if (w.type == DType::kQ4_0) {
            const BlockQ4_0& blk = RowBlocks<BlockQ4_0>(w, r)[b];
            src = blk.qs;
            d[n] = blk.d;
          } else if (w.type == DType::kIQ4_NL) {
            const BlockIQ4_NL& blk = RowBlocks<BlockIQ4_NL>(w, r)[b];
            src = blk.qs;
            d[n] = blk.d;
          } else {
            const BlockQ4_1& blk = RowBlocks<BlockQ4_1>(w, r)[b];
            src = blk.qs;
            d[n] = blk.d;
            m[n] = blk.m;
          }
          for (int e = 0; e < kQK / 2; ++e) qs[(e / 4) * 64 + n * 4 + e % 4] = src[e];
        }
      }
    }
  }
  return p;
}

uint8_t* PanelArena::Allocate(size_t bytes, std::shared_ptr<void>* owner) {
  constexpr size_t kAlign = 64;
  constexpr size_t kHuge = size_t{2} << 20;
  constexpr size_t kChunk = size_t{32} << 20;
  const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
  if (base_ == nullptr || size_ - used_ < need) {
    // A new chunk; the old one's unused tail is never touched, so (being
    // anonymous memory) it costs no RAM.
    const size_t size = std::max(kChunk, (need + kHuge - 1) / kHuge * kHuge);
    void* mem = std::aligned_alloc(kHuge, size);
    if (mem == nullptr) return nullptr;
    internal::AdviseHugePages(mem, size);
    chunk_ = std::shared_ptr<void>(mem, std::free);
    base_ = static_cast<uint8_t*>(mem);
    size_ = size;
    used_ = 0;
  }
  uint8_t* out = base_ + used_;
  used_ += need;
  *owner = chunk_;
  return out;
}

int64_t PackedBytes(const PackedWeight& p) { return p.n_panels * p.panel_bytes; }

void DequantizeRow(DType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(h[i]);
      return;
    }
    case DType::kBF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(h[i]);
      return;
    }
    case DType::kQ8_0: {
      const auto* blocks = static_cast<const BlockQ8_0*>(src);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float d = Fp16ToFp32(blocks[b].d);
        for (int j = 0; j < kQK; ++j) dst[b * kQK + j] = blocks[b].qs[j] * d;
      }
      return;
    }
    case DType::kQ4_0: {
      const auto* blocks = static_cast<const BlockQ4_0*>(src);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float d = Fp16ToFp32(blocks[b].d);
        for (int j = 0; j < kQK / 2; ++j) {
          dst[b * kQK + j] = ((blocks[b].qs[j] & 0x0F) - 8) * d;
          dst[b * kQK + j + kQK / 2] = ((blocks[b].qs[j] >> 4) - 8) * d;
        }
      }
      return;
    }
    case DType::kQ4_1: {
      const auto* blocks = static_cast<const BlockQ4_1*>(src);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float d = Fp16ToFp32(blocks[b].d);
        const float m = Fp16ToFp32(blocks[b].m);
        for (int j = 0; j < kQK / 2; ++j) {
          dst[b * kQK + j] = (blocks[b].qs[j] & 0x0F) * d + m;
          dst[b * kQK + j + kQK / 2] = (blocks[b].qs[j] >> 4) * d + m;
        }
      }
      return;
    }
    default:
      internal::DequantizeRowExtended(type, src, dst, n);
      return;
  }
}

void QuantizeRowReference(DType type, const float* src, void* dst, int64_t n) {
  switch (type) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = Fp32ToFp16(src[i]);
      return;
    }
    case DType::kBF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = Fp32ToBf16(src[i]);
      return;
    }
    case DType::kQ8_0: {
      auto* blocks = static_cast<BlockQ8_0*>(dst);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        float amax = 0.0f;
        for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        blocks[b].d = Fp32ToFp16(d);
        for (int j = 0; j < kQK; ++j) blocks[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
      }
      return;
    }
    case DType::kQ4_0: {
      auto* blocks = static_cast<BlockQ4_0*>(dst);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        // The signed value of largest magnitude maps to -8, so the full
        // [-8, 7] range is used on the side that needs it.
        float amax = 0.0f;
        float vmax = 0.0f;
        for (int j = 0; j < kQK; ++j) {
          if (std::fabs(x[j]) > amax) {
            amax = std::fabs(x[j]);
            vmax = x[j];
          }
        }
        const float d = vmax / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        blocks[b].d = Fp32ToFp16(d);
        for (int j = 0; j < kQK / 2; ++j) {
          const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
          const int q1 =
              std::min(15, static_cast<int>(static_cast<int8_t>(x[j + kQK / 2] * id + 8.5f)));
          blocks[b].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
      }
      return;
    }
    case DType::kQ4_1: {
      auto* blocks = static_cast<BlockQ4_1*>(dst);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        float lo = x[0];
        float hi = x[0];
        for (int j = 1; j < kQK; ++j) {
          lo = std::min(lo, x[j]);
          hi = std::max(hi, x[j]);
        }
        const float d = (hi - lo) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        blocks[b].d = Fp32ToFp16(d);
        blocks[b].m = Fp32ToFp16(lo);
        for (int j = 0; j < kQK / 2; ++j) {
          const int q0 =
              std::min(15, static_cast<int>(static_cast<int8_t>((x[j] - lo) * id + 0.5f)));
          const int q1 = std::min(
              15, static_cast<int>(static_cast<int8_t>((x[j + kQK / 2] - lo) * id + 0.5f)));
          blocks[b].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
      }
      return;
    }
    case DType::kQ5_0: {
      // As Q4_0 with 5 bits: the signed value of largest magnitude maps to
      // -16; bit 4 of element j goes to bit j of qh.
      auto* blocks = static_cast<BlockQ5_0*>(dst);
      for (int64_t b = 0; b < n / kQK; ++b) {
        const float* x = src + b * kQK;
        float amax = 0.0f;
        float vmax = 0.0f;
        for (int j = 0; j < kQK; ++j) {
          if (std::fabs(x[j]) > amax) {
            amax = std::fabs(x[j]);
            vmax = x[j];
          }
        }
        const float d = vmax / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        blocks[b].d = Fp32ToFp16(d);
        uint32_t qh = 0;
        for (int j = 0; j < kQK / 2; ++j) {
          const int q0 = std::min(31, static_cast<int>(static_cast<int8_t>(x[j] * id + 16.5f)));
          const int q1 =
              std::min(31, static_cast<int>(static_cast<int8_t>(x[j + kQK / 2] * id + 16.5f)));
          blocks[b].qs[j] = static_cast<uint8_t>((q0 & 0x0F) | ((q1 & 0x0F) << 4));
          qh |= static_cast<uint32_t>(q0 >> 4) << j;
          qh |= static_cast<uint32_t>(q1 >> 4) << (j + kQK / 2);
        }
        std::memcpy(blocks[b].qh, &qh, sizeof(qh));
      }
      return;
    }
    default:
      // The other extended formats are read from files only; nothing here
      // writes them.
      std::fprintf(stderr, "QuantizeRowReference: no quantizer for %s\n", DTypeName(type));
      std::abort();
  }
}

void MatMulReference(const WeightView& w, const float* x, int64_t n_tokens, int64_t x_stride,
                     float* y, int64_t y_stride) {
  const int64_t row_bytes = RowBytes(w.type, w.cols);
  std::vector<float> row(w.cols);
  for (int64_t r = 0; r < w.rows; ++r) {
    DequantizeRow(w.type, static_cast<const uint8_t*>(w.data) + r * row_bytes, row.data(), w.cols);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * x_stride;
      // Double accumulation keeps the reference's own rounding well below
      // the error the tests allow the fast path.
      double sum = 0.0;
      for (int64_t i = 0; i < w.cols; ++i) sum += static_cast<double>(row[i]) * xt[i];
      y[t * y_stride + r] = static_cast<float>(sum);
    }
  }
}

void MatMulMany(const WeightView* ws, int n_weights, const float* x, int64_t n_tokens,
                int64_t x_stride, float* const* ys, const int64_t* y_strides, ThreadPool* pool) {
  if (n_weights <= 0 || n_tokens <= 0) return;
  const bool simd = UseAvx2();
  const bool vnni = simd && UseAvx512Vnni();
  const int64_t cols = ws[0].cols;
  int64_t total_rows = 0;
  bool any_quantized = false;
  for (int i = 0; i < n_weights; ++i) {
    total_rows += ws[i].rows;
    any_quantized = any_quantized || internal::IsQuantized(ws[i].type);
  }
  if (total_rows <= 0) return;

  // Q4_1 and Q5_1 alone want ggml's Q8_1 sum (their vec_dot_type); with
  // other formats present the exact sum keeps their offset terms exact (Q4_1
  // and Q5_1 then differ from ggml only in the last bits of the min term).
  // Panel kernels (packed weights) need no s for Q8_0/Q4_0 (their block
  // dots are exact signed integers) and take Q4_1's ggml value always.
  // The K-quants and IQ4_XS meet Q8_K activations (one scale per 256
  // values), as in llama.cpp; the other quantized types 32-value blocks.
  bool all_q4_1 = true;
  bool any_packed = false;
  bool any_q8 = false;
  bool any_q8k = false;
  for (int i = 0; i < n_weights; ++i) {
    const bool panels = vnni && ws[i].packed != nullptr;
    any_packed = any_packed || panels;
    if (!internal::IsQuantized(ws[i].type)) continue;
    if (internal::UsesQ8K(ws[i].type)) {  // Q4_K panels too (their s_a term)
      any_q8k = true;
      continue;
    }
    any_q8 = true;
    if (ws[i].type != DType::kQ4_1 && ws[i].type != DType::kQ5_1 && !panels) all_q4_1 = false;
  }
  const internal::ActSum sum_mode = all_q4_1 ? internal::ActSum::kQ8_1 : internal::ActSum::kExact;

  QuantizedActs acts;
  QuantizedActs acts_k;
  if (any_q8k) {
    ActsScratch& scratch = ScratchQ8K();
    const int64_t nb = cols / kQK;
    const size_t n_blocks = static_cast<size_t>(n_tokens * nb);
    if (scratch.qs.size() < n_blocks * kQK + 64) scratch.qs.resize(n_blocks * kQK + 64);
    if (scratch.ds.size() < 2 * n_blocks + 16) scratch.ds.resize(2 * n_blocks + 16);
    if (scratch.bsums.size() < 2 * n_blocks) scratch.bsums.resize(2 * n_blocks);
    for (int64_t t = 0; t < n_tokens; ++t) {
      int8_t* qs = scratch.qs.data() + t * nb * kQK;
      float* ds = scratch.ds.data() + t * 2 * nb;
      int16_t* bs = scratch.bsums.data() + t * 2 * nb;
      if (simd) {
        internal::QuantizeActsQ8KAvx2(x + t * x_stride, cols, qs, ds, bs);
      } else {
        internal::QuantizeActsQ8KScalar(x + t * x_stride, cols, qs, ds, bs);
      }
    }
    acts_k.n_blocks = nb;
    acts_k.qs = scratch.qs.data();
    acts_k.ds = scratch.ds.data();
    acts_k.bsums = scratch.bsums.data();
  }
  if (any_quantized && any_q8) {
    // Quantize every token once here rather than once per output row.
    ActsScratch& scratch = Scratch();
    const int64_t nb = cols / kQK;
    const size_t n_blocks = static_cast<size_t>(n_tokens * nb);
    // Slack at the ends lets vector kernels over-read past the last block.
    if (scratch.qs.size() < n_blocks * kQK + 64) scratch.qs.resize(n_blocks * kQK + 64);
    if (scratch.ds.size() < 2 * n_blocks + 16) scratch.ds.resize(2 * n_blocks + 16);
    if (any_packed && scratch.sums.size() < n_blocks) scratch.sums.resize(n_blocks);
    for (int64_t t = 0; t < n_tokens; ++t) {
      int8_t* qs = scratch.qs.data() + t * nb * kQK;
      float* ds = scratch.ds.data() + t * 2 * nb;
      int32_t* sums = any_packed ? scratch.sums.data() + t * nb : nullptr;
      if (simd) {
        internal::QuantizeActsAvx2(x + t * x_stride, cols, sum_mode, qs, ds, sums);
      } else {
        internal::QuantizeActsScalar(x + t * x_stride, cols, sum_mode, qs, ds, sums);
      }
    }
    acts.n_blocks = nb;
    acts.qs = scratch.qs.data();
    acts.ds = scratch.ds.data();
    acts.sums = any_packed ? scratch.sums.data() : nullptr;
  }

  // Packed weights go to AMX from AmxMinTokens() tokens (prefill chunks,
  // batched decode), to the VNNI panel kernel below: same bits either way.
  const AmxKernel amx =
      vnni && n_tokens >= AmxMinTokens() ? ActiveAmxKernel() : AmxKernel::kOff;

  // [r0, r1) indexes the weights' rows stacked one after another; each
  // weight gets the part of the range that falls on it.
  auto rows_fn = [&](int64_t r0, int64_t r1) {
    int64_t base = 0;
    for (int i = 0; i < n_weights && base < r1; base += ws[i].rows, ++i) {
      const int64_t lo = std::max(r0, base) - base;
      const int64_t hi = std::min(r1, base + ws[i].rows) - base;
      if (lo >= hi) continue;
      if (vnni && ws[i].packed != nullptr) {
        const PackedWeight& pw = *ws[i].packed;
        const QuantizedActs& pa = internal::UsesQ8K(pw.type) ? acts_k : acts;
        // Q2_K, Q3_K and Q6_K scale per 16 values, finer than a tile's
        // 32-value sums: the VNNI kernel serves them at every batch size.
        const bool per16 = internal::PanelScalesPer16(pw.type);
        if (amx == AmxKernel::kHardware && !per16) {
          internal::MatMulPanelsAmx(pw, pa, n_tokens, lo, hi, ys[i], y_strides[i]);
        } else if (amx == AmxKernel::kEmulated && !per16) {
          internal::MatMulPanelsAmxEmulated(pw, pa, n_tokens, lo, hi, ys[i], y_strides[i]);
        } else {
          internal::MatMulPanelsVnni(pw, pa, n_tokens, lo, hi, ys[i], y_strides[i]);
        }
      } else if (internal::IsExtendedType(ws[i].type)) {
        const QuantizedActs& a = internal::UsesQ8K(ws[i].type) ? acts_k : acts;
        if (vnni) {
          internal::MatMulRowsExtendedVnni(ws[i], a, n_tokens, lo, hi, ys[i], y_strides[i]);
        } else if (simd) {
          internal::MatMulRowsExtendedAvx2(ws[i], a, n_tokens, lo, hi, ys[i], y_strides[i]);
        } else {
          internal::MatMulRowsExtendedScalar(ws[i], a, n_tokens, lo, hi, ys[i], y_strides[i]);
        }
      } else if (vnni) {
        internal::MatMulRowsAvx512Vnni(ws[i], x, x_stride, acts, n_tokens, lo, hi, ys[i],
                                       y_strides[i]);
      } else if (simd) {
        internal::MatMulRowsAvx2(ws[i], x, x_stride, acts, n_tokens, lo, hi, ys[i], y_strides[i]);
      } else {
        internal::MatMulRowsScalar(ws[i], x, x_stride, acts, n_tokens, lo, hi, ys[i], y_strides[i]);
      }
    }
  };
  // Grain of 16 rows keeps every thread's share a whole number of the
  // kernels' row groups; ParallelFor hands each thread one contiguous range,
  // so each thread streams its own part of the weights.
  constexpr int64_t kRowGrain = 16;
  if (pool != nullptr && total_rows > kRowGrain) {
    pool->ParallelFor(total_rows, kRowGrain, rows_fn);
  } else {
    rows_fn(0, total_rows);
  }
}

std::string MatMulPathDescription() {
  if (!UseAvx2()) return "portable (no AVX2)";
  if (!UseAvx512Vnni()) return "avx2";
  if (UseAmx()) {
    return "amx-int8 for >= " + std::to_string(AmxMinTokens()) +
           " tokens, avx512-vnni below (packed 16-row panels, same bits)";
  }
  return "avx512-vnni (packed 16-row panels; AMX: " +
         std::string(GetCpuFeatures().amx_int8 ? "off" : "not on this CPU") + ")";
}

void MatMul(const WeightView& w, const float* x, int64_t n_tokens, int64_t x_stride, float* y,
            int64_t y_stride, ThreadPool* pool) {
  MatMulMany(&w, 1, x, n_tokens, x_stride, &y, &y_stride, pool);
}

}  // namespace kvserve::kernels
