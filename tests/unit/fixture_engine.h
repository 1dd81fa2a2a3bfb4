// The engine on the tiny DeepSeek-V3 fixture (float32 on the CPU backend), for the engine-level tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "deepinfer/engine/engine.h"
#include "test_data.h"

namespace deepinfer::testing {

inline const std::string kTinyV3Fixture = "tests/data/models/tiny-deepseek-v3";

// The engine, or nullptr after a test failure naming why the model or the engine could not be made.
inline std::unique_ptr<engine::Engine> make_fixture_engine(const engine::EngineConfig& config) {
  auto backend = backend::make_cpu_backend();
  auto model = model::DeepSeekModel::load(source_path(kTinyV3Fixture), *backend, backend::Precision::kF32);
  EXPECT_TRUE(model.ok()) << model.status().to_string();
  if (!model.ok()) return nullptr;
  auto engine = engine::Engine::create(std::move(backend), std::move(model).value(), config);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

}  // namespace deepinfer::testing
