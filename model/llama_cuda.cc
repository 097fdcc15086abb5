#include "model/llama_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/attention_generic.h"
#include "kernels/cuda/attention_mass.h"
#include "kernels/cuda/cuda_kernels.h"

namespace kvserve {
namespace {

using kernels::DType;

absl::StatusOr<DType> ToCudaDType(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return DType::kF32;
    case GgmlType::kF16:
      return DType::kF16;
    case GgmlType::kBF16:
      return DType::kBF16;
    case GgmlType::kQ8_0:
      return DType::kQ8_0;
    case GgmlType::kQ4_0:
      return DType::kQ4_0;
    case GgmlType::kQ4_1:
      return DType::kQ4_1;
    case GgmlType::kQ5_0:
      return DType::kQ5_0;
    case GgmlType::kQ5_1:
      return DType::kQ5_1;
    case GgmlType::kQ2_K:
      return DType::kQ2_K;
    case GgmlType::kQ3_K:
      return DType::kQ3_K;
    case GgmlType::kQ4_K:
      return DType::kQ4_K;
    case GgmlType::kQ5_K:
      return DType::kQ5_K;
    case GgmlType::kQ6_K:
      return DType::kQ6_K;
    case GgmlType::kIQ4_NL:
      return DType::kIQ4_NL;
    case GgmlType::kIQ4_XS:
      return DType::kIQ4_XS;
  }
  return absl::UnimplementedError("tensor type has no device format");
}

// Every weight keeps what the CPU forward computes with: F32 and BF16 their
// values, F16 its bits, and the block-quantized types (Q8_0/Q4_0/Q4_1, Q5_0,
// Q5_1, IQ4_NL, the K-quants, IQ4_XS) their GGUF bytes (kNative), run by the
// kernels that quantize activations as the CPU does.
cuda::WeightFormat FormatFor(DType t) {
  if (cuda::IsNativeType(t)) return cuda::WeightFormat::kNative;
  switch (t) {
    case DType::kF32:
      return cuda::WeightFormat::kF32;
    case DType::kBF16:
      return cuda::WeightFormat::kBF16;
    default:
      return cuda::WeightFormat::kF16;
  }
}

absl::StatusOr<const GgufTensorInfo*> Tensor(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("missing tensor ", name));
  return t;
}

}  // namespace

CudaLlama::~CudaLlama() {
  // Let queued work finish before the buffers it uses go back to the pool.
  if (stream_.get() != nullptr) (void)stream_.Synchronize();
}

absl::StatusOr<std::unique_ptr<CudaLlama>> CudaLlama::Create(const LlamaModel& model) {
  RETURN_IF_ERROR(cuda::CudaUsable());
  const LlamaConfig& c = model.config();
  RETURN_IF_ERROR(SupportsModel(c));
  std::unique_ptr<CudaLlama> m(new CudaLlama());
  m->config_ = c;
  ASSIGN_OR_RETURN(m->stream_, cuda::CudaStream::Create());
  ASSIGN_OR_RETURN(m->blas_, cuda::CublasMatMul::Create(&m->memory_, m->stream_.get()));
  absl::Status s = m->Upload(model);
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("uploading ", model.file().path(), " to the GPU: ", s.message()));
  }
  return m;
}

absl::Status CudaLlama::Upload(const LlamaModel& model) {
  const LlamaConfig& c = config_;
  const GgufFile& f = model.file();
  const cuda::StreamHandle stream = stream_.get();

  auto matrix = [&](const std::string& name) -> absl::StatusOr<cuda::DeviceWeight> {
    ASSIGN_OR_RETURN(const GgufTensorInfo* t, Tensor(f, name));
    ASSIGN_OR_RETURN(DType type, ToCudaDType(t->type));
    // ggml shape {in, out}: out rows of `in` elements.
    const kernels::WeightView w{type, t->data, t->shape[1], t->shape[0]};
    return cuda::UploadWeight(w, FormatFor(type), &memory_, stream);
  };
  auto raw = [&](const void* data, size_t bytes) -> absl::StatusOr<cuda::DeviceBuffer> {
    ASSIGN_OR_RETURN(cuda::DeviceBuffer b, memory_.Allocate(bytes));
    RETURN_IF_ERROR(cuda::CopyToDevice(b.data(), data, bytes));
    return b;
  };
  // F32 vectors (LlamaModel checked their lengths at load).
  auto vector = [&](const std::string& name,
                    int64_t n = -1) -> absl::StatusOr<cuda::DeviceBuffer> {
    ASSIGN_OR_RETURN(const GgufTensorInfo* t, Tensor(f, name));
    if (t->type != GgmlType::kF32) return absl::InvalidArgumentError(name + " is not F32");
    return raw(t->data, sizeof(float) * static_cast<size_t>(n < 0 ? c.dim : n));
  };

  // The embedding table stays in its file type: EmbeddingGather dequantizes
  // only the rows a batch reads.
  ASSIGN_OR_RETURN(const GgufTensorInfo* embd, Tensor(f, "token_embd.weight"));
  ASSIGN_OR_RETURN(embd_type_, ToCudaDType(embd->type));
  ASSIGN_OR_RETURN(token_embd_,
                   raw(embd->data, static_cast<size_t>(kernels::RowBytes(embd_type_, c.dim)) *
                                       static_cast<size_t>(c.vocab_size)));
  ASSIGN_OR_RETURN(output_norm_, vector("output_norm.weight"));
  // Tied output: the embedding table is also the output head (as a matrix).
  ASSIGN_OR_RETURN(output_, matrix(c.tied_output ? "token_embd.weight" : "output.weight"));
  layers_.resize(c.n_layers);
  for (int32_t l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    Layer& L = layers_[l];
    ASSIGN_OR_RETURN(L.attn_norm, vector(p + "attn_norm.weight"));
    ASSIGN_OR_RETURN(L.wq, matrix(p + "attn_q.weight"));
    ASSIGN_OR_RETURN(L.wk, matrix(p + "attn_k.weight"));
    ASSIGN_OR_RETURN(L.wv, matrix(p + "attn_v.weight"));
    ASSIGN_OR_RETURN(L.wo, matrix(p + "attn_output.weight"));
    ASSIGN_OR_RETURN(L.ffn_norm, vector(p + "ffn_norm.weight"));
    ASSIGN_OR_RETURN(L.w_gate, matrix(p + "ffn_gate.weight"));
    ASSIGN_OR_RETURN(L.w_up, matrix(p + "ffn_up.weight"));
    ASSIGN_OR_RETURN(L.w_down, matrix(p + "ffn_down.weight"));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(L.bq, vector(p + "attn_q.bias", c.q_dim()));
      ASSIGN_OR_RETURN(L.bk, vector(p + "attn_k.bias", c.kv_dim()));
      ASSIGN_OR_RETURN(L.bv, vector(p + "attn_v.bias", c.kv_dim()));
    }
    if (c.qk_norm) {
      ASSIGN_OR_RETURN(L.q_norm, vector(p + "attn_q_norm.weight", c.head_dim));
      ASSIGN_OR_RETURN(L.k_norm, vector(p + "attn_k_norm.weight", c.head_dim));
    }
    if (c.post_norms) {
      ASSIGN_OR_RETURN(L.post_attn_norm, vector(p + "post_attention_norm.weight"));
      ASSIGN_OR_RETURN(L.post_ffn_norm, vector(p + "post_ffw_norm.weight"));
    }
  }
  // The RoPE divisors come from the config (a tensor or computed from
  // metadata), not always from a tensor.
  if (!c.rope_freq_factors.empty()) {
    ASSIGN_OR_RETURN(rope_freqs_, raw(c.rope_freq_factors.data(),
                                      sizeof(float) * c.rope_freq_factors.size()));
  }
  return stream_.Synchronize();
}

absl::Status CudaLlama::CheckKvLayout(kernels::KvDType dtype, int32_t block_size) const {
  return SupportsKvLayout(dtype, block_size, config_.head_dim);
}

absl::Status CudaLlama::SupportsModel(const LlamaConfig& c) {
  // Every family the CPU forward runs; the attention kernels bound the head.
  if (c.head_dim > cuda::kGenericMaxHeadDim) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA attention kernels support head_dim up to ", cuda::kGenericMaxHeadDim,
                     " (tuned: 64 and 128); this model has ", c.head_dim, " (use --device cpu)"));
  }
  return absl::OkStatus();
}

absl::Status CudaLlama::SupportsKvLayout(kernels::KvDType dtype, int32_t block_size,
                                         int32_t head_dim) {
  using kernels::KvDType;
  const bool plain = dtype == KvDType::kF32 || dtype == KvDType::kF16 || dtype == KvDType::kBF16;
  const bool quantized = dtype == KvDType::kInt8 || dtype == KvDType::kFp8E4M3 ||
                         dtype == KvDType::kFp8E5M2 || dtype == KvDType::kInt4 ||
                         dtype == KvDType::kInt4G64;
  if (!plain && !quantized) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device cuda supports --kv-cache-dtype f32, f16, bf16, int8, fp8-e4m3, fp8-e5m2, "
        "int4 or int4-g64, not '",
        std::string(kernels::KvDTypeName(dtype)), "' (use --device cpu)"));
  }
  // The quantized codecs run in the tuned attention kernels only (256: the
  // decode kernel and the chunked prefill kernel).
  if (quantized && head_dim != 0 && head_dim != 64 && head_dim != 128 && head_dim != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device cuda runs --kv-cache-dtype ", std::string(kernels::KvDTypeName(dtype)),
        " for head_dim 64, 128 or 256; this model has ", head_dim,
        " (use f32/f16/bf16 or --device cpu)"));
  }
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device cuda needs a power-of-two --block-size, not ", block_size));
  }
  return absl::OkStatus();
}

absl::Status CudaLlama::Grow(cuda::DeviceBuffer* b, size_t bytes) {
  if (b->size() >= bytes) return absl::OkStatus();
  b->Reset();
  ASSIGN_OR_RETURN(*b, memory_.Allocate(bytes));
  return absl::OkStatus();
}

absl::Status CudaLlama::EnsureScratch(int64_t n, int64_t n_logits, size_t staging_ints) {
  const LlamaConfig& c = config_;
  const size_t f = sizeof(float);
  const int64_t q_dim = static_cast<int64_t>(c.n_heads) * c.head_dim;
  RETURN_IF_ERROR(Grow(&x_, f * n * c.dim));
  RETURN_IF_ERROR(Grow(&xn_, f * n * c.dim));
  RETURN_IF_ERROR(Grow(&q_, f * n * q_dim));
  RETURN_IF_ERROR(Grow(&k_, f * n * c.kv_dim()));
  RETURN_IF_ERROR(Grow(&v_, f * n * c.kv_dim()));
  RETURN_IF_ERROR(Grow(&attn_, f * n * q_dim));
  RETURN_IF_ERROR(Grow(&gate_, f * n * c.ffn_dim));
  RETURN_IF_ERROR(Grow(&up_, f * n * c.ffn_dim));
  RETURN_IF_ERROR(Grow(&final_, f * std::max<int64_t>(n_logits, 1) * c.dim));
  RETURN_IF_ERROR(Grow(&logits_, f * std::max<int64_t>(n_logits, 1) * c.vocab_size));
  const size_t int_bytes = sizeof(int32_t) * staging_ints;
  RETURN_IF_ERROR(Grow(&ints_, int_bytes));
  if (staging_.size() < int_bytes) {
    // Twice the need: the block table grows a little with every decode step.
    ASSIGN_OR_RETURN(staging_, cuda::PinnedHostBuffer::Allocate(2 * int_bytes));
  }
  return absl::OkStatus();
}

absl::Status CudaLlama::ReleaseScratch() {
  RETURN_IF_ERROR(stream_.Synchronize());
  for (cuda::DeviceBuffer* b :
       {&x_, &xn_, &q_, &k_, &v_, &attn_, &gate_, &up_, &final_, &logits_, &workspace_, &ints_}) {
    b->Reset();
  }
  staging_ = cuda::PinnedHostBuffer();
  // The cuBLAS wrapper keeps converted activations; a fresh one holds none.
  blas_.reset();
  ASSIGN_OR_RETURN(blas_, cuda::CublasMatMul::Create(&memory_, stream_.get()));
  return absl::OkStatus();
}

absl::Status CudaLlama::Forward(const ForwardBatch& b, const kernels::PagedKvView& kv,
                                float* logits, ThreadPool* /*pool*/) {
  const LlamaConfig& c = config_;
  // The same checks as LlamaModel::CheckBatch: every index the kernels follow
  // is validated here, on the host, so no kernel reads out of bounds.
  const size_t n_sz = b.tokens.size();
  if (n_sz == 0) return absl::InvalidArgumentError("empty batch");
  if (b.token_seq.size() != n_sz || b.positions.size() != n_sz ||
      (!b.slots.empty() && b.slots.size() != n_sz)) {
    return absl::InvalidArgumentError("batch arrays differ in length");
  }
  const bool want_mass = b.attention_mass != nullptr;
  if (want_mass && (b.attention_mass_stride <= 0 ||
                    (!b.attention_mass_seqs.empty() &&
                     b.attention_mass_seqs.size() != static_cast<size_t>(kv.n_seqs)))) {
    return absl::InvalidArgumentError(
        "attention mass needs a positive stride and one flag per KV sequence");
  }
  // K/V are addressed (and causality bounded) by slot; RoPE uses positions.
  const absl::Span<const int32_t> slots = b.kv_slots();
  const bool shifted = !b.slots.empty();
  if (kv.n_kv_heads != c.n_kv_heads || kv.head_dim != c.head_dim) {
    return absl::InvalidArgumentError("KV view does not match the model's heads");
  }
  // KV cache groups (hybrid attention): the map as the CPU forward checks
  // it; each group's view must match the main one (one device pool, one
  // codec) and hold every token's slot (below).
  const bool grouped_kv = !b.group_kv.empty();
  RETURN_IF_ERROR(CheckKvGroupMap(b, c.n_layers));
  for (const kernels::PagedKvView& g : b.group_kv) {
    if (g.n_seqs != kv.n_seqs || g.n_kv_heads != c.n_kv_heads || g.head_dim != c.head_dim ||
        g.block_size != kv.block_size || g.dtype != kv.dtype || g.pool != kv.pool) {
      return absl::InvalidArgumentError("a KV group's view does not match the main view");
    }
  }
  RETURN_IF_ERROR(CheckKvLayout(kv.dtype, kv.block_size));
  const int32_t n_seqs = kv.n_seqs;
  for (size_t i = 0; i < n_sz; ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token id ", b.tokens[i], " is outside the vocabulary (", c.vocab_size, ")"));
    }
    if (b.token_seq[i] < 0 || b.token_seq[i] >= n_seqs) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, " names sequence ", b.token_seq[i], " outside the KV view"));
    }
    const int32_t s = b.token_seq[i];
    const int64_t capacity =
        static_cast<int64_t>(kv.seq_block_offsets[s + 1] - kv.seq_block_offsets[s]) * kv.block_size;
    if (b.positions[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("position ", b.positions[i], " is negative"));
    }
    // Only the sequences whose mass is wanted need room in a mass row.
    if (want_mass && slots[i] >= b.attention_mass_stride &&
        (b.attention_mass_seqs.empty() || b.attention_mass_seqs[s] != 0)) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slots[i],
                                                     " is past the attention mass rows (stride ",
                                                     b.attention_mass_stride, ")"));
    }
    if (slots[i] < 0 || slots[i] >= capacity) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slots[i], " of sequence ", s,
                                                     " has no KV slot (capacity ", capacity,
                                                     ")"));
    }
    for (const kernels::PagedKvView& g : b.group_kv) {
      const int64_t group_capacity =
          static_cast<int64_t>(g.seq_block_offsets[s + 1] - g.seq_block_offsets[s]) * g.block_size;
      if (slots[i] >= group_capacity) {
        return absl::InvalidArgumentError(absl::StrCat("slot ", slots[i], " of sequence ", s,
                                                       " has no slot in a KV group (capacity ",
                                                       group_capacity, ")"));
      }
    }
  }
  for (int32_t r : b.logit_rows) {
    if (r < 0 || static_cast<size_t>(r) >= n_sz) {
      return absl::InvalidArgumentError(absl::StrCat("logit row ", r, " is outside the batch"));
    }
  }

  const int32_t n = static_cast<int32_t>(n_sz);
  const int64_t n_logits = static_cast<int64_t>(b.logit_rows.size());
  const int64_t q_dim = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t kv_dim = c.kv_dim();
  const int32_t n_blocks = kv.seq_block_offsets[n_seqs];

  // Attention plan. The prefill kernel wants each sequence's query rows
  // contiguous, in sequence order, at consecutive positions (the engine's
  // batches are built that way); the decode kernel takes any ragged batch,
  // so it is the fallback and the choice when every sequence has one row.
  std::vector<int32_t> q_offsets(static_cast<size_t>(n_seqs) + 1, 0);
  std::vector<int32_t> seq_lens(static_cast<size_t>(n_seqs), 0);
  bool grouped = true;
  int32_t max_rows = 0, max_context = 0, run = 0;
  for (int32_t i = 0; i < n; ++i) {
    max_context = std::max(max_context, slots[i] + 1);
    const bool continues = i > 0 && b.token_seq[i] == b.token_seq[i - 1];
    if (continues) {
      if (slots[i] != slots[i - 1] + 1) grouped = false;
      ++run;
    } else {
      if (i > 0 && b.token_seq[i] < b.token_seq[i - 1]) grouped = false;
      if (q_offsets[b.token_seq[i] + 1] != 0) grouped = false;  // a second run of one sequence
      run = 1;
    }
    max_rows = std::max(max_rows, run);
    ++q_offsets[b.token_seq[i] + 1];
    seq_lens[b.token_seq[i]] = slots[i] + 1;
  }
  for (int32_t s = 0; s < n_seqs; ++s) q_offsets[s + 1] += q_offsets[s];
  // Head dims without a tuned kernel (e.g. stories260K's 8) take the
  // generic kernel, which runs any ragged batch. 256-wide heads (Gemma 3)
  // take the tiled prefill kernel (128 channels staged at a time) for
  // prefill chunks and the decode kernel for decode rows (not with f32 K/V,
  // whose decode rows stay on the generic kernel).
  const bool tuned = c.head_dim == 64 || c.head_dim == 128;
  const bool decode_tuned =
      tuned || (c.head_dim == 256 && kv.dtype != kernels::KvDType::kF32);
  const bool use_prefill = (tuned || c.head_dim == 256) && grouped && max_rows > 1;
  const bool use_decode = decode_tuned && !use_prefill;

  // One staging copy of every int array of the step: [tokens][token_seq]
  // [positions][logit_rows][block_ids][seq_block_offsets][q_offsets][seq_lens]
  // [slots, only when they differ from the positions].
  host_ints_.clear();
  auto put = [&](const int32_t* p, size_t count) -> size_t {
    const size_t at = host_ints_.size();
    host_ints_.insert(host_ints_.end(), p, p + count);
    return at;
  };
  const size_t o_tokens = put(b.tokens.data(), n_sz);
  const size_t o_seq = put(b.token_seq.data(), n_sz);
  const size_t o_pos = put(b.positions.data(), n_sz);
  const size_t o_rows = put(b.logit_rows.data(), b.logit_rows.size());
  const size_t o_blocks = put(kv.block_ids, static_cast<size_t>(n_blocks));
  const size_t o_offsets = put(kv.seq_block_offsets, static_cast<size_t>(n_seqs) + 1);
  const size_t o_qoff = put(q_offsets.data(), q_offsets.size());
  const size_t o_lens = put(seq_lens.data(), seq_lens.size());
  const size_t o_slots = shifted ? put(slots.data(), n_sz) : o_pos;
  // KV cache groups: each group's block table and offsets.
  std::vector<std::pair<size_t, size_t>> o_groups;
  for (const kernels::PagedKvView& g : b.group_kv) {
    const size_t ob = put(g.block_ids, static_cast<size_t>(g.seq_block_offsets[n_seqs]));
    const size_t oo = put(g.seq_block_offsets, static_cast<size_t>(n_seqs) + 1);
    o_groups.emplace_back(ob, oo);
  }
  // H2O: which sequences' mass rows the step fills (1: wanted).
  size_t o_wanted = 0;
  if (want_mass) {
    std::vector<int32_t> wanted(static_cast<size_t>(n_seqs), 1);
    for (size_t i = 0; i < b.attention_mass_seqs.size(); ++i) {
      wanted[i] = b.attention_mass_seqs[i] != 0 ? 1 : 0;
    }
    o_wanted = put(wanted.data(), wanted.size());
  }

  // The previous step's upload read the staging buffer; it is done once the
  // stream is idle (Forward always ends synchronized, except on an error).
  RETURN_IF_ERROR(stream_.Synchronize());
  RETURN_IF_ERROR(EnsureScratch(n, n_logits, host_ints_.size()));
  const cuda::StreamHandle st = stream_.get();
  std::memcpy(staging_.data(), host_ints_.data(), sizeof(int32_t) * host_ints_.size());
  RETURN_IF_ERROR(cuda::CopyToDeviceAsync(ints_.data(), staging_.data(),
                                          sizeof(int32_t) * host_ints_.size(), st));
  const int32_t* d = ints_.as<int32_t>();
  const int32_t* d_tokens = d + o_tokens;
  const int32_t* d_seq = d + o_seq;
  const int32_t* d_pos = d + o_pos;
  const int32_t* d_slot = d + o_slots;

  kernels::PagedKvView dkv = kv;  // kv.pool is already device memory
  dkv.block_ids = d + o_blocks;
  dkv.seq_block_offsets = d + o_offsets;
  std::vector<kernels::PagedKvView> dgroups;
  for (size_t g = 0; g < o_groups.size(); ++g) {
    kernels::PagedKvView v = b.group_kv[g];
    v.block_ids = d + o_groups[g].first;
    v.seq_block_offsets = d + o_groups[g].second;
    dgroups.push_back(v);
  }

  float* x = x_.as<float>();
  float* xn = xn_.as<float>();
  float* q = q_.as<float>();
  float* k = k_.as<float>();
  float* v = v_.as<float>();
  float* attn = attn_.as<float>();
  float* gate = gate_.as<float>();
  float* up = up_.as<float>();

  RETURN_IF_ERROR(cuda::EmbeddingGather(embd_type_, token_embd_.data(), c.vocab_size, c.dim,
                                        d_tokens, n, x, st));
  if (c.embed_scale != 1.0f) {
    RETURN_IF_ERROR(cuda::ScaleInPlace(x, c.embed_scale, static_cast<int64_t>(n) * c.dim, st));
  }

  const float scale = c.attention_scale > 0 ? c.attention_scale
                                            : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  // As on the CPU: a window reaching back past slot 0 for every token masks
  // nothing, and such steps keep the tuned kernels on windowed layers too.
  const bool window_masks = c.sliding_window > 0 && max_context > c.sliding_window;
  cuda::DecodeAttentionBatch decode;
  decode.n_tokens = n;
  decode.token_seq = d_seq;
  decode.token_pos = d_slot;
  decode.n_heads = c.n_heads;
  decode.scale = scale;
  decode.max_context = max_context;
  cuda::PrefillAttentionBatch prefill;
  prefill.q_seq_offsets = d + o_qoff;
  prefill.seq_lens = d + o_lens;
  prefill.max_q_per_seq = max_rows;
  prefill.n_heads = c.n_heads;
  prefill.scale = scale;
  // The step's mass starts at zero on the device and is added to the
  // caller's rows at the end (the CPU forward adds into them directly).
  const size_t mass_floats =
      want_mass ? static_cast<size_t>(n_seqs) * kv.n_kv_heads * b.attention_mass_stride : 0;
  if (want_mass) {
    RETURN_IF_ERROR(Grow(&mass_, sizeof(float) * mass_floats));
    RETURN_IF_ERROR(cuda::MemsetAsync(mass_.data(), 0, sizeof(float) * mass_floats, st));
  }
  size_t workspace_bytes = 0;
  if (use_decode) {
    workspace_bytes = cuda::PagedDecodeAttentionWorkspaceBytes(dkv, decode);
    RETURN_IF_ERROR(Grow(&workspace_, workspace_bytes));
  }

  for (int32_t l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    // Attention block.
    RETURN_IF_ERROR(cuda::RmsNorm(x, L.attn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st));
    RETURN_IF_ERROR(blas_->MatMul(L.wq, xn, n, c.dim, q, q_dim));
    RETURN_IF_ERROR(blas_->MatMul(L.wk, xn, n, c.dim, k, kv_dim));
    RETURN_IF_ERROR(blas_->MatMul(L.wv, xn, n, c.dim, v, kv_dim));
    if (c.qkv_bias) {
      RETURN_IF_ERROR(cuda::AddRowBias(q, L.bq.as<float>(), n, q_dim, st));
      RETURN_IF_ERROR(cuda::AddRowBias(k, L.bk.as<float>(), n, kv_dim, st));
      RETURN_IF_ERROR(cuda::AddRowBias(v, L.bv.as<float>(), n, kv_dim, st));
    }
    if (c.qk_norm) {  // per head, before RoPE
      RETURN_IF_ERROR(cuda::RmsNorm(q, L.q_norm.as<float>(), static_cast<int64_t>(n) * c.n_heads,
                                    c.head_dim, c.rms_eps, q, st));
      RETURN_IF_ERROR(cuda::RmsNorm(k, L.k_norm.as<float>(),
                                    static_cast<int64_t>(n) * c.n_kv_heads, c.head_dim, c.rms_eps,
                                    k, st));
    }
    kernels::RopeParams rope = c.RopeForLayer(l);
    rope.freq_factors = rope_freqs_.size() > 0 ? rope_freqs_.as<float>() : nullptr;  // device
    RETURN_IF_ERROR(cuda::Rope(q, n, q_dim, c.n_heads, d_pos, rope, st));
    RETURN_IF_ERROR(cuda::Rope(k, n, kv_dim, c.n_kv_heads, d_pos, rope, st));
    // The layer's K/V: its group's table and its slot in the group's page,
    // or layer l of the one all-layers view.
    const kernels::PagedKvView& lkv = grouped_kv ? dgroups[b.layer_group[l]] : dkv;
    const int32_t ll = grouped_kv ? b.layer_index[l] : l;
    RETURN_IF_ERROR(cuda::AppendKv(lkv, ll, n, d_seq, d_slot, k, kv_dim, v, kv_dim, st));
    if (want_mass) {
      RETURN_IF_ERROR(cuda::AccumulateAttentionMass(lkv, ll, n, d_seq, d_slot, c.n_heads, scale, q,
                                                    q_dim, d + o_wanted, mass_.as<float>(),
                                                    b.attention_mass_stride, st));
    }
    // Every kernel starts a windowed layer's tokens at their window.
    const int32_t window = window_masks && c.LayerWindowed(l) ? c.sliding_window : 0;
    if (use_prefill) {
      prefill.window = window;
      RETURN_IF_ERROR(cuda::PagedPrefillAttention(lkv, ll, prefill, q, q_dim, attn, q_dim, st));
    } else if (use_decode) {
      decode.window = window;
      RETURN_IF_ERROR(cuda::PagedDecodeAttention(lkv, ll, decode, q, q_dim, attn, q_dim,
                                                 workspace_bytes > 0 ? workspace_.data() : nullptr,
                                                 workspace_bytes, st));
    } else {
      RETURN_IF_ERROR(cuda::PagedAttentionGeneric(lkv, ll, n, d_seq, d_slot, c.n_heads, scale, q,
                                                  q_dim, attn, q_dim, window, st));
    }
    RETURN_IF_ERROR(blas_->MatMul(L.wo, attn, n, q_dim, xn, c.dim));
    if (c.post_norms) {
      RETURN_IF_ERROR(
          cuda::RmsNorm(xn, L.post_attn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st));
    }
    RETURN_IF_ERROR(cuda::AddInPlace(x, xn, static_cast<int64_t>(n) * c.dim, st));
    // Feed-forward block (SwiGLU; GEGLU with the tanh GELU for Gemma).
    RETURN_IF_ERROR(cuda::RmsNorm(x, L.ffn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st));
    RETURN_IF_ERROR(blas_->MatMul(L.w_gate, xn, n, c.dim, gate, c.ffn_dim));
    RETURN_IF_ERROR(blas_->MatMul(L.w_up, xn, n, c.dim, up, c.ffn_dim));
    if (c.gelu_ffn) {
      RETURN_IF_ERROR(cuda::GeluTanhMul(gate, up, static_cast<int64_t>(n) * c.ffn_dim, gate, st));
    } else {
      RETURN_IF_ERROR(cuda::SiluMul(gate, up, static_cast<int64_t>(n) * c.ffn_dim, gate, st));
    }
    RETURN_IF_ERROR(blas_->MatMul(L.w_down, gate, n, c.ffn_dim, xn, c.dim));
    if (c.post_norms) {
      RETURN_IF_ERROR(cuda::RmsNorm(xn, L.post_ffn_norm.as<float>(), n, c.dim, c.rms_eps, xn, st));
    }
    RETURN_IF_ERROR(cuda::AddInPlace(x, xn, static_cast<int64_t>(n) * c.dim, st));
  }

  // Only rows that need logits pay for the output head. Gathering rows of x
  // is an F32 "embedding" lookup with the logit rows as token ids.
  if (n_logits > 0) {
    float* fin = final_.as<float>();
    RETURN_IF_ERROR(cuda::EmbeddingGather(DType::kF32, x, n, c.dim, d + o_rows, n_logits, fin, st));
    RETURN_IF_ERROR(
        cuda::RmsNorm(fin, output_norm_.as<float>(), n_logits, c.dim, c.rms_eps, fin, st));
    RETURN_IF_ERROR(
        blas_->MatMul(output_, fin, n_logits, c.dim, logits_.as<float>(), c.vocab_size));
    if (c.final_logit_softcap > 0) {
      RETURN_IF_ERROR(cuda::SoftcapInPlace(logits_.as<float>(), c.final_logit_softcap,
                                           n_logits * c.vocab_size, st));
    }
    RETURN_IF_ERROR(
        cuda::CopyToHostAsync(logits, logits_.data(), sizeof(float) * n_logits * c.vocab_size, st));
  }
  if (want_mass) {
    host_mass_.resize(mass_floats);
    RETURN_IF_ERROR(
        cuda::CopyToHostAsync(host_mass_.data(), mass_.data(), sizeof(float) * mass_floats, st));
  }
  // Synchronous like the CPU forward: a kernel fault surfaces in this step's
  // Status, and the engine may reuse blocks and read logits at once.
  RETURN_IF_ERROR(stream_.Synchronize());
  for (size_t i = 0; i < mass_floats; ++i) b.attention_mass[i] += host_mass_[i];
  return absl::OkStatus();
}

}  // namespace kvserve
