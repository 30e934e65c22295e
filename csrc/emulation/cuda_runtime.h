// Stands in for the toolkit's <cuda_runtime.h> when the device kernels are compiled as host C++
// (this folder comes first on the include path of the emulated build): see cuda_emulation.h.
#pragma once

#include "cuda_emulation.h"
