/* experts — the latent MoE of one layer (K3-MODEL.md §4.3), without any transport.
 *
 * Owns: the router (fp32 sigmoid scores, e_score_correction_bias for selection only, grouped
 * top-k, renormalise, routed_scaling_factor), the latent down-projection, the routed expert
 * compute on rows (W2 · act(W1 r, W3 r), MXFP4 or BF16 weights), the slot-order weighted sum +
 * latent RMSNorm + up-projection, the shared experts, and the pure token-permutation helper
 * used by the distributed dispatch (H7's comm/).
 * Callers must not: pick a transport here, or sum expert outputs in any order other than the
 * top-k slot order (k = 0..K-1) — that order is what makes every S×E split bit-identical.
 *
 * Conventions (shared with the PyTorch reference in tests/reference/):
 * - Slot order: slot k of token t is the k-th best expert by biased score s' = σ(z) + bias,
 *   descending; EQUAL s' values are broken towards the LOWER expert index. Groups (n_group > 1)
 *   are ranked by the sum of their two best s' values, descending, equal sums broken towards the
 *   LOWER group index (a group of one expert scores that expert alone); experts of groups not
 *   kept are masked to -inf (DeepSeek-V3 "noaux_tc"; n_group = 1 is the plain top-k).
 *   NOTE: torch.topk does NOT promise this tie rule (it returns ties in arbitrary order); a
 *   reference that must agree on ties has to use torch.sort(descending=True, stable=True).
 * - Weights: w_k = σ(z)[I_k] (UNBIASED); if moe_renormalize, w_k / (Σ_k w_k + 1e-20) with the sum
 *   taken in slot order; then × routed_scaling_factor.
 * - Row layout: the T·K routed rows of a batch are in slot order, row i = t·K + k; the expert id
 *   of row i is topk_ids[i] (topk_ids is [T, K] row-major, so it IS the [n] expert array).
 * - Rows are Lw = latent_size wide (K3: 3584), or D wide when latent_size == 0 (Kimi-Linear:
 *   experts on the hidden size, no latent norm / up-projection).
 * - Every output row of k3_moe_expert_rows depends only on its own input row and expert (bitwise;
 *   it relies on the kernel determinism rule of kernels/k3_kernels.h).
 *
 * Scratch: every compute function takes a float scratch buffer of at least
 * k3_moe_scratch_floats(c, T) floats (T = the token count of the call; for k3_moe_expert_rows
 * with n rows use k3_moe_rows_scratch_floats(c, n)), 8-byte aligned (k3_alloc gives 64; int64
 * indices live in it). The functions never allocate. */
#ifndef K3_EXPERTS_H
#define K3_EXPERTS_H

#include "k3_base.h"
#include "k3_kernels.h"
#include "k3_model.h"

/* Upper bound on n_group handled by the grouped top-k (group scores live on the stack). */
#define K3_MOE_MAX_GROUPS 1024

/* Width of one routed row: latent_size, or hidden_size when there is no latent. */
int64_t k3_moe_row_width(const k3_config *c);

/* Check that the MoE part of a config is usable by this module (K within the kept groups,
 * n_group divides n_experts, ...). Errors name the config key (K3_ERR_CONFIG). */
k3_status k3_moe_check_config(const k3_config *c);

/* ---- routing ------------------------------------------------------------------------------ */
/* x: [T, D] post-norm input. Writes topk ids [T, K] and weights [T, K] (renormalised, scaled).
 * scratch: >= k3_moe_scratch_floats(c, T) (it uses T·n_experts·2). */
k3_status k3_moe_route(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw, const float *x,
                       int64_t T, int32_t *topk_ids, float *topk_w, float *scratch);

/* The selection step of the router alone (pure; exported for tests and the reference check).
 * scores: σ(z) [T, E]; biased: σ(z) + bias [T, E] — OVERWRITTEN (masked groups / taken experts).
 * Writes topk_ids [T, K] and topk_w [T, K]. Errors on non-finite scores (naming token and expert).
 */
k3_status k3_moe_select(const k3_config *c, const float *scores, float *biased, int64_t T,
                        int32_t *topk_ids, float *topk_w);

/* ---- latent down-projection ---------------------------------------------------------------- */
/* r[T, Lw] = lat_down · x (x [T, D]); a copy of x when latent_size == 0. */
k3_status k3_moe_down(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw, const float *x,
                      int64_t T, float *r);
/* rows[T·K, Lw]: row t·K + k = r[t] (the slot-order rows handed to a k3_moe_exchange hook).
 * rows may alias r (the expansion runs backwards in place). */
void k3_moe_expand_rows(const float *r, int64_t T, int K, int64_t Lw, float *rows);

/* ---- routed experts ------------------------------------------------------------------------ */
/* rows [n, Lw] with expert ids [n] -> out [n, Lw] = W2·act(W1 r, W3 r), row by row
 * (order-independent; rows of one expert are batched through ops->matmul in tiles).
 * Errors: expert id out of range or not loaded on this rank (naming row and expert). An expert
 * counts as loaded when its k3_expert_w has .present set or holds tensor data.
 * scratch: >= k3_moe_rows_scratch_floats(c, n). */
k3_status k3_moe_expert_rows(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw,
                             const float *rows, const int32_t *expert, int64_t n, float *out,
                             float *scratch);
size_t k3_moe_rows_scratch_floats(const k3_config *c, int64_t n);

/* ---- combine + shared ---------------------------------------------------------------------- */
/* y[t] = up(RMSNorm(Σ_k w[t,k]·expert_out[t*K+k]  summed in k order)) + shared(x[t]) ; y [T, D].
 * x [T, D] (post-norm input, for the shared experts), topk_w [T, K], expert_out [T·K, Lw]
 * (UNWEIGHTED expert outputs in slot order). */
k3_status k3_moe_finish(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw, const float *x,
                        const float *topk_w, const float *expert_out, int64_t T, float *y,
                        float *scratch);

/* ---- the whole layer, single process ------------------------------------------------------- */
/* route -> down -> expert rows -> finish with every expert local; bitwise identical to driving
 * the four steps by hand (the token loop is tiled, so the scratch does not hold T·K rows).
 * x [T, D] -> y [T, D]. y must not alias x. */
k3_status k3_moe_forward(const k3_ops *ops, const k3_config *c, const k3_layer_w *lw,
                         const float *x, int64_t T, float *y, float *scratch);

/* Floats of scratch enough for every function above called with T tokens (k3_moe_expert_rows
 * with n <= T·K rows included). */
size_t k3_moe_scratch_floats(const k3_config *c, int64_t T);

/* ---- token permutation for dispatch (pure) -------------------------------------------------- */
/* Given the n = T·K slot rows' expert ids [n] and owner[e] (rank owning expert e, in
 * [0, n_ranks)), computes
 *   counts[n_ranks]  rows going to each rank,
 *   perm[n]          perm[j] = slot row placed at send position j; positions are sorted by
 *                    (owner rank, expert, slot) — rank r's rows are the contiguous range starting
 *                    at Σ_{r'<r} counts[r'],
 *   inv[n]           inv[perm[j]] = j (where slot row i went).
 * work: int64_t [n_experts] scratch. Errors name the bad row / expert / owner. */
k3_status k3_moe_permute(const int32_t *expert, int64_t n, const int32_t *owner, int n_experts,
                         int n_ranks, int64_t *counts, int64_t *perm, int64_t *inv, int64_t *work);

#endif /* K3_EXPERTS_H */
