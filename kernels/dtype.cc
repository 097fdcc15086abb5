#include "kernels/dtype.h"

namespace kvserve::kernels {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kQ8_0:
      return "q8_0";
    case DType::kQ4_0:
      return "q4_0";
    case DType::kQ4_1:
      return "q4_1";
  }
  return "unknown";
}

int64_t BlockElems(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return 1;
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1:
      return kQK;
  }
  return 1;
}

int64_t BlockBytes(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kQ8_0:
      return sizeof(BlockQ8_0);
    case DType::kQ4_0:
      return sizeof(BlockQ4_0);
    case DType::kQ4_1:
      return sizeof(BlockQ4_1);
  }
  return 0;
}

}  // namespace kvserve::kernels
