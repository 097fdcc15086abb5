// The online-softmax attention loop, written once and instantiated by the
// portable (attention.cc) and the AVX2 (attention_avx2.cc) translation units
// with their own vector primitives. Each instantiation uses a policy type from
// its TU's anonymous namespace, so the two never merge at link time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/kv_codec.h"
#include "kernels/kv_view.h"

namespace kvserve::kernels::internal {

// Running softmax state of `group` query heads that share one KV head:
// max score m, normalizer l = sum(exp(score - m)), and the unnormalized
// output acc[head_dim] per head.
struct AttnState {
  float* m;    // [group]
  float* l;    // [group]
  float* acc;  // [group][head_dim]
};

// One unit of work: query heads [kv_head * group, (kv_head + 1) * group) of
// one token attend to positions [pos_begin, pos_end) of sequence seq.
struct AttnItem {
  int32_t seq;
  int32_t kv_head;
  int32_t pos_begin;
  int32_t pos_end;
  const float* q;  // first query head of the group; heads head_dim apart
};

// Most positions handled per softmax update: the rescale of acc costs
// head_dim per head per update, so updating per 64 positions instead of per
// block makes small blocks cheap. Also sizes the score scratch.
constexpr int32_t kPosTile = 64;

// Ops provides, for element type Elem (float or uint16_t half):
//   Scores(q, group, head_dim, k_rows, n, scale, scores, ld): scores[h*ld+j]
//     = scale * dot(q + h*head_dim, k_rows + j*head_dim) for j < n.
//   Max(x, n) -> max of x[0..n).
//   ExpShift(x, n, shift) -> sum: x[j] = exp(x[j] - shift), returns the sum.
//   Scale(v, c, n): v[i] *= c.
//   AccumulateV(acc, group, stride, width, p, ld, v_rows, n): for i < width,
//     acc[h*stride+i] += sum_j p[h*ld+j] * v_rows[j*stride+i], j in order.
//     Each element's sequence of operations depends only on n and on whether
//     it lies in width's whole groups of 8 or in the tail, so a caller may
//     split the channels into ranges of multiples of 8 (tail in the last).
//   RoundF16(x, dst, n): dst[i] = x[i] rounded to f16 (round to nearest even)
//     and back, exactly as Fp16ToFp32(Fp32ToFp16(x[i])).
//   ScaleRoundF16(x, n, c): x[i] = RoundF16(x[i] * c).
// scores: group * kPosTile floats of scratch.
template <typename Ops, typename Elem>
void AttendRange(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                 float scale, AttnState st, float* scores) {
  const int32_t hd = kv.head_dim;
  const int32_t bs = kv.block_size;
  const int32_t* blocks = kv.block_ids + kv.seq_block_offsets[item.seq];
  const int64_t v_offset = kv.layer_bytes / 2;
  int32_t pos = item.pos_begin;
  while (pos < item.pos_end) {
    // Gather a tile of up to kPosTile positions (at least one run inside a
    // block); score it block run by block run.
    const int32_t tile_end = std::min(item.pos_end, pos + kPosTile);
    int32_t n = 0;
    for (int32_t p = pos; p < tile_end;) {
      const int32_t slot = p % bs;
      const int32_t run = std::min(tile_end - p, bs - slot);
      const uint8_t* k_head = kv.BlockHead(layer, blocks[p / bs], item.kv_head);
      const Elem* k_rows = reinterpret_cast<const Elem*>(k_head) + static_cast<int64_t>(slot) * hd;
      Ops::Scores(item.q, group, hd, k_rows, run, scale, scores + n, kPosTile);
      n += run;
      p += run;
    }
    for (int32_t h = 0; h < group; ++h) {
      float* s = scores + h * kPosTile;
      const float tile_max = Ops::Max(s, n);
      const float new_m = std::max(st.m[h], tile_max);
      const float tile_sum = Ops::ExpShift(s, n, new_m);
      if (new_m > st.m[h]) {
        // exp(-inf) = 0 on the first tile: acc and l are zero anyway.
        const float c = std::exp(st.m[h] - new_m);
        st.l[h] *= c;
        Ops::Scale(st.acc + static_cast<int64_t>(h) * hd, c, hd);
        st.m[h] = new_m;
      }
      st.l[h] += tile_sum;
    }
    n = 0;
    for (int32_t p = pos; p < tile_end;) {
      const int32_t slot = p % bs;
      const int32_t run = std::min(tile_end - p, bs - slot);
      const uint8_t* v_head = kv.BlockHead(layer, blocks[p / bs], item.kv_head) + v_offset;
      const Elem* v_rows = reinterpret_cast<const Elem*>(v_head) + static_cast<int64_t>(slot) * hd;
      Ops::AccumulateV(st.acc, group, hd, hd, scores + n, kPosTile, v_rows, run);
      n += run;
      p += run;
    }
    pos = tile_end;
  }
}

// The plain-loop row decoder; each ISA's TU may pass a faster one.
struct PlainRowDecoder {
  static void Row(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n, float* dst) {
    DequantizeRow(t, data, meta, n, dst);
  }
  static void KiviKeyRow(const uint8_t* codes, const float* scale, const float* offset, int32_t n,
                         float* dst) {
    DequantizeKiviKeyRow(codes, scale, offset, n, dst);
  }
};

// Per-thread scratch for int4-kivi keys' per-channel factors.
inline float* KiviFactorScratch(int32_t head_dim) {
  thread_local std::vector<float> buf;
  if (buf.size() < 2 * static_cast<size_t>(head_dim)) buf.resize(2 * static_cast<size_t>(head_dim));
  return buf.data();
}

// Dequantizes the rows of positions [p0, p1) of one KV head (keys, or
// values when v_half) into rows[(p - p0) * head_dim].
template <typename Decoder>
void DequantizeRows(const PagedKvView& kv, int32_t layer, const int32_t* blocks, int32_t kv_head,
                    bool v_half, int32_t p0, int32_t p1, float* rows) {
  const int32_t hd = kv.head_dim;
  const int64_t row_bytes = kv.RowBytes();
  const int64_t meta_bytes = kv.RowMetaBytes();
  const int64_t half = v_half ? kv.layer_bytes / 2 : 0;
  if (KvIsKivi(kv.dtype) && !v_half) {
    // Keys per channel: decode a block's channel factors once per run of
    // positions inside that block, then its rows.
    float* scale = KiviFactorScratch(hd);
    float* offset = scale + hd;
    for (int32_t p = p0; p < p1;) {
      const int32_t block = blocks[p / kv.block_size];
      const int32_t slot = p % kv.block_size;
      const int32_t run = std::min(p1 - p, kv.block_size - slot);
      KiviKeyChannelParams(kv.BlockHeadMeta(layer, block, kv_head), hd, scale, offset);
      const uint8_t* data = kv.BlockHead(layer, block, kv_head) + slot * row_bytes;
      for (int32_t j = 0; j < run; ++j) {
        Decoder::KiviKeyRow(data + j * row_bytes, scale, offset, hd,
                            rows + static_cast<int64_t>(p - p0 + j) * hd);
      }
      p += run;
    }
    return;
  }
  for (int32_t p = p0; p < p1; ++p) {
    const int32_t block = blocks[p / kv.block_size];
    const int32_t slot = p % kv.block_size;
    const uint8_t* data = kv.BlockHead(layer, block, kv_head) + half + slot * row_bytes;
    const uint8_t* meta = kv.BlockHeadMeta(layer, block, kv_head) + half + slot * meta_bytes;
    Decoder::Row(kv.dtype, data, meta, hd, rows + static_cast<int64_t>(p - p0) * hd);
  }
}

// AttendRange for a quantized cache (bf16, fp8, int8, int4*): each tile of at
// most kPosTile positions is dequantized into `rows` (kPosTile * head_dim
// floats of per-thread scratch) right before the float Ops score it or
// weight it, so the kernel reads the compressed cache once and never holds
// more than one tile in full precision. Ops is the float instantiation;
// Decoder provides Row(dtype, data, meta, n, dst) as DequantizeRow does.
template <typename Ops, typename Decoder>
void AttendRangeQuant(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                      float scale, AttnState st, float* scores, float* rows) {
  const int32_t hd = kv.head_dim;
  const int32_t* blocks = kv.block_ids + kv.seq_block_offsets[item.seq];
  for (int32_t pos = item.pos_begin; pos < item.pos_end;) {
    const int32_t tile_end = std::min(item.pos_end, pos + kPosTile);
    const int32_t n = tile_end - pos;
    DequantizeRows<Decoder>(kv, layer, blocks, item.kv_head, false, pos, tile_end, rows);
    Ops::Scores(item.q, group, hd, rows, n, scale, scores, kPosTile);
    for (int32_t h = 0; h < group; ++h) {
      float* s = scores + h * kPosTile;
      const float new_m = std::max(st.m[h], Ops::Max(s, n));
      const float tile_sum = Ops::ExpShift(s, n, new_m);
      if (new_m > st.m[h]) {
        const float c = std::exp(st.m[h] - new_m);
        st.l[h] *= c;
        Ops::Scale(st.acc + static_cast<int64_t>(h) * hd, c, hd);
        st.m[h] = new_m;
      }
      st.l[h] += tile_sum;
    }
    DequantizeRows<Decoder>(kv, layer, blocks, item.kv_head, true, pos, tile_end, rows);
    Ops::AccumulateV(st.acc, group, hd, hd, scores, kPosTile, rows, n);
    pos = tile_end;
  }
}

// Two-pass attention for an f16 cache: the query is rounded to f16 and the
// normalized probabilities are rounded to f16 before they weight V, with f32
// accumulation -- f16 operands as tensor-core kernels use them, and the exact
// rounding points of llama.cpp's CPU attention, so both engines break greedy
// near-ties the same way. Probabilities are normalized before V is read, so
// each (token, KV head) pair runs in three steps, each of which can be split
// across threads without changing a bit:
//   1. F16ScoreRange: scores of any block-aligned range of positions (each
//      score depends only on its position, and block-aligned ranges issue
//      exactly the Ops::Scores calls that the whole context does);
//   2. F16Normalize: max, exp, sum and f16 rounding of one head's scores (an
//      ordered reduction: one head stays on one thread);
//   3. F16AccumulateV: the output channels [c0, c1) (c0, and c1 unless it is
//      head_dim, multiples of 8), each summed over all positions in order.
// AttendTwoPassF16 runs the three over a whole pair on one thread.

// Query heads of the group rounded to f16: q16[group * head_dim].
template <typename Ops>
void F16RoundQuery(const float* q, int32_t n, float* q16) {
  Ops::RoundF16(q, q16, n);
}

// scores[h * ld + p - origin] for positions p in [p0, p1) of KV head
// kv_head (origin: the first position the pair attends to, its window's
// start or 0). Split ranges issue the same Ops::Scores runs as the whole
// range when p0 is origin or a multiple of block_size.
template <typename Ops>
void F16ScoreRange(const PagedKvView& kv, int32_t layer, const int32_t* blocks, int32_t kv_head,
                   int32_t group, float scale, const float* q16, int32_t p0, int32_t p1,
                   float* scores, int32_t ld, int32_t origin) {
  const int32_t hd = kv.head_dim;
  const int32_t bs = kv.block_size;
  for (int32_t p = p0; p < p1;) {
    const int32_t slot = p % bs;
    const int32_t run = std::min(p1 - p, bs - slot);
    const uint8_t* k_head = kv.BlockHead(layer, blocks[p / bs], kv_head);
    Ops::Scores(q16, group, hd, reinterpret_cast<const uint16_t*>(k_head) + int64_t{slot} * hd, run,
                scale, scores + (p - origin), ld);
    p += run;
  }
}

// One head's scores s[0, len) -> f16-rounded probabilities (len: the
// positions the pair attends to).
template <typename Ops>
void F16Normalize(float* s, int32_t len) {
  const float mx = Ops::Max(s, len);
  const float sum = Ops::ExpShift(s, len, mx);
  const float inv = static_cast<float>(1.0 / static_cast<double>(sum));
  Ops::ScaleRoundF16(s, len, inv);
}

// out[h * head_dim + i] = sum_p probs[h * ld + p - begin] * V[p][i] over
// positions p in [begin, len), for i in [c0, c1).
template <typename Ops>
void F16AccumulateV(const PagedKvView& kv, int32_t layer, const int32_t* blocks, int32_t kv_head,
                    int32_t group, const float* probs, int32_t ld, int32_t begin, int32_t len,
                    int32_t c0, int32_t c1, float* out) {
  const int32_t hd = kv.head_dim;
  const int32_t bs = kv.block_size;
  const int64_t v_offset = kv.layer_bytes / 2;
  for (int32_t h = 0; h < group; ++h) {
    std::fill(out + static_cast<int64_t>(h) * hd + c0, out + static_cast<int64_t>(h) * hd + c1,
              0.0f);
  }
  for (int32_t p = begin; p < len;) {
    const int32_t slot = p % bs;
    const int32_t run = std::min(len - p, bs - slot);
    const uint8_t* v_head = kv.BlockHead(layer, blocks[p / bs], kv_head) + v_offset;
    Ops::AccumulateV(out + c0, group, hd, c1 - c0, probs + (p - begin), ld,
                     reinterpret_cast<const uint16_t*>(v_head) + int64_t{slot} * hd + c0, run);
    p += run;
  }
}

// The three steps of one ISA, for the threaded driver in attention.cc.
struct F16Kernels {
  void (*round_query)(const float* q, int32_t n, float* q16);
  void (*score_range)(const PagedKvView& kv, int32_t layer, const int32_t* blocks, int32_t kv_head,
                      int32_t group, float scale, const float* q16, int32_t p0, int32_t p1,
                      float* scores, int32_t ld, int32_t origin);
  void (*normalize)(float* s, int32_t len);
  void (*accumulate_v)(const PagedKvView& kv, int32_t layer, const int32_t* blocks, int32_t kv_head,
                       int32_t group, const float* probs, int32_t ld, int32_t begin, int32_t len,
                       int32_t c0, int32_t c1, float* out);
};

template <typename Ops>
constexpr F16Kernels MakeF16Kernels() {
  return {&F16RoundQuery<Ops>, &F16ScoreRange<Ops>, &F16Normalize<Ops>, &F16AccumulateV<Ops>};
}

// The whole of one pair on the calling thread: positions [item.pos_begin,
// item.pos_end) (pos_begin > 0 for a sliding window).
// scores: group * ld floats, ld >= pos_end - pos_begin; q16: group * head_dim floats.
// Writes the normalized output of each head to out + h * head_dim.
template <typename Ops>
void AttendTwoPassF16(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                      float scale, float* scores, int32_t ld, float* q16, float* out) {
  const int32_t begin = item.pos_begin;
  const int32_t len = item.pos_end;
  const int32_t* blocks = kv.block_ids + kv.seq_block_offsets[item.seq];
  F16RoundQuery<Ops>(item.q, group * kv.head_dim, q16);
  F16ScoreRange<Ops>(kv, layer, blocks, item.kv_head, group, scale, q16, begin, len, scores, ld,
                     begin);
  for (int32_t h = 0; h < group; ++h) {
    F16Normalize<Ops>(scores + static_cast<int64_t>(h) * ld, len - begin);
  }
  F16AccumulateV<Ops>(kv, layer, blocks, item.kv_head, group, scores, ld, begin, len, 0,
                      kv.head_dim, out);
}

void AttendTwoPassF16Avx2(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                          float scale, float* scores, int32_t ld, float* q16, float* out);
// The AVX2 steps. REQUIRES: the CPU has AVX2 (and F16C).
const F16Kernels& F16KernelsAvx2();

// DequantizeRow with AVX2 for f16, bf16, int8, fp8 and the int4 rows (other
// codecs: the plain loop). Exactly equal to DequantizeRow (f16: but for a
// signalling NaN's bits). REQUIRES: the CPU has AVX2 and F16C.
void DequantizeRowAvx2(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n, float* dst);
// QuantizeRow with AVX2/F16C for f16, int8, fp8 and the int4 rows (other
// codecs: the plain loop), byte for byte. REQUIRES: AVX2 and F16C.
void QuantizeRowAvx2(KvDType t, const float* src, int32_t n, uint8_t* data, uint8_t* meta);
// AppendKiviKeys with AVX2 for a fresh block (first_slot 0; otherwise the
// plain loop), byte for byte. REQUIRES: AVX2.
void AppendKiviKeysAvx2(const float* src, int64_t src_stride, int32_t n, int32_t first_slot,
                        int32_t head_dim, uint8_t* codes, uint8_t* meta);
// DequantizeKiviKeyRow with AVX2, exactly equal to it. REQUIRES: AVX2.
void DequantizeKiviKeyRowAvx2(const uint8_t* codes, const float* scale, const float* offset,
                              int32_t n, float* dst);

// Entry points per ISA: run one item from a freshly reset state.
// rows: kPosTile * head_dim floats of scratch, used only by quantized caches.
void AttendAvx2(const PagedKvView& kv, int32_t layer, const AttnItem& item, int32_t group,
                float scale, AttnState st, float* scores, float* rows);

}  // namespace kvserve::kernels::internal
