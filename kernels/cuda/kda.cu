// kda.cu — the KDA ops of the cuda backend (K3-MODEL.md §2): the decay gate (kda_gate), the
// depthwise causal short conv (short_conv), and the delta rule in its two forms.
//   kda_recurrent: one block per head; per token the block stages exp(g), k, q in shared memory
//     and each thread owns value columns j (S[:, j] in global memory, coalesced across j), running
//     the ref's per-column arithmetic (cuda_math.cuh k3c_kda_col_step) in the ref's order.
//   kda_chunked: one block per head, kernels/ref's chunked (WY/UT) form with the same float64
//     intra-chunk math and the same scratch layout (work, per head), in the phases of
//     cuda_math.cuh (k3c_kda_chunk_p1..p8) with a barrier after each. §2.4 overflow rule:
//     every decay factor is exp of a difference <= 0 — exp(Γ_i − Γ_j) for i >= j, exp(Γ_i) and
//     exp(Γ_last − Γ_j) — never exp(−Γ). A ragged tail (< C tokens) runs the recurrence.
// One block per head is little parallelism for long prefill (H blocks); it is correct first.
//
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

static __global__ void gate_kernel(float *r, const float *dt_bias, const float *a_log, int64_t T,
                                   int H, int dk, bool has_lb, float lb) {
    const int64_t P = (int64_t)H * dk, n = T * P;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t ch = i % P;
        const float a = expf(a_log[ch / dk]);
        r[i] = k3c_kda_gate(r[i], dt_bias[ch], a, has_lb, lb);
    }
}

static __global__ void conv_kernel(const float *in, int64_t n, int64_t P, int K, const float *w,
                                   float *state, float *out) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= P) return;
    k3c_short_conv_col(in + c, n, P, K, w + c * K, state + c, out + c);
}

/* The recurrence of one head over n tokens; sh: 3·dk floats of shared memory. */
static __device__ void head_recurrent(const float *q, const float *k, const float *v,
                                      const float *g, const float *beta, int64_t n, int64_t sqk,
                                      int64_t svo, int64_t sb, int dk, int dv, float scale,
                                      float *S, float *o, float *sh) {
    float *se = sh, *sk = sh + dk, *sq = sh + 2 * dk;
    for (int64_t t = 0; t < n; t++) {
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            se[i] = expf(g[t * sqk + i]);
            sk[i] = k[t * sqk + i];
            sq[i] = q[t * sqk + i];
        }
        __syncthreads();
        const float b = beta[t * sb];
        for (int j = threadIdx.x; j < dv; j += blockDim.x)
            o[t * svo + j] = k3c_kda_col_step(S + j, dv, dk, se, sk, sq, v[t * svo + j], b, scale);
        __syncthreads(); /* before the next token overwrites se/sk/sq */
    }
}

static __global__ void recurrent_kernel(const float *q, const float *k, const float *v,
                                        const float *g, const float *beta, int64_t n, int H, int dk,
                                        int dv, float scale, float *S, float *o) {
    extern __shared__ float sh_rec[];
    const int h = blockIdx.x;
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    head_recurrent(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk, svo, H, dk, dv,
                   scale, S + (int64_t)h * dk * dv, o + h * dv, sh_rec);
}

static __global__ void chunked_kernel(const float *q_, const float *k_, const float *v_,
                                      const float *g_, const float *beta_, int64_t n, int H, int dk,
                                      int dv, float scale, float *S_, float *o_, int C,
                                      float *work_, size_t wf) {
    extern __shared__ double sh_chk[]; /* row [C], then 3·dk floats for the tail */
    const int h = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    k3c_kda_chunk c;
    c.q = q_ + h * dk, c.k = k_ + h * dk, c.v = v_ + h * dv, c.g = g_ + h * dk, c.beta = beta_ + h;
    c.sqk = (int64_t)H * dk, c.svo = (int64_t)H * dv, c.sb = H;
    c.dk = dk, c.dv = dv, c.C = C, c.scale = scale;
    c.S = S_ + (int64_t)h * dk * dv, c.o = o_ + h * dv;
    k3c_kda_chunk_layout(&c, (double *)(work_ + (size_t)h * wf), sh_chk);
    for (c.t0 = 0; C > 1 && c.t0 + C <= n; c.t0 += C) {
        k3c_kda_chunk_p1(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p2(&c, tid, nt);
        __syncthreads();
        for (int i = 1; i < C; i++) {
            k3c_kda_chunk_p3(&c, i, tid, nt);
            __syncthreads();
            k3c_kda_chunk_p4(&c, i, tid, nt);
            __syncthreads();
        }
        k3c_kda_chunk_p5(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p6(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p7(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p8(&c, tid, nt);
        __syncthreads();
    }
    const int64_t t0 = c.t0;
    if (t0 < n)
        head_recurrent(c.q + t0 * c.sqk, c.k + t0 * c.sqk, c.v + t0 * c.svo, c.g + t0 * c.sqk,
                       c.beta + t0 * c.sb, n - t0, c.sqk, c.svo, c.sb, dk, dv, scale, c.S,
                       c.o + t0 * c.svo, (float *)(sh_chk + C));
}

extern "C" int k3c_kda_gate(cudaStream_t s, float *r, const float *dt_bias, const float *a_log,
                            int64_t T, int H, int dk, bool has_lb, float lb) {
    const int64_t n = T * H * dk;
    if (n <= 0) return 0;
    gate_kernel<<<k3c_blocks(n, 256), 256, 0, s>>>(r, dt_bias, a_log, T, H, dk, has_lb, lb);
    return (int)cudaGetLastError();
}

extern "C" int k3c_short_conv(cudaStream_t s, const float *in, int64_t n, int64_t P, int K,
                              const float *w, float *state, float *out) {
    if (P <= 0 || (n <= 0 && K <= 1)) return 0;
    conv_kernel<<<(unsigned)((P + 127) / 128), 128, 0, s>>>(in, n, P, K, w, state, out);
    return (int)cudaGetLastError();
}

extern "C" int k3c_kda(cudaStream_t s, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                       float scale, float *S, float *o, int C, float *work, size_t wf) {
    if (n <= 0 || H <= 0) return 0;
    const size_t sh_tail = 3 * (size_t)dk * sizeof(float);
    if (C == 0) {
        recurrent_kernel<<<(unsigned)H, 128, sh_tail, s>>>(q, k, v, g, beta, n, H, dk, dv, scale, S,
                                                           o);
    } else {
        const size_t sh = (size_t)C * sizeof(double) + sh_tail;
        chunked_kernel<<<(unsigned)H, 256, sh, s>>>(q, k, v, g, beta, n, H, dk, dv, scale, S, o, C,
                                                    work, wf);
    }
    return (int)cudaGetLastError();
}
