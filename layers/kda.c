/* kda.c — one KDA (Kimi Delta Attention) layer over a batch (K3-MODEL.md §2).
 *
 * Owns: the q/k/v projections, the depthwise causal short conv (the short_conv op, + SiLU) with
 * its per-sequence state (the last K-1 PRE-conv inputs, oldest first), L2 norm of q and k (fla:
 * x·rsqrt(Σx²+1e-6)), both decay-gate forms (K3 lower-bound sigmoid, Kimi-Linear softplus), beta,
 * the delta rule (the kda_chunked op for runs of >= kda_chunk tokens, else kda_recurrent: fp32
 * state [H, dk, dv] in the sequence state), the gated per-head RMSNorm with K3's full-rank g_proj
 * or Kimi-Linear's g_a/g_b, and o_proj. Projections run once over all T tokens of the batch; the
 * conv and the recurrence run per sequence on its own token run. */
#include "layers_internal.h"

#include <math.h>

#define K3_KDA_L2_EPS 1e-6f /* fla l2norm */

k3_status k3_layers_kda(k3_stage *s, int layer, const k3_batch *b, const float *x, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[layer];
    const layer_vecs *lv = &s->vec[layer];
    k3_backend *be = s->be;
    const k3_ops *ops = be->ops;
    const int H = c->kda_n_heads, dk = c->kda_head_dim, dv = c->kda_head_dim,
              K = c->kda_conv_kernel;
    const int64_t P = (int64_t)H * dk;
    int64_t T = 0;
    for (int i = 0; i < b->n_seqs; i++) T += b->n_tokens[i];

    /* the projections of x in one dispatch (the low-rank gate's g_a after f_b: both use kfa) */
    const k3_mm proj[6] = {{x, T, &lw->q_proj, s->kq},    {x, T, &lw->k_proj, s->kk},
                           {x, T, &lw->v_proj, s->kv},    {x, T, &lw->f_a, s->kfa},
                           {x, T, &lw->b_proj, s->kbeta}, {x, T, &lw->g_proj, s->kg}};
    K3_TRY(ops->matmul_group(be, proj, c->kda_full_rank_gate ? 6 : 5));
    K3_TRY(ops->matmul(be, s->kfa, T, &lw->f_b, s->kr));
    K3_TRY(ops->sigmoid(be, s->kbeta, T * H, s->kbeta));
    if (!c->kda_full_rank_gate) {
        K3_TRY(ops->matmul(be, x, T, &lw->g_a, s->kfa));
        K3_TRY(ops->matmul(be, s->kfa, T, &lw->g_b, s->kg));
    }

    /* decay gate, log space, per head and key channel */
    K3_TRY(ops->kda_gate(be, s->kr, lv->dt_bias, lv->a_log, T, H, dk, c->kda_has_lower_bound,
                         c->kda_gate_lower_bound));

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
            K3_TRY(ops->short_conv(be, src[j], n, P, K, lv->conv[j], conv + (size_t)j * (K - 1) * P,
                                   dst[j]));
            K3_TRY(ops->silu(be, dst[j], n * P, dst[j]));
        }
        K3_TRY(ops->l2norm(be, dst[0], n * H, dk, K3_KDA_L2_EPS, dst[0]));
        K3_TRY(ops->l2norm(be, dst[1], n * H, dk, K3_KDA_L2_EPS, dst[1]));
        const float *g = s->kr + t0 * P, *beta = s->kbeta + t0 * H;
        float *o = s->ko + t0 * P;
        if (s->kda_chunk > 1 && n >= s->kda_chunk)
            K3_TRY(ops->kda_chunked(be, dst[0], dst[1], dst[2], g, beta, n, H, dk, dv, scale, S, o,
                                    s->kda_chunk, s->kwork));
        else
            K3_TRY(
                ops->kda_recurrent(be, dst[0], dst[1], dst[2], g, beta, n, H, dk, dv, scale, S, o));
        t0 += n;
    }

    /* gated RMSNorm per head: RMSNorm(o[h]; o_norm) ⊙ σ(G[h]) */
    K3_TRY(ops->rmsnorm(be, s->ko, lv->o_norm, T * H, dv, c->rms_norm_eps, s->ko));
    K3_TRY(ops->sigmoid(be, s->kg, T * P, s->kg));
    K3_TRY(ops->mul(be, s->ko, s->kg, T * P, s->ko));
    return ops->matmul(be, s->ko, T, &lw->o_proj, y);
}
