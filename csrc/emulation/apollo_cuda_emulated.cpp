// csrc/cuda/apollo_cuda.cu compiled as host C++ behind the CUDA emulation (cuda_emulation.h).
#include "../cuda/apollo_cuda.cu"
