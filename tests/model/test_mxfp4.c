/* test_mxfp4.c — byte-level tests of model/k3_mxfp4.h on hand-made blocks.
 * The expected values are written out by hand from the E2M1/E8M0 definitions (spec §7.1-7.3),
 * not computed by the code under test. */
#include "k3_mxfp4.h"
#include "k3_test.h"

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

int main(void) {
    /* E2M1: every code */
    static const float want[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    static const int kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    for (unsigned c = 0; c < 16; c++) {
        K3_CHECK(bits(k3_mxfp4_e2m1(c)) == bits(want[c]), "code %u -> %g want %g", c,
                 (double)k3_mxfp4_e2m1(c), (double)want[c]);
        K3_CHECK(k3_mxfp4_kvalue(c) == kv[c], "kvalue %u -> %d", c, k3_mxfp4_kvalue(c));
    }
    /* E8M0 -> f32 (bit patterns written by hand) */
    K3_CHECK(bits(k3_e8m0_to_f32(0)) == 0x00400000u, "e=0 is 2^-127 (subnormal)");
    K3_CHECK(bits(k3_e8m0_to_f32(1)) == 0x00800000u, "e=1 is 2^-126");
    K3_CHECK(k3_e8m0_to_f32(127) == 1.0f, "e=127 is 1");
    K3_CHECK(k3_e8m0_to_f32(128) == 2.0f, "e=128 is 2");
    K3_CHECK(bits(k3_e8m0_to_f32(254)) == 0x7f000000u, "e=254 is 2^127");
    K3_CHECK(isinf(k3_e8m0_to_f32(255)) && k3_e8m0_to_f32(255) > 0,
             "e=255 is +inf (compressed-tensors: bf16 2^128 overflows)");
    K3_CHECK(bits(k3_e8m0_to_f32_half_ggml(0)) == 0x00200000u, "ggml e=0 -> 2^-128");
    K3_CHECK(bits(k3_e8m0_to_f32_half_ggml(1)) == 0x00400000u, "ggml e=1 -> 2^-127");
    K3_CHECK(k3_e8m0_to_f32_half_ggml(128) == 1.0f, "ggml e=128 -> 1");
    K3_CHECK(bits(k3_e8m0_to_f32_half_ggml(255)) == 0x7f000000u, "ggml e=255 -> 2^127");

    /* a hand-made native row of 64 elements: group 0 (e=127) holds codes 0..15 then 15..0,
     * group 1 (e=125, x0.25) holds code 7 at even positions, code 9 at odd ones. */
    uint8_t packed[32], scale[2] = {127, 125};
    for (int m = 0; m < 8; m++) packed[m] = (uint8_t)((2 * m) | ((2 * m + 1) << 4));
    for (int m = 8; m < 16; m++) packed[m] = (uint8_t)((31 - 2 * m) | ((30 - 2 * m) << 4));
    for (int m = 16; m < 32; m++) packed[m] = 0x97; /* low 7 (even), high 9 (odd) */
    K3_CHECK(packed[0] == 0x10 && packed[7] == 0xfe && packed[8] == 0xef && packed[15] == 0x01,
             "hand-made bytes");
    float row[64];
    k3_mxfp4_decode_row(packed, scale, 64, row);
    for (int i = 0; i < 16; i++) K3_CHECK(row[i] == want[i], "row[%d] = %g", i, (double)row[i]);
    for (int i = 16; i < 32; i++)
        K3_CHECK(bits(row[i]) == bits(want[31 - i]), "row[%d] = %g", i, (double)row[i]);
    for (int i = 32; i < 64; i++)
        K3_CHECK(row[i] == (i % 2 ? -0.125f : 1.5f), "row[%d] = %g (6*0.25 / -0.5*0.25)", i,
                 (double)row[i]);
    for (int i = 0; i < 64; i++)
        K3_CHECK(bits(k3_mxfp4_get(packed, scale, i)) == bits(row[i]), "get %d", i);

    /* repack bytes: qs[j] = code(j) | code(j+16) << 4 */
    k3_block_mxfp4 blk[2];
    k3_mxfp4_repack_row(packed, scale, 64, blk);
    K3_CHECK(blk[0].e == 127 && blk[1].e == 125, "scales copied");
    for (int j = 0; j < 16; j++)
        K3_CHECK(blk[0].qs[j] == (uint8_t)(j | ((15 - j) << 4)), "qs[%d] = %02x", j, blk[0].qs[j]);
    for (int j = 0; j < 16; j++)
        K3_CHECK(blk[1].qs[j] == (uint8_t)((j % 2 ? 9 : 7) | ((j % 2 ? 9 : 7) << 4)), "blk1 qs[%d]",
                 j);

    /* repack -> ggml decode == native decode, for every code in every position and scales
     * 0, 1, 2, 126, 127, 128, 253, 254 (e = 255 differs by definition, see the header) */
    static const uint8_t scales[] = {0, 1, 2, 126, 127, 128, 200, 253, 254};
    int mism = 0;
    for (size_t si = 0; si < K3_ARRAY_LEN(scales); si++) {
        for (int shift = 0; shift < 16; shift++) {
            uint8_t p[16];
            for (int m = 0; m < 16; m++)
                p[m] = (uint8_t)(((2 * m + shift) & 15) | (((2 * m + 1 + shift) & 15) << 4));
            float nat[32], gg[32];
            k3_block_mxfp4 b;
            k3_mxfp4_decode_row(p, &scales[si], 32, nat);
            k3_mxfp4_repack_block(p, scales[si], &b);
            k3_mxfp4_decode_block_ggml(&b, gg);
            for (int i = 0; i < 32; i++) mism += !(nat[i] == gg[i]);
        }
    }
    K3_CHECK(mism == 0, "%d ggml/native mismatches", mism);
    /* e = 255: native gives inf (and NaN for ±0), ggml 2^127-scaled finite values */
    {
        uint8_t p[16] = {0x21}, e = 255;
        float nat[32];
        k3_mxfp4_decode_row(p, &e, 32, nat);
        K3_CHECK(isinf(nat[0]) && isinf(nat[1]) && isnan(nat[2]), "e=255 native: inf, inf, NaN");
    }
    return k3_test_done("model_mxfp4");
}
