// Run-time CPU feature detection for kernels compiled with per-function target attributes.
#pragma once

// Target attributes only mean something on x86; elsewhere the portable code is all there is.
#if defined(__x86_64__) && defined(__GNUC__)
#define SPECINFER_TARGET(isa) __attribute__((target(isa)))
#else
#define SPECINFER_TARGET(isa)
#endif

#define SPECINFER_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define SPECINFER_AVX2 "avx2,fma,f16c"

namespace specinfer::cpu {

inline bool has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
#else
  return false;
#endif
}

inline bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

inline bool has_avx2_fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

}  // namespace specinfer::cpu
