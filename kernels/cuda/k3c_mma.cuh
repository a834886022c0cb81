// k3c_mma.cuh — the tensor-core primitives of the cuda kernels, one header for both builds (issue
// 44): warp-level mma.m16n8k16 bf16 -> f32 (row.col), ldmatrix x1/x2/x4 and .trans, cp.async of
// 16 bytes with commit_group / wait_group, and the MXFP4 dequant helpers (E2M1 x4/x8 -> BF16,
// E8M0 -> BF16). Under nvcc they are inline PTX (sm_80+; the build targets sm_90a). Under the
// emulation (kernels/cuda/emu, K3_CUDA_EMULATION) they are lane-exact C++ implementations of the
// PTX ISA's documented fragment maps, built on the emulator's warp rendezvous
// (k3emu::warp_exchange_op), with the checks a first device run would otherwise meet:
//   - every lane of the warp must reach the same instruction: a lane that has exited, or that
//     waits in another warp collective, fails the launch with a `k3emu:` line;
//   - an ldmatrix row address outside every shared-memory array of the block, or not 16-byte
//     aligned, fails the launch (`k3emu: ... ldmatrix ...`);
//   - a cp.async destination holds 0xff (NaN) from the copy's issue until the wait_group that
//     completes its group, so a missing or too-loose wait reads NaN;
//   - each warp-level mma is counted per kernel (k3emu_mma_count, cuda_runtime_api.h).
// Split activations (k3c_split_bf16, x2, x3): an fp32 operand as 2 or 3 bf16 terms, so a GEMM with
// bf16-exact weights keeps fp32 accuracy on the bf16 mma (one mma per term on the same B).
//
// Fragment maps (PTX ISA, "Warp-level matrix fragment mma.m16n8k16", section "Matrix Fragments
// for mma.m16n8k16 with floating point type"; groupID g = lane >> 2, threadID_in_group t =
// lane % 4; a 32-bit register holds two bf16, the lower-indexed element in its low half):
//   A [16 x 16] row, 4 regs:  a[j] = A[g + 8·(j & 1)][2t + 8·(j >> 1) + {0, 1}]
//   B [16 x 8]  col, 2 regs:  b[j] = B[2t + 8·j + {0, 1}][g]
//   C, D [16 x 8] f32, 4:     c[i] = C[g + 8·(i >> 1)][2t + (i & 1)]
// ldmatrix (PTX ISA, "Warp-level matrix load instruction: ldmatrix"): .xN loads N 8x8 matrices of
// b16; thread i supplies the row address of row i % 8 of matrix i / 8 (threads 0-7 for .x1, 0-15
// for .x2, all for .x4; each row 16 contiguous bytes, 16-byte aligned, in shared memory); lane l
// receives in r[j] the pair at row l / 4, columns 2·(l % 4) + {0, 1} of matrix j, or with .trans
// the pair at rows 2·(l % 4) + {0, 1}, column l / 4.
//
// Arithmetic of the emulated mma: the 16 products (exact in double) are summed in double, C is
// added and the result rounded to f32 once. The hardware's internal order and width are not
// documented, so equality with a device is claimed only where the sum is exact whatever the
// order (the layout oracle, tests/gpu/test_cuda_mma.cu); elsewhere compare with a tolerance.
#ifndef K3C_MMA_CUH
#define K3C_MMA_CUH

#include "cuda_math.cuh"

#include <stdint.h>

/* ---- MXFP4 dequant (both builds, host too) ---------------------------------------------------
 * E2M1 s.e1e0.m placed into a bf16 as sign -> bit 15, e1e0.m -> bits 8..6 (the exponent's two low
 * bits and the mantissa's top bit) is the value · 2^-126 (e > 0: 2^(e - 127)·(1 + m/2); e = 0: the
 * bf16 subnormal m·2^-127), so one multiply by 2^126 gives the E2M1 value exactly. */
K3C_FN uint32_t k3c_e2m1x2_bits(uint32_t q) { /* nibbles 0, 1 of q -> bf16x2 · 2^-126 */
    return ((q & 0x8u) << 12) | ((q & 0x7u) << 6) | ((q & 0x80u) << 24) | ((q & 0x70u) << 18);
}
/* bf16x2 · 2^126 (exact: a power of two on values that cannot overflow) */
K3C_FN uint32_t k3c_bf16x2_mul_2p126(uint32_t v) {
#ifdef __CUDA_ARCH__
    uint32_t d;
    /* fma with -0 addend: a·b + (-0) = a·b, signed zeros included (sm_80+) */
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x7e807e80u), "r"(0x80008000u));
    return d;
#else
    const float lo = k3_mxfp4_bits_to_f32(v << 16) * 0x1p126f;
    const float hi = k3_mxfp4_bits_to_f32(v & 0xffff0000u) * 0x1p126f;
    uint32_t ul, uh;
    memcpy(&ul, &lo, 4);
    memcpy(&uh, &hi, 4);
    return (ul >> 16) | (uh & 0xffff0000u);
#endif
}
/* f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN) */
K3C_FN uint16_t k3c_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* ---- split activations (bf16 terms of an fp32 value) ----------------------------------------
 * x = x1 + x2 + x3 + r with x1 = bf16(x), x2 = bf16(x - x1), x3 = bf16(x - x1 - x2) (each rounded
 * to nearest even; each difference is exact in fp32: a multiple of x's ulp, at most 2^-8·|x|).
 * |r| <= 2^-8n·|x| after n terms (n = 1: 2^-8, bf16's unit roundoff; 2: 2^-16; 3: 2^-24, and an x
 * with |x| >= 2^-110 is exactly x1 + x2 + x3: 24 bits in three 8-bit significands and the signs
 * of the roundings; below, bf16's subnormal floor leaves at most 2^-134 a term).
 * With bf16-exact weights (MXFP4) each product w·x_i is exact in an mma, so W·x = Σ_i W·x_i with
 * fp32 accumulation keeps fp32 activations on bf16 tensor cores (docs/DESIGN.md §3b). A finite x
 * above bf16's largest finite value would round x1 to ±inf; x1 is then truncated (toward zero),
 * so the terms stay finite. Generic: any bf16-exact operand (MoE experts, dense bf16 GEMMs). */
#define K3C_SPLIT_MAX 3                   /* terms of k3c_split_bf16 */
K3C_FN float k3c_bf16_value(uint16_t h) { /* bf16 bits -> f32 (exact) */
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* the first term: bf16(x), or bf16 toward zero where rounding would overflow a finite x */
K3C_FN uint16_t k3c_split_head(float x) {
    const uint16_t h = k3c_bf16_rne(x);
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((h & 0x7fffu) == 0x7f80u && (u & 0x7f800000u) != 0x7f800000u) return (uint16_t)(u >> 16);
    return h;
}
/* n (1 .. K3C_SPLIT_MAX) bf16 terms of x into out[0 .. n-1], largest first */
K3C_FN void k3c_split_bf16(float x, int n, uint16_t *out) {
    float r = x;
#pragma unroll /* constant indices: out stays in registers when inlined */
    for (int i = 0; i < K3C_SPLIT_MAX; i++) {
        if (i >= n) break;
        out[i] = i ? k3c_bf16_rne(r) : k3c_split_head(r);
        r -= k3c_bf16_value(out[i]);
    }
}
K3C_FN void k3c_split_bf16x2(float x, uint16_t out[2]) {
    k3c_split_bf16(x, 2, out);
}
K3C_FN void k3c_split_bf16x3(float x, uint16_t out[3]) {
    k3c_split_bf16(x, 3, out);
}
/* bf16x2 · bf16x2, each half rounded to nearest even */
K3C_FN uint32_t k3c_bf16x2_mul(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
#else
    const float lo = k3_mxfp4_bits_to_f32(a << 16) * k3_mxfp4_bits_to_f32(b << 16);
    const float hi = k3_mxfp4_bits_to_f32(a & 0xffff0000u) * k3_mxfp4_bits_to_f32(b & 0xffff0000u);
    return (uint32_t)k3c_bf16_rne(lo) | (uint32_t)k3c_bf16_rne(hi) << 16;
#endif
}
/* 4 E2M1 codes (nibble i of q = element i, the checkpoint's byte order) -> out[2] bf16x2: out[j]
 * low half = element 2j, high half = element 2j + 1 */
K3C_FN void k3c_e2m1x4_to_bf16(uint32_t q, uint32_t out[2]) {
    out[0] = k3c_bf16x2_mul_2p126(k3c_e2m1x2_bits(q));
    out[1] = k3c_bf16x2_mul_2p126(k3c_e2m1x2_bits(q >> 8));
}
/* 8 E2M1 codes -> out[4] bf16x2, the same order */
K3C_FN void k3c_e2m1x8_to_bf16(uint32_t q, uint32_t out[4]) {
    k3c_e2m1x4_to_bf16(q, out);
    k3c_e2m1x4_to_bf16(q >> 16, out + 2);
}
/* E8M0 -> bf16 bits: 2^(e - 127) is the exponent field e (a shift); e = 0 is the bf16 subnormal
 * 2^-127 and e = 255 +inf, as k3_e8m0_to_f32 (k3_mxfp4.h) decodes them */
K3C_FN uint16_t k3c_e8m0_to_bf16(uint8_t e) {
    return e ? (uint16_t)((unsigned)e << 7) : (uint16_t)0x0040u;
}

#ifndef K3_CUDA_EMULATION
/* ---- nvcc: inline PTX -------------------------------------------------------------------- */
static __device__ __forceinline__ unsigned k3c_smem_addr(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
/* d = A·B + c for one warp (fragments as above); d may alias c */
static __device__ __forceinline__ void k3c_mma_bf16_16816(float d[4], const uint32_t a[4],
                                                          const uint32_t b[2], const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
                   "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
static __device__ __forceinline__ void k3c_ldmatrix_x1(uint32_t r[1], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0])
                 : "r"(k3c_smem_addr(row))
                 : "memory");
}
static __device__ __forceinline__ void k3c_ldmatrix_x2(uint32_t r[2], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(k3c_smem_addr(row))
                 : "memory");
}
static __device__ __forceinline__ void k3c_ldmatrix_x4(uint32_t r[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(k3c_smem_addr(row))
                 : "memory");
}
static __device__ __forceinline__ void k3c_ldmatrix_x1_trans(uint32_t r[1], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0])
                 : "r"(k3c_smem_addr(row))
                 : "memory");
}
static __device__ __forceinline__ void k3c_ldmatrix_x2_trans(uint32_t r[2], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(k3c_smem_addr(row))
                 : "memory");
}
static __device__ __forceinline__ void k3c_ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(k3c_smem_addr(row))
                 : "memory");
}
/* 16 bytes global -> shared, bypassing L1 (.cg); completes at the wait_group of its group */
static __device__ __forceinline__ void k3c_cp_async16(void *smem_dst, const void *gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(k3c_smem_addr(smem_dst)),
                 "l"(gmem_src)
                 : "memory");
}
static __device__ __forceinline__ void k3c_cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
/* wait until at most N committed groups are pending */
template <int N> static __device__ __forceinline__ void k3c_cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#else
/* ---- the emulation: the PTX maps in C++ on the warp rendezvous ------------------------------ */
static const char k3c_op_mma[] = "mma.m16n8k16";

static inline void k3c_mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2],
                                      const float c[4]) {
    k3emu::mma_frag mine;
    for (int j = 0; j < 4; j++) mine.a[j] = a[j], mine.c[j] = c[j];
    mine.b[0] = b[0], mine.b[1] = b[1];
    /* round 1: every lane's fragment address; lane 0 then computes the warp's 16x8 product once
     * (k3emu::mma_m16n8k16_bf16: the PTX maps, lane by lane) into every lane's d; round 2 keeps
     * each lane's frame alive until lane 0 has written it */
    const uint64_t *p =
        k3emu::warp_exchange_op(0xffffffffu, (uint64_t)(uintptr_t)&mine, k3c_op_mma);
    if (k3emu::lane_id() == 0) {
        k3emu::count_mma();
        k3emu::mma_m16n8k16_bf16(p);
    }
    (void)k3emu::warp_exchange_op(0xffffffffu, 0, k3c_op_mma);
    for (int i = 0; i < 4; i++) d[i] = mine.d[i];
}

/* ldmatrix .x<N> (.trans when T) */
template <int N, bool T> static inline void k3c_ldmatrix_emu(uint32_t *r, const void *row) {
    static const char *const ops[2][3] = {
        {"ldmatrix.x1", "ldmatrix.x2", "ldmatrix.x4"},
        {"ldmatrix.x1.trans", "ldmatrix.x2.trans", "ldmatrix.x4.trans"}};
    const char *op = ops[T][N == 1 ? 0 : N == 2 ? 1 : 2];
    const uint64_t *p = k3emu::warp_exchange_op(0xffffffffu, (uint64_t)(uintptr_t)row, op);
    const unsigned lane = k3emu::lane_id();
    /* each lane checks the row addresses it reads (every supplied one is read by some lane; the
     * first failure is reported) */
    for (unsigned i = 0; i < 8u * N; i++) {
        if (T ? i % 8 / 2 != lane % 4 : i % 8 != lane / 4) continue;
        const void *a = (const void *)(uintptr_t)p[i];
        if ((uintptr_t)a & 15u) {
            k3emu::device_error("%s: row address %p of lane %u (matrix %u, row %u) is not "
                                "16-byte aligned",
                                op, a, i, i / 8, i % 8);
            for (int j = 0; j < N; j++) r[j] = 0;
            return;
        }
        if (!k3emu::in_shared(a, 16)) {
            k3emu::device_error("%s: row address %p of lane %u (matrix %u, row %u) is outside "
                                "every shared-memory array of the block",
                                op, a, i, i / 8, i % 8);
            for (int j = 0; j < N; j++) r[j] = 0;
            return;
        }
    }
    for (unsigned j = 0; j < (unsigned)N; j++) {
        const unsigned char *m = nullptr;
        if (!T) {
            m = (const unsigned char *)(uintptr_t)p[8 * j + lane / 4];
            memcpy(&r[j], m + 4 * (lane % 4), 4);
        } else {
            uint16_t lo, hi;
            memcpy(&lo,
                   (const unsigned char *)(uintptr_t)p[8 * j + 2 * (lane % 4)] + 2 * (lane / 4), 2);
            memcpy(&hi,
                   (const unsigned char *)(uintptr_t)p[8 * j + 2 * (lane % 4) + 1] + 2 * (lane / 4),
                   2);
            r[j] = (uint32_t)lo | (uint32_t)hi << 16;
        }
    }
}
static inline void k3c_ldmatrix_x1(uint32_t r[1], const void *row) {
    k3c_ldmatrix_emu<1, false>(r, row);
}
static inline void k3c_ldmatrix_x2(uint32_t r[2], const void *row) {
    k3c_ldmatrix_emu<2, false>(r, row);
}
static inline void k3c_ldmatrix_x4(uint32_t r[4], const void *row) {
    k3c_ldmatrix_emu<4, false>(r, row);
}
static inline void k3c_ldmatrix_x1_trans(uint32_t r[1], const void *row) {
    k3c_ldmatrix_emu<1, true>(r, row);
}
static inline void k3c_ldmatrix_x2_trans(uint32_t r[2], const void *row) {
    k3c_ldmatrix_emu<2, true>(r, row);
}
static inline void k3c_ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    k3c_ldmatrix_emu<4, true>(r, row);
}
static inline void k3c_cp_async16(void *smem_dst, const void *gmem_src) {
    k3emu::cp_async16(smem_dst, gmem_src);
}
static inline void k3c_cp_async_commit(void) {
    k3emu::cp_commit();
}
template <int N> static inline void k3c_cp_async_wait(void) {
    k3emu::cp_wait((unsigned)N);
}
#endif

#endif /* K3C_MMA_CUH */
