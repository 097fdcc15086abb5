// libFuzzer target: ParseOpenAiRequest on arbitrary bytes. The first byte
// picks completions or chat; the rest is the body. Every input must either
// parse or fail with a 400 naming a problem; ASan/UBSan catch the rest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "server/frontend/openai_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  kvserve::OpenAiRequest out;
  std::optional<kvserve::ApiError> err = kvserve::ParseOpenAiRequest(body, chat, &out);
  if (err && (err->status != 400 || err->message.empty())) std::abort();
  return 0;
}
