/* tolerances.h — every numeric tolerance of the test suite, derived in one place.
 * fp32 has a unit roundoff u = 2^-24 ≈ 6e-8. A reduction of n terms in a different order
 * differs by at most ~n·u relative in the worst case and ~sqrt(n)·u typically.
 * Python tests read these #define lines through tests/k3_tolerances.py (TOL["K3_TOL_..."]), so
 * keep each value a literal or an arithmetic expression of literals and earlier defines. */
#ifndef K3_TOLERANCES_H
#define K3_TOLERANCES_H

#define K3_FP32_U 5.9604644775390625e-8 /* 2^-24 */

/* Whole-model logits vs the independent PyTorch reference (fp32 both sides, different
 * reduction orders and libm): the bound. */
#define K3_TOL_GOLDEN_LOGITS_REL_L2 1e-5
/* Same engine, different prefill chunking / decode-vs-prefill (only reduction order and the
 * chunked-vs-recurrent KDA form differ). */
#define K3_TOL_CHUNK_INVARIANCE_REL_L2 1e-6
/* Distributed without --deterministic (the default "pre-summed" combine, layers/stage.c): each
 * owner lane sums w_k·o_k over ITS experts of a token (slot order), and the token's lane adds
 * the owners' partial sums in lane order, instead of one K-term sum in slot order. Only the
 * order of a K-term fp32 sum changes: per element the two orders differ by at most
 * (K-1)·u·Σ_k|w_k o_k| (typically sqrt(K)·u of it) — with K = 4 (tiny) about 1.2e-7 relative
 * per MoE layer. fp32 rounding in one layer moves tiny-model logits ~8x more (measured for the
 * chunked KDA form and the ref/cpu backends), over 7 MoE layers: 7 · 1.2e-7 · 8 ≈ 7e-6 at worst.
 * Measured: 2.7e-6 (2x2, four prompts). Every split of the mpi tier is checked against it, with
 * identical greedy tokens; with --deterministic the logits must be bit-identical instead. */
#define K3_TOL_DISTRIBUTED_REL_L2 1e-5

/* experts/: one MoE layer (or expert rows) in fp32 vs a float64 evaluation of the same weights.
 * The path chains <= 5 fp32 dot products (router/down n = D, w1/w3 n = Lw, w2 n = I, up n = Lw,
 * the K-term slot sum) plus libm tanh/exp/sqrt (~1 ulp). With the test's n <= 96 one dot is off
 * by ~sqrt(n)·u ≈ 6e-7 relative typically (n·u ≈ 6e-6 worst case); measured 2.5e-7..4e-7 for
 * the whole layer. 1e-5 (≈ 170 u) leaves room for the worst case of one stage while any real
 * bug (a wrong weight, slot, activation cap or norm) moves the result by > 2e-3 (measured). */
#define K3_TOL_MOE_F64_REL_L2 1e-5
/* Router near-ties: a token whose float64 biased-score gap between the k-th and (k+1)-th expert
 * (or group) is below this may legitimately route differently in fp32, so the experts tests skip
 * it (and count it: a handful at most, else the input is degenerate). Scores are sigmoid(W x) +
 * bias with |score| < 2; the fp32 logit is a D-term dot product, off by ~sqrt(D)·u ≈ 7e-7 typically
 * and D·u ≈ 7.6e-6 at worst for D = 128 (tiny), and sigmoid' <= 1/4 only shrinks it: 1e-5 covers
 * the worst case. */
#define K3_TOL_ROUTER_NEAR_TIE 1e-5

/* One fp32 op vs a float64 evaluation of the same formula (dot products of n <= 512 terms,
 * norms, softmax): typical error sqrt(n)·u ≈ 1.4e-6 at n = 512, worst case n·u ≈ 3e-5 only for
 * adversarial signs; inputs are random normal, so 1e-5 leaves ~7× margin over typical. */
#define K3_TOL_OP_REL_L2 1e-5
/* KDA recurrence (fp32, 40 steps) vs float64: per step a dk-term dot, and the state carries
 * rounding forward (damped by decay ≤ 1 and the delta rule's projection); 40·sqrt(dk)·u ≈ 1e-5. */
#define K3_TOL_KDA_REL_L2 2e-5
/* KDA chunked vs recurrent (both fp32) over 263 steps: chunking reorders every sum within a
 * chunk (C ≤ 64 terms of products of exp factors, plus the triangular solve), ≈ C·sqrt(dk)·u
 * per step; bound ≈ 64·6·6e-8 ≈ 2e-5. */
#define K3_TOL_KDA_CHUNK_REL_L2 2e-5

/* Sampler chi-square goodness-of-fit (tests/sampler): with a correct sampler the statistic is
 * chi-square(df) distributed, so a fixed seed fails with probability K3_TOL_CHI2_PVALUE. The
 * critical value is the Wilson-Hilferty quantile df*(1 - a + z*sqrt(a))^3, a = 2/(9 df), with z the
 * one-sided standard-normal quantile of that p-value (Phi^-1(1 - 1e-6) = 4.7534). */
#define K3_TOL_CHI2_PVALUE 1e-6
#define K3_TOL_CHI2_Z      4.7534
/* One whole KDA or MLA layer (fp32, a chain of ~6 ops of <= 64-term reductions) vs the float64
 * evaluation of the spec: errors of the ops add, ~6·sqrt(64)·u ≈ 3e-6 typical; 1e-5 bound. */
#define K3_TOL_LAYER_REL_L2 1e-5
/* The whole model on the ref backend vs the cpu backend (both fp32, summation orders differ in
 * every dot product): each is within K3_TOL_GOLDEN_LOGITS_REL_L2 of float64, so their distance
 * is bounded by twice that; observed ~1e-7. */
#define K3_TOL_BACKEND_REL_L2 2e-5
/* The same, for `make-tiny --preset deep` (93 layers, the real K3 schedule: 69 KDA + 24 MLA, MoE
 * from layer 1) instead of tiny's 8: every layer adds its own fp32 rounding differences, and the
 * distance grows with depth (measured cuda vs cpu: 2.35e-6 at 8 layers, 2.27e-5 at 93, i.e.
 * linearly). The tiny bound scaled by the depth ratio 93 / 8; a real kernel bug moves the logits
 * by > 1e-3. (tests/gpu/gpu_model.py) */
#define K3_TOL_BACKEND_DEEP_REL_L2 (K3_TOL_BACKEND_REL_L2 * 93.0 / 8.0)
/* The same for `make-tiny --preset small` (12 layers): the tiny bound scaled by 12 / 8, as deep's
 * (tests/gpu/gpu_small.py: issue 44's small --pp 2 --ep 2 cuda + nccl acceptance). */
#define K3_TOL_BACKEND_SMALL_REL_L2 (K3_TOL_BACKEND_REL_L2 * 12.0 / 8.0)
/* The opt-in chunked (WY) KDA form vs the recurrent form over a whole model: the same math with
 * other fp32 roundings of the state. Measured on tiny (100 tokens): layer-0 hidden differs by
 * ~3e-7 (a few u, the recurrence's own rounding), and the 8 layers amplify it ~8x to ~2e-6 at the
 * logits (delta-rule cancellation v - Sᵀk, AttnRes/router softmaxes). Bound: 10 × the layer-0
 * difference × the measured amplification ≈ 2e-5 — the golden bound, both forms must meet it. */
#define K3_TOL_KDA_FORM_REL_L2 2e-5

/* The reference's own goldens recomputed (tests/reference/k3_reference.py --check): computed in
 * float64 and stored as fp32 (rel u ≈ 6e-8); another torch build reorders float64 reductions at
 * the ~1e-12 level, and fp32 paths inside the libraries reach ~1e-7. 1e-6 (≈ 17 u) passes any
 * honest recomputation, while a golden row scaled by 1.0001 (1e-4) already fails. */
#define K3_TOL_GOLDEN_REGEN_REL_L2 1e-6

/* W4A16 tensor-core GEMMs (kernels/cuda/moe_mma.cu) with ONE bf16 activation term
 * (K3_CUDA_MMA_TERMS=1) vs the checkpoint's MXFP4 decode with fp32 activations, per output element
 * y = Σ_k w_k x_k: the kernel rounds each x_k to bf16 (round to nearest even, 8 significand bits:
 * relative error <= 2^-8, bf16's unit roundoff) and multiplies the exact weights (E2M1 · 2^e is
 * exact in bf16) with fp32 accumulation (K/16 mma steps, each rounding once on the emulator; on a
 * device the accumulation order is undocumented: allow K roundings). So |y − y_ref| <= (2^-8 +
 * 2K·u)·Σ_k |w_k x_k|, element by element (issue 44a wrote 2^-9 here: half of bf16's roundoff;
 * its tests passed at <= 0.54 of that bound, so the correction changed no verdict): */
#define K3_TOL_BF16_ACT_REL 3.90625e-3 /* 2^-8: bf16's unit roundoff */

/* The same GEMMs with split activations (k3c_split_bf16, kernels/cuda/k3c_mma.cuh; the cuda
 * backend's default is 3 terms, K3_CUDA_MMA_TERMS = 1, 2, 3 picks): x = x1 + .. + xn + r, x1 =
 * bf16(x), x_i = bf16(x − x1 − .. − x_{i−1}), each rounding to nearest even, each difference exact
 * in fp32. Derivation, per element y = Σ_k w_k x_k:
 *   - residual: |x − x1| <= 2^-8·|x|, and each further term rounds the residual the previous one
 *     left (relative error 2^-8 again), so |r| <= 2^-8n·|x| (n = 1: 2^-8, 2: 2^-16, 3: 2^-24; a
 *     fp32 x with |x| >= 2^-110 is exactly x1 + x2 + x3: its 24 significand bits lie in three
 *     8-bit ones, the roundings' signs taking the carries). Below that, bf16's subnormal floor adds
 *     at most 2^-134 per term, absolute: 2^-134·Σ|w_k| per element, below every test's inputs;
 *   - products: w_k (MXFP4: E2M1 · 2^e, exact in bf16) times each bf16 x_k,i is exact in fp32 and
 *     in the mma;
 *   - sums: the kernel adds n·K exact products in fp32 (each mma rounds once on the emulator; on a
 *     device the order is undocumented: allow n·K roundings), their magnitudes summing to
 *     Σ_k |w_k|·Σ_i |x_k,i| <= (1 + 2^-8)(1 + 2^-8 + 2^-16)·Σ|w_k x_k| <= 1.01·Σ|w_k x_k|; the
 *     reference (fp32 activations) rounds K times more, on Σ|w_k x_k|.
 * So |y − y_ref| <= (2^-8n + (1.01·n + 1)·K·u)·Σ_k |w_k x_k| (first order in u; the tests
 * (test_cuda_mma, test_cuda_ops) check exactly this, element by element): */
#define K3_TOL_SPLIT_ACT_REL(n) ((n) >= 3 ? 0x1p-24 : (n) == 2 ? 0x1p-16 : 0x1p-8)
#define K3_TOL_SPLIT_GEMM_REL(n, K)                                                                \
    (K3_TOL_SPLIT_ACT_REL(n) + (1.01 * (double)(n) + 1.0) * K3_FP32_U * (double)(K))

/* bf16 keeps 8 significant bits: a round to nearest even moves x by at most 2^-8·|x| (unit
 * roundoff 2^-8 = 0.0039). */
#define K3_TOL_BF16_U 3.90625e-3
/* MLA on tensor cores (kernels/cuda/mla_mma.cu) vs ref, per output element o_e = Σ_j p_j v_je of
 * one (query, head), with A = scale·max_j Σ_i |q_i c_ji| (float64, from the inputs):
 *   - scores: bf16 products are exact in fp32 and summed with fp32 accumulation (at most W + 3
 *     roundings with the scale, on either side: the kernel and ref), so |δs_j| <= Δs =
 *     SIDES·(W + 3)·u·A; against the fp32 inputs add their rounding to bf16, |(1 + 2^-8)² − 1|·A
 *     = K3_TOL_MLA_BF16_IN·A;
 *   - the kernel's weights are p̃_j = bf16(exp(s_j + δs_j − m)), normalised by their own sum, so
 *     p̃_j = c·p_j·(1 + δ_j) with |δ_j| <= ε = 2^-8 + 1.01·Δs + 32u (bf16 rounding, exp of the
 *     score error, expf / the split combine's few roundings), and |Σ p̃ v / Σ p̃ − Σ p v| <=
 *     2ε/(1 − ε)·Σ_j p_j |v_j| (since |o| <= Σ p|v|);
 *   - PV in fp32 on both sides: SIDES·(n + 32)·u·Σ_j p_j |v_j|; against fp32 inputs v itself is
 *     rounded: + 2^-8·Σ_j p_j |v_j|.
 * The tests check |o − o_ref| <= that sum × Σ_j p_j |v_je|, element by element, against ref run
 * on the bf16-rounded inputs (the kernel's arithmetic alone: about 2^-7 of Σ p|v| when A is small)
 * and on the fp32 inputs (what bf16 costs: dominated by the input rounding of the scores). */
#define K3_TOL_MLA_BF16_SIDES 2.0
#define K3_TOL_MLA_BF16_IN    7.8277587890625e-3 /* 2^-7 + 2^-16 */
/* The same MLA with split operands (the cuda default, mla_mma.cu terms 3): each fp32 operand x is
 * hi = bf16(x), lo = bf16(x − hi) (x − hi exact in fp32), so x = hi + lo + r_x with |hi − x| <=
 * u_b|x|, |lo| <= u_b(1 + u_b)|x| and |r_x| <= u_b·|x − hi| <= u_b²|x| (u_b = 2^-8, u_b² = 2^-16).
 * A product from hi·hi + hi·lo + lo·hi (each exact in fp32) misses
 *   xy − (hi_x + lo_x)(hi_y + lo_y) + lo_x·lo_y = r_x·y + x·r_y − r_x·r_y + lo_x·lo_y,
 * so its error is <= (2u_b² + u_b⁴ + u_b²(1 + u_b)²)·|xy| < 3.0079·2^-16·|xy| (4 terms, + lo·lo:
 * 2u_b² + u_b⁴; the 3-term bound covers both). Per output element, as above with:
 *   - scores: Δs = SIDES·(3W + 3)·u·A (three mma products a k-step, each accumulation rounding
 *     counted) + K3_TOL_MLA_SPLIT_IN·A for the split;
 *   - weights: p in fp32 (l sums the fp32 p; no bf16 rounding of p): ε = 1.01·Δs + 32u;
 *   - PV: SIDES·(3n + 32)·u + K3_TOL_MLA_SPLIT_IN of Σ p_j |v_j| (p and v both split).
 * |o − o_ref| <= (2ε/(1 − ε) + PV term)·Σ_j p_j |v_je| against ref on the fp32 inputs: a few 1e-5
 * of Σ p|v|, where plain bf16 operands allow ~1e-2. */
#define K3_TOL_MLA_SPLIT_IN 4.6e-5 /* >= 3.0079·2^-16 = 4.5897e-5 */

/* KDA prefill on tensor cores (kernels/cuda/kda.cu head_mma, chunk 16) vs ref, element by element:
 * the test (test_cuda_ops kda_mma_check) runs the chunk algebra in float64 and carries a
 * first-order bound of what the bf16 operands can do — each rounded operand of a product moves it
 * by <= K3_TOL_BF16_U of its magnitude Σ|x||y|, and the state's accumulated bound enters every
 * later product through |x|·E — so the bound follows the data instead of a worst-case constant
 * (the decay and the delta rule shrink it, a long run or a stiff solve (I + βA)⁻¹ grows it). On
 * top of each magnitude term a slack for what is fp32 on either side (the kernel's sums of <= 128
 * terms, expf of the decays, the fp32 Γ cumsum, ref's fp32 state between chunks): 64u, about
 * 50× the typical and above the worst case of the 16-term chunk sums. */
#define K3_TOL_KDA_MMA_SLACK (64 * K3_FP32_U)
/* The dense BF16 tensor-core GEMM (kernels/cuda/matmul_mma.cu) in its 3xBF16 form (the `matmul`
 * op's): x = p0 + p1 + p2 exactly (three bf16 planes hold fp32's 24 significand bits), each
 * w·p_i exact in fp32, so the only rounding is the fp32 accumulation of 3K exact terms (on a
 * device in an undocumented order: allow 3K roundings, each <= u·Σ|terms| <= u·Σ_k|w_k x_k|),
 * against ref's K-term fp32 sum (K roundings): |y − y_ref| <= (3 + 1)·K·u·Σ|w x| per element.
 * tests/gpu/test_cuda_gemm.cu checks it, and that the W16A16 form (one plane) breaks it. */
#define K3_TOL_TC_SPLIT3_KU 4.0

#endif /* K3_TOLERANCES_H */
