// libFuzzer target: the GGUF reader on arbitrary bytes. The input lives in
// its own exact-size heap allocation, so ASan flags any read past its end;
// a file that loads has every metadata value and tensor table entry read.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<uint8_t[]> copy(new uint8_t[size == 0 ? 1 : size]);
  if (size > 0) std::memcpy(copy.get(), data, size);
  auto file = kvserve::GgufFile::FromBuffer(copy.get(), size);
  if (!file.ok()) return 0;
  const kvserve::GgufFile& f = **file;
  for (const std::string& key : f.Keys()) {
    (void)f.GetU32(key);
    (void)f.GetI64(key);
    (void)f.GetF32(key);
    (void)f.GetBool(key);
    (void)f.GetString(key);
    (void)f.GetStringArray(key);
    (void)f.GetF32Array(key);
    (void)f.GetI32Array(key);
  }
  for (const kvserve::GgufTensorInfo& t : f.tensors()) (void)f.FindTensor(t.name);
  return 0;
}
