/* utf8.c — strict UTF-8 decoding (k3_utf8.h). Table-free: the ranges of the Unicode standard's
 * Table 3-7 ("well-formed UTF-8 byte sequences"), which are exactly what CPython's decoder accepts;
 * the second byte's range depends on the lead byte (E0: A0..BF, ED: 80..9F, F0: 90..BF,
 * F4: 80..8F), which rules out overlongs, surrogates and code points above U+10FFFF. */
#include "k3_utf8.h"

int k3_utf8_next(const uint8_t *s, size_t n, uint32_t *cp) {
    uint32_t c = s[0];
    if (c < 0x80) {
        if (cp) *cp = c;
        return 1;
    }
    int len;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        c &= 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
        c &= 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
        c &= 0x07;
    } else {
        return -1; /* 80..C1, F5..FF: never a lead byte */
    }
    for (int k = 1; k < len; k++) {
        if ((size_t)k >= n) return 0;
        uint8_t b = s[k];
        if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return -k;
        c = (c << 6) | (b & 0x3F);
    }
    if (cp) *cp = c;
    return len;
}

size_t k3_utf8_valid_prefix(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int r = k3_utf8_next(s + i, n - i, NULL);
        if (r <= 0) return i;
        i += (size_t)r;
    }
    return n;
}

size_t k3_utf8_put(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

bool k3_py_isspace(uint32_t c) {
    if (c <= 0x20) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
