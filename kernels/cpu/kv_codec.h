// Row codecs of the KV cache: one (token, KV head) row of head_dim floats to
// and from its stored form (data bytes + scale-area bytes, see kv_view.h).
// Plain loops: the write path runs once per appended token, and the read
// path calls DequantizeRow on one row at a time into a small tile, so the
// cache is never expanded to full precision. Thread-safe (pure functions).
#pragma once

#include <cstdint>

#include "kernels/cpu/ops.h"
#include "kernels/kv_view.h"

namespace kvserve::kernels {

// data: KvRowBytes(t, n) bytes; meta: KvRowMetaBytes(t, n) bytes (may be null
// when that is 0). For int4-kivi these are the value rows (int4, groups of
// 32); its keys go through the per-block functions below.
void QuantizeRow(KvDType t, const float* src, int32_t n, uint8_t* data, uint8_t* meta);
void DequantizeRow(KvDType t, const uint8_t* data, const uint8_t* meta, int32_t n, float* dst);

// int4-kivi keys of one (block, KV head): codes = the head's block_size rows
// of KvRowBytes(kInt4Kivi, head_dim) bytes, meta = its head_dim channel
// pairs (kv_view.h). Appends n keys (src[j * src_stride], head_dim floats)
// at slots [first_slot, first_slot + n), widening channel ranges and
// re-encoding earlier codes when needed.
// REQUIRES: slots [0, first_slot) were written by this function (the block
// fills in order); first_slot == 0 starts the block afresh, whatever it held.
void AppendKiviKeys(const float* src, int64_t src_stride, int32_t n, int32_t first_slot,
                    int32_t head_dim, uint8_t* codes, uint8_t* meta);
// Per-channel decode factors of a block's keys: key[c] = code[c] * scale[c]
// + offset[c] (a multiply, then an add: SIMD decoders match bit for bit).
void KiviKeyChannelParams(const uint8_t* meta, int32_t head_dim, float* scale, float* offset);
void DequantizeKiviKeyRow(const uint8_t* codes, const float* scale, const float* offset,
                          int32_t head_dim, float* dst);

// Decodes the stored key (value: value == true) of one (layer, seq, pos,
// head) with plain loops, whatever the codec: the reference read path.
// Token eviction's compaction: for every layer, K and V and KV head, copies
// the row (data and scale-area metadata) of slot from[i] of sequence `seq`
// to slot to[i], in order i = 0, 1, ... A slot's bytes move as they are (no
// re-encoding), so kept tokens read back bit-identical.
// REQUIRES: a per-row codec (not int4-kivi*, whose keys share per-block
// scales); to[i] <= from[i] and both ascending (a compaction moves down, so
// no row is overwritten before it is read); host memory.
void MoveKvRows(const PagedKvView& kv, int32_t n_layers, int32_t seq, const int32_t* from,
                const int32_t* to, int32_t n);

// StreamingLLM positions within the cache: rotates the stored key of every
// layer and KV head at slot slots[i] of sequence `seq` by deltas[i] RoPE
// positions (a rotation by p followed by one by d is a rotation by p + d),
// decoding and re-encoding the row through its codec: exact in f32 up to
// float rounding, one more rounding in f16/bf16, a re-quantization for the
// byte and int4 codecs. Values are position-free and stay as they are.
// REQUIRES: a per-row codec (not int4-kivi*); host memory; the slots'
// blocks private to the sequence.
void RotateKvKeys(const PagedKvView& kv, int32_t n_layers, int32_t seq, const int32_t* slots,
                  const int32_t* deltas, int32_t n, const RopeParams& rope);

void ReadKvRow(const PagedKvView& kv, int32_t layer, int32_t seq, int32_t pos, int32_t head,
               bool value, float* dst);

// OCP fp8 conversions, round to nearest even, saturating to the largest
// finite value (e4m3: 448, e5m2: 57344); NaN maps to NaN.
uint8_t Fp32ToE4M3(float f);
float E4M3ToFp32(uint8_t b);
uint8_t Fp32ToE5M2(float f);
float E5M2ToFp32(uint8_t b);
// The same conversions by binary search over the sorted codes: the plain
// reference the arithmetic encoders above are tested against.
uint8_t Fp32ToE4M3Reference(float f);
uint8_t Fp32ToE5M2Reference(float f);
// The 256 decoded values of an fp8 codec (kFp8E4M3 or kFp8E5M2), built once:
// SIMD decoders gather from it and so match the plain loop bit for bit.
const float* Fp8DecodeTable(KvDType t);
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

// Two 4-bit codes per byte, the even index in the low nibble; an odd n leaves
// the high nibble of the last byte zero.
void PackInt4(const uint8_t* codes, int32_t n, uint8_t* packed);
void UnpackInt4(const uint8_t* packed, int32_t n, uint8_t* codes);

}  // namespace kvserve::kernels
