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
    k3_backend *be = s->be;
    const k3_ops *ops = be->ops;
    const int H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
              dv = c->v_head_dim;
    const int Rkv = c->kv_lora_rank, W = Rkv + dr;
    const int64_t qw = (int64_t)H * (dn + dr);
    int64_t T = 0;
    for (int i = 0; i < b->n_seqs; i++) T += b->n_tokens[i];

    /* the projections of x in one dispatch: q (low-rank: its first half), the latent
       [c | k_pe] of every new token, the output gate */
    const bool qlr = c->q_lora_rank > 0;
    const k3_mm proj[3] = {qlr ? (k3_mm){x, T, &lw->q_a_proj, s->mcq}
                               : (k3_mm){x, T, &lw->q_proj_mla, s->mq},
                           {x, T, &lw->kv_a_proj, s->mckv},
                           {x, T, &lw->g_proj, s->mgate}};
    K3_TRY(ops->matmul_group(be, proj, c->mla_use_output_gate ? 3 : 2));
    if (qlr) {
        K3_TRY(ops->rmsnorm(be, s->mcq, lv->q_a_norm, T, c->q_lora_rank, c->mla_norm_eps, s->mcq));
        K3_TRY(ops->matmul(be, s->mcq, T, &lw->q_b_proj, s->mq));
    }
    for (int64_t t = 0; t < T; t++)
        K3_TRY(ops->rmsnorm(be, s->mckv + t * W, lv->kv_a_norm, 1, Rkv, c->mla_norm_eps,
                            s->mckv + t * W));
    {
        int64_t t0 = 0;
        for (int i = 0; i < b->n_seqs; i++) {
            k3_seq_state *st = b->states[i];
            float *cache =
                st->mla + ((size_t)s->slot[layer] * (size_t)st->max_ctx + (size_t)st->pos) * W;
            K3_TRY(ops->copy2d(be, cache, W, s->mckv + t0 * W, W, b->n_tokens[i], W));
            t0 += b->n_tokens[i];
        }
    }

    /* absorbed queries qc[t, h] = [W_UK[h]ᵀ q_nope[h] | q_pe[h]] */
    for (int h = 0; h < H; h++) {
        k3_tensor wuk;
        K3_TRY(k3_tensor_rows(&lw->kv_b_proj, (int64_t)h * (dn + dv), dn, &wuk));
        K3_TRY(ops->copy2d(be, s->mtmp_in, dn, s->mq + (int64_t)h * (dn + dr), qw, T, dn));
        K3_TRY(ops->matmul_tn(be, s->mtmp_in, T, &wuk, s->mtmp_out)); /* [T, Rkv] */
        float *qc = s->mqc + (int64_t)h * W;                          /* row t at + t·H·W */
        K3_TRY(ops->copy2d(be, qc, (int64_t)H * W, s->mtmp_out, Rkv, T, Rkv));
        K3_TRY(ops->copy2d(be, qc + Rkv, (int64_t)H * W, s->mq + (int64_t)h * (dn + dr) + dn, qw, T,
                           dr));
    }

    /* attention of each token over its own sequence's cache up to its position: one causal call
       per sequence (its tokens sit at st->pos, st->pos + 1, ...; mwork is [H, max_ctx]) */
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    {
        int64_t t = 0;
        for (int i = 0; i < b->n_seqs; i++) {
            k3_seq_state *st = b->states[i];
            const float *cache = st->mla + (size_t)s->slot[layer] * (size_t)st->max_ctx * W;
            K3_TRY(ops->attn_latent_causal(be, s->mqc + t * H * W, cache, st->pos, b->n_tokens[i],
                                           H, W, Rkv, scale, s->molat + t * H * Rkv, s->mwork));
            t += b->n_tokens[i];
        }
    }

    /* attn[t, h] = W_UV[h] o_lat[t, h] */
    for (int h = 0; h < H; h++) {
        k3_tensor wuv;
        K3_TRY(k3_tensor_rows(&lw->kv_b_proj, (int64_t)h * (dn + dv) + dn, dv, &wuv));
        K3_TRY(ops->copy2d(be, s->mtmp_in, Rkv, s->molat + (int64_t)h * Rkv, (int64_t)H * Rkv, T,
                           Rkv));
        K3_TRY(ops->matmul(be, s->mtmp_in, T, &wuv, s->mtmp_out)); /* [T, dv] */
        K3_TRY(
            ops->copy2d(be, s->mattn + (int64_t)h * dv, (int64_t)H * dv, s->mtmp_out, dv, T, dv));
    }

    if (c->mla_use_output_gate) {
        K3_TRY(ops->sigmoid(be, s->mgate, T * H * dv, s->mgate));
        K3_TRY(ops->mul(be, s->mattn, s->mgate, T * H * dv, s->mattn));
    }
    return ops->matmul(be, s->mattn, T, &lw->o_proj, y);
}
