// libFuzzer target: the tokenizers on arbitrary bytes. Loads the vocabulary
// of a real model once (KVSERVE_FUZZ_MODEL, else stories260K's SentencePiece
// and then SmolLM2's byte-level BPE where present) and encodes each input
// with and without special-token parsing, then decodes the ids; ids must be
// in the vocabulary; Decode and the streaming detokenizer run over them.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/gguf.h"
#include "model/tokenizer.h"

namespace {

struct Loaded {
  std::unique_ptr<kvserve::GgufFile> file;
  std::unique_ptr<kvserve::Tokenizer> tokenizer;
};

std::vector<Loaded>* Tokenizers() {
  static std::vector<Loaded>* loaded = [] {
    auto* out = new std::vector<Loaded>;
    std::vector<std::string> paths;
    if (const char* p = std::getenv("KVSERVE_FUZZ_MODEL")) {
      paths.push_back(p);
    } else {
      paths = {KVSERVE_SOURCE_DIR "/../shared/models/stories260K.gguf",
               "/work/shared/models/stories260K.gguf",
               KVSERVE_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"};
    }
    for (const std::string& path : paths) {
      auto file = kvserve::GgufFile::Open(path);
      if (!file.ok()) continue;
      auto tok = kvserve::Tokenizer::FromGguf(**file);
      if (!tok.ok()) continue;
      out->push_back({std::move(file).value(), std::move(tok).value()});
    }
    if (out->empty()) {
      std::fprintf(stderr, "tokenizer_fuzz: no model found (set KVSERVE_FUZZ_MODEL)\n");
      std::exit(2);
    }
    return out;
  }();
  return loaded;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const Loaded& l : *Tokenizers()) {
    const kvserve::Tokenizer& t = *l.tokenizer;
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = t.Encode(text, /*add_bos=*/false, special);
      for (int32_t id : ids) {
        if (id < 0 || id >= t.vocab_size()) std::abort();
      }
      // Not a round trip: bytes whose byte-level token the vocabulary lacks
      // (SmolLM2 has none for 0x06) are dropped, as llama.cpp and HF do.
      (void)t.Decode(ids);
      kvserve::StreamingDetokenizer stream(&t);
      std::string streamed;
      for (int32_t id : ids) streamed += stream.Push(id);
      streamed += stream.Flush();
    }
  }
  return 0;
}
