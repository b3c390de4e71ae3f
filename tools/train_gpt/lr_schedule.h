#pragma once
// Learning rate of optimizer step `step` (0-based): linear warmup to `peak` over `warmup` steps,
// then cosine decay to peak * min_ratio at the last step.
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace train_gpt {

inline double lr_at(int64_t step, int64_t total, double peak, int64_t warmup, double min_ratio = 0.1) {
  if (warmup > 0 && step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const int64_t decay = std::max<int64_t>(1, total - warmup - 1);
  const double t = std::clamp(static_cast<double>(step - warmup) / static_cast<double>(decay), 0.0, 1.0);
  const double pi = std::acos(-1.0);
  return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(pi * t)));
}

}  // namespace train_gpt
