// Programmatic dependent launch (Hopper; CUDA's "PDL"): a kernel launched with launch_pdl may be scheduled while
// the kernel before it in the stream is still running, and must call pdl_begin() before it touches global memory.
// pdl_begin() waits until the previous kernel has finished and its writes are visible (griddepcontrol.wait), then
// lets the next PDL kernel be scheduled in turn (griddepcontrol.launch_dependents). What it buys: the next kernel's
// launch and CTA start overlap this one's tail, a microsecond or two per kernel boundary, which at decode batch 1 is
// a large share of each small kernel's time (bench/gpu/NOTES.md). Captured into CUDA graphs as programmatic edges.
// DEEPINFER_PDL=0 launches plainly (measurements; the CUDA backend refuses values other than 0 and 1). Thread-safety:
// as a kernel launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string_view>
#include <utility>

namespace deepinfer::kernels::cuda {

inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("DEEPINFER_PDL");
    return value == nullptr || std::string_view(value) != "0";
  }();
  return enabled;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed; launch
// errors are left for cudaGetLastError, as with <<<>>>.
template <typename... KernelArgs, typename... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  if (!pdl_enabled()) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace deepinfer::kernels::cuda
