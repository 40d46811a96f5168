// The one score and mask contract of every attention kernel (forward families: tile_scores.cuh;
// backward: bwd_common.cuh's probabilities; decode: decode_split.cuh). Per score at absolute
// (q_idx, kv_idx) of (b, h):
//   score = score_mod(scale * s + bias)   grad = score_mod'(scale * s + bias)
// and a fused mask's verdict. The variant's configuration Cfg provides
//   Hooks     the user's expressions (templates/hooks.cu.jinja, rendered once for every kernel):
//             score_mod, score_grad (taking p only when they read the user's arrays), mask, and
//             the flags kHasScoreMod, kHasScoreGrad, kFusedMask, kScoreReadsArrays;
//   kHasBias  an additive bias is read per score, as BiasElem (element.cuh: any element type
//             whatever the inputs are) at p.bias with strides p.bias_s{b,h,q,k}.
#pragma once
#include "element.cuh"

namespace omni {

template <class Cfg>
struct ScoreHooks {
  using H = typename Cfg::Hooks;

  // The transformed score; `grad` gets the modifier's derivative (1 without a modifier).
  template <class P>
  static __device__ __forceinline__ float transform(float s, int b, int h, int q_idx, int kv_idx, const P& p, float& grad) {
    s = scale_and_bias(s, b, h, q_idx, kv_idx, p);
    if constexpr (H::kScoreReadsArrays) {
      grad = H::score_grad(s, b, h, q_idx, kv_idx, p);
      s = H::score_mod(s, b, h, q_idx, kv_idx, p);
    } else if constexpr (H::kHasScoreMod) {
      grad = H::score_grad(s, b, h, q_idx, kv_idx);
      s = H::score_mod(s, b, h, q_idx, kv_idx);
    } else {
      grad = 1.f;
    }
    return s;
  }

  // The transformed score alone (the forward and decode).
  template <class P>
  static __device__ __forceinline__ float transform(float s, int b, int h, int q_idx, int kv_idx, const P& p) {
    s = scale_and_bias(s, b, h, q_idx, kv_idx, p);
    if constexpr (H::kScoreReadsArrays) {
      s = H::score_mod(s, b, h, q_idx, kv_idx, p);
    } else if constexpr (H::kHasScoreMod) {
      s = H::score_mod(s, b, h, q_idx, kv_idx);
    }
    return s;
  }

  // Whether the fused mask allows the score (true without a fused mask).
  template <class P>
  static __device__ __forceinline__ bool mask(int b, int h, int q_idx, int kv_idx, const P& p) {
    return H::mask(p, b, h, q_idx, kv_idx);
  }

 private:
  template <class P>
  static __device__ __forceinline__ float scale_and_bias(float s, int b, int h, int q_idx, int kv_idx, const P& p) {
    s *= p.scale;
    if constexpr (Cfg::kHasBias) {
      s += load_float<typename Cfg::BiasElem>(p.bias, b * p.bias_sb + h * p.bias_sh + q_idx * p.bias_sq + kv_idx * p.bias_sk);
    }
    return s;
  }
};

}  // namespace omni
