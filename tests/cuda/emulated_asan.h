// PTDP_EMU_ASAN: the emulated CUDA (tests/cuda/emulated_cuda.h, emulated_cuda_runtime.cc) is
// built under AddressSanitizer (scripts/emulated-asan.sh; docs/gpu.md, "Tests"), with its interface
// declared.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define PTDP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PTDP_EMU_ASAN 1
#endif
#endif
#ifdef PTDP_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
