#include "kernels/cpu/kv_transcode.h"

#include <cstring>
#include <vector>

#include "kernels/cpu/attention_internal.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/kv_codec.h"

namespace kvserve::kernels {
namespace {

constexpr int32_t kBlockIds[1] = {0};
constexpr int32_t kSeqOffsets[2] = {0, 1};

}  // namespace

int64_t KvBlockBytes(KvDType t, const KvBlockShape& s) {
  return 2 * PagedKvView::HalfLayerBytes(s.block_size, s.n_kv_heads, s.head_dim, t) * s.n_layers;
}

PagedKvView OneBlockView(KvDType t, const KvBlockShape& s, uint8_t* block) {
  PagedKvView v;
  v.pool = block;
  v.block_bytes = KvBlockBytes(t, s);
  v.layer_bytes = s.n_layers > 0 ? v.block_bytes / s.n_layers : 0;
  v.block_size = s.block_size;
  v.n_kv_heads = s.n_kv_heads;
  v.head_dim = s.head_dim;
  v.dtype = t;
  v.block_ids = kBlockIds;
  v.seq_block_offsets = kSeqOffsets;
  v.n_seqs = 1;
  return v;
}

void TranscodeKvBlock(const KvBlockShape& s, KvDType from, const uint8_t* src, KvDType to,
                      uint8_t* dst) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(KvBlockBytes(from, s)));
    return;
  }
  // The views never write through src (const_cast only to share the type).
  const PagedKvView in = OneBlockView(from, s, const_cast<uint8_t*>(src));
  const PagedKvView out = OneBlockView(to, s, dst);
  std::memset(dst, 0, static_cast<size_t>(out.block_bytes));
  const int32_t hd = s.head_dim;
  const int32_t bs = s.block_size;
  // The row codecs with AVX2/F16C where the CPU has them (each equal to its
  // plain loop byte for byte, tested): decoding and encoding every codec.
  const bool simd = UseAvx2();
  auto* const decode_row = simd ? &internal::DequantizeRowAvx2 : &DequantizeRow;
  auto* const decode_kivi_key = simd ? &internal::DequantizeKiviKeyRowAvx2 : &DequantizeKiviKeyRow;
  auto* const encode_row = simd ? &internal::QuantizeRowAvx2 : &QuantizeRow;
  auto* const encode_kivi_keys = simd ? &internal::AppendKiviKeysAvx2 : &AppendKiviKeys;
  const int64_t in_half = in.layer_bytes / 2, out_half = out.layer_bytes / 2;
  const int64_t in_row = in.RowBytes(), in_meta = in.RowMetaBytes();
  const int64_t out_row = out.RowBytes(), out_meta = out.RowMetaBytes();
  // One head's block_size rows of keys (then values), decoded.
  std::vector<float> rows(static_cast<size_t>(bs) * hd);
  std::vector<float> scale(static_cast<size_t>(hd)), offset(static_cast<size_t>(hd));
  for (int32_t l = 0; l < s.n_layers; ++l) {
    for (int32_t h = 0; h < s.n_kv_heads; ++h) {
      for (int half = 0; half < 2; ++half) {
        const bool value = half == 1;
        const uint8_t* data = in.BlockHead(l, 0, h) + (value ? in_half : 0);
        const uint8_t* meta = in.BlockHeadMeta(l, 0, h) + (value ? in_half : 0);
        if (!value && KvIsKivi(from)) {
          KiviKeyChannelParams(meta, hd, scale.data(), offset.data());
          for (int32_t j = 0; j < bs; ++j) {
            decode_kivi_key(data + j * in_row, scale.data(), offset.data(), hd,
                            rows.data() + static_cast<size_t>(j) * hd);
          }
        } else {
          for (int32_t j = 0; j < bs; ++j) {
            decode_row(from, data + j * in_row, in_meta > 0 ? meta + j * in_meta : nullptr, hd,
                       rows.data() + static_cast<size_t>(j) * hd);
          }
        }
        uint8_t* odata = out.BlockHead(l, 0, h) + (value ? out_half : 0);
        uint8_t* ometa = out.BlockHeadMeta(l, 0, h) + (value ? out_half : 0);
        if (!value && KvIsKivi(to)) {
          encode_kivi_keys(rows.data(), hd, bs, /*first_slot=*/0, hd, odata, ometa);
        } else {
          for (int32_t j = 0; j < bs; ++j) {
            encode_row(to, rows.data() + static_cast<size_t>(j) * hd, hd, odata + j * out_row,
                       out_meta > 0 ? ometa + j * out_meta : nullptr);
          }
        }
      }
    }
  }
}

void TranscodeKvBlockReference(const KvBlockShape& s, KvDType from, const uint8_t* src,
                               KvDType to, uint8_t* dst) {
  const PagedKvView in = OneBlockView(from, s, const_cast<uint8_t*>(src));
  const PagedKvView out = OneBlockView(to, s, dst);
  std::memset(dst, 0, static_cast<size_t>(out.block_bytes));
  const int32_t hd = s.head_dim;
  std::vector<float> row(static_cast<size_t>(hd));
  std::vector<float> keys(static_cast<size_t>(s.block_size) * hd);
  for (int32_t l = 0; l < s.n_layers; ++l) {
    for (int32_t h = 0; h < s.n_kv_heads; ++h) {
      for (int32_t pos = 0; pos < s.block_size; ++pos) {
        ReadKvRow(in, l, 0, pos, h, /*value=*/false, keys.data() + static_cast<size_t>(pos) * hd);
        if (!KvIsKivi(to)) {
          QuantizeRow(to, keys.data() + static_cast<size_t>(pos) * hd, hd, out.KeyAt(l, 0, pos, h),
                      out.RowMetaBytes() > 0 ? out.KeyMetaAt(l, 0, pos, h) : nullptr);
        }
        ReadKvRow(in, l, 0, pos, h, /*value=*/true, row.data());
        QuantizeRow(to, row.data(), hd, out.ValueAt(l, 0, pos, h),
                    out.RowMetaBytes() > 0 ? out.ValueMetaAt(l, 0, pos, h) : nullptr);
      }
      if (KvIsKivi(to)) {
        AppendKiviKeys(keys.data(), hd, s.block_size, 0, hd, out.BlockHead(l, 0, h),
                       out.BlockHeadMeta(l, 0, h));
      }
    }
  }
}

}  // namespace kvserve::kernels
