/* k3_utf8 — the one strict UTF-8 decoder of the project (what Python's strict decoder accepts).
 *
 * Owns: the classification of a byte sequence as valid / invalid / incomplete UTF-8, with the
 * "maximal invalid subpart" length that Python's errors="replace" turns into one U+FFFD, and the
 * encoder of one code point, and Python's str.isspace of a code point. Every UTF-8 check in
 * coordinator/ (tokenizer input validation, detokenizer and parser replacement, the JSON reader)
 * goes through these functions. Rules: no overlong forms, no surrogates (U+D800..U+DFFF), nothing
 * above U+10FFFF; U+0000 is an ordinary character (byte 0x00), never a terminator: every function
 * takes a length. */
#ifndef K3_UTF8_H
#define K3_UTF8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The sequence at s[0..n), n >= 1. Returns
 *   1..4  a complete valid sequence of that many bytes; *cp (if not NULL) is its code point;
 *   0     s[0..n) is a valid but incomplete prefix (more bytes are needed);
 *   -k    invalid: k >= 1 is the length of the maximal invalid subpart to replace by U+FFFD. */
int k3_utf8_next(const uint8_t *s, size_t n, uint32_t *cp);

/* Length of the longest valid prefix of s[0..n) that ends on a character boundary: n when all of
 * it is valid UTF-8, else the offset of the first invalid or incomplete sequence. */
size_t k3_utf8_valid_prefix(const uint8_t *s, size_t n);

/* UTF-8 of cp (<= 0x10FFFF, not a surrogate) into out; returns its length 1..4. */
size_t k3_utf8_put(uint32_t cp, uint8_t out[4]);

/* Python str.isspace() of one code point (what .strip() and tokenization_kimi's chunking use):
 * the Unicode White_Space set plus U+001C..U+001F. */
bool k3_py_isspace(uint32_t cp);

#endif /* K3_UTF8_H */
