/* tolerances.h — every numeric tolerance of the test suite, derived in one place.
 * fp32 has a unit roundoff u = 2^-24 ≈ 6e-8. A reduction of n terms in a different order
 * differs by at most ~n·u relative in the worst case and ~sqrt(n)·u typically. */
#ifndef K3_TOLERANCES_H
#define K3_TOLERANCES_H

#define K3_FP32_U 5.9604644775390625e-8 /* 2^-24 */

/* Whole-model logits vs the independent PyTorch reference (fp32 both sides, different
 * reduction orders and libm): the bound. */
#define K3_TOL_GOLDEN_LOGITS_REL_L2 1e-5
/* Same engine, different prefill chunking / decode-vs-prefill (only reduction order and the
 * chunked-vs-recurrent KDA form differ). */
#define K3_TOL_CHUNK_INVARIANCE_REL_L2 1e-6
/* Distributed without --deterministic: combine pre-sums in another order. */
#define K3_TOL_DISTRIBUTED_REL_L2 1e-5

#endif /* K3_TOLERANCES_H */
