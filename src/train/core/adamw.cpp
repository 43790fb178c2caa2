// adamw.cpp — the CPU AdamW reference and the global gradient norm (formulas in adamw.h).
#include "train/core/adamw.h"

#include <algorithm>
#include <cmath>

#include "core/message.h"
#include "core/numeric.h"

namespace flare::train {

double gradient_norm(const ParameterLayout& layout, const float* grads) {
  double sum = 0.0;
  for (const ParamSpec& p : layout.params) {
    const float* g = grads + p.offset;
    for (int64_t i = 0; i < p.numel; ++i) sum += static_cast<double>(g[i]) * g[i];
  }
  return std::sqrt(sum);
}

float clip_scale(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

Status adamw_step(const ParameterLayout& layout, const AdamWStep& s, const float* grads,
                  float* master, float* m, float* v, uint16_t* weights) {
  if (grads == nullptr || master == nullptr || m == nullptr || v == nullptr)
    return invalid("adamw_step: grads, master, m and v must not be null");
  if (s.t < 1) return invalid("adamw_step: t = ", s.t, " must be >= 1 (steps count from 1)");
  if (!std::isfinite(s.lr) || s.lr < 0) return invalid("adamw_step: lr = ", s.lr, " must be finite and >= 0");
  if (!(s.beta1 >= 0 && s.beta1 < 1)) return invalid("adamw_step: beta1 = ", s.beta1, " must be in [0, 1)");
  if (!(s.beta2 >= 0 && s.beta2 < 1)) return invalid("adamw_step: beta2 = ", s.beta2, " must be in [0, 1)");
  if (!std::isfinite(s.eps) || s.eps <= 0) return invalid("adamw_step: eps = ", s.eps, " must be finite and > 0");
  if (!std::isfinite(s.weight_decay) || s.weight_decay < 0)
    return invalid("adamw_step: weight_decay = ", s.weight_decay, " must be finite and >= 0");
  if (!std::isfinite(s.grad_scale) || s.grad_scale < 0)
    return invalid("adamw_step: grad_scale = ", s.grad_scale, " must be finite and >= 0");

  const double t = static_cast<double>(s.t);
  const float bc1 = static_cast<float>(1.0 - std::pow(s.beta1, t));
  const float bc2 = static_cast<float>(1.0 - std::pow(s.beta2, t));
  const float beta1 = static_cast<float>(s.beta1);
  const float beta2 = static_cast<float>(s.beta2);
  // 1 − beta in double: 1 − fp32(0.999) would be off by 1.3e-5 relative, where torch is exact.
  const float one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  const float one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  const float lr = static_cast<float>(s.lr);
  const float eps = static_cast<float>(s.eps);

  for (const ParamSpec& p : layout.params) {
    const float decay = p.weight_decay ? static_cast<float>(1.0 - s.lr * s.weight_decay) : 1.0f;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      const float g = grads[i] * s.grad_scale;
      m[i] = beta1 * m[i] + one_minus_beta1 * g;
      v[i] = beta2 * v[i] + one_minus_beta2 * g * g;
      const float m_hat = m[i] / bc1;
      const float v_hat = v[i] / bc2;
      master[i] = master[i] * decay - lr * (m_hat / (std::sqrt(v_hat) + eps));
      if (weights != nullptr) weights[i] = float_to_bf16(master[i]);
    }
  }
  return Status::ok_status();
}

}  // namespace flare::train
