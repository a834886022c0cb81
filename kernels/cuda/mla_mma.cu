// mla_mma.cu — absorbed MLA attention on tensor cores (issue 44, Deliver 3b): the attn_paged and
// attn_latent ops of the cuda backend for latent rows of W <= K3C_MLA_MAX_W (K3: W = 576 = 512
// latent + 64 rope, Rkv = 512), FlashMLA's scheme (split-KV over the 64-token pages, an LSE
// combine) on mma.m16n8k16 bf16 -> f32 (k3c_mma.cuh). One query token t, H heads:
//   s_h(j) = scale · qc[t, h]·cache[j],  p = softmax_j,  o_lat[t, h] = Σ_j p_j cache[j][0:Rkv].
// The heads are the mma's M: all heads of a token share the latent rows (absorbed form), so
// S [16 heads × 16 positions] = Q [16 × W] · K [16 × W]ᵀ and O [16 × Rkv] += P [16 × 16] · V [16 ×
// Rkv] with V = K's first Rkv columns.
//
// Splits. A query of context n takes ns = min(ceil(n / 256), 32) splits of len = ceil(n / ns)
// rounded up to a page (64): ns = ceil(n / len) ranges [s·len, (s + 1)·len) ∩ [0, n). They depend
// on n alone, so a query's bits depend only on its qc row, n and the cache rows (attn_latent and
// attn_paged, prefill and decode, agree bit for bit: the ops' determinism contract).
//
// Operands: terms 1 rounds every fp32 operand to bf16; terms 3 (the backend's default) splits each
// into hi = bf16(x) and lo = bf16(x − hi) and accumulates hi·lo, lo·hi, hi·hi per mma step in
// fp32 (a product's error <= 3.008·2^-16 of |xy|: fp32-grade); terms 4 adds lo·lo.
// mla_split_kernel: grid (tokens, head tiles × column chunks, ns_max), 128 threads (4 warps).
// Block (t, tile, chunk, s) owns heads [16·tile, +16) (rows past H are zero queries), value
// columns [512·chunk, +512) ∩ [0, Rkv) and split s. The queries are A fragments in registers
// (hi, lo): warp w holds k-steps w, w + 4, ... (<= K3C_MLA_QSTEPS). Shared memory (bf16 as
// uint16, rows of ld = roundup(W, 16) + 8 elements: 16-byte aligned ldmatrix rows, the +8 skews
// the banks; <= 47 KiB at W = 640 split):
//   Ks, Kl [16 × ld]  one tile of 16 positions of the cache, hi and (split) lo (float4 loads when
//                     W % 4 = 0; positions past the split and columns past W zero);
//   Ps, Pl [16 × 24]  P of the tile, hi and (split) lo; Sf [4 × 16 × 16] f32 the k-quarters of S;
//   m, l, alpha [16] the online softmax of each head row.
// Per tile: QKᵀ — warp w computes both 8-position n-tiles over its k-steps (B = ldmatrix.x2 of
// Ks / Kl rows: a row-major [N, K] is B "col"); then threads 0..15 (one head row each) take
// S = (((Sf[0] + Sf[1]) + Sf[2]) + Sf[3])·scale, the new max m', alpha = exp(m − m'), p =
// exp(s − m') (split: hi + lo, l = alpha·l + Σ p in fp32; bf16: p rounded and l summing the
// rounded p, so the weights sum to what normalises them); then PV — warp w owns the n-tiles w,
// w + 4, ... of its chunk (<= 16: 64 f32 accumulators a lane), rescales them by alpha of their
// rows, A = ldmatrix.x4 of Ps / Pl, B = ldmatrix.x2.trans of Ks / Kl at column 8·nt (V [k =
// position, n = column] row-major). The split ends
// with o = acc / l and lse = m + log l: written to o_lat when ns = 1, else to the partials.
// mla_combine_kernel: block (t, h) over the ns partials in split order: M = max lse, w_s =
// exp(lse_s − M), o = Σ_s w_s·o_s / Σ_s w_s.
// Scratch (the partials): per token H·ns_max·(Rkv + 1) floats (k3c_attn_mla_part_floats), the
// backend's (backend_cuda.c), tokens launched in groups that fit it.
// Cost on a device: each head tile reads the split's cache rows once (H / 16 tiles: from L2 after
// the first); decode is bandwidth-bound on the cache rows. Verified under emulation only (the mma
// and ldmatrix maps by the layout oracle, the kernel against ref); device run pending.
#include "cuda_launch.h"
#include "k3c_mma.cuh"

#define K3C_MLA_HEADS     16  /* heads per block: the mma's M */
#define K3C_MLA_TILE      16  /* positions per tile: one k-step of PV */
#define K3C_MLA_COLS      512 /* value columns per block: 16 n-tiles per warp */
#define K3C_MLA_THREADS   128
#define K3C_MLA_SPLIT_MIN 256 /* positions a split takes at least */
#define K3C_MLA_SPLITS    32  /* splits of a query at most */
#define K3C_MLA_PLD       24  /* Ps row: 16 positions + 8 of skew */
/* k-steps of Q a warp holds: ceil(K3C_MLA_MAX_W / 16 / 4) */
#define K3C_MLA_QSTEPS ((K3C_MLA_MAX_W / 16 + 3) / 4)

/* ns splits of len positions for a context of n (> 0): a function of n alone */
K3C_FN void k3c_mla_splits(int64_t n, int *ns, int64_t *len) {
    int64_t s = (n + K3C_MLA_SPLIT_MIN - 1) / K3C_MLA_SPLIT_MIN;
    if (s > K3C_MLA_SPLITS) s = K3C_MLA_SPLITS;
    if (s < 1) s = 1;
    int64_t l = (n + s - 1) / s;
    l = (l + K3C_KV_BLOCK - 1) / K3C_KV_BLOCK * K3C_KV_BLOCK;
    *len = l;
    *ns = (int)((n + l - 1) / l);
}
K3C_FN int k3c_mla_ld(int W) {
    return ((W + 15) & ~15) + 8;
}

typedef struct k3c_mla_job {
    k3c_seqs sq; /* paged: the batch; else one query over n_ctx contiguous rows */
    bool paged;
    int64_t n_ctx; /* contiguous only */
    const float *qc, *cache;
    int H, W, Rkv, ns_max;
    int terms; /* products per mma step: 1 (bf16), 3 (hi·hi + hi·lo + lo·hi) or 4 (+ lo·lo) */
    float scale;
    int64_t t0;   /* the launch's first token */
    float *o_lat; /* [T, H, Rkv] */
    float *part;  /* [tokens of the launch, H, ns_max, Rkv] */
    float *lse;   /* [tokens of the launch, H, ns_max] */
} k3c_mla_job;

/* the context and the block table of token t */
static __device__ int64_t mla_ctx(const k3c_mla_job &j, int64_t t, const int32_t **bt) {
    if (!j.paged) {
        *bt = nullptr;
        return j.n_ctx;
    }
    const int i = k3c_seq_of(j.sq.tok0, j.sq.n_seqs, t);
    *bt = j.sq.blocks + (int64_t)i * j.sq.max_blocks;
    return (int64_t)j.sq.pos[i] + (t - j.sq.tok0[i]) + 1;
}

/* x -> hi = bf16(x) and lo = bf16(x − hi) (x − hi is exact in fp32), so x = hi + lo + r with
   |r| <= 2^-16·|x|; a non-finite x keeps lo = 0. (The MoE kernel's helpers of the same idea may
   replace this one once k3c_mma.cuh has them.) */
K3C_FN uint16_t mla_split(float x, uint16_t *lo) {
    const uint16_t hi = k3c_bf16_rne(x);
    *lo = isfinite(x) ? k3c_bf16_rne(x - k3c_bf16(hi)) : (uint16_t)0;
    return hi;
}
K3C_FN uint32_t mla_split2(float x, float y, uint32_t *lo) {
    uint16_t lx, ly;
    const uint32_t h = (uint32_t)mla_split(x, &lx) | (uint32_t)mla_split(y, &ly) << 16;
    *lo = (uint32_t)lx | (uint32_t)ly << 16;
    return h;
}
/* the A fragment (hi and lo) of the tile's queries at k-step ks: a[i] = Q[g + 8(i & 1)][2t +
   8(i >> 1) + {0, 1}] (k3c_mma.cuh), rows past H and columns past W zero */
static __device__ void mla_qfrag(const k3c_mla_job &j, int64_t t, int h0, int ks, int lane,
                                 uint32_t ah[4], uint32_t al[4]) {
    const int g = lane >> 2, tq = lane & 3;
    for (int i = 0; i < 4; i++) {
        const int h = h0 + g + 8 * (i & 1), c = ks * 16 + 2 * tq + 8 * (i >> 1);
        const float *q = j.qc + (t * j.H + h) * j.W;
        const float x = h < j.H && c < j.W ? q[c] : 0.0f;
        const float y = h < j.H && c + 1 < j.W ? q[c + 1] : 0.0f;
        ah[i] = mla_split2(x, y, &al[i]);
    }
}

/* rows [a, a + 16) ∩ [0, p1) of the cache -> Ks in bf16 (and, split, Kl the remainders); the rest
   zero */
static __device__ void mla_stage(const k3c_mla_job &j, const int32_t *bt, int64_t a, int64_t p1,
                                 int ld, uint16_t *Ks, uint16_t *Kl) {
    const int W = j.W;
    if ((W & 3) == 0) {
        const int w4 = W >> 2;
        for (int e = threadIdx.x; e < K3C_MLA_TILE * w4; e += blockDim.x) {
            const int r = e / w4, c = (e % w4) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (a + r < p1) {
                const int64_t row = bt ? k3c_kv_row(bt, a + r) : a + r;
                v = *(const float4 *)(j.cache + row * W + c);
            }
            uint32_t l0, l1;
            uint32_t *d = (uint32_t *)(Ks + r * ld + c);
            d[0] = mla_split2(v.x, v.y, &l0), d[1] = mla_split2(v.z, v.w, &l1);
            if (Kl) {
                uint32_t *dl = (uint32_t *)(Kl + r * ld + c);
                dl[0] = l0, dl[1] = l1;
            }
        }
    } else {
        for (int e = threadIdx.x; e < K3C_MLA_TILE * W; e += blockDim.x) {
            const int r = e / W, c = e % W;
            float v = 0.0f;
            if (a + r < p1) v = j.cache[(bt ? k3c_kv_row(bt, a + r) : a + r) * W + c];
            uint16_t lo;
            Ks[r * ld + c] = mla_split(v, &lo);
            if (Kl) Kl[r * ld + c] = lo;
        }
    }
    const int pad = ld - W;
    for (int e = threadIdx.x; e < K3C_MLA_TILE * pad; e += blockDim.x) {
        Ks[(e / pad) * ld + W + e % pad] = 0;
        if (Kl) Kl[(e / pad) * ld + W + e % pad] = 0;
    }
}

static __global__ void __launch_bounds__(K3C_MLA_THREADS) mla_split_kernel(k3c_mla_job j) {
    K3C_DYN_SHARED(uint4, sh_mla);
    const int64_t tl = blockIdx.x, t = j.t0 + tl;
    const int ncc = (j.Rkv + K3C_MLA_COLS - 1) / K3C_MLA_COLS;
    const int h0 = (int)(blockIdx.y / ncc) * K3C_MLA_HEADS;
    const int c_lo = (int)(blockIdx.y % ncc) * K3C_MLA_COLS;
    const int c_hi = c_lo + K3C_MLA_COLS < j.Rkv ? c_lo + K3C_MLA_COLS : j.Rkv;
    const int s = blockIdx.z;
    const int32_t *bt;
    const int64_t n = mla_ctx(j, t, &bt);
    int ns;
    int64_t len;
    k3c_mla_splits(n, &ns, &len);
    if (s >= ns) return; /* block-uniform */
    const int64_t p0 = (int64_t)s * len, p1 = p0 + len < n ? p0 + len : n;
    const int W = j.W, ld = k3c_mla_ld(W), ksteps = (W + 15) / 16;
    const bool split = j.terms > 1;
    uint16_t *Ks = (uint16_t *)sh_mla, *Kl = Ks + K3C_MLA_TILE * ld;
    uint16_t *Ps = Kl + (split ? K3C_MLA_TILE * ld : 0), *Pl = Ps + K3C_MLA_HEADS * K3C_MLA_PLD;
    float *Sf = (float *)(Pl + (split ? K3C_MLA_HEADS * K3C_MLA_PLD : 0));
    float *rm = Sf + 4 * K3C_MLA_HEADS * K3C_MLA_TILE, *rl = rm + 16, *ra = rl + 16;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;

    /* the queries stay in registers: warp w holds the A fragments of k-steps w, w + 4, ... */
    uint32_t qh[K3C_MLA_QSTEPS][4], ql[K3C_MLA_QSTEPS][4];
#pragma unroll
    for (int q = 0; q < K3C_MLA_QSTEPS; q++) {
        const int ks = warp + 4 * q;
        if (ks < ksteps) mla_qfrag(j, t, h0, ks, lane, qh[q], ql[q]);
    }
    if (tid < K3C_MLA_HEADS) rm[tid] = -INFINITY, rl[tid] = 0.0f;
    float acc[K3C_MLA_COLS / 32][4];
#pragma unroll
    for (int q = 0; q < K3C_MLA_COLS / 32; q++)
        acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;

    for (int64_t a = p0; a < p1; a += K3C_MLA_TILE) {
        mla_stage(j, bt, a, p1, ld, Ks, split ? Kl : nullptr);
        __syncthreads();
        /* S = Q·Kᵀ: warp w, both 8-position n-tiles, k-steps w, w + 4, ...; split: hi·lo and
           lo·hi before hi·hi into the same f32 accumulator (terms 4: and lo·lo) */
        {
            float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
            for (int q = 0; q < K3C_MLA_QSTEPS; q++) {
                const int ks = warp + 4 * q;
                if (ks >= ksteps) break; /* warp-uniform */
                for (int nt = 0; nt < 2; nt++) {
                    const int off = (nt * 8 + (lane & 7)) * ld + ks * 16 + 8 * ((lane >> 3) & 1);
                    uint32_t bh[2], bl[2];
                    k3c_ldmatrix_x2(bh, Ks + off);
                    if (split) {
                        k3c_ldmatrix_x2(bl, Kl + off);
                        if (j.terms > 3) k3c_mma_bf16_16816(c[nt], ql[q], bl, c[nt]);
                        k3c_mma_bf16_16816(c[nt], qh[q], bl, c[nt]);
                        k3c_mma_bf16_16816(c[nt], ql[q], bh, c[nt]);
                    }
                    k3c_mma_bf16_16816(c[nt], qh[q], bh, c[nt]);
                }
            }
            float *S = Sf + warp * K3C_MLA_HEADS * K3C_MLA_TILE;
            for (int nt = 0; nt < 2; nt++)
                for (int i = 0; i < 4; i++)
                    S[(g + 8 * (i >> 1)) * K3C_MLA_TILE + nt * 8 + 2 * tq + (i & 1)] = c[nt][i];
        }
        __syncthreads();
        /* the online softmax of head row tid: the four k-quarters added in order */
        if (tid < K3C_MLA_HEADS) {
            const int r = tid, hs = K3C_MLA_HEADS * K3C_MLA_TILE;
            float sv[K3C_MLA_TILE], mt = -INFINITY;
            for (int c = 0; c < K3C_MLA_TILE; c++) {
                const float *S = Sf + r * K3C_MLA_TILE + c;
                sv[c] =
                    a + c < p1 ? (((S[0] + S[hs]) + S[2 * hs]) + S[3 * hs]) * j.scale : -INFINITY;
                mt = fmaxf(mt, sv[c]);
            }
            const float mn = fmaxf(rm[r], mt), alpha = expf(rm[r] - mn);
            float l = rl[r] * alpha;
            for (int c = 0; c < K3C_MLA_TILE; c++) {
                const float p = a + c < p1 ? expf(sv[c] - mn) : 0.0f;
                if (split) { /* P = hi + lo; l sums the fp32 p */
                    Ps[r * K3C_MLA_PLD + c] = mla_split(p, &Pl[r * K3C_MLA_PLD + c]);
                    l += p;
                } else { /* P in bf16; l sums the rounded p (the weights normalise exactly) */
                    const uint16_t pb = k3c_bf16_rne(p);
                    Ps[r * K3C_MLA_PLD + c] = pb;
                    l += k3c_bf16(pb);
                }
            }
            rm[r] = mn, rl[r] = l, ra[r] = alpha;
        }
        __syncthreads();
        /* O = alpha·O + P·V over this warp's n-tiles */
        {
            uint32_t ah[4], al[4];
            const int po = ((lane & 7) + 8 * ((lane >> 3) & 1)) * K3C_MLA_PLD + 8 * (lane >> 4);
            k3c_ldmatrix_x4(ah, Ps + po);
            if (split) k3c_ldmatrix_x4(al, Pl + po);
            const float a0 = ra[g], a1 = ra[g + 8];
#pragma unroll
            for (int q = 0; q < K3C_MLA_COLS / 32; q++) {
                const int c0 = c_lo + (warp + 4 * q) * 8;
                if (c0 >= c_hi) break; /* warp-uniform */
                uint32_t bh[2], bl[2];
                k3c_ldmatrix_x2_trans(bh, Ks + (lane & 15) * ld + c0);
                acc[q][0] *= a0, acc[q][1] *= a0, acc[q][2] *= a1, acc[q][3] *= a1;
                if (split) {
                    k3c_ldmatrix_x2_trans(bl, Kl + (lane & 15) * ld + c0);
                    if (j.terms > 3) k3c_mma_bf16_16816(acc[q], al, bl, acc[q]);
                    k3c_mma_bf16_16816(acc[q], ah, bl, acc[q]);
                    k3c_mma_bf16_16816(acc[q], al, bh, acc[q]);
                }
                k3c_mma_bf16_16816(acc[q], ah, bh, acc[q]);
            }
        }
        __syncthreads(); /* before the next tile overwrites Ks, Ps, Sf */
    }
    /* o = acc / l: to o_lat (one split) or the partials */
    const int ldp = j.ns_max;
#pragma unroll
    for (int q = 0; q < K3C_MLA_COLS / 32; q++) {
        const int c0 = c_lo + (warp + 4 * q) * 8;
        if (c0 >= c_hi) break;
        for (int i = 0; i < 4; i++) {
            const int r = g + 8 * (i >> 1), h = h0 + r, e = c0 + 2 * tq + (i & 1);
            if (h >= j.H || e >= c_hi) continue;
            const float o = acc[q][i] / rl[r];
            if (ns == 1)
                j.o_lat[(t * j.H + h) * j.Rkv + e] = o;
            else
                j.part[((tl * j.H + h) * ldp + s) * j.Rkv + e] = o;
        }
    }
    if (ns > 1 && c_lo == 0 && tid < K3C_MLA_HEADS && h0 + tid < j.H)
        j.lse[(tl * j.H + h0 + tid) * ldp + s] = rm[tid] + logf(rl[tid]);
}

static __global__ void mla_combine_kernel(k3c_mla_job j) {
    const int64_t tl = blockIdx.x, t = j.t0 + tl;
    const int h = blockIdx.y;
    const int32_t *bt;
    const int64_t n = mla_ctx(j, t, &bt);
    int ns;
    int64_t len;
    k3c_mla_splits(n, &ns, &len);
    if (ns == 1) return; /* the split kernel wrote o_lat */
    const float *lse = j.lse + (tl * j.H + h) * j.ns_max;
    float M = -INFINITY, Z = 0.0f;
    for (int s = 0; s < ns; s++) M = fmaxf(M, lse[s]);
    for (int s = 0; s < ns; s++) Z += expf(lse[s] - M);
    const float *part = j.part + (tl * j.H + h) * j.ns_max * (int64_t)j.Rkv;
    for (int e = threadIdx.x; e < j.Rkv; e += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < ns; s++) o = fmaf(expf(lse[s] - M), part[(int64_t)s * j.Rkv + e], o);
        j.o_lat[(t * j.H + h) * j.Rkv + e] = o / Z;
    }
}

static int mla_ns_max(int64_t max_ctx) {
    int ns;
    int64_t len;
    k3c_mla_splits(max_ctx > 0 ? max_ctx : 1, &ns, &len);
    return ns;
}

extern "C" int64_t k3c_attn_mla_part_floats(int64_t max_ctx, int H, int Rkv) {
    const int ns = mla_ns_max(max_ctx);
    return ns > 1 ? (int64_t)H * ns * (Rkv + 1) : 0;
}

extern "C" int k3c_attn_mla(cudaStream_t s, const k3c_seqs *sq, int64_t n_ctx, const float *qc,
                            const float *cache, int H, int W, int Rkv, float scale, float *o_lat,
                            float *part, int64_t tb, int terms) {
    const int64_t T = sq ? sq->T : 1, max_ctx = sq ? sq->max_ctx : n_ctx;
    if (T <= 0 || H <= 0 || Rkv <= 0) return 0;
    k3c_mla_job j;
    memset(&j, 0, sizeof j);
    if (sq) j.sq = *sq;
    j.paged = sq != nullptr, j.n_ctx = n_ctx, j.qc = qc, j.cache = cache;
    j.H = H, j.W = W, j.Rkv = Rkv, j.scale = scale, j.o_lat = o_lat, j.terms = terms;
    j.ns_max = mla_ns_max(max_ctx);
    if (j.ns_max == 1 || tb < 1) tb = T;
    const int ld = k3c_mla_ld(W), ncc = (Rkv + K3C_MLA_COLS - 1) / K3C_MLA_COLS;
    const int nk = terms > 1 ? 2 : 1; /* Ks (and Kl), Ps (and Pl) */
    const size_t sh = (size_t)nk * K3C_MLA_TILE * ld * 2 +
                      (size_t)nk * K3C_MLA_HEADS * K3C_MLA_PLD * 2 +
                      (4 * K3C_MLA_HEADS * K3C_MLA_TILE + 3 * 16) * sizeof(float);
    for (int64_t t0 = 0; t0 < T; t0 += tb) {
        const int64_t nt = T - t0 < tb ? T - t0 : tb;
        j.t0 = t0;
        j.part = part;
        j.lse = part ? part + nt * H * j.ns_max * (int64_t)Rkv : nullptr;
        dim3 grid((unsigned)nt, (unsigned)(((H + K3C_MLA_HEADS - 1) / K3C_MLA_HEADS) * ncc),
                  (unsigned)j.ns_max);
        K3C_LAUNCH(grid, K3C_MLA_THREADS, sh, s, mla_split_kernel)(j);
        if (j.ns_max > 1) {
            dim3 cg((unsigned)nt, (unsigned)H);
            K3C_LAUNCH(cg, 128, 0, s, mla_combine_kernel)(j);
        }
    }
    return (int)cudaGetLastError();
}
