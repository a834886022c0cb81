/* kern_gemv.h — part of kern_tmpl.h (included there, once per ISA unit): the decode matmul,
 * y[t, o] for T < 4 tokens, rows [o0, o1). Same per-element arithmetic as gemm_rows (the
 * reduction-order rule in kern_tmpl.h's header), so a token's result never depends on T. */

static void gemv_rows(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1,
                      float *y) {
    gemm_rows(W, x, T, o0, o1, y);
}
