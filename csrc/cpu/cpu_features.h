// Run-time CPU feature detection for kernels compiled with per-function target attributes.
#pragma once

#include <cstdlib>
#include <cstring>

// x86 with GCC or Clang: where the intrinsics kernels and their target attributes exist.
#if defined(__x86_64__) && defined(__GNUC__)
#define SPECINFER_HAVE_X86 1
#endif

#ifdef SPECINFER_HAVE_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Target attributes only mean something on x86; elsewhere the portable code is all there is.
#ifdef SPECINFER_HAVE_X86
#define SPECINFER_TARGET(isa) __attribute__((target(isa)))
#else
#define SPECINFER_TARGET(isa)
#endif

#define SPECINFER_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define SPECINFER_AVX2 "avx2,fma,f16c"
// Elementwise kernels: GCC vectorises AVX-512 targets 256 bits wide unless told otherwise.
#define SPECINFER_AVX512_WIDE SPECINFER_AVX512 ",prefer-vector-width=512"

namespace specinfer::cpu {

// SPECINFER_CPU_ISA caps the kernels chosen below what the CPU has, so that every kernel family
// can be tested and measured on one machine: "avx512" (no AMX), "avx2" (no AVX-512), "portable"
// (no intrinsics); unset or "native", the best the CPU has. Read once; specinfer.ops rejects
// other values.
inline int isa_cap() {
  static const int cap = [] {
    const char* value = std::getenv("SPECINFER_CPU_ISA");
    if (value != nullptr && std::strcmp(value, "portable") == 0) return 0;
    if (value != nullptr && std::strcmp(value, "avx2") == 0) return 1;
    if (value != nullptr && std::strcmp(value, "avx512") == 0) return 2;
    return 3;
  }();
  return cap;
}

inline bool has_avx512() {
#ifdef SPECINFER_HAVE_X86
  static const bool yes = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
#else
  return false;
#endif
}

inline bool has_avx512_vnni() {
#ifdef SPECINFER_HAVE_X86
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;
#endif
}

inline bool has_avx512_bf16() {
#ifdef SPECINFER_HAVE_X86
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

// AMX tiles with bf16 dot products (CPUID leaf 7: EDX bits 22 and 24; every such CPU also has
// AVX512-BF16, which the amx_bf16 family runs for its other kernels), which Linux lets a process
// use only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18).
inline bool has_amx_bf16() {
#ifdef SPECINFER_HAVE_X86
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (isa_cap() < 3 || !has_avx512_bf16() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
      return false;
    }
    const bool cpu = (edx >> 22 & 1u) && (edx >> 24 & 1u);
    return cpu && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  }();
  return yes;
#else
  return false;
#endif
}

inline bool has_avx2_fma() {
#ifdef SPECINFER_HAVE_X86
  static const bool yes =
      isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

// The kernel family the CPU ops run: "amx_bf16" (AVX512-BF16 kernels, bf16 linears on AMX),
// "avx512_bf16", "avx512", "avx2" or "portable".
inline const char* active_isa() {
  if (has_amx_bf16()) return "amx_bf16";
  if (has_avx512_bf16()) return "avx512_bf16";
  if (has_avx512()) return "avx512";
  if (has_avx2_fma()) return "avx2";
  return "portable";
}

}  // namespace specinfer::cpu
