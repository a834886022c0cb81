/* experts — the latent MoE of one layer (K3-MODEL.md §4.3), without any transport.
 *
 * Owns: the router (fp32 sigmoid scores, e_score_correction_bias for selection only, grouped
 * top-k, renormalise, routed_scaling_factor), the latent down-projection, the routed expert
 * compute on rows (W2 · act(W1 r, W3 r), MXFP4 or BF16 weights), latent RMSNorm + up-projection
 * of the weighted expert sum, the shared experts, and the single-process layer forward. The
 * distributed MoE step (dispatch, combine) is driven by the stage (layers/stage.c) through the
 * comm handle it is given; this module never picks a transport.
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
 * Scratch: every compute function takes a backend float scratch of at least
 * k3_moe_scratch_floats(c, T) floats (T = the token count of the call; for k3_moe_expert_rows
 * with n rows use k3_moe_rows_scratch_floats(c, n)). k3_moe_expert_rows, whose rows and expert
 * ids are host metadata, sorts them on the host in an int64 scratch of k3_moe_rows_host_ints(c,
 * n) (k3_moe_host_ints(c, T) covers n <= T·K); nothing else touches host memory. The functions
 * never allocate. */
#ifndef K3_EXPERTS_H
#define K3_EXPERTS_H

#include "k3_base.h"
#include "k3_kernels.h"
#include "k3_model.h"

/* Upper bound on n_group (the moe_topk op keeps group scores on the stack). */
#define K3_MOE_MAX_GROUPS 1024

/* Width of one routed row: latent_size, or hidden_size when there is no latent. */
int64_t k3_moe_row_width(const k3_config *c);

/* Check that the MoE part of a config is usable by this module (K within the kept groups,
 * n_group divides n_experts, ...). Errors name the config key (K3_ERR_CONFIG). */
k3_status k3_moe_check_config(const k3_config *c);

/* ---- routing ------------------------------------------------------------------------------ */
/* x: [T, D] post-norm input. Writes topk ids [T, K] (int32) and weights [T, K] (renormalised,
 * scaled) through the backend's moe_topk op. scratch: >= k3_moe_scratch_floats(c, T). */
k3_status k3_moe_router(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                        int64_t T, int32_t *topk_ids, float *topk_w, float *scratch);

/* ---- latent down-projection ---------------------------------------------------------------- */
/* r[T, Lw] = lat_down · x (x [T, D]); a copy of x when latent_size == 0. r must not alias x. */
k3_status k3_moe_down(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                      int64_t T, float *r);

/* ---- routed experts ------------------------------------------------------------------------ */
/* out [n, Lw]: out[i] = W2·act(W1 r_i, W3 r_i) of expert expert[i] with r_i = src[row_of[i]]
 * (row_of NULL: r_i = src[i]). row_of, expert: host [n]. Rows of one expert are batched through
 * ops->matmul in tiles; each output row depends only on its own input row and expert.
 * Errors: expert id out of range or not loaded on this rank (naming row and expert). An expert
 * counts as loaded when its k3_expert_w has .present set or holds tensor data.
 * scratch: >= k3_moe_rows_scratch_floats(c, n); hscratch: >= k3_moe_rows_host_ints(c, n). */
k3_status k3_moe_expert_rows(k3_backend *be, const k3_config *c, const k3_layer_w *lw,
                             const float *src, const int64_t *row_of, const int32_t *expert,
                             int64_t n, float *out, float *scratch, int64_t *hscratch);
size_t k3_moe_rows_scratch_floats(const k3_config *c, int64_t n);
size_t k3_moe_rows_host_ints(const k3_config *c, int64_t n);

/* ---- finish: latent norm + up-projection + shared ------------------------------------------ */
/* y[t] = up(RMSNorm(acc[t])) + shared(x[t]) ; y [T, D]. acc [T, Lw] is the weighted expert sum
 * (the slot sum Σ_k w[t,k]·out[t·K+k] in k order — the op rows_wsum — or, distributed without
 * --deterministic, the sum of the owners' pre-sums); x [T, D] the post-norm input. */
k3_status k3_moe_finish(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                        const float *acc, int64_t T, float *y, float *scratch);

/* ---- the whole layer, single process ------------------------------------------------------- */
/* route -> down -> expert rows -> slot sum -> finish with every expert local. x [T, D] ->
 * y [T, D]; y must not alias x. Everything stays on the backend: the expert ids and weights
 * never come to the host, and the op calls (about a dozen: router, down, ONE moe_experts for the
 * expert rows and their slot sum, finish) do not depend on T or on the routing. The op tiles
 * tokens itself, so the scratch does not hold T·K rows; results are bit for bit the steps above
 * done one by one (k3_moe_expert_rows with row_of[i] = i / K, then rows_wsum). Every loaded
 * expert's shapes are checked against the config; an expert a row needs that is not loaded is
 * an error naming the row and the expert (K3_ERR_MISSING). No host scratch. */
k3_status k3_moe_forward(k3_backend *be, const k3_config *c, const k3_layer_w *lw, const float *x,
                         int64_t T, float *y, float *scratch);

/* Backend floats of scratch enough for every function above called with T tokens
 * (k3_moe_expert_rows with n <= T·K rows included), and the host int64s that k3_moe_expert_rows
 * needs for up to T·K rows (k3_moe_forward needs none). */
size_t k3_moe_scratch_floats(const k3_config *c, int64_t T);
size_t k3_moe_host_ints(const k3_config *c, int64_t T);

#endif /* K3_EXPERTS_H */
