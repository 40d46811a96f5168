// Element traits: what a kernel knows of an operand's element type. Every operand (Q, K/V, O,
// bias) names its traits in the variant's configuration (Cfg::QElem, KvElem, OElem, BiasElem),
// picked by the template from the variant's dtype through Element<Dtype::...>; the kernels read
// Storage (the type in memory), kBytes and to_float from them, and the 16-bit ones are also the
// mma.sync / wgmma instruction types (mma.cuh's Fp16 and Bf16: pack, mma).
//
// A new element type is a specialisation here plus a value of the variant's dtype: the fp8 types
// below (e4m3, e5m2) are storage and conversion only; no shipped kernel reads them yet.
#pragma once
#include "mma.cuh"

namespace omni {

typedef unsigned char u8;

// The names are the variant's dtype values, so that a template writes Element<Dtype::{{ dtype }}>.
enum class Dtype { fp16, bf16, fp32, e4m3, e5m2 };

struct Fp32 {
  using Storage = float;
  static __device__ __forceinline__ float to_float(float x) { return x; }
};

// fp8 storage. Conversions go through packed f16x2 (cvt.rn.f16x2.e4m3x2 / e5m2x2, sm_89 and later):
// two fp8 values in the low 16 bits of a register become two fp16 values, `lo` in the low half.
template <bool kE4M3>
struct Fp8 {
  using Storage = u8;
  static __device__ __forceinline__ u32 to_f16x2(u16 two) {
    u32 r;
    if constexpr (kE4M3) {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(two));
    } else {
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(r) : "h"(two));
    }
    return r;
  }
  static __device__ __forceinline__ float to_float(u8 x) { return Fp16::to_float(static_cast<u16>(to_f16x2(x))); }
};
using E4M3 = Fp8<true>;   // 4 exponent bits, 3 mantissa bits: the precision format
using E5M2 = Fp8<false>;  // 5 exponent bits, 2 mantissa bits: the range format

template <Dtype> struct ElementOf;
template <> struct ElementOf<Dtype::fp16> { using type = Fp16; };
template <> struct ElementOf<Dtype::bf16> { using type = Bf16; };
template <> struct ElementOf<Dtype::fp32> { using type = Fp32; };
template <> struct ElementOf<Dtype::e4m3> { using type = E4M3; };
template <> struct ElementOf<Dtype::e5m2> { using type = E5M2; };
template <Dtype d> using Element = typename ElementOf<d>::type;

template <class E>
struct ElementBytes { enum : int { value = sizeof(typename E::Storage) }; };

// One element of a read-only array as float (a bias: any element type whatever the inputs are).
template <class E>
__device__ __forceinline__ float load_float(const void* p, i64 offset) {
  return E::to_float(__ldg(static_cast<const typename E::Storage*>(p) + offset));
}

}  // namespace omni
