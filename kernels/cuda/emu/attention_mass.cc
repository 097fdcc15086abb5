// ../attention_mass.cu built as plain C++ for the CUDA emulator (device.h).
#include "kernels/cuda/emu/device.h"
// device.h must come first: it turns the CUDA keywords into C++.
#include "kernels/cuda/attention_mass.cu"
