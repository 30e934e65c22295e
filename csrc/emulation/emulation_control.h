// What the host side of the emulated build (ops.cpp, tests) controls and reads of the CUDA
// emulation, without the CUDA keywords of cuda_emulation.h. ATen-free.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fusedoff {
namespace emulation {

// Blocks of a grid, and threads between barriers, run in an order drawn from `seed`; 0 (the
// default) runs them in index order.
void set_schedule_seed(std::uint64_t seed);

// Kernel launches run so far in this process, failed ones included.
std::uint64_t launch_count();

}  // namespace emulation

namespace emulation_selftest {  // emulator_selftest.cpp: kernels that hold the emulation to CUDA's rules

std::vector<std::string> selftest_names();
// The named kernel's outputs and its launch's error message ("" when it succeeded).
std::pair<std::vector<int>, std::string> selftest(const std::string& name);

}  // namespace emulation_selftest
}  // namespace fusedoff
