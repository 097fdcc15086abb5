// KV block transcoding: one whole block (every layer, K and V, every KV
// head, every slot, scale areas included) from one KV codec's layout to
// another's, for the host tier's --kv-host-dtype (a block is re-encoded on
// demotion and decoded back into the pool's codec on promotion). Each row is
// decoded to f32 and encoded again through the row codecs (kv_codec.h; their
// AVX2/F16C forms where the CPU has them, equal byte for byte); int4-kivi keys are encoded a block
// at once (AppendKiviKeys from slot 0), which is their most precise write.
//
// Thread-safe (pure functions on caller memory); host memory only.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/kv_view.h"

namespace kvserve::kernels {

// The shape every layer of a block shares.
struct KvBlockShape {
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;
};

// Bytes of one block in codec t: the pool's block_bytes for that codec.
int64_t KvBlockBytes(KvDType t, const KvBlockShape& shape);

// A one-block view of `block` (block id 0) laid out in codec t.
PagedKvView OneBlockView(KvDType t, const KvBlockShape& shape, uint8_t* block);

// Re-encodes block src (codec from, KvBlockBytes(from) bytes) into dst
// (codec to, KvBlockBytes(to) bytes, overwritten whole: padding is zeroed
// so equal inputs give equal bytes and checksums). from == to copies the
// bytes unchanged. REQUIRES: every slot of the block written (a full block).
void TranscodeKvBlock(const KvBlockShape& shape, KvDType from, const uint8_t* src, KvDType to,
                      uint8_t* dst);

// The reference: the same conversion written the slow, obvious way, one
// (layer, head, slot) row at a time through ReadKvRow and QuantizeRow (and
// AppendKiviKeys for int4-kivi keys), to test TranscodeKvBlock against.
void TranscodeKvBlockReference(const KvBlockShape& shape, KvDType from, const uint8_t* src,
                               KvDType to, uint8_t* dst);

}  // namespace kvserve::kernels
