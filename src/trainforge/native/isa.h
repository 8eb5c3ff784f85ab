// Instruction-path choice shared by the kernel files: the best the CPU has, or the one
// TRAINFORGE_CPU_ISA names (read per call so a test can switch paths inside one process).
#pragma once
#include <c10/util/Exception.h>
#include <cstdlib>
#include <string>

// Per-function instruction sets: one .so carries every path, chosen at run time.
#define T2 __attribute__((target("avx2,fma,f16c")))
#define T512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace trainforge_cpu {

inline bool supports(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "scalar") return true;
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return false;
}

inline std::string chosen_isa() {
  const char* env = std::getenv("TRAINFORGE_CPU_ISA");
  if (env != nullptr && env[0] != '\0') {
    std::string want(env);
    TORCH_CHECK(want == "avx2" || want == "avx512" || want == "scalar",
                "TRAINFORGE_CPU_ISA must be avx2, avx512 or scalar, got '", want, "'");
    TORCH_CHECK(supports(want), "TRAINFORGE_CPU_ISA=", want, " but this CPU lacks it");
    return want;
  }
  if (supports("avx512")) return "avx512";
  if (supports("avx2")) return "avx2";
  return "scalar";
}

// Whether the fp32 GEMV's M = 1 loops prefetch their own weight stream ahead (blocks.cpp, "fp32
// GEMV"): TRAINFORGE_CPU_PREFETCH=1 / 0 forces it (read per call, for tests and A/B runs); by
// default on Intel CPUs only. Decode of the 90m f32 file at one thread, paired runs: x1.10 with it
// on a Xeon (Emerald Rapids), x1.11-1.34 without it on Zen 4 (x1.16-1.42 on its AVX2 path).
inline bool stream_prefetch() {
  const char* env = std::getenv("TRAINFORGE_CPU_PREFETCH");
  if (env != nullptr && env[0] != '\0') {
    std::string want(env);
    TORCH_CHECK(want == "0" || want == "1", "TRAINFORGE_CPU_PREFETCH must be 0 or 1, got '", want, "'");
    return want == "1";
  }
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
}

}  // namespace trainforge_cpu
