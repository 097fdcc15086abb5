// CudaLlama: LlamaModel's forward on an NVIDIA GPU over a device-resident
// paged KV pool, with the CPU forward's semantics (ragged batch, GQA, both
// RoPE layouts, tied output) and logits copied back to host memory so the
// engine's sampler is unchanged. Every family the CPU forward runs: Llama
// 3.x's RoPE scaling, Qwen2's Q/K/V biases, Qwen3's QK-norm, Gemma 3's
// post-norms, GELU FFN, scaled embeddings, per-layer RoPE base and sliding
// windows, with KV cache groups (hybrid attention) as the engine lays them
// out.
//
// Weights are uploaded once, at Create: matrices through cuda::UploadWeight
// (F32, F16 and BF16 stay as they are; Q8_0/Q4_0/Q4_1 stay in their GGUF
// bytes and run the integer kernels with 8-bit activations, as on the CPU;
// other block types become F16),
// the embedding table in its own type (EmbeddingGather dequantizes rows),
// norms as F32. The per-step host arrays (tokens, positions, block table)
// go through one pinned staging buffer and one upload.
//
// Owns its DeviceMemoryPool (weights, scratch and, through
// ForwardBackend::kv_device_memory, the KV pool's blocks), one stream and a
// cuBLAS handle. The backend must outlive every KvPool allocated from it.
// Not thread-safe: one engine thread.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/runtime.h"
#include "model/backend.h"
#include "model/llama.h"

namespace kvserve {

class CudaLlama final : public ForwardBackend {
 public:
  // Unavailable when CUDA is not usable here; Unimplemented for a model the
  // kernels cannot run (head_dim above 256; 64 and 128 have tuned kernels,
  // other head dims a generic, slower attention kernel). `model` must outlive
  // the backend (its GGUF mapping is read at Create only).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CudaLlama>> Create(const LlamaModel& model);
  ~CudaLlama() override;

  Device device() const override { return Device::kCuda; }
  const LlamaConfig& config() const override { return config_; }
  [[nodiscard]] absl::Status Forward(const ForwardBatch& batch, const kernels::PagedKvView& kv,
                                     float* logits, ThreadPool* pool) override;
  cuda::DeviceMemoryPool* kv_device_memory() override { return &memory_; }
  cuda::StreamHandle kv_stream() override { return stream_.get(); }
  [[nodiscard]] absl::Status CheckKvLayout(kernels::KvDType dtype,
                                           int32_t block_size) const override;

  // The KV layouts the CUDA kernels run: f32/f16/bf16 for any head_dim;
  // int8, fp8-e4m3/e5m2, int4 and int4-g64 for head_dim 64, 128 and 256 (0: not
  // known yet); power-of-two block sizes. InvalidArgument naming the flag
  // otherwise (int4-kivi* has no CUDA kernels).
  [[nodiscard]] static absl::Status SupportsKvLayout(kernels::KvDType dtype, int32_t block_size,
                                                     int32_t head_dim);
  // head_dim up to cuda::kGenericMaxHeadDim; Unimplemented otherwise.
  [[nodiscard]] static absl::Status SupportsModel(const LlamaConfig& config);

  // Device memory of this backend (weights, scratch, KV blocks): tests check
  // that a run leaves no buffer behind.
  const cuda::DeviceMemoryPool& device_memory() const { return memory_; }
  // Waits for the stream and frees the step scratch (activations, staging,
  // cuBLAS's converted activations): afterwards device_memory() holds the
  // weights plus whatever KV pools still live, exactly as right after Create,
  // which is what leak checks compare.
  absl::Status ReleaseScratch();

 private:
  struct Layer {
    cuda::DeviceBuffer attn_norm, ffn_norm;
    cuda::DeviceWeight wq, wk, wv, wo, w_gate, w_up, w_down;
    // The families' additions, empty where the model has none (as on the
    // CPU: Qwen2's Q/K/V biases, Qwen3/Gemma 3's QK-norm, Gemma 3's
    // post-attention and post-FFN norms).
    cuda::DeviceBuffer bq, bk, bv, q_norm, k_norm, post_attn_norm, post_ffn_norm;
  };

  CudaLlama() = default;
  absl::Status Upload(const LlamaModel& model);
  absl::Status EnsureScratch(int64_t n_tokens, int64_t n_logits, size_t staging_ints);
  absl::Status Grow(cuda::DeviceBuffer* b, size_t bytes);

  LlamaConfig config_;
  // Declaration order is destruction order reversed: buffers before the pool.
  cuda::DeviceMemoryPool memory_;
  cuda::CudaStream stream_;
  std::unique_ptr<cuda::CublasMatMul> blas_;

  kernels::DType embd_type_ = kernels::DType::kF32;
  cuda::DeviceBuffer token_embd_;  // [vocab][dim] in embd_type_
  cuda::DeviceBuffer output_norm_;
  cuda::DeviceBuffer rope_freqs_;  // Llama 3's rope_freq_factors; empty without
  cuda::DeviceWeight output_;
  std::vector<Layer> layers_;

  // Scratch, grown to the largest batch seen.
  cuda::DeviceBuffer x_, xn_, q_, k_, v_, attn_, gate_, up_, final_, logits_, workspace_;
  cuda::DeviceBuffer ints_;         // the step's int32 arrays (device)
  cuda::DeviceBuffer mass_;         // the step's attention mass rows (H2O), when asked
  std::vector<float> host_mass_;    // mass_ copied back, then added to the caller's rows
  cuda::PinnedHostBuffer staging_;  // the same arrays, staged on the host
  std::vector<int32_t> host_ints_;  // built here, then copied to staging_
};

}  // namespace kvserve
