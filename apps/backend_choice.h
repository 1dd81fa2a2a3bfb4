// The device flags shared by `deepinfer serve` and `deepinfer generate`: --device auto|cpu|cuda and --bf16, turned
// into a backend, the weights' precision, and the compute mode that goes into the KV cache's model fingerprint
// (a disk tier written by one mode is never read by another).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "deepinfer/backend/backend.h"
#include "deepinfer/core/status.h"

namespace deepinfer::apps {

struct DeviceOptions {
  std::string device = "auto";
  bool bf16 = false;
};

inline void add_device_flags(CLI::App* cmd, DeviceOptions& options) {
  cmd->add_option("--device", options.device,
                  "auto (cuda when a usable GPU is there, else cpu), cpu (float32, the reference-exact path), or cuda "
                  "(GPU 0 of CUDA_VISIBLE_DEVICES: bf16 weights and KV cache, FP8 checkpoints kept in FP8)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_flag("--bf16", options.bf16,
                "CPU: keep weights in bf16 (float32 accumulation); default float32. With --device auto it selects the CPU");
}

struct BackendChoice {
  std::unique_ptr<backend::Backend> backend;
  backend::Precision precision = backend::Precision::kF32;
  std::string compute_mode;  // e.g. "f32 weights, f32 latent KV"
};

// DEEPINFER_BATCH_INVARIANT=1: the CUDA backend's batch-invariant mode (src/backend/cuda/cuda_backend.h; the backend
// reads the variable and refuses values other than 0 and 1). Said in the compute mode.
inline bool batch_invariant_requested() {
  const char* v = std::getenv("DEEPINFER_BATCH_INVARIANT");
  return v != nullptr && std::string_view(v) == "1";
}

// `device_index`: the GPU (a tensor-parallel rank's own).
inline Result<BackendChoice> make_backend(const DeviceOptions& options, int device_index = 0) {
  BackendChoice choice;
  if (options.device != "cpu" && !(options.device == "auto" && options.bf16)) {
    Result<std::unique_ptr<backend::Backend>> cuda = backend::make_cuda_backend(device_index);
    if (!cuda.ok() && options.device == "cuda") return cuda.status();
    if (cuda.ok()) {
      choice.backend = std::move(cuda).value();
      choice.precision = backend::Precision::kFP8;  // FP8 where the checkpoint is FP8, else bf16
      choice.compute_mode = "cuda: bf16/fp8 weights, bf16 latent KV";
      if (batch_invariant_requested()) choice.compute_mode += ", batch-invariant";
      return choice;
    }
  }
  choice.backend = backend::make_cpu_backend();
  choice.precision = options.bf16 ? backend::Precision::kBF16 : backend::Precision::kF32;
  choice.compute_mode = options.bf16 ? "bf16 weights, f32 latent KV" : "f32 weights, f32 latent KV";
  if (batch_invariant_requested()) choice.compute_mode += "; DEEPINFER_BATCH_INVARIANT is the CUDA backend's (not used)";
  return choice;
}

}  // namespace deepinfer::apps
