/* cuda_runtime.h — k3's CUDA emulation (K3_CUDA_EMULATE builds only): the runtime API
 * (cuda_runtime_api.h) and, in C++, the device side that the kernels of kernels/cuda compile
 * against on the host (k3emu_device.h: the built-in variables, barriers, warp primitives,
 * atomics, vector types, K3C_SHARED / K3C_DYN_SHARED and K3C_LAUNCH). */
#ifndef K3_EMU_CUDA_RUNTIME_H
#define K3_EMU_CUDA_RUNTIME_H

#include "cuda_runtime_api.h"

#ifdef __cplusplus
#include "k3emu_device.h"
#endif

#endif /* K3_EMU_CUDA_RUNTIME_H */
