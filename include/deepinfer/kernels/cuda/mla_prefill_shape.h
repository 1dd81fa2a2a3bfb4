// How run_mla_prefill (mla_prefill.h) shapes the expanded MLA attention's grid: 64 or 128 query rows per CTA, and
// into how many ranges each 128-row CTA's keys are split. Host arithmetic only (no CUDA), so that the choice is
// unit-tested on the CPU against the cases measured in bench/gpu/NOTES.md. Thread-safe (pure).
#pragma once

#include <algorithm>
#include <cstdint>

namespace deepinfer::kernels::cuda {

// What run_mla_prefill launches: query rows per CTA (64 or 128) and key splits (1 = none).
struct MlaPrefillShape {
  int rows_per_cta = 0;
  int key_splits = 0;
};

struct MlaPrefillGrid {
  int64_t tiles_64 = 0;    // query tiles with work at 64 rows (Σ_b ceil(L_b / 64)), per head
  int64_t tiles_128 = 0;   // the same at 128 rows
  int64_t heads = 0;       // H
  int64_t sms = 0;         // the device's SMs
  int64_t max_keys = 0;    // the most keys one CTA sees (the chunk's keys over a cached prefix; the rows from 0)
  bool overlap = true;     // the wgmma kernel's softmax overlapped with P · V (sets the 128-row kernel's speed)
  int64_t max_splits = 1;  // key splits the caller's workspace holds (1: none)
};

// The cheapest shape by waves, in units of a 64-row CTA's work (H100 measurements, bench/gpu/NOTES.md, 2026-12-06):
//   - 64 rows: a wave of two CTAs an SM takes 2; CTAs no more than the SMs run alone, 1.3 each (H = 16, 512 rows
//     after 3,584: 128 CTAs in 85 us against 131 us a double wave at H = 128);
//   - 128 rows: a wave of one CTA an SM takes 2 / 1.2 overlapped (1.17-1.25x measured at equal waves), 2 / 1.1
//     serial; split s ways, 1 / s of that plus 0.05 for the combine pass.
// Splits only below 4 waves of 128-row CTAs (where the last wave's emptiness matters) and at 1,024 keys or more a
// split: their partials are a write and a read of T x H x 129 floats a split, which many short CTAs do not repay
// (H = 128, 1 x 4,096 from position 0: 2.00 ms unsplit, 2.33 split 2 ways, 2.71 4 ways).
inline MlaPrefillShape choose_mla_prefill_shape(const MlaPrefillGrid& g) {
  const int64_t sms = std::max<int64_t>(g.sms, 1);
  const int64_t ctas_64 = g.tiles_64 * g.heads, ctas_128 = g.tiles_128 * g.heads;
  const double cost_64 = ctas_64 <= sms ? 1.3 : 2.0 * static_cast<double>((ctas_64 + 2 * sms - 1) / (2 * sms));
  const double wave_128 = 2.0 / (g.overlap ? 1.2 : 1.1);
  const int64_t max_splits =
      ctas_128 < 4 * sms ? std::clamp<int64_t>(std::min<int64_t>(g.max_splits, g.max_keys / 1024), 1, 8) : 1;
  MlaPrefillShape best{64, 1};
  double best_cost = cost_64;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const double waves = static_cast<double>((ctas_128 * s + sms - 1) / sms);
    const double cost = waves * wave_128 / static_cast<double>(s) + (s > 1 ? 0.05 : 0.0);
    if (cost < best_cost) {
      best_cost = cost;
      best = {128, static_cast<int>(s)};
    }
  }
  return best;
}

}  // namespace deepinfer::kernels::cuda
