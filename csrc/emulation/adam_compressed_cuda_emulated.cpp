// csrc/cuda/adam_compressed_cuda.cu compiled as host C++ behind the CUDA emulation (cuda_emulation.h).
#include "../cuda/adam_compressed_cuda.cu"
