// test_cuda_mma.cu — the layout oracle of the tensor-core primitives (issue 44; kernels/cuda/
// k3c_mma.cuh). One warp copies a 16x16 A tile and a 16x8 B tile to shared memory with cp.async,
// loads the mma fragments with every ldmatrix form (x1, x2, x4, each plain and .trans, in four
// modes) and runs one mma.m16n8k16; D is checked bit for bit against a plain C product. The
// inputs make every product exact in f32 whatever the summation order: small integers, and
// permutation matrices against arbitrary finite bf16 values (each output is one input value plus
// exact zeros), so the same test proves on a device (label gpu, scripts/device-check.sh runs it
// first) that the emulated fragment maps equal the hardware's. Also: the MXFP4 dequant helpers
// against k3_mxfp4.h on all codes and scales (host). Emulation only (label gpuemu): the mma count
// per kernel, and each emulator check seen failing on an injected bug — a lane missing from an
// mma (exited, or in another collective), an ldmatrix row address misaligned or outside shared
// memory (a `k3emu:` line and cudaErrorLaunchFailure), and a missing cp.async wait (NaN in D).
#define _Noreturn [[noreturn]] /* k3_base.h / k3_kernels.h are C11 headers */
#define _Static_assert static_assert
extern "C" {
#include "k3_kernels.h"
}
#include "cuda_launch.h"
#include "k3c_mma.cuh"
#include "k3c_repack.h"
#include "tolerances.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <unistd.h>

#ifdef K3_CUDA_EMULATION
static const bool k_emu = true;
#else
static const bool k_emu = false;
#endif

static int g_pass, g_fail;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            g_pass++;                                                                              \
        } else {                                                                                   \
            g_fail++;                                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

static uint64_t g_rng = 20261206;
static uint32_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12, g_rng ^= g_rng << 25, g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 2685821657736338717ull) >> 32);
}
static uint16_t bf16_of(float f) { /* exact values only (the tests' inputs) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static float f_of_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* modes: which ldmatrix forms load A and B
 *   0: A x4 from A [16][16],           B x2 from Bn [8 n][16 k]
 *   1: A 4 × x1 from A,                B x2.trans from Bk [16 k][8 n]
 *   2: A x4.trans from At [16 k][16 m], B 2 × x1 from Bn
 *   3: A 2 × x2 from A,                B 2 × x1.trans from Bk
 * flags: 4 = skip the cp.async wait (injected bug), 8 = misalign A's row addresses by 2 bytes,
 * 16 = give ldmatrix a global address, 32 = lane 31 exits before the mma, 64 = lane 31 does a
 * shuffle where the others do the mma. */
enum { F_NOWAIT = 4, F_MISALIGN = 8, F_GLOBAL = 16, F_EXIT = 32, F_SHFL = 64 };

/* a: A, or At in mode 2 (256 bf16); b: Bn, or Bk in modes 1 and 3 (128 bf16); c, d [16][8] */
static __global__ void oracle_kernel(const uint16_t *a, const uint16_t *b, const float *c, float *d,
                                     int mode) {
    K3C_SHARED(uint16_t, sa, [256]);
    K3C_SHARED(uint16_t, sb, [128]);
    const unsigned lane = threadIdx.x, g = lane >> 2, t = lane & 3u;
    k3c_cp_async16(sa + 8 * lane, a + 8 * lane); /* 32 chunks of 16 B */
    if (lane < 16) k3c_cp_async16(sb + 8 * lane, b + 8 * lane);
    k3c_cp_async_commit();
    if (!(mode & F_NOWAIT)) k3c_cp_async_wait<0>();
    __syncthreads();
    uint32_t af[4], bf[2];
    const unsigned m = lane / 8, r = lane % 8;
    const uint16_t *arow =
        sa + (m & 1u) * 8 * 16 + r * 16 + (m >> 1) * 8; /* A[r + 8(m&1)][8(m>>1)] */
    if (mode & F_MISALIGN) arow += 1;
    if (mode & F_GLOBAL) arow = a + 16 * r;
    switch (mode & 3) {
    case 0:
        k3c_ldmatrix_x4(af, arow);
        k3c_ldmatrix_x2(bf, sb + (lane % 8) * 16 + (lane / 8 % 2) * 8);
        break;
    case 1:
        for (unsigned j = 0; j < 4; j++)
            k3c_ldmatrix_x1(af + j, sa + (j & 1u) * 8 * 16 + r * 16 + (j >> 1) * 8);
        k3c_ldmatrix_x2_trans(bf, sb + (lane % 16) * 8);
        break;
    case 2: /* matrix m of At: rows k0 + r, columns m0.. with m0 = 8(m&1), k0 = 8(m>>1) */
        k3c_ldmatrix_x4_trans(af, sa + ((m >> 1) * 8 + r) * 16 + (m & 1u) * 8);
        for (unsigned j = 0; j < 2; j++) k3c_ldmatrix_x1(bf + j, sb + r * 16 + j * 8);
        break;
    default:
        for (unsigned h = 0; h < 2; h++) /* h = 0: regs 0, 1 (columns 0-7); h = 1: columns 8-15 */
            k3c_ldmatrix_x2(af + 2 * h, sa + (lane / 8 % 2) * 8 * 16 + r * 16 + h * 8);
        for (unsigned j = 0; j < 2; j++) k3c_ldmatrix_x1_trans(bf + j, sb + (j * 8 + r) * 8);
        break;
    }
    float cf[4], df[4];
    for (int i = 0; i < 4; i++) cf[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    if ((mode & F_EXIT) && lane == 31) return;
    if ((mode & F_SHFL) && lane == 31) {
        df[0] = __shfl_sync(0xffffffffu, cf[0], 0);
        return;
    }
    k3c_mma_bf16_16816(df, af, bf, cf);
    for (int i = 0; i < 4; i++) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = df[i];
}

struct dev {
    uint16_t *a = nullptr, *b = nullptr;
    float *c = nullptr, *d = nullptr;
    dev() {
        bool ok = cudaMalloc((void **)&a, 512) == cudaSuccess &&
                  cudaMalloc((void **)&b, 256) == cudaSuccess &&
                  cudaMalloc((void **)&c, 512) == cudaSuccess &&
                  cudaMalloc((void **)&d, 512) == cudaSuccess;
        CHECK(ok, "cudaMalloc");
    }
    ~dev() {
        cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(d);
    }
};

/* runs the oracle on A [16][16], B [16][8], C [16][8] (row-major); D out; returns the error */
static cudaError_t run_oracle(dev &m, const uint16_t *A, const uint16_t *B, const float *C,
                              float *D, int mode) {
    uint16_t ha[256], hb[128];
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 16; k++) ha[(mode & 3) == 2 ? k * 16 + i : i * 16 + k] = A[i * 16 + k];
    const bool bk = (mode & 3) == 1 || (mode & 3) == 3;
    for (int k = 0; k < 16; k++)
        for (int n = 0; n < 8; n++) hb[bk ? k * 8 + n : n * 16 + k] = B[k * 8 + n];
    cudaMemcpy(m.a, ha, sizeof ha, cudaMemcpyHostToDevice);
    cudaMemcpy(m.b, hb, sizeof hb, cudaMemcpyHostToDevice);
    cudaMemcpy(m.c, C, 512, cudaMemcpyHostToDevice);
    cudaMemset(m.d, 0, 512);
    K3C_LAUNCH(1, 32, 0, 0, oracle_kernel)(m.a, m.b, m.c, m.d, mode);
    cudaError_t e = cudaDeviceSynchronize();
    cudaError_t e2 = cudaGetLastError();
    if (e == cudaSuccess) e = e2;
    cudaMemcpy(D, m.d, 512, cudaMemcpyDeviceToHost);
    return e;
}

/* the plain C reference (exact for the oracle's inputs) */
static void reference(const uint16_t *A, const uint16_t *B, const float *C, float *D) {
    for (int i = 0; i < 16; i++)
        for (int n = 0; n < 8; n++) {
            double s = C[i * 8 + n];
            for (int k = 0; k < 16; k++)
                s += (double)f_of_bf16(A[i * 16 + k]) * f_of_bf16(B[k * 8 + n]);
            D[i * 8 + n] = (float)s;
        }
}

/* a finite, nonzero bf16 of moderate exponent (so a product with 1 and sums with zeros are exact)
 */
static uint16_t any_bf16(void) {
    const uint32_t r = rnd();
    return (uint16_t)((r & 0x8000u) | ((112u + (r >> 16) % 32u) << 7) | (r & 0x7fu));
}

static int mismatches(const float *D, const float *want) {
    int n = 0;
    for (int i = 0; i < 128; i++) n += memcmp(&D[i], &want[i], 4) != 0;
    return n;
}

static void test_oracle(dev &m) {
    uint16_t A[256], B[128];
    float C[128], D[128], want[128];
    for (int mode = 0; mode < 4; mode++)
        for (int kind = 0; kind < 3; kind++) {
            /* kind 0: small integers; 1: A a permutation, B arbitrary; 2: A arbitrary, B a
             * (partial) permutation; C small integers / zero */
            int perm[16];
            for (int i = 0; i < 16; i++) perm[i] = i;
            for (int i = 15; i > 0; i--) {
                const int j = (int)(rnd() % (unsigned)(i + 1)), x = perm[i];
                perm[i] = perm[j], perm[j] = x;
            }
            for (int i = 0; i < 16; i++)
                for (int k = 0; k < 16; k++)
                    A[i * 16 + k] = kind == 0   ? bf16_of((float)((int)(rnd() % 7) - 3))
                                    : kind == 1 ? bf16_of(perm[i] == k ? 1.0f : 0.0f)
                                                : any_bf16();
            for (int k = 0; k < 16; k++)
                for (int n = 0; n < 8; n++)
                    B[k * 8 + n] = kind == 0   ? bf16_of((float)((int)(rnd() % 7) - 3))
                                   : kind == 1 ? any_bf16()
                                               : bf16_of(perm[n] == k ? 1.0f : 0.0f);
            for (int i = 0; i < 128; i++) C[i] = kind == 0 ? (float)((int)(rnd() % 9) - 4) : 0.0f;
            reference(A, B, C, want);
            const cudaError_t e = run_oracle(m, A, B, C, D, mode);
            CHECK(e == cudaSuccess, "mode %d kind %d: %s", mode, kind, cudaGetErrorName(e));
            const int bad = mismatches(D, want);
            CHECK(bad == 0, "mode %d kind %d: %d of 128 outputs differ from the C reference", mode,
                  kind, bad);
        }
}

/* the dequant helpers against k3_mxfp4.h on every code pair and scale (host) */
static void test_dequant(void) {
    int bad = 0;
    for (uint32_t q = 0; q < 65536; q++) {
        uint32_t out[2];
        k3c_e2m1x4_to_bf16(q, out);
        for (int i = 0; i < 4; i++) {
            const float got = f_of_bf16((uint16_t)(out[i / 2] >> (16 * (i & 1))));
            const float want = k3_mxfp4_e2m1((q >> (4 * i)) & 15u);
            bad += memcmp(&got, &want, 4) != 0;
        }
    }
    CHECK(bad == 0, "E2M1x4 -> bf16: %d of 262144 elements differ from k3_mxfp4_e2m1", bad);
    bad = 0;
    for (int rep = 0; rep < 4096; rep++) {
        const uint32_t q = rnd();
        uint32_t out[4];
        k3c_e2m1x8_to_bf16(q, out);
        for (int i = 0; i < 8; i++) {
            const float got = f_of_bf16((uint16_t)(out[i / 2] >> (16 * (i & 1))));
            const float want = k3_mxfp4_e2m1((q >> (4 * i)) & 15u);
            bad += memcmp(&got, &want, 4) != 0;
        }
    }
    CHECK(bad == 0, "E2M1x8 -> bf16: %d elements differ", bad);
    bad = 0;
    for (int e = 0; e < 256; e++) {
        const float got = f_of_bf16(k3c_e8m0_to_bf16((uint8_t)e)),
                    want = k3_e8m0_to_f32((uint8_t)e);
        bad += memcmp(&got, &want, 4) != 0;
    }
    CHECK(bad == 0, "E8M0 -> bf16: %d of 256 scales differ from k3_e8m0_to_f32", bad);
}

/* the dequant helpers on the device (inline PTX under nvcc) against the host path: out[4i..] =
 * k3c_e2m1x8_to_bf16(q[i]), e8[i] = k3c_e8m0_to_bf16(i) for i < 256 */
static __global__ void dequant_kernel(const uint32_t *q, int n, uint32_t *out, uint16_t *e8) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) k3c_e2m1x8_to_bf16(q[i], out + 4 * i);
    if (i < 256) e8[i] = k3c_e8m0_to_bf16((uint8_t)i);
}

static void test_dequant_device(void) {
    enum { N = 1024 };
    static uint32_t hq[N], hout[4 * N], want[4 * N];
    uint16_t he8[256];
    for (int i = 0; i < N; i++) hq[i] = i < 256 ? (uint32_t)i * 0x01010101u : rnd();
    for (int i = 0; i < N; i++) k3c_e2m1x8_to_bf16(hq[i], want + 4 * i);
    uint32_t *q = nullptr, *out = nullptr;
    uint16_t *e8 = nullptr;
    bool ok = cudaMalloc((void **)&q, sizeof hq) == cudaSuccess &&
              cudaMalloc((void **)&out, sizeof hout) == cudaSuccess &&
              cudaMalloc((void **)&e8, sizeof he8) == cudaSuccess;
    CHECK(ok, "cudaMalloc");
    if (ok) {
        cudaMemcpy(q, hq, sizeof hq, cudaMemcpyHostToDevice);
        K3C_LAUNCH(N / 128, 128, 0, 0, dequant_kernel)(q, N, out, e8);
        const cudaError_t e = cudaDeviceSynchronize();
        CHECK(e == cudaSuccess && cudaGetLastError() == cudaSuccess, "dequant_kernel: %s",
              cudaGetErrorName(e));
        cudaMemcpy(hout, out, sizeof hout, cudaMemcpyDeviceToHost);
        cudaMemcpy(he8, e8, sizeof he8, cudaMemcpyDeviceToHost);
        int bad = 0;
        for (int i = 0; i < 4 * N; i++) bad += hout[i] != want[i];
        CHECK(bad == 0, "E2M1x8 -> bf16 on the device: %d of %d words differ from the host", bad,
              4 * N);
        bad = 0;
        for (int i = 0; i < 256; i++) bad += he8[i] != k3c_e8m0_to_bf16((uint8_t)i);
        CHECK(bad == 0, "E8M0 -> bf16 on the device: %d of 256 differ", bad);
    }
    cudaFree(q), cudaFree(out), cudaFree(e8);
}

/* the repack into fragment order (k3c_repack.h): lossless (unpack restores every byte) and the
 * fragments decode (k3c_e2m1x8_to_bf16 · E8M0) to the checkpoint's values bit for bit */
static void test_repack(void) {
    enum { N = 40, K = 320, KT = K / 32 };
    static uint8_t packed[N * K / 2], scale[N * KT], packed2[N * K / 2], scale2[N * KT];
    static uint32_t words[N / 8 * KT * 32];
    static uint8_t scales[N / 8 * KT * 8];
    for (size_t i = 0; i < sizeof packed; i++) packed[i] = (uint8_t)rnd();
    for (size_t i = 0; i < sizeof scale; i++) scale[i] = (uint8_t)(i < 256 ? i : rnd() % 40 + 107);
    CHECK(k3c_mxfp4_frag_words(N, K) == (int64_t)(sizeof words / 4) &&
              k3c_mxfp4_frag_scales(N, K) == (int64_t)sizeof scales,
          "fragment sizes");
    k3c_mxfp4_repack(packed, scale, N, K, words, scales);
    memset(packed2, 0, sizeof packed2);
    memset(scale2, 0, sizeof scale2);
    k3c_mxfp4_unpack(words, scales, N, K, packed2, scale2);
    CHECK(!memcmp(packed, packed2, sizeof packed) && !memcmp(scale, scale2, sizeof scale),
          "repack then unpack is not the identity");
    int bad = 0, seen = 0;
    static uint8_t hit[N][K];
    memset(hit, 0, sizeof hit);
    for (int nt = 0; nt < N / 8; nt++)
        for (int kt = 0; kt < KT; kt++)
            for (unsigned l = 0; l < 32; l++) {
                uint32_t b[4];
                k3c_e2m1x8_to_bf16(words[(nt * KT + kt) * 32 + l], b);
                const float sc = f_of_bf16(k3c_e8m0_to_bf16(scales[(nt * KT + kt) * 8 + (l >> 2)]));
                for (unsigned p = 0; p < 8; p++) {
                    int64_t n, k;
                    k3c_mxfp4_frag_pos(nt, kt, l, p, &n, &k);
                    hit[n][k]++;
                    const float got = f_of_bf16((uint16_t)(b[p / 2] >> (16 * (p & 1)))) * sc;
                    const float want = k3_mxfp4_get(packed + n * (K / 2), scale + n * KT, k);
                    bad += memcmp(&got, &want, 4) != 0 && !(isnan(got) && isnan(want));
                    seen++;
                }
            }
    int once = 0;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) once += hit[n][k] == 1;
    CHECK(once == N * K, "fragment positions: %d of %d weights covered exactly once", once, N * K);
    CHECK(bad == 0, "fragment decode: %d of %d weights differ from k3_mxfp4_get", bad, seen);
}

/* k3c_split_bf16 (k3c_mma.cuh) on the host: for n = 1, 2, 3 terms the residual |x − Σ x_i| is
 * within 2^-8n·|x| + 2^-134 (K3_TOL_SPLIT_ACT_REL; bf16's subnormal floor), 3 terms are exact for
 * |x| >= 2^-110, and a finite x above bf16's range keeps finite terms */
static void test_split(void) {
    int bad[4] = {0, 0, 0, 0}, inexact3 = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)rnd() << 16 ^ (uint32_t)rnd();
        u = (u & 0x807fffffu) | (uint32_t)(1 + rnd() % 253) << 23; /* normal, any sign */
        float x;
        memcpy(&x, &u, 4);
        for (int n = 1; n <= K3C_SPLIT_MAX; n++) {
            uint16_t h[K3C_SPLIT_MAX];
            k3c_split_bf16(x, n, h);
            double sum = 0;
            for (int k = 0; k < n; k++) sum += (double)k3c_bf16_value(h[k]);
            const double r = fabs((double)x - sum);
            if (!(r <= K3_TOL_SPLIT_ACT_REL(n) * fabs((double)x) + 0x1p-134)) bad[n]++;
            if (n == 3 && r != 0 && fabs((double)x) >= 0x1p-110) inexact3++;
        }
    }
    for (int n = 1; n <= K3C_SPLIT_MAX; n++)
        CHECK(bad[n] == 0, "k3c_split_bf16, %d term(s): %d residuals above 2^-%d |x|", n, bad[n],
              8 * n);
    CHECK(inexact3 == 0, "k3c_split_bf16: 3 terms inexact on %d floats of |x| >= 2^-110", inexact3);
    uint16_t h2[2], h3[3];
    k3c_split_bf16x2(1.0f + 0x1p-12f, h2);
    CHECK(h2[0] == 0x3f80u && k3c_bf16_value(h2[1]) == 0x1p-12f, "split x2 of 1 + 2^-12");
    const float big = 3.4e38f; /* above bf16's largest finite 3.3895e38: bf16 would round to inf */
    k3c_split_bf16x3(big, h3);
    const double s3 = (double)k3c_bf16_value(h3[0]) + k3c_bf16_value(h3[1]) + k3c_bf16_value(h3[2]);
    CHECK(isfinite(k3c_bf16_value(h3[0])) && s3 == (double)big,
          "split x3 of 3.4e38: finite terms summing to x (got %g)", s3);
}

/* the grouped W4A16 GEMM (moe_mma.cu) vs the ref backend's matmul (fp32 activations, the
 * checkpoint's MXFP4 decode) per expert, element by element within bounds derived from
 * tests/tolerances.h. Experts with 17, 0, 1 and 5 rows; layout contiguous or masked (capacity 24,
 * the unused rows of x NaN, of y checked untouched); plain, or gate/up fused with SwiGLU
 * (beta < 0) or SiTU in the epilogue. */
enum { W4_E = 4, W4_N = 40, W4_K = 320, W4_KT = W4_K / 32, W4_CAP = 24 };
static uint8_t w4_packed[2][W4_E][W4_N * W4_K / 2], w4_scale[2][W4_E][W4_N * W4_KT];

/* Σ_k |w_k x_k| for row n of matrix m of expert e */
static double w4_abs(int m, int e, int n, const float *xr) {
    double a = 0;
    for (int k = 0; k < W4_K; k++)
        a += fabs(k3_mxfp4_get(w4_packed[m][e] + n * (W4_K / 2), w4_scale[m][e] + n * W4_KT, k) *
                  xr[k]);
    return a;
}

static void test_w4a16(bool masked, bool gateup, float beta, bool small, int terms) {
    enum { E = W4_E, N = W4_N, K = W4_K, KT = W4_KT, CAP = W4_CAP };
    /* small: no expert above 8 rows, so the launcher runs swap-AB */
    const int32_t count[E] = {small ? 8 : 17, 0, 1, 5};
    int64_t off[E + 1] = {0};
    for (int e = 0; e < E; e++) off[e + 1] = off[e] + count[e];
    const int64_t R = masked ? E * CAP : off[E];
    const float lin_beta = 3.0f;
    static uint32_t words[2][E * N / 8 * KT * 32];
    static uint8_t scales[2][E * N / 8 * KT * 8];
    static float x[E * CAP * K], y[E * CAP * N], want[2][E * CAP * N];
    for (int m = 0; m < 2; m++)
        for (int e = 0; e < E; e++) {
            for (size_t i = 0; i < sizeof w4_packed[m][e]; i++) w4_packed[m][e][i] = (uint8_t)rnd();
            for (size_t i = 0; i < sizeof w4_scale[m][e]; i++)
                w4_scale[m][e][i] = (uint8_t)(rnd() % 8 + 121);
            k3c_mxfp4_repack(w4_packed[m][e], w4_scale[m][e], N, K,
                             words[m] + e * k3c_mxfp4_frag_words(N, K),
                             scales[m] + e * k3c_mxfp4_frag_scales(N, K));
        }
    /* the first row of expert e's rows: off[e], or e·CAP when masked */
    int64_t first[E];
    for (int e = 0; e < E; e++) first[e] = masked ? e * CAP : off[e];
    for (int64_t i = 0; i < R * K; i++) x[i] = NAN;
    for (int e = 0; e < E; e++)
        for (int64_t i = first[e] * K; i < (first[e] + count[e]) * K; i++)
            x[i] = (float)((int)(rnd() % 20001) - 10000) * 3.1e-4f;
    uint32_t *dw[2] = {nullptr, nullptr};
    uint8_t *ds[2] = {nullptr, nullptr};
    int64_t *doff = nullptr;
    int32_t *dcount = nullptr;
    float *dx = nullptr, *dy = nullptr;
    bool ok = cudaMalloc((void **)&doff, sizeof off) == cudaSuccess &&
              cudaMalloc((void **)&dcount, sizeof count) == cudaSuccess &&
              cudaMalloc((void **)&dx, sizeof x) == cudaSuccess &&
              cudaMalloc((void **)&dy, sizeof y) == cudaSuccess;
    for (int m = 0; m < 2; m++)
        ok = ok && cudaMalloc((void **)&dw[m], sizeof words[m]) == cudaSuccess &&
             cudaMalloc((void **)&ds[m], sizeof scales[m]) == cudaSuccess;
    CHECK(ok, "cudaMalloc");
    if (ok) {
        for (int m = 0; m < 2; m++) {
            cudaMemcpy(dw[m], words[m], sizeof words[m], cudaMemcpyHostToDevice);
            cudaMemcpy(ds[m], scales[m], sizeof scales[m], cudaMemcpyHostToDevice);
        }
        cudaMemcpy(doff, off, sizeof off, cudaMemcpyHostToDevice);
        cudaMemcpy(dcount, count, sizeof count, cudaMemcpyHostToDevice);
        cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice);
        cudaMemset(dy, 0x7f, sizeof y); /* a finite sentinel: rows past the counts keep it */
#ifdef K3_CUDA_EMULATION
        const unsigned long long m0 =
            k3emu_mma_count(small ? "w4a16_swap_kernel" : "w4a16_grouped_kernel");
#endif
        k3c_w4_rows rows = {masked ? nullptr : doff,
                            masked ? dcount : nullptr,
                            masked ? CAP : 0,
                            small ? 8 : 17,
                            nullptr,
                            nullptr,
                            nullptr};
        const int rc =
            k3c_w4a16_grouped(0, dw[0], ds[0], gateup ? dw[1] : nullptr, gateup ? ds[1] : nullptr,
                              E, N, K, rows, beta, lin_beta, terms, dx, dy);
        const cudaError_t e2 = cudaDeviceSynchronize();
        CHECK(rc == 0 && e2 == cudaSuccess && cudaGetLastError() == cudaSuccess,
              "k3c_w4a16_grouped: %d, %s", rc, cudaGetErrorName(e2));
        cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost);
#ifdef K3_CUDA_EMULATION
        /* per matrix: n-tiles x row tiles (2 + 0 + 1 + 1) x K/16 steps; swap-AB: 16-row tiles of W
         * (3) x experts with rows (3) x K/16; times the activation terms */
        const char *kname = small ? "w4a16_swap_kernel" : "w4a16_grouped_kernel";
        const unsigned long long want_mma = (small ? 3ull * 3 : (unsigned long long)(N / 8) * 4) *
                                            (K / 16) * (gateup ? 2 : 1) * (unsigned long long)terms;
        CHECK(k3emu_mma_count(kname) - m0 == want_mma, "%s: mma count %llu, want %llu", kname,
              k3emu_mma_count(kname) - m0, want_mma);
#endif
        k3_backend *ref = nullptr;
        CHECK(k3_backend_create("ref", NULL, &ref) == K3_OK, "ref backend");
        for (int m = 0; m < (gateup ? 2 : 1) && ref; m++)
            for (int e = 0; e < E; e++) {
                k3_tensor W;
                memset(&W, 0, sizeof W);
                W.dtype = K3_DT_MXFP4, W.ndim = 2, W.shape[0] = N, W.shape[1] = K;
                W.data = w4_packed[m][e], W.scale = w4_scale[m][e], W.mem = K3_MEM_HOST;
                if (count[e])
                    CHECK(ref->ops->matmul(ref, x + first[e] * K, count[e], &W,
                                           want[m] + first[e] * N) == K3_OK,
                          "ref matmul of expert %d", e);
            }
        if (ref) k3_backend_destroy(ref);
        /* per element: the GEMM's |Δ| <= δ = K3_TOL_SPLIT_GEMM_REL(terms, K)·Σ|w x| (the split's
         * residual plus both fp32 sums: tests/tolerances.h); through act(g, u) = a(g)·b(u) (|b'| <=
         * 1, |b(u)| <= |u|, |a'| <= La: SiLU 1.0998, SiTU 1 + beta/4): |Δh| <= La·δg·(|b(u)| + δu)
         * + |a(g)|·δu, plus 8 u·|h| + 1e-30 for the evaluation of h on either side (libm tanh /
         * exp, ~1 ulp each) */
        const double c = K3_TOL_SPLIT_GEMM_REL(terms, K);
        const double La = beta < 0 ? 1.0998 : 1.0 + beta / 4.0;
        int bad = 0, untouched = 0, rows_out = 0;
        double worst = 0;
        for (int e = 0; e < E; e++)
            for (int64_t r = first[e]; r < first[e] + (masked ? CAP : count[e]); r++) {
                const bool live = r < first[e] + count[e];
                for (int n = 0; n < N; n++) {
                    const float got = y[r * N + n];
                    if (!live) {
                        uint32_t gb;
                        memcpy(&gb, &got, 4);
                        untouched += gb == 0x7f7f7f7fu;
                        continue;
                    }
                    rows_out += n == 0;
                    const double dg = c * w4_abs(0, e, n, x + r * K), g = want[0][r * N + n];
                    double bound = dg, ref_v = g;
                    if (gateup) {
                        const double du = c * w4_abs(1, e, n, x + r * K), u = want[1][r * N + n];
                        const float h = k3c_moe_act((float)g, (float)u, beta, lin_beta);
                        const double a = beta < 0 ? fabs(g / (1 + exp(-g)))
                                                  : fabs(k3c_situ((float)g, 1.0f, beta, 0.0f));
                        const double b = beta < 0 || lin_beta <= 0
                                             ? fabs(u)
                                             : fabs(lin_beta * tanh(u / lin_beta));
                        ref_v = h;
                        bound = La * dg * (b + du) + a * du + 8 * K3_FP32_U * fabs(h) + 1e-30;
                    }
                    const double err = fabs((double)got - ref_v);
                    if (!(err <= bound)) bad++;
                    if (bound > 0 && err / bound > worst) worst = err / bound;
                }
            }
        CHECK(bad == 0, "W4A16 %s%s, %d term(s): %d outputs outside the derived bound",
              masked ? "masked" : "contiguous", gateup ? (beta < 0 ? " swiglu" : " situ") : "",
              terms, bad);
        CHECK(rows_out == off[E], "rows checked %d, want %lld", rows_out, (long long)off[E]);
        if (masked)
            CHECK(untouched == (int)(E * CAP - off[E]) * N,
                  "masked: %d of %lld rows past the counts untouched", untouched / N,
                  (long long)(E * CAP - off[E]));
        printf("w4a16 %s %s%s, %d term(s) vs ref: worst error / bound = %.3g\n",
               small ? "swap-AB" : "grouped", masked ? "masked" : "contiguous",
               gateup ? (beta < 0 ? " swiglu" : " situ") : "", terms, worst);
    }
    for (int m = 0; m < 2; m++) cudaFree(dw[m]), cudaFree(ds[m]);
    cudaFree(doff), cudaFree(dcount), cudaFree(dx), cudaFree(dy);
}

/* The split exactly, on the GEMM (an oracle: bit-exact in any summation order, on a device too):
 * W = a signed, power-of-two scaled permutation (row n: ±2^j at column π(n), zeros elsewhere), x
 * with full 24-bit significands. Each output is then the one product x·w summed term by term
 * with zeros, and every partial sum of the terms is exact in fp32 (the terms' bits are disjoint
 * pieces of x's 24), so y = (x1 + .. + xn)·w exactly: x itself for 3 terms, bf16(x) for 1. A lost
 * or repeated term, a wrong plane or a wrong split changes the bits. Grouped (17 rows) and swap-AB
 * (5 rows); the fused gate/up shares the planes (test_w4a16 checks it within its bound). */
static void test_w4a16_split_exact(int terms, bool small) {
    enum { N = 32, K = 64, KT = K / 32 };
    const int rows = small ? 5 : 17;
    static uint8_t packed[N * K / 2], scale[N * KT];
    static uint32_t words[N / 8 * KT * 32];
    static uint8_t scales[N / 8 * KT * 8];
    static float x[17 * K], y[17 * N];
    memset(packed, 0, sizeof packed);
    float wv[N];
    int col[N];
    for (int n = 0; n < N; n++) {
        col[n] = (n * 5 + 3) % K;                       /* a permutation of 32 of the 64 columns */
        const unsigned code = (n & 1 ? 0x8u : 0u) | 2u; /* ±1.0 in E2M1 */
        packed[n * (K / 2) + col[n] / 2] |= (uint8_t)(code << (4 * (col[n] & 1)));
        for (int g = 0; g < KT; g++) scale[n * KT + g] = (uint8_t)(127 + (n % 3)); /* 1, 2, 4 */
        wv[n] = k3_mxfp4_get(packed + n * (K / 2), scale + n * KT, col[n]);
    }
    k3c_mxfp4_repack(packed, scale, N, K, words, scales);
    for (int i = 0; i < rows * K; i++) { /* full significands, exponents -10 .. 10, both signs */
        const uint32_t u = (rnd() & 0x807fffffu) | (uint32_t)(117 + rnd() % 21) << 23;
        memcpy(&x[i], &u, 4);
    }
    int64_t off[2] = {0, rows};
    uint32_t *dw = nullptr;
    uint8_t *ds = nullptr;
    int64_t *doff = nullptr;
    float *dx = nullptr, *dy = nullptr;
    bool ok = cudaMalloc((void **)&dw, sizeof words) == cudaSuccess &&
              cudaMalloc((void **)&ds, sizeof scales) == cudaSuccess &&
              cudaMalloc((void **)&doff, sizeof off) == cudaSuccess &&
              cudaMalloc((void **)&dx, sizeof x) == cudaSuccess &&
              cudaMalloc((void **)&dy, sizeof y) == cudaSuccess;
    CHECK(ok, "cudaMalloc");
    if (ok) {
        cudaMemcpy(dw, words, sizeof words, cudaMemcpyHostToDevice);
        cudaMemcpy(ds, scales, sizeof scales, cudaMemcpyHostToDevice);
        cudaMemcpy(doff, off, sizeof off, cudaMemcpyHostToDevice);
        cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice);
        const k3c_w4_rows wr = {doff, nullptr, 0, rows, nullptr, nullptr, nullptr};
        const int rc =
            k3c_w4a16_grouped(0, dw, ds, nullptr, nullptr, 1, N, K, wr, -1.0f, 0.0f, terms, dx, dy);
        CHECK(rc == 0 && cudaDeviceSynchronize() == cudaSuccess, "k3c_w4a16_grouped: %d", rc);
        cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost);
        int bad = 0;
        for (int r = 0; r < rows; r++)
            for (int n = 0; n < N; n++) {
                uint16_t h[K3C_SPLIT_MAX];
                k3c_split_bf16(x[r * K + col[n]], terms, h);
                double sum = 0; /* exact: the terms are disjoint bit pieces */
                for (int p = 0; p < terms; p++) sum += (double)k3c_bf16_value(h[p]);
                const float want = (float)(sum * (double)wv[n]);
                bad += memcmp(&want, &y[r * N + n], 4) != 0;
            }
        CHECK(bad == 0, "split exact, %d term(s), %s: %d of %d outputs not bit-exact", terms,
              small ? "swap-AB" : "grouped", bad, rows * N);
        if (terms == K3C_SPLIT_MAX) { /* and 3 terms are x itself */
            int notx = 0;
            for (int r = 0; r < rows; r++)
                for (int n = 0; n < N; n++) notx += y[r * N + n] != x[r * K + col[n]] * wv[n];
            CHECK(notx == 0, "split exact, 3 terms, %s: %d outputs are not x·w",
                  small ? "swap-AB" : "grouped", notx);
        }
    }
    cudaFree(dw), cudaFree(ds), cudaFree(doff), cudaFree(dx), cudaFree(dy);
}

#ifdef K3_CUDA_EMULATION
/* runs f with stderr captured; returns what it printed (echoed, marked as expected) */
#include "k3emu_stderr.h"

template <class F> static std::string captured_stderr(F f) {
    bool ok;
    std::string s = k3emu_captured_stderr(f, &ok);
    CHECK(ok, "cannot capture stderr");
    return s;
}

/* wait_group N completes all committed groups but the newest N: two groups of one chunk each,
 * read after wait_group 1 (group 1 still in flight: NaN) and after wait_group 0 */
static __global__ void pipeline_kernel(const float *src, float *out) {
    K3C_SHARED(float, sh, [8]);
    k3c_cp_async16(sh, src);
    k3c_cp_async_commit();
    k3c_cp_async16(sh + 4, src + 4);
    k3c_cp_async_commit();
    k3c_cp_async_wait<1>();
    out[0] = sh[0], out[1] = sh[4];
    k3c_cp_async_wait<0>();
    out[2] = sh[0], out[3] = sh[4];
}

/* the emulator's checks, each on an injected bug, and the mma count */
static void test_emulator_checks(dev &m) {
    uint16_t A[256], B[128];
    float C[128], D[128], want[128];
    for (int i = 0; i < 256; i++) A[i] = bf16_of((float)((int)(rnd() % 7) - 3));
    for (int i = 0; i < 128; i++) B[i] = bf16_of((float)((int)(rnd() % 7) - 3)), C[i] = 1.0f;
    reference(A, B, C, want);

    const unsigned long long n0 = k3emu_mma_count("oracle_kernel"), all0 = k3emu_mma_count(NULL);
    CHECK(run_oracle(m, A, B, C, D, 0) == cudaSuccess && mismatches(D, want) == 0, "clean run");
    CHECK(k3emu_mma_count("oracle_kernel") == n0 + 1 && k3emu_mma_count(NULL) == all0 + 1,
          "mma count +%llu (kernel), +%llu (all), want +1", k3emu_mma_count("oracle_kernel") - n0,
          k3emu_mma_count(NULL) - all0);
    CHECK(k3emu_mma_count("no_such_kernel") == 0, "an unknown kernel counts 0");

    /* missing cp.async wait: the destination is still poisoned when ldmatrix reads it */
    cudaError_t e = run_oracle(m, A, B, C, D, F_NOWAIT);
    int n_nan = 0;
    for (int i = 0; i < 128; i++) n_nan += isnan(D[i]) != 0;
    CHECK(e == cudaSuccess && n_nan == 128, "no wait_group: %d of 128 outputs NaN (%s)", n_nan,
          cudaGetErrorName(e));

    float hsrc[8] = {1, 2, 3, 4, 5, 6, 7, 8}, hout[4];
    cudaMemcpy(m.c, hsrc, sizeof hsrc, cudaMemcpyHostToDevice);
    K3C_LAUNCH(1, 1, 0, 0, pipeline_kernel)(m.c, m.d);
    e = cudaGetLastError();
    cudaMemcpy(hout, m.d, sizeof hout, cudaMemcpyDeviceToHost);
    CHECK(e == cudaSuccess && hout[0] == 1 && isnan(hout[1]) && hout[2] == 1 && hout[3] == 5,
          "wait_group 1 then 0: %g %g, %g %g; want 1 NaN, 1 5 (%s)", hout[0], hout[1], hout[2],
          hout[3], cudaGetErrorName(e));

    struct bug {
        int mode;
        const char *fragment;
    } bugs[] = {
        {F_MISALIGN, "is not 16-byte aligned"},
        {F_GLOBAL, "is outside every shared-memory array of the block"},
        {F_EXIT, "lane 31 (thread 31) has exited"},
        {F_SHFL, "waits in mma.m16n8k16 while lane 31 waits in a shuffle/vote"},
    };
    for (const bug &bg : bugs) {
        std::string log = captured_stderr([&] { e = run_oracle(m, A, B, C, D, bg.mode); });
        CHECK(e == cudaErrorLaunchFailure, "bug %d: %s, want cudaErrorLaunchFailure", bg.mode,
              cudaGetErrorName(e));
        CHECK(log.find("k3emu: kernel oracle_kernel, block (0,0,0): ") != std::string::npos &&
                  log.find(bg.fragment) != std::string::npos,
              "bug %d: want a k3emu: line with '%s', got '%s'", bg.mode, bg.fragment, log.c_str());
    }
    /* a good run right after the failures */
    CHECK(run_oracle(m, A, B, C, D, 3) == cudaSuccess && mismatches(D, want) == 0,
          "a clean run after the injected bugs");
}
#endif

int main(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("SKIP test_cuda_mma: no CUDA device visible\n");
        return 77;
    }
    test_dequant();
    test_dequant_device();
    test_repack();
    test_split();
    for (int terms = 1; terms <= K3C_W4_MAX_TERMS; terms++)
        for (int small = 0; small < 2; small++) test_w4a16_split_exact(terms, small);
    for (int terms = 0; terms <= K3C_W4_MAX_TERMS + 1; terms += K3C_W4_MAX_TERMS + 1) {
        const k3c_w4_rows none = {nullptr, nullptr, 0, 1, nullptr, nullptr, nullptr};
        CHECK(k3c_w4a16_grouped(0, nullptr, nullptr, nullptr, nullptr, 1, 8, 32, none, -1.0f, 0.0f,
                                terms, nullptr, nullptr) == (int)cudaErrorInvalidValue,
              "k3c_w4a16_grouped refuses %d terms", terms);
    }
    for (int terms = 1; terms <= K3C_W4_MAX_TERMS; terms++) /* split activations */
        for (int small = 0; small < 2; small++) {           /* small: swap-AB */
            test_w4a16(false, false, -1.0f, small, terms);
            test_w4a16(true, false, -1.0f, small, terms);
            test_w4a16(false, true, -1.0f, small, terms); /* SwiGLU */
            test_w4a16(true, true, 10.0f, small, terms);  /* SiTU, beta 10 */
        }
    {
        dev m;
        test_oracle(m);
#ifdef K3_CUDA_EMULATION
        test_emulator_checks(m);
#endif
    }
    printf("test_cuda_mma (%s): %d checks passed, %d failed\n", k_emu ? "emulation" : "device",
           g_pass, g_fail);
    return g_fail || !g_pass ? 1 : 0;
}
