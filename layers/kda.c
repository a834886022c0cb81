/* kda.c — one KDA (Kimi Delta Attention) layer over a batch (K3-MODEL.md §2).
 *
 * Owns: the q/k/v projections, the depthwise causal short conv (+SiLU) with its per-sequence
 * state (the last K-1 PRE-conv inputs, oldest first), L2 norm of q and k (fla: x·rsqrt(Σx²+1e-6)),
 * both decay-gate forms (K3 lower-bound sigmoid, Kimi-Linear softplus), beta, the delta rule
 * (ops->kda_chunked for runs of >= kda_chunk tokens, else ops->kda_recurrent: fp32 state
 * [H, dk, dv] in the sequence state), the gated per-head RMSNorm with K3's full-rank g_proj or
 * Kimi-Linear's g_a/g_b, and o_proj.
 * Projections run once over all T tokens of the batch; the conv and the recurrence run per
 * sequence on its own token run. */
#include "layers_internal.h"

#include <math.h>

#define K3_KDA_L2_EPS 1e-6f /* fla l2norm */

/* PyTorch softplus (beta 1, threshold 20). */
static inline float softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

/* out[t, c] = SiLU(Σ_j w[c, j] · in_{t-(K-1)+j}[c]); in_{<0} from state [K-1, P] (oldest
 * first); then the state becomes the last K-1 inputs of (state ++ in). */
static void short_conv(const float *in, int64_t n, int64_t P, int K, const float *w, float *state,
                       float *out) {
    for (int64_t t = 0; t < n; t++) {
        float *o = out + t * P;
        for (int64_t c = 0; c < P; c++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                int64_t idx = t - (K - 1) + j;
                float v = idx >= 0 ? in[idx * P + c] : state[(idx + (K - 1)) * P + c];
                acc += w[c * K + j] * v;
            }
            o[c] = acc;
        }
    }
    /* new state: window of the last K-1 inputs */
    int km1 = K - 1;
    if (km1 <= 0) return;
    if (n >= km1) {
        memcpy(state, in + (n - km1) * P, (size_t)km1 * (size_t)P * sizeof(float));
    } else {
        int64_t keep = km1 - n; /* oldest rows shift up */
        memmove(state, state + n * P, (size_t)keep * (size_t)P * sizeof(float));
        memcpy(state + keep * P, in, (size_t)n * (size_t)P * sizeof(float));
    }
}

k3_status k3_layers_kda(k3_stage *s, int layer, const k3_batch *b, const float *x, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[layer];
    const layer_vecs *lv = &s->vec[layer];
    const k3_ops *ops = s->ops;
    const int H = c->kda_n_heads, dk = c->kda_head_dim, dv = c->kda_head_dim,
              K = c->kda_conv_kernel;
    const int64_t P = (int64_t)H * dk;
    int64_t T = 0;
    for (int i = 0; i < b->n_seqs; i++) T += b->n_tokens[i];

    K3_TRY(ops->matmul(x, T, &lw->q_proj, s->kq));
    K3_TRY(ops->matmul(x, T, &lw->k_proj, s->kk));
    K3_TRY(ops->matmul(x, T, &lw->v_proj, s->kv));
    K3_TRY(ops->matmul(x, T, &lw->f_a, s->kfa));
    K3_TRY(ops->matmul(s->kfa, T, &lw->f_b, s->kr));
    K3_TRY(ops->matmul(x, T, &lw->b_proj, s->kbeta));
    ops->sigmoid(s->kbeta, T * H, s->kbeta);
    if (c->kda_full_rank_gate) {
        K3_TRY(ops->matmul(x, T, &lw->g_proj, s->kg));
    } else {
        K3_TRY(ops->matmul(x, T, &lw->g_a, s->kfa));
        K3_TRY(ops->matmul(s->kfa, T, &lw->g_b, s->kg));
    }

    /* decay gate, log space, per head and key channel */
    for (int64_t t = 0; t < T; t++) {
        float *r = s->kr + t * P;
        for (int h = 0; h < H; h++) {
            float a = lv->a_exp[h];
            for (int i = 0; i < dk; i++) {
                int64_t ch = (int64_t)h * dk + i;
                float v = r[ch] + lv->dt_bias[ch];
                r[ch] = c->kda_has_lower_bound
                            ? c->kda_gate_lower_bound * (1.0f / (1.0f + expf(-a * v)))
                            : -a * softplus(v);
            }
        }
    }

    const int seq_state_idx = s->slot[layer];
    const float scale = 1.0f / sqrtf((float)dk);
    int64_t t0 = 0;
    for (int i = 0; i < b->n_seqs; i++) {
        k3_seq_state *st = b->states[i];
        int64_t n = b->n_tokens[i];
        float *conv = st->conv + (size_t)seq_state_idx * 3 * (size_t)(K - 1) * (size_t)P;
        float *S = st->S + (size_t)seq_state_idx * (size_t)H * dk * dv;
        float *src[3] = {s->kq + t0 * P, s->kk + t0 * P, s->kv + t0 * P};
        float *dst[3] = {s->kqc + t0 * P, s->kkc + t0 * P, s->kvc + t0 * P};
        for (int j = 0; j < 3; j++) {
            short_conv(src[j], n, P, K, lv->conv[j], conv + (size_t)j * (K - 1) * P, dst[j]);
            ops->silu(dst[j], n * P, dst[j]);
        }
        ops->l2norm(dst[0], n * H, dk, K3_KDA_L2_EPS, dst[0]);
        ops->l2norm(dst[1], n * H, dk, K3_KDA_L2_EPS, dst[1]);
        const float *g = s->kr + t0 * P, *beta = s->kbeta + t0 * H;
        float *o = s->ko + t0 * P;
        if (s->kda_chunk > 1 && n >= s->kda_chunk)
            ops->kda_chunked(dst[0], dst[1], dst[2], g, beta, n, H, dk, dv, scale, S, o,
                             s->kda_chunk, s->kwork);
        else
            ops->kda_recurrent(dst[0], dst[1], dst[2], g, beta, n, H, dk, dv, scale, S, o);
        t0 += n;
    }

    /* gated RMSNorm per head: RMSNorm(o[h]; o_norm) ⊙ σ(G[h]) */
    ops->rmsnorm(s->ko, lv->o_norm, T * H, dv, c->rms_norm_eps, s->ko);
    ops->sigmoid(s->kg, T * P, s->kg);
    for (int64_t e = 0; e < T * P; e++) s->ko[e] *= s->kg[e];
    return ops->matmul(s->ko, T, &lw->o_proj, y);
}
