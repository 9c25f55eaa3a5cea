// Activations shared by the CPU loops and the CUDA kernels (one definition, so both round alike).
// No torch headers. Built with -ffp-contract=off / --fmad=false, so every operation below rounds on its own.
#pragma once

#include <math.h>

#include "philox.h"  // DG_HD

namespace dg {

// torch's gelu(approximate="tanh") in fp32, in torch's order of operations:
// x³ = x·x·x; inner = √(2/π)·(x + 0.044715·x³); 0.5·x·(1 + tanh(inner)).
DG_HD float gelu_tanh(float x) {
  const float x_cube = x * x * x;
  const float inner = 0.7978845608028654f * (x + 0.044715f * x_cube);
  return 0.5f * x * (1.0f + tanhf(inner));
}

}  // namespace dg
