/* kda.c — one KDA (Kimi Delta Attention) layer over a batch (K3-MODEL.md §2).
 *
 * Owns: the q/k/v projections, the depthwise causal short conv (the short_conv op, + SiLU) with
 * its per-sequence state (the last K-1 PRE-conv inputs, oldest first), L2 norm of q and k (fla:
 * x·rsqrt(Σx²+1e-6)), both decay-gate forms (K3 lower-bound sigmoid, Kimi-Linear softplus), beta,
 * the delta rule (the kda_chunked op for runs of >= kda_chunk tokens, else kda_recurrent: fp32
 * state [H, dk, dv] in the sequence state), the gated per-head RMSNorm with K3's full-rank g_proj
 * or Kimi-Linear's g_a/g_b, and o_proj. Every op runs once over all T tokens of the batch; the
 * conv and the recurrence take the descriptor and run each sequence on its own token run, from
 * its slot of the stage's slot pool. */
#include "layers_internal.h"

#include <math.h>

#define K3_KDA_L2_EPS 1e-6f /* fla l2norm */

k3_status k3_layers_kda(k3_stage *s, int layer, const k3_seqs *sq, const float *x, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[layer];
    const layer_vecs *lv = &s->vec[layer];
    k3_backend *be = s->be;
    const k3_ops *ops = be->ops;
    const int H = c->kda_n_heads, dk = c->kda_head_dim, dv = c->kda_head_dim,
              K = c->kda_conv_kernel;
    const int64_t P = (int64_t)H * dk, T = sq->T;

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

    /* short conv of each sequence from its slot's conv state, SiLU, L2 norm of q and k */
    const int m = s->slot[layer];
    float *src[3] = {s->kq, s->kk, s->kv}, *dst[3] = {s->kqc, s->kkc, s->kvc};
    for (int j = 0; j < 3; j++) { /* q, k, v: three tensors, not a loop over the batch */
        float *conv = s->conv_pool + ((size_t)m * 3 + (size_t)j) * (size_t)(K - 1) * (size_t)P;
        K3_TRY(ops->short_conv_seqs(be, sq, src[j], P, K, lv->conv[j], conv, s->conv_slot, dst[j]));
        K3_TRY(ops->silu(be, dst[j], T * P, dst[j]));
    }
    K3_TRY(ops->l2norm(be, dst[0], T * H, dk, K3_KDA_L2_EPS, dst[0]));
    K3_TRY(ops->l2norm(be, dst[1], T * H, dk, K3_KDA_L2_EPS, dst[1]));

    /* the delta rule of every sequence from its slot's state */
    const float scale = 1.0f / sqrtf((float)dk);
    K3_TRY(ops->kda_seqs(be, sq, dst[0], dst[1], dst[2], s->kr, s->kbeta, H, dk, dv, scale,
                         s->S_pool + (size_t)m * (size_t)H * dk * dv, s->S_slot, s->ko,
                         s->kda_chunk, s->kwork));

    /* gated RMSNorm per head: RMSNorm(o[h]; o_norm) ⊙ σ(G[h]) */
    K3_TRY(ops->rmsnorm(be, s->ko, lv->o_norm, T * H, dv, c->rms_norm_eps, s->ko));
    K3_TRY(ops->sigmoid(be, s->kg, T * P, s->kg));
    K3_TRY(ops->mul(be, s->ko, s->kg, T * P, s->ko));
    return ops->matmul(be, s->ko, T, &lw->o_proj, y);
}
