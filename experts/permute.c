/* permute.c — the token permutation behind MoE dispatch (pure, no transport).
 *
 * Owns: k3_moe_permute, which orders the T·K slot rows of a batch by (owner rank, expert, slot)
 * so a transport can send one contiguous range per destination rank, and gives the inverse so
 * the combined outputs can be put back into slot order. Deterministic: the order depends only
 * on the expert ids and the owner map (a counting sort, stable in slot index). */
#include "k3_experts.h"

k3_status k3_moe_permute(const int32_t *expert, int64_t n, const int32_t *owner, int n_experts,
                         int n_ranks, int64_t *counts, int64_t *perm, int64_t *inv, int64_t *work) {
    if (n < 0) return K3_ERR(K3_ERR_ARG, "MoE permute: n = %lld rows < 0", (long long)n);
    if (n_experts <= 0 || n_ranks <= 0)
        return K3_ERR(K3_ERR_ARG, "MoE permute: n_experts = %d and n_ranks = %d must be > 0",
                      n_experts, n_ranks);
    for (int e = 0; e < n_experts; e++) {
        if (owner[e] < 0 || owner[e] >= n_ranks)
            return K3_ERR(K3_ERR_ARG, "MoE permute: expert %d has owner rank %d outside [0, %d)", e,
                          owner[e], n_ranks);
    }
    for (int64_t i = 0; i < n; i++) {
        if (expert[i] < 0 || expert[i] >= n_experts)
            return K3_ERR(K3_ERR_ARG, "MoE permute: row %lld has expert id %d outside [0, %d)",
                          (long long)i, expert[i], n_experts);
    }
    /* rows per expert, then per rank */
    for (int e = 0; e < n_experts; e++) work[e] = 0;
    for (int r = 0; r < n_ranks; r++) counts[r] = 0;
    for (int64_t i = 0; i < n; i++) work[expert[i]]++;
    for (int e = 0; e < n_experts; e++) counts[owner[e]] += work[e];
    /* first send position of each expert: ranks in order, experts ascending within a rank
     * (O(n_ranks · n_experts); both are at most a few thousand). */
    int64_t pos = 0;
    for (int r = 0; r < n_ranks; r++) {
        for (int e = 0; e < n_experts; e++) {
            if (owner[e] != r) continue;
            int64_t cnt = work[e];
            work[e] = pos; /* now: next free position of expert e */
            pos += cnt;
        }
    }
    /* stable in slot index: rows visited in increasing i */
    for (int64_t i = 0; i < n; i++) {
        int64_t j = work[expert[i]]++;
        perm[j] = i;
        inv[i] = j;
    }
    return K3_OK;
}
