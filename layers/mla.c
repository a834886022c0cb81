/* mla.c — one MLA layer over a batch (K3-MODEL.md §3): NoPE, absorbed form, K3 output gate.
 *
 * Owns: q LoRA (q_a_proj → RMSNorm(eps = mla_norm_eps) → q_b_proj) or a plain q_proj,
 * kv_a_proj_with_mqa → [c = RMSNorm(·[0:Rkv]) | k_pe] written to the sequence's pages of the
 * paged latent cache (Rkv + dr floats per token — 576 for K3), the absorbed attention
 *   q_abs[h] = W_UK[h]ᵀ q_nope[h];  s = scale·(q_abs·c_s + q_pe·k_pe_s), causal softmax;
 *   o_lat[h] = Σ_s p_s c_s;  attn[h] = W_UV[h] o_lat[h]
 * (the same path for prefill and decode: each query token attends to the cache up to its own
 * position, so results do not depend on how the prompt is chunked), the sigmoid output gate
 * σ(g_proj x) and o_proj. kv_b_proj rows of head h: [h·(dn+dv), +dn) = W_UK[h], next dv = W_UV[h].
 * One op call covers every sequence, head and token of the batch (the descriptor sq). */
#include "layers_internal.h"

#include <math.h>

k3_status k3_layers_mla(k3_stage *s, int layer, const k3_seqs *sq, const float *x, float *y) {
    const k3_config *c = s->c;
    const k3_layer_w *lw = &s->w->layers[layer];
    const layer_vecs *lv = &s->vec[layer];
    k3_backend *be = s->be;
    const k3_ops *ops = be->ops;
    const int H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
              dv = c->v_head_dim;
    const int Rkv = c->kv_lora_rank, W = Rkv + dr;
    const int64_t T = sq->T, qw = (int64_t)H * (dn + dr);
    float *cache = s->kv_pool + (size_t)s->slot[layer] * (size_t)s->n_blocks * K3_KV_BLOCK * W;

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
    /* c = RMSNorm of the first Rkv floats of each W-wide latent row; every row to its page */
    K3_TRY(ops->rmsnorm_rows(be, s->mckv, W, lv->kv_a_norm, T, Rkv, c->mla_norm_eps, s->mckv, W));
    K3_TRY(ops->kv_write(be, sq, s->mckv, W, cache));

    /* absorbed queries qc[t, h] = [W_UK[h]ᵀ q_nope[h] | q_pe[h]]: W_UK[h] = kv_b_proj rows
       [h·(dn+dv), +dn); the q_pe of every (token, head) row in one copy */
    K3_TRY(ops->matmul_heads(be, s->mq, qw, dn + dr, T, H, &lw->kv_b_proj, 0, dn + dv, dn, true,
                             s->mqc, (int64_t)H * W, W, s->mhwork));
    K3_TRY(ops->copy2d(be, s->mqc + Rkv, W, s->mq + dn, dn + dr, T * H, dr));

    /* every token over its own sequence's pages up to its position, the whole batch at once */
    const float scale = 1.0f / sqrtf((float)(dn + dr));
    K3_TRY(ops->attn_paged(be, sq, s->mqc, cache, H, W, Rkv, scale, s->molat, s->mwork));

    /* attn[t, h] = W_UV[h] o_lat[t, h]: W_UV[h] = kv_b_proj rows [h·(dn+dv) + dn, +dv) */
    K3_TRY(ops->matmul_heads(be, s->molat, (int64_t)H * Rkv, Rkv, T, H, &lw->kv_b_proj, dn, dn + dv,
                             dv, false, s->mattn, (int64_t)H * dv, dv, s->mhwork));

    if (c->mla_use_output_gate) {
        K3_TRY(ops->sigmoid(be, s->mgate, T * H * dv, s->mgate));
        K3_TRY(ops->mul(be, s->mattn, s->mgate, T * H * dv, s->mattn));
    }
    return ops->matmul(be, s->mattn, T, &lw->o_proj, y);
}
