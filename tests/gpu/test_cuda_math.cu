// test_cuda_math.cu — the cuda kernels' math on the host (label unit; no device needed). Every
// kernel of kernels/cuda/ keeps its per-element / per-row arithmetic in __host__ __device__
// functions (kernels/cuda/cuda_math.cuh); this test runs those functions on the CPU through the
// kernels' own lane loops and reduction trees (a block of 256 threads or a warp of 32 lanes,
// emulated in order) and compares them with kernels/ref on random inputs within
// tests/tolerances.h. It checks the arithmetic and the reduction orders, not the launches, the
// indexing of threads onto data or the memory traffic: those need the gpu-label test
// (tests/gpu/test_cuda_ops.c) on a device.
#define _Noreturn [[noreturn]] /* k3_base.h / k3_kernels.h are C11 headers */
#define _Static_assert static_assert
extern "C" {
#include "k3_kernels.h"
#include "k3_kernels_internal.h"
}
#include "k3_test.h"
#include "tolerances.h"

#include <vector>

#include "cuda_math.cuh"

static k3_rng g_rng;
static const uint64_t k_seed = 20261130;
static k3_backend *g_ref;

typedef std::vector<float> fv;

static fv randn(int64_t n, float sd) {
    fv x((size_t)n);
    for (auto &v : x) v = sd * k3_rng_normal(&g_rng);
    return x;
}
static fv nans(int64_t n) {
    return fv((size_t)n, NAN);
}
static double rel(const fv &a, const fv &b) {
    return k3_rel_l2(a.data(), b.data(), a.size());
}
static bool finite_nondegenerate(const fv &a) {
    float lo = a[0], hi = a[0];
    for (float v : a) {
        if (!isfinite(v)) return false;
        lo = fminf(lo, v), hi = fmaxf(hi, v);
    }
    return hi - lo > 1e-3f;
}
#define CHECK_REL(got, want, tol, what)                                                            \
    K3_CHECK(finite_nondegenerate(want) && rel(got, want) < (tol), "%s: rel-L2 %g (tol %g)", what, \
             rel(got, want), (double)(tol))

/* ---- pointwise ------------------------------------------------------------------------------ */
static void test_pointwise(void) {
    const int64_t n = 1000;
    fv g = randn(n, 3.0f), u = randn(n, 3.0f);
    const char *names[4] = {"silu", "sigmoid", "situ", "swiglu"};
    for (int op = 0; op < 4; op++) {
        fv want = nans(n), got = nans(n);
        if (op == 0) K3_CHECK_OK(g_ref->ops->silu(g_ref, g.data(), n, want.data()));
        if (op == 1) K3_CHECK_OK(g_ref->ops->sigmoid(g_ref, g.data(), n, want.data()));
        if (op == 2)
            K3_CHECK_OK(g_ref->ops->situ(g_ref, g.data(), u.data(), n, 4.0f, 2.5f, want.data()));
        if (op == 3) K3_CHECK_OK(g_ref->ops->swiglu(g_ref, g.data(), u.data(), n, want.data()));
        for (int64_t i = 0; i < n; i++)
            got[i] = op == 0   ? k3c_silu(g[i])
                     : op == 1 ? k3c_sigm(g[i])
                     : op == 2 ? k3c_situ(g[i], u[i], 4.0f, 2.5f)
                               : k3c_swiglu(g[i], u[i]);
        CHECK_REL(got, want, K3_TOL_OP_REL_L2, names[op]);
    }
    /* situ with lin_beta <= 0: u unchanged */
    fv want = nans(n), got = nans(n);
    K3_CHECK_OK(g_ref->ops->situ(g_ref, g.data(), u.data(), n, 4.0f, 0.0f, want.data()));
    for (int64_t i = 0; i < n; i++) got[i] = k3c_situ(g[i], u[i], 4.0f, 0.0f);
    CHECK_REL(got, want, K3_TOL_OP_REL_L2, "situ (no linear cap)");
}

/* ---- decodes: every bf16 / f16 bit pattern ------------------------------------------------- */
static void test_decode(void) {
    int bad_bf = 0, bad_h = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = k3c_bf16((uint16_t)h), b = k3_bf16_to_f32((uint16_t)h);
        float c = k3c_f16((uint16_t)h), d = k3_f16_to_f32((uint16_t)h);
        bad_bf += memcmp(&a, &b, 4) != 0;
        bad_h += memcmp(&c, &d, 4) != 0;
    }
    K3_CHECK(bad_bf == 0 && bad_h == 0, "decode: %d bf16 and %d f16 patterns differ", bad_bf,
             bad_h);
}

/* ---- norms, softmax, AttnRes (one block of K3C_ROW_THREADS per row) ------------------------ */
static const int NT = K3C_ROW_THREADS;
static float block_sum_sumsq(const float *x, int64_t n) {
    float p[NT];
    for (int l = 0; l < NT; l++) p[l] = k3c_sumsq_part(x, n, l, NT);
    return k3c_block_tree(p, NT, false);
}
static void test_norms(void) {
    const int64_t T = 5, n = 1000;
    fv x = randn(T * n, 1.5f), w = randn(n, 1.0f);
    for (int l2 = 0; l2 < 2; l2++) {
        fv want = nans(T * n), got = nans(T * n);
        if (l2)
            K3_CHECK_OK(g_ref->ops->l2norm(g_ref, x.data(), T, n, 1e-6f, want.data()));
        else
            K3_CHECK_OK(g_ref->ops->rmsnorm(g_ref, x.data(), w.data(), T, n, 1e-6f, want.data()));
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x.data() + t * n;
            float ss = block_sum_sumsq(xt, n);
            float r = l2 ? k3c_l2_scale(ss, 1e-6f) : k3c_rms_scale(ss, n, 1e-6f);
            for (int64_t i = 0; i < n; i++) got[t * n + i] = (l2 ? 1.0f : w[i]) * (xt[i] * r);
        }
        CHECK_REL(got, want, K3_TOL_OP_REL_L2, l2 ? "l2norm" : "rmsnorm");
    }
}
static void softmax_row(const float *x, int64_t n, float *y) {
    float p[NT];
    for (int l = 0; l < NT; l++) p[l] = k3c_max_part(x, n, l, NT);
    float m = k3c_block_tree(p, NT, true);
    for (int l = 0; l < NT; l++) p[l] = k3c_expsum_part(x, m, n, l, NT, y);
    float z = k3c_block_tree(p, NT, false);
    for (int64_t i = 0; i < n; i++) y[i] /= z;
}
static void test_softmax(void) {
    const int64_t T = 4, n = 777;
    fv x = randn(T * n, 4.0f), want = nans(T * n), got = nans(T * n);
    K3_CHECK_OK(g_ref->ops->softmax(g_ref, x.data(), T, n, want.data()));
    for (int64_t t = 0; t < T; t++) softmax_row(x.data() + t * n, n, got.data() + t * n);
    CHECK_REL(got, want, K3_TOL_OP_REL_L2, "softmax");
}
static void test_attnres(void) {
    const int64_t T = 3, D = 700;
    const int N = 5;
    fv bank = randn(N * T * D, 1.0f), p = randn(T * D, 1.0f), w = randn(D, 0.3f);
    fv want = nans(T * D), got = nans(T * D);
    K3_CHECK_OK(g_ref->ops->attnres_mix(g_ref, bank.data(), N, p.data(), w.data(), T, D, 1e-6f,
                                        want.data()));
    for (int64_t t = 0; t < T; t++) {
        float s[64], m = -INFINITY, z = 0.0f;
        for (int i = 0; i <= N; i++) {
            const float *v = i < N ? bank.data() + ((int64_t)i * T + t) * D : p.data() + t * D;
            float r = k3c_rms_scale(block_sum_sumsq(v, D), D, 1e-6f);
            float q[NT];
            for (int l = 0; l < NT; l++) q[l] = k3c_normdot_part(v, r, w.data(), D, l, NT);
            s[i] = k3c_block_tree(q, NT, false);
        }
        for (int i = 0; i <= N; i++) m = s[i] > m ? s[i] : m;
        for (int i = 0; i <= N; i++) s[i] = expf(s[i] - m), z += s[i];
        for (int i = 0; i <= N; i++) s[i] /= z;
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int i = 0; i < N; i++) acc = fmaf(s[i], bank[((int64_t)i * T + t) * D + d], acc);
            got[t * D + d] = fmaf(s[N], p[t * D + d], acc);
        }
    }
    CHECK_REL(got, want, K3_TOL_OP_REL_L2, "attnres_mix");
}

/* ---- matmul / matmul_tn -------------------------------------------------------------------- */
struct weight {
    k3_tensor t;
    std::vector<uint8_t> data, scale;
};
static weight make_weight(k3_dtype dt, int64_t out, int64_t in) {
    weight w;
    const int64_t n = out * in;
    w.data.resize(dt == K3_DT_F32 ? n * 4 : dt == K3_DT_BF16 ? n * 2 : n / 2);
    if (dt == K3_DT_F32)
        for (int64_t i = 0; i < n; i++) ((float *)w.data.data())[i] = k3_rng_normal(&g_rng);
    else if (dt == K3_DT_BF16)
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)w.data.data())[i] = k3_f32_to_bf16(k3_rng_normal(&g_rng));
    else {
        for (auto &b : w.data) b = (uint8_t)k3_rng_u64(&g_rng);
        w.scale.resize(n / 32);
        for (auto &e : w.scale) e = (uint8_t)(122 + k3_rng_u64(&g_rng) % 8);
    }
    w.t = k3_tensor{};
    w.t.dtype = dt;
    w.t.ndim = 2;
    w.t.shape[0] = out;
    w.t.shape[1] = in;
    w.t.data = w.data.data();
    w.t.scale = dt == K3_DT_MXFP4 ? w.scale.data() : nullptr;
    w.t.mem = K3_MEM_HOST;
    return w;
}
static void test_matmul(void) {
    const struct {
        k3_dtype dt;
        int64_t in;
        bool vec;
    } cases[] = {{K3_DT_F32, 1088, true},   {K3_DT_F32, 1101, false},  {K3_DT_BF16, 1088, true},
                 {K3_DT_BF16, 1100, false}, {K3_DT_MXFP4, 1088, true}, {K3_DT_MXFP4, 64, true},
                 {K3_DT_MXFP4, 1088, false}};
    const int64_t out = 37, T = 3;
    for (const auto &cs : cases) {
        weight W = make_weight(cs.dt, out, cs.in);
        fv x = randn(T * cs.in, 1.0f), want = nans(T * out), got = nans(T * out);
        K3_CHECK_OK(g_ref->ops->matmul(g_ref, x.data(), T, &W.t, want.data()));
        const int ebytes = cs.dt == K3_DT_F32 ? 4 : 2;
        for (int64_t o = 0; o < out; o++) {
            const uint8_t *row = cs.dt == K3_DT_MXFP4 ? W.data.data() + o * cs.in / 2
                                                      : W.data.data() + o * cs.in * ebytes;
            const uint8_t *srow =
                cs.dt == K3_DT_MXFP4 ? W.scale.data() + o * (cs.in / 32) : nullptr;
            for (int64_t t = 0; t < T; t++)
                got[t * out + o] =
                    k3c_gemv_row((int)cs.dt, cs.vec, row, srow, x.data() + t * cs.in, cs.in);
        }
        char what[64];
        snprintf(what, sizeof what, "matmul %s in=%lld %s", k3_dtype_name(cs.dt), (long long)cs.in,
                 cs.vec ? "vector" : "scalar");
        CHECK_REL(got, want, K3_TOL_OP_REL_L2, what);

        /* matmul_tn: y[t, i] = Σ_o x[t, o] W[o, i], o by slices */
        fv xt = randn(T * out, 1.0f), want2 = nans(T * cs.in), got2 = nans(T * cs.in);
        K3_CHECK_OK(g_ref->ops->matmul_tn(g_ref, xt.data(), T, &W.t, want2.data()));
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < cs.in; i++)
                got2[t * cs.in + i] =
                    k3c_tn_col((int)cs.dt, W.t.data, W.t.scale, out, cs.in, xt.data() + t * out, i);
        snprintf(what, sizeof what, "matmul_tn %s in=%lld", k3_dtype_name(cs.dt), (long long)cs.in);
        CHECK_REL(got2, want2, K3_TOL_OP_REL_L2, what);
    }
}

/* ---- KDA pieces ---------------------------------------------------------------------------- */
static void test_kda_gate_conv(void) {
    const int64_t T = 6;
    const int H = 3, dk = 16;
    const int64_t P = (int64_t)H * dk;
    fv r = randn(T * P, 2.0f), dtb = randn(P, 0.5f), alog = randn(H, 0.5f);
    for (int lb = 0; lb < 2; lb++) {
        fv want = r, got = r;
        K3_CHECK_OK(g_ref->ops->kda_gate(g_ref, want.data(), dtb.data(), alog.data(), T, H, dk,
                                         lb != 0, -5.0f));
        for (int64_t i = 0; i < T * P; i++)
            got[i] = k3c_kda_gate(got[i], dtb[i % P], expf(alog[(i % P) / dk]), lb != 0, -5.0f);
        CHECK_REL(got, want, K3_TOL_OP_REL_L2, lb ? "kda_gate (lower bound)" : "kda_gate");
    }
    const int K = 4;
    const int64_t ns[3] = {7, 2, 1}; /* more than, fewer than, one of K - 1 rows */
    for (int64_t n : ns) {
        fv in = randn(n * P, 1.0f), w = randn(P * K, 0.5f), st = randn((K - 1) * P, 1.0f);
        fv st_ref = st, st_got = st, want = nans(n * P), got = nans(n * P);
        K3_CHECK_OK(g_ref->ops->short_conv(g_ref, in.data(), n, P, K, w.data(), st_ref.data(),
                                           want.data()));
        for (int64_t c = 0; c < P; c++)
            k3c_short_conv_col(in.data() + c, n, P, K, w.data() + c * K, st_got.data() + c,
                               got.data() + c);
        CHECK_REL(got, want, K3_TOL_OP_REL_L2, "short_conv out");
        K3_CHECK(memcmp(st_got.data(), st_ref.data(), st_got.size() * 4) == 0,
                 "short_conv state (n=%lld)", (long long)n);
    }
}

struct kda_in {
    fv q, k, v, g, beta;
};
static kda_in make_kda(int64_t n, int H, int dk, int dv) {
    kda_in a;
    a.q = randn(n * H * dk, 1.0f);
    a.k = randn(n * H * dk, 1.0f);
    a.v = randn(n * H * dv, 1.0f);
    a.g = randn(n * H * dk, 1.0f);
    a.beta = fv((size_t)(n * H));
    for (auto &b : a.beta) b = (float)k3_rng_uniform(&g_rng);
    for (auto &x : a.g) x = -0.3f * fabsf(x) - 0.01f; /* log decay < 0 */
    /* q, k L2-normalised per head, as the layer feeds them */
    for (fv *p : {&a.q, &a.k})
        for (int64_t r = 0; r < n * H; r++) {
            float ss = 0;
            for (int i = 0; i < dk; i++) ss += (*p)[r * dk + i] * (*p)[r * dk + i];
            for (int i = 0; i < dk; i++) (*p)[r * dk + i] /= sqrtf(ss);
        }
    return a;
}
/* the recurrence of kda.cu head_recurrent: per token e/k/q staged, each column j stepped */
static void emu_recurrent(const kda_in &a, int64_t t0, int64_t n, int H, int dk, int dv,
                          float scale, float *S, float *o) {
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    std::vector<float> e(dk), k(dk), q(dk);
    for (int h = 0; h < H; h++)
        for (int64_t t = t0; t < t0 + n; t++) {
            for (int i = 0; i < dk; i++) {
                e[i] = expf(a.g[t * sqk + h * dk + i]);
                k[i] = a.k[t * sqk + h * dk + i];
                q[i] = a.q[t * sqk + h * dk + i];
            }
            for (int j = 0; j < dv; j++)
                o[t * svo + h * dv + j] =
                    k3c_kda_col_step(S + (int64_t)h * dk * dv + j, dv, dk, e.data(), k.data(),
                                     q.data(), a.v[t * svo + h * dv + j], a.beta[t * H + h], scale);
        }
}
static void test_kda(void) {
    const int64_t n = 70; /* two chunks of 32 and a ragged tail of 6 */
    const int H = 2, dk = 16, dv = 24, C = 32, nt = 256;
    const float scale = 0.25f;
    kda_in a = make_kda(n, H, dk, dv);
    fv S0 = randn((int64_t)H * dk * dv, 0.5f);
    /* recurrent */
    fv S_ref = S0, S_got = S0, want = nans(n * H * dv), got = nans(n * H * dv);
    K3_CHECK_OK(g_ref->ops->kda_recurrent(g_ref, a.q.data(), a.k.data(), a.v.data(), a.g.data(),
                                          a.beta.data(), n, H, dk, dv, scale, S_ref.data(),
                                          want.data()));
    emu_recurrent(a, 0, n, H, dk, dv, scale, S_got.data(), got.data());
    CHECK_REL(got, want, K3_TOL_KDA_REL_L2, "kda_recurrent o");
    CHECK_REL(S_got, S_ref, K3_TOL_KDA_REL_L2, "kda_recurrent S");
    /* chunked: the phases for every thread of a 256-thread block in turn, then the tail */
    const size_t wf = k3_kda_chunk_work_floats(C, dk, dv);
    fv work_ref((size_t)H * wf), work_got((size_t)H * wf);
    fv S2_ref = S0, S2_got = S0, want2 = nans(n * H * dv), got2 = nans(n * H * dv);
    K3_CHECK_OK(g_ref->ops->kda_chunked(g_ref, a.q.data(), a.k.data(), a.v.data(), a.g.data(),
                                        a.beta.data(), n, H, dk, dv, scale, S2_ref.data(),
                                        want2.data(), C, work_ref.data()));
    std::vector<double> row(C);
    int64_t tail0 = 0;
    for (int h = 0; h < H; h++) {
        k3c_kda_chunk c;
        c.q = a.q.data() + h * dk, c.k = a.k.data() + h * dk, c.v = a.v.data() + h * dv;
        c.g = a.g.data() + h * dk, c.beta = a.beta.data() + h;
        c.sqk = (int64_t)H * dk, c.svo = (int64_t)H * dv, c.sb = H;
        c.dk = dk, c.dv = dv, c.C = C, c.scale = scale;
        c.S = S2_got.data() + (int64_t)h * dk * dv, c.o = got2.data() + h * dv;
        k3c_kda_chunk_layout(&c, (double *)(work_got.data() + (size_t)h * wf), row.data());
        for (c.t0 = 0; c.t0 + C <= n; c.t0 += C) {
            for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p1(&c, tid, nt);
            for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p2(&c, tid, nt);
            for (int i = 1; i < C; i++) {
                for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p3(&c, i, tid, nt);
                for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p4(&c, i, tid, nt);
            }
            for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p5(&c, tid, nt);
            for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p6(&c, tid, nt);
            for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p7(&c, tid, nt);
            for (int tid = 0; tid < nt; tid++) k3c_kda_chunk_p8(&c, tid, nt);
        }
        tail0 = c.t0;
    }
    K3_CHECK(tail0 == 64, "kda_chunked: tail starts at %lld", (long long)tail0);
    emu_recurrent(a, tail0, n - tail0, H, dk, dv, scale, S2_got.data(), got2.data());
    CHECK_REL(got2, want2, K3_TOL_KDA_CHUNK_REL_L2, "kda_chunked o");
    CHECK_REL(S2_got, S2_ref, K3_TOL_KDA_CHUNK_REL_L2, "kda_chunked S");
}

/* ---- latent attention ---------------------------------------------------------------------- */
static void test_attn_latent(void) {
    const int64_t n_ctx = 45;
    const int H = 3, Rkv = 64, W = 80;
    const float scale = 0.125f;
    fv qc = randn((int64_t)H * W, 1.0f), cache = randn(n_ctx * W, 1.0f);
    fv want = nans((int64_t)H * Rkv), got = nans((int64_t)H * Rkv), work((size_t)(H * n_ctx));
    K3_CHECK_OK(g_ref->ops->attn_latent(g_ref, qc.data(), cache.data(), n_ctx, H, W, Rkv, scale,
                                        want.data(), work.data()));
    fv wk((size_t)(H * n_ctx));
    for (int h = 0; h < H; h++) {
        for (int64_t j = 0; j < n_ctx; j++) { /* scores_kernel: a warp per (h, j) */
            float p[K3C_WARP];
            for (int l = 0; l < K3C_WARP; l++)
                p[l] = k3c_gemv_part(K3C_DT_F32, false, cache.data() + j * W, nullptr,
                                     qc.data() + (int64_t)h * W, W, l, K3C_WARP);
            wk[h * n_ctx + j] = k3c_xor_tree(p) * scale;
        }
        float *w = wk.data() + h * n_ctx, p[NT]; /* mix_kernel: a block per head */
        for (int l = 0; l < NT; l++) p[l] = k3c_max_part(w, n_ctx, l, NT);
        float m = k3c_block_tree(p, NT, true);
        for (int l = 0; l < NT; l++) p[l] = k3c_expsum_part(w, m, n_ctx, l, NT, w);
        float z = k3c_block_tree(p, NT, false);
        for (int i = 0; i < Rkv; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n_ctx; j++) acc = fmaf(w[j] / z, cache[j * W + i], acc);
            got[(int64_t)h * Rkv + i] = acc;
        }
    }
    CHECK_REL(got, want, K3_TOL_OP_REL_L2, "attn_latent");
}

/* ---- MoE router: the same selection as ref, bit for bit, ties included --------------------- */
static void test_topk(void) {
    const int64_t T = 40;
    const int E = 64, K = 6, G = 8, TG = 4;
    fv s((size_t)(T * E)), bias = randn(E, 0.01f);
    for (auto &v : s) v = (float)(k3_rng_u64(&g_rng) % 8) / 8.0f; /* many exact ties */
    for (int b = 0; b < 2; b++)
        for (int renorm = 0; renorm < 2; renorm++) {
            const float *bp = b ? bias.data() : nullptr;
            fv work_r((size_t)(T * E)), work_g((size_t)(T * E)), w_r = nans(T * K),
                                                                 w_g = nans(T * K);
            std::vector<int32_t> id_r((size_t)(T * K), -1), id_g((size_t)(T * K), -2);
            K3_CHECK_OK(g_ref->ops->moe_topk(g_ref, s.data(), bp, T, E, K, G, TG, renorm != 0, 2.5f,
                                             work_r.data(), id_r.data(), w_r.data()));
            float gs[K3C_TOPK_MAX_GROUPS];
            unsigned char gk[K3C_TOPK_MAX_GROUPS];
            int rc = -1;
            for (int64_t t = 0; t < T && rc == -1; t++)
                rc = k3c_topk_token(s.data() + t * E, bp, E, K, G, TG, renorm != 0, 2.5f,
                                    work_g.data() + t * E, id_g.data() + t * K, w_g.data() + t * K,
                                    gs, gk);
            K3_CHECK(rc == -1 && id_g == id_r &&
                         memcmp(w_g.data(), w_r.data(), w_r.size() * 4) == 0,
                     "moe_topk (bias %d, renorm %d): ids/weights differ from ref", b, renorm);
        }
    /* a non-finite score: as ref, experts 0..K-1 with NaN weights (the token fails alone) */
    fv s1(s.begin(), s.begin() + E), work((size_t)E), w((size_t)K), w_r((size_t)K);
    std::vector<int32_t> ids((size_t)K), id_r((size_t)K);
    s1[9] = NAN;
    s1[20] = INFINITY;
    K3_CHECK_OK(g_ref->ops->moe_topk(g_ref, s1.data(), nullptr, 1, E, K, G, TG, true, 1.0f,
                                     work.data(), id_r.data(), w_r.data()));
    float gs[K3C_TOPK_MAX_GROUPS];
    unsigned char gk[K3C_TOPK_MAX_GROUPS];
    K3_CHECK(k3c_topk_token(s1.data(), nullptr, E, K, G, TG, true, 1.0f, work.data(), ids.data(),
                            w.data(), gs, gk) == -1,
             "moe_topk: a non-finite score is no error");
    bool nan_w = true;
    for (int k = 0; k < K; k++)
        nan_w = nan_w && ids[k] == k && id_r[k] == k && w[k] != w[k] && w_r[k] != w_r[k]; /* NaN */
    K3_CHECK(nan_w, "moe_topk: a non-finite score gives experts 0..K-1 with NaN weights");
}

/* ---- rows_wsum ----------------------------------------------------------------------------- */
static void test_wsum(void) {
    const int64_t width = 33, rows = 12;
    const int64_t seg[5] = {0, 3, 4, 9, 12};
    fv x = randn(rows * width, 1.0f), w = randn(rows, 1.0f);
    for (int uni = 0; uni < 2; uni++)
        for (int wt = 0; wt < 2; wt++) {
            const int64_t n_seg = uni ? 3 : 4;
            const int64_t *sg = uni ? nullptr : seg;
            const float *wp = wt ? w.data() : nullptr;
            fv want = nans(n_seg * width), got = nans(n_seg * width);
            K3_CHECK_OK(
                g_ref->ops->rows_wsum(g_ref, x.data(), wp, sg, 4, n_seg, width, want.data()));
            for (int64_t j = 0; j < n_seg; j++)
                for (int64_t d = 0; d < width; d++)
                    got[j * width + d] = k3c_wsum_elem(x.data(), wp, sg ? sg[j] : j * 4,
                                                       sg ? sg[j + 1] : (j + 1) * 4, width, d);
            CHECK_REL(got, want, K3_TOL_OP_REL_L2, "rows_wsum");
        }
}

/* ---- varlen batches: the sequence of a token, the paged row, the paged attention -------- */
/* k3c_seq_of against a linear scan over random batches (1..40 sequences of 1..9 tokens) */
static void test_seq_of(void) {
    int bad = 0, checked = 0;
    for (int rep = 0; rep < 50; rep++) {
        const int n = 1 + (int)(k3_rng_u64(&g_rng) % 40);
        std::vector<int32_t> tok0((size_t)n + 1, 0);
        for (int i = 0; i < n; i++) tok0[i + 1] = tok0[i] + 1 + (int32_t)(k3_rng_u64(&g_rng) % 9);
        for (int64_t t = 0; t < tok0[n]; t++) {
            int want = 0;
            while (tok0[want + 1] <= t) want++;
            bad += k3c_seq_of(tok0.data(), n, t) != want;
            checked++;
        }
    }
    K3_CHECK(bad == 0 && checked > 500, "k3c_seq_of: %d of %d tokens in the wrong sequence", bad,
             checked);
}
/* k3c_kv_row against the host descriptor's k3_seqs_kv_row on a random block table */
static void test_kv_row(void) {
    const int n = 5, mb = 7;
    std::vector<int32_t> blocks((size_t)n * mb);
    for (size_t b = 0; b < blocks.size(); b++) blocks[b] = (int32_t)((b * 37 + 11) % blocks.size());
    k3_seqs sq = {};
    sq.n_seqs = n;
    sq.max_blocks = mb;
    sq.blocks = blocks.data();
    int bad = 0;
    for (int i = 0; i < n; i++)
        for (int64_t p = 0; p < (int64_t)mb * K3C_KV_BLOCK; p++)
            bad += k3c_kv_row(blocks.data() + (int64_t)i * mb, p) != k3_seqs_kv_row(&sq, i, p);
    K3_CHECK(bad == 0 && K3C_KV_BLOCK == K3_KV_BLOCK, "k3c_kv_row: %d rows differ", bad);
}
/* The host image of one (token, head) block of attn.cu paged_kernel: warps' scores of a tile
   (xor tree of the lanes' partials), thread tid's max / Σ exp over positions tid, tid + 256, ...,
   the block trees, then p_j = exp(s_j − m) / z and o[e] = Σ_j p_j·row_j[e] in order. keep: the
   scores the block keeps (a context longer than keep is recomputed per tile in each pass; the
   numbers are the same, which the caller checks by running both). */
static void emu_paged(const float *q, const float *cache, const int32_t *bt, int64_t n, int W,
                      int Rkv, float scale, int64_t keep, float *o) {
    const int TL = 256;
    const bool store = (n + TL - 1) / TL * TL <= keep;
    fv sc((size_t)(store ? keep : TL));
    auto tile = [&](int64_t j0, float *st) {
        for (int r = 0; r < TL && j0 + r < n; r++) {
            const float *row = cache + k3c_kv_row(bt, j0 + r) * W;
            float p[K3C_WARP];
            for (int l = 0; l < K3C_WARP; l++)
                p[l] = k3c_gemv_part(K3C_DT_F32, false, row, nullptr, q, W, l, K3C_WARP);
            st[r] = k3c_xor_tree(p) * scale;
        }
    };
    float m_t[TL], z_t[TL];
    for (int tid = 0; tid < TL; tid++) m_t[tid] = -INFINITY, z_t[tid] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += TL) {
        float *st = store ? sc.data() + j0 : sc.data();
        tile(j0, st);
        for (int tid = 0; tid < TL; tid++)
            if (j0 + tid < n) m_t[tid] = fmaxf(m_t[tid], st[tid]);
    }
    const float m = k3c_block_tree(m_t, TL, true);
    for (int64_t j0 = 0; j0 < n; j0 += TL) {
        float *st = store ? sc.data() + j0 : sc.data();
        if (!store) tile(j0, st);
        for (int tid = 0; tid < TL; tid++)
            if (j0 + tid < n) z_t[tid] += expf(st[tid] - m);
    }
    const float z = k3c_block_tree(z_t, TL, false);
    for (int e = 0; e < Rkv; e++) o[e] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += TL) {
        float *st = store ? sc.data() + j0 : sc.data();
        if (!store) tile(j0, st);
        for (int r = 0; r < TL && j0 + r < n; r++) st[r] = expf(st[r] - m) / z;
        for (int r = 0; r < TL && j0 + r < n; r++) {
            const float *row = cache + k3c_kv_row(bt, j0 + r) * W;
            for (int e = 0; e < Rkv; e++) o[e] = fmaf(st[r], row[e], o[e]);
        }
    }
}
/* attn_paged's math: a sequence's positions scattered over shuffled blocks, stored and
   recomputed scores, against ref attn_latent on the contiguous copy (rel-L2) and against the
   host image of attn.cu's attn_latent kernels on that copy (bit for bit: the contract) */
static void test_attn_paged(void) {
    const int H = 2, Rkv = 48, W = 72, nb = 8;
    const float scale = 0.125f;
    const int64_t n_ctx = 300; /* 5 blocks, a ragged last one; two score tiles */
    fv pool = randn((int64_t)nb * K3C_KV_BLOCK * W, 1.0f), qc = randn((int64_t)H * W, 1.0f);
    const int32_t bt[5] = {6, 1, 7, 3, 0};
    fv cont((size_t)(n_ctx * W));
    for (int64_t j = 0; j < n_ctx; j++)
        memcpy(cont.data() + j * W, pool.data() + k3c_kv_row(bt, j) * W, (size_t)W * 4);
    fv want = nans((int64_t)H * Rkv), work((size_t)(H * n_ctx));
    K3_CHECK_OK(g_ref->ops->attn_latent(g_ref, qc.data(), cont.data(), n_ctx, H, W, Rkv, scale,
                                        want.data(), work.data()));
    fv kept = nans((int64_t)H * Rkv), redo = nans((int64_t)H * Rkv), flat = nans((int64_t)H * Rkv);
    for (int h = 0; h < H; h++) {
        const float *q = qc.data() + (int64_t)h * W;
        emu_paged(q, pool.data(), bt, n_ctx, W, Rkv, scale, 512, kept.data() + h * Rkv);
        emu_paged(q, pool.data(), bt, n_ctx, W, Rkv, scale, 256, redo.data() + h * Rkv);
        /* attn_latent's kernels (scores_kernel + mix_kernel) on the contiguous copy */
        fv wk((size_t)n_ctx);
        for (int64_t j = 0; j < n_ctx; j++) {
            float p[K3C_WARP];
            for (int l = 0; l < K3C_WARP; l++)
                p[l] = k3c_gemv_part(K3C_DT_F32, false, cont.data() + j * W, nullptr, q, W, l,
                                     K3C_WARP);
            wk[j] = k3c_xor_tree(p) * scale;
        }
        float p[NT];
        for (int l = 0; l < NT; l++) p[l] = k3c_max_part(wk.data(), n_ctx, l, NT);
        const float m = k3c_block_tree(p, NT, true);
        for (int l = 0; l < NT; l++) p[l] = k3c_expsum_part(wk.data(), m, n_ctx, l, NT, wk.data());
        const float z = k3c_block_tree(p, NT, false);
        for (int e = 0; e < Rkv; e++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n_ctx; j++) acc = fmaf(wk[j] / z, cont[j * W + e], acc);
            flat[(int64_t)h * Rkv + e] = acc;
        }
    }
    CHECK_REL(kept, want, K3_TOL_OP_REL_L2, "attn_paged (scores kept)");
    K3_CHECK(memcmp(kept.data(), flat.data(), kept.size() * 4) == 0,
             "attn_paged: not attn_latent's bits on the contiguous copy");
    K3_CHECK(memcmp(kept.data(), redo.data(), kept.size() * 4) == 0,
             "attn_paged: recomputed scores differ from kept ones");
}

/* ---- moe_experts: one item (W1, W3, act, W2 rows) and the slot sum ------------------------ */
/* Items and their weighted slot sum by the helpers moe.cu's kernels call (k3c_gemv_row with
   matmul's path choice, k3c_moe_act, k3c_wsum_step), against ref matmul -> swiglu / situ ->
   matmul -> rows_wsum; and the sum bit for bit k3c_wsum_elem over the items (rows_wsum's
   kernel on this backend). */
static void test_moe_items(void) {
    const int64_t Lw = 96, I = 64, K = 3, T = 4, n = T * K;
    const k3_dtype dts[2] = {K3_DT_BF16, K3_DT_MXFP4};
    for (int d = 0; d < 2; d++)
        for (int a = 0; a < 2; a++) {
            const float beta = a ? 4.0f : -1.0f, lin = a ? 2.5f : 0.0f;
            weight W1 = make_weight(dts[d], I, Lw), W3 = make_weight(dts[d], I, Lw);
            weight W2 = make_weight(dts[d], Lw, I);
            fv src = randn(T * Lw, 1.0f), wts = randn(n, 0.5f);
            fv g = nans(n * I), u = nans(n * I), item_r = nans(n * Lw), sum_r = nans(T * Lw);
            fv x = nans(n * Lw);
            for (int64_t i = 0; i < n; i++)
                memcpy(x.data() + i * Lw, src.data() + (i / K) * Lw, (size_t)Lw * 4);
            K3_CHECK_OK(g_ref->ops->matmul(g_ref, x.data(), n, &W1.t, g.data()));
            K3_CHECK_OK(g_ref->ops->matmul(g_ref, x.data(), n, &W3.t, u.data()));
            if (a)
                K3_CHECK_OK(
                    g_ref->ops->situ(g_ref, g.data(), u.data(), n * I, beta, lin, g.data()));
            else
                K3_CHECK_OK(g_ref->ops->swiglu(g_ref, g.data(), u.data(), n * I, g.data()));
            K3_CHECK_OK(g_ref->ops->matmul(g_ref, g.data(), n, &W2.t, item_r.data()));
            K3_CHECK_OK(g_ref->ops->rows_wsum(g_ref, item_r.data(), wts.data(), nullptr, K, T, Lw,
                                              sum_r.data()));
            const bool v1 = k3c_mm_vec((int)dts[d], W1.t.data, Lw, true);
            const bool v2 = k3c_mm_vec((int)dts[d], W2.t.data, I, true);
            K3_CHECK(v1 && v2, "moe items: the vector path (aligned weights, whole chunks)");
            const int eb = dts[d] == K3_DT_MXFP4 ? 0 : 2;
            auto row_of = [&](const weight &Wm, int64_t o, int64_t in) {
                return eb ? Wm.data.data() + o * in * eb : Wm.data.data() + o * in / 2;
            };
            auto srow_of = [&](const weight &Wm, int64_t o, int64_t in) {
                return eb ? (const uint8_t *)nullptr : Wm.scale.data() + o * (in / 32);
            };
            fv h = nans(n * I), item = nans(n * Lw), sum = nans(T * Lw), sum_e = nans(T * Lw);
            for (int64_t i = 0; i < n; i++) {
                const float *xi = src.data() + (i / K) * Lw;
                for (int64_t o = 0; o < I; o++) {
                    float gv = k3c_gemv_row((int)dts[d], v1, row_of(W1, o, Lw), srow_of(W1, o, Lw),
                                            xi, Lw);
                    float uv = k3c_gemv_row((int)dts[d], v1, row_of(W3, o, Lw), srow_of(W3, o, Lw),
                                            xi, Lw);
                    h[i * I + o] = k3c_moe_act(gv, uv, beta, lin);
                }
            }
            for (int64_t t = 0; t < T; t++)
                for (int64_t o = 0; o < Lw; o++) {
                    float acc = 0.0f;
                    for (int64_t k = 0; k < K; k++) {
                        const int64_t i = t * K + k;
                        const float v = k3c_gemv_row((int)dts[d], v2, row_of(W2, o, I),
                                                     srow_of(W2, o, I), h.data() + i * I, I);
                        item[i * Lw + o] = v;
                        acc = k3c_wsum_step(acc, wts.data(), i, v, k == 0);
                    }
                    sum[t * Lw + o] = acc;
                }
            for (int64_t t = 0; t < T; t++)
                for (int64_t o = 0; o < Lw; o++)
                    sum_e[t * Lw + o] =
                        k3c_wsum_elem(item.data(), wts.data(), t * K, (t + 1) * K, Lw, o);
            char what[64];
            snprintf(what, sizeof what, "moe items %s %s", k3_dtype_name(dts[d]),
                     a ? "situ" : "swiglu");
            CHECK_REL(item, item_r, K3_TOL_OP_REL_L2, what);
            CHECK_REL(sum, sum_r, K3_TOL_OP_REL_L2, what);
            K3_CHECK(memcmp(sum.data(), sum_e.data(), sum.size() * 4) == 0,
                     "%s: slot sum is not rows_wsum's arithmetic", what);
        }
}

int main(void) {
    printf("test_cuda_math seed %llu (host emulation of the cuda kernels' math)\n",
           (unsigned long long)k_seed);
    k3_rng_seed(&g_rng, k_seed);
    K3_CHECK_OK(k3_backend_create("ref", nullptr, &g_ref));
    if (!g_ref) return k3_test_done("cuda_math");
    test_pointwise();
    test_decode();
    test_norms();
    test_softmax();
    test_attnres();
    test_matmul();
    test_kda_gate_conv();
    test_kda();
    test_attn_latent();
    test_topk();
    test_wsum();
    test_seq_of();
    test_kv_row();
    test_attn_paged();
    test_moe_items();
    k3_backend_destroy(g_ref);
    return k3_test_done("cuda_math");
}
