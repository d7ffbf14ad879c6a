// Fixed-width integer types for NVRTC (which ships no libc headers) and for host compilers.
#pragma once
#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
typedef unsigned long long size_t_;
#else
#include <stdint.h>
#endif

// The gate's calibrated slowdown (MB_INJECT_SCOPE(), empty unless MB_INJECT_PPM is defined).
#include "mb/inject.cuh"
