// SentenceEncoder: model-directory loading, the embed pipeline.
#include "embed/sentence_encoder.h"

#include <limits>

#include <xxhash.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "embed/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvserve::embed {
namespace {

// Bumped when this code's numerics change, so cached entries embedded by an
// older build are not compared with new vectors.
constexpr char kFingerprintVersion[] = "kvserve-bert-mean-v1";

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<nlohmann::json> ReadJson(const std::string& path, const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON (", e.what(), ")"));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SentenceEncoder>> SentenceEncoder::Load(
    const std::string& dir, const SentenceEncoderOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("sentence encoder model directory '", dir,
                                            "' does not exist (deploy/setup.sh fetches "
                                            "all-MiniLM-L6-v2 into models/all-MiniLM-L6-v2)"));
  }
  const std::string config_path = dir + "/config.json";
  const std::string weights_path = dir + "/model.safetensors";
  const std::string tokenizer_path = dir + "/tokenizer.json";
  const std::string st_config_path = dir + "/sentence_bert_config.json";
  const std::string pooling_path = dir + "/1_Pooling/config.json";
  for (const std::string& p : {config_path, weights_path, tokenizer_path}) {
    if (!fs::is_regular_file(p, ec)) {
      return absl::NotFoundError(absl::StrCat("sentence encoder model directory '", dir, "' lacks ",
                                              fs::path(p).filename().string()));
    }
  }
  ASSIGN_OR_RETURN(BertConfig config, BertConfig::FromFile(config_path));
  ASSIGN_OR_RETURN(std::string config_text, ReadFile(config_path));
  ASSIGN_OR_RETURN(std::string tokenizer_text, ReadFile(tokenizer_path));
  ASSIGN_OR_RETURN(BertTokenizer tokenizer,
                   BertTokenizer::FromJson(tokenizer_text, tokenizer_path));
  if (tokenizer.vocab_size() > config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(tokenizer_path, ": vocabulary of ",
                                                   tokenizer.vocab_size(), " exceeds the model's ",
                                                   config.vocab_size));
  }

  // sentence-transformers' max_seq_length (optional file; BERT's positions
  // bound it either way).
  int max_seq = config.max_positions;
  std::string st_text, pooling_text;
  if (fs::is_regular_file(st_config_path, ec)) {
    ASSIGN_OR_RETURN(st_text, ReadFile(st_config_path));
    ASSIGN_OR_RETURN(nlohmann::json st, ReadJson(st_config_path, st_text));
    const auto it = st.find("max_seq_length");
    if (it != st.end() && !it->is_number_integer()) {
      return absl::InvalidArgumentError(st_config_path + ": max_seq_length is not an integer");
    }
    if (it != st.end()) max_seq = std::min(max_seq, it->get<int>());
    if (st.value("do_lower_case", false)) {
      return absl::InvalidArgumentError(st_config_path + ": do_lower_case=true is not supported");
    }
  }
  if (max_seq < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": max_seq_length ", max_seq, " is below 2"));
  }
  if (fs::is_regular_file(pooling_path, ec)) {
    ASSIGN_OR_RETURN(pooling_text, ReadFile(pooling_path));
    ASSIGN_OR_RETURN(nlohmann::json pool, ReadJson(pooling_path, pooling_text));
    for (const char* mode :
         {"pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
          "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"}) {
      if (pool.value(mode, false)) {
        return absl::InvalidArgumentError(
            absl::StrCat(pooling_path, ": ", mode, " is not supported (mean pooling only)"));
      }
    }
    if (!pool.value("pooling_mode_mean_tokens", true)) {
      return absl::InvalidArgumentError(pooling_path +
                                        ": mean pooling is off; nothing else is supported");
    }
  }

  ASSIGN_OR_RETURN(SafetensorsFile weights, SafetensorsFile::Open(weights_path));
  ASSIGN_OR_RETURN(BertEncoder encoder, BertEncoder::Load(config, weights, options.weight_type));

  // Content fingerprint: every file that changes the vectors.
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  for (std::string_view part :
       {std::string_view(config_text), std::string_view(tokenizer_text), std::string_view(st_text),
        std::string_view(pooling_text), weights.bytes()}) {
    const uint64_t len = part.size();
    XXH3_128bits_update(state, &len, sizeof(len));
    XXH3_128bits_update(state, part.data(), part.size());
  }
  const XXH128_hash_t hash = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  std::string fingerprint =
      absl::StrFormat("%s:%016x%016x:seq%d:%s", kFingerprintVersion, hash.high64, hash.low64,
                      max_seq, options.weight_type == kernels::DType::kF16 ? "f16" : "f32");

  return std::unique_ptr<SentenceEncoder>(new SentenceEncoder(
      std::move(tokenizer), std::move(encoder), max_seq, std::move(fingerprint)));
}

absl::StatusOr<std::vector<int32_t>> SentenceEncoder::Tokenize(std::string_view text) const {
  return tokenizer_.Encode(text, max_seq_length_);
}

absl::StatusOr<int32_t> SentenceEncoder::CountTokens(std::string_view text) const {
  // Untruncated: one [CLS] ... [SEP] sequence as long as the text needs.
  ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                   tokenizer_.Encode(text, std::numeric_limits<int>::max()));
  return static_cast<int32_t>(ids.size());
}

absl::StatusOr<std::vector<float>> SentenceEncoder::Embed(std::string_view text) const {
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, Tokenize(text));
  ASSIGN_OR_RETURN(std::vector<float> v, encoder_.Forward(ids));
  double norm = 0;
  for (float x : v) norm += static_cast<double>(x) * x;
  // sentence-transformers' Normalize: x / max(||x||, 1e-12).
  const float inv = static_cast<float>(1.0 / std::max(std::sqrt(norm), 1e-12));
  for (float& x : v) x *= inv;
  return v;
}

absl::StatusOr<std::unique_ptr<TextEmbedder>> LoadSentenceEncoder(
    const std::string& dir, const SentenceEncoderOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<SentenceEncoder> e, SentenceEncoder::Load(dir, options));
  return std::unique_ptr<TextEmbedder>(std::move(e));
}

}  // namespace kvserve::embed
