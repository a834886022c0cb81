/* mla.c — one MLA layer over a batch (K3-MODEL.md §3): NoPE, absorbed form, K3 output gate.
 *
 * Owns: q LoRA (q_a_proj → RMSNorm(eps = mla_norm_eps) → q_b_proj) or a plain q_proj,
 * kv_a_proj_with_mqa → [c = RMSNorm(·[0:Rkv]) | k_pe] written to the sequence's latent cache
 * (Rkv + dr floats per token — 576 for K3), the absorbed attention
 *   q_abs[h] = W_UK[h]ᵀ q_nope[h];  s = scale·(q_abs·c_s + q_pe·k_pe_s), causal softmax;
 *   o_lat[h] = Σ_s p_s c_s;  attn[h] = W_UV[h] o_lat[h]
 * (the same path for prefill and decode: each query token attends to the cache up to its own
 * position, so results do not depend on how the prompt is chunked), the sigmoid output gate
 * σ(g_proj x) and o_proj. kv_b_proj rows of head h: [h·(dn+dv), +dn) = W_UK[h], next dv = W_UV[h].
 */
#include "layers_internal.h"

#include <math.h>

k3_status k3_layers_mla(k3_stage *s, int layer, const k3_batch *b, const float *x, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[layer];
    const layer_vecs *lv = &s->vec[layer];
    const k3_ops *ops = s->ops;
    const int H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
              dv = c->v_head_dim;
    const int Rkv = c->kv_lora_rank, W = Rkv + dr;
    const int64_t qw = (int64_t)H * (dn + dr);
    int64_t T = 0;
    for (int i = 0; i < b->n_seqs; i++) T += b->n_tokens[i];

    /* q */
    if (c->q_lora_rank > 0) {
        K3_TRY(ops->matmul(x, T, &lw->q_a_proj, s->mcq));
        ops->rmsnorm(s->mcq, lv->q_a_norm, T, c->q_lora_rank, c->mla_norm_eps, s->mcq);
        K3_TRY(ops->matmul(s->mcq, T, &lw->q_b_proj, s->mq));
    } else {
        K3_TRY(ops->matmul(x, T, &lw->q_proj_mla, s->mq));
    }
    /* latent [c | k_pe] of every new token, into each sequence's cache */
    K3_TRY(ops->matmul(x, T, &lw->kv_a_proj, s->mckv));
    for (int64_t t = 0; t < T; t++)
        ops->rmsnorm(s->mckv + t * W, lv->kv_a_norm, 1, Rkv, c->mla_norm_eps, s->mckv + t * W);
    {
        int64_t t0 = 0;
        for (int i = 0; i < b->n_seqs; i++) {
            k3_seq_state *st = b->states[i];
            float *cache =
                st->mla + ((size_t)s->slot[layer] * (size_t)st->max_ctx + (size_t)st->pos) * W;
            memcpy(cache, s->mckv + t0 * W, (size_t)b->n_tokens[i] * W * sizeof(float));
            t0 += b->n_tokens[i];
        }
    }

    /* absorbed queries qc[t, h] = [W_UK[h]ᵀ q_nope[h] | q_pe[h]] */
    for (int h = 0; h < H; h++) {
        k3_tensor wuk;
        K3_TRY(k3_tensor_rows(&lw->kv_b_proj, (int64_t)h * (dn + dv), dn, &wuk));
        for (int64_t t = 0; t < T; t++)
            memcpy(s->mtmp_in + t * dn, s->mq + t * qw + (int64_t)h * (dn + dr),
                   (size_t)dn * sizeof(float));
        K3_TRY(ops->matmul_tn(s->mtmp_in, T, &wuk, s->mtmp_out)); /* [T, Rkv] */
        for (int64_t t = 0; t < T; t++) {
            float *qc = s->mqc + (t * H + h) * W;
            memcpy(qc, s->mtmp_out + t * Rkv, (size_t)Rkv * sizeof(float));
            memcpy(qc + Rkv, s->mq + t * qw + (int64_t)h * (dn + dr) + dn,
                   (size_t)dr * sizeof(float));
        }
    }

    /* attention of each token over its own sequence's cache up to its position */
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    {
        int64_t t = 0;
        for (int i = 0; i < b->n_seqs; i++) {
            k3_seq_state *st = b->states[i];
            const float *cache = st->mla + (size_t)s->slot[layer] * (size_t)st->max_ctx * W;
            for (int j = 0; j < b->n_tokens[i]; j++, t++)
                ops->attn_latent(s->mqc + t * H * W, cache, st->pos + j + 1, H, W, Rkv, scale,
                                 s->molat + t * H * Rkv, s->mwork);
        }
    }

    /* attn[t, h] = W_UV[h] o_lat[t, h] */
    for (int h = 0; h < H; h++) {
        k3_tensor wuv;
        K3_TRY(k3_tensor_rows(&lw->kv_b_proj, (int64_t)h * (dn + dv) + dn, dv, &wuv));
        for (int64_t t = 0; t < T; t++)
            memcpy(s->mtmp_in + t * Rkv, s->molat + (t * H + h) * Rkv, (size_t)Rkv * sizeof(float));
        K3_TRY(ops->matmul(s->mtmp_in, T, &wuv, s->mtmp_out)); /* [T, dv] */
        for (int64_t t = 0; t < T; t++)
            memcpy(s->mattn + t * H * dv + (int64_t)h * dv, s->mtmp_out + t * dv,
                   (size_t)dv * sizeof(float));
    }

    if (c->mla_use_output_gate) {
        K3_TRY(ops->matmul(x, T, &lw->g_proj, s->mgate));
        ops->sigmoid(s->mgate, T * H * dv, s->mgate);
        for (int64_t e = 0; e < T * H * dv; e++) s->mattn[e] *= s->mgate[e];
    }
    return ops->matmul(s->mattn, T, &lw->o_proj, y);
}
