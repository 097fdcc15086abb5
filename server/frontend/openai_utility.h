// The HTTP utility endpoints beside completions (issue 44): OpenAI's
// POST /v1/embeddings, served by the sentence encoder the semantic cache
// carries (embed/), and vLLM's POST /tokenize and POST /detokenize over the
// served model's tokenizer and chat template. Each takes the body's bytes
// and returns the status and the JSON body; the HTTP server only routes.
// Every field is honoured or refused by name (400, param), as for
// completions.
//
// Thread-safety: pure functions over const services; they run on the HTTP
// handler threads (an embedding batch runs the encoder, milliseconds per
// input).
#pragma once

#include <string>
#include <string_view>

#include "embed/embedder.h"
#include "server/service/model_service.h"

namespace kvserve {

struct UtilityReply {
  int status = 200;
  std::string body;  // JSON
};

// The most inputs one embeddings request may carry (OpenAI's limit).
inline constexpr size_t kMaxEmbeddingInputs = 2048;

// POST /v1/embeddings. `embedder` null: 404 (the server was started
// without --semantic-cache-model). `model_name` is the name clients send.
UtilityReply EmbeddingsHttp(const TextEmbedder* embedder, const std::string& model_name,
                            std::string_view body);

// POST /tokenize: {"prompt": text} or {"messages": [...]} (vLLM's shapes).
UtilityReply TokenizeHttp(ModelService* service, std::string_view body);

// POST /detokenize: {"tokens": [ids]}.
UtilityReply DetokenizeHttp(ModelService* service, std::string_view body);

}  // namespace kvserve
