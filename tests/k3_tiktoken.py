"""k3_tiktoken.py — the K3 tokenizer facts the Python-side references share, written once:
the original K3 pre-tokenizer pattern (tokenization_kimi.py pat_str, with its `&&` class
intersections, which tiktoken's fancy-regex supports), the named slots of the 256-id special block
(K3-CHAT.md §4.1), and a loader for `.tiktoken` rank files. Imported by tests/tokenizer/vs_tiktoken.py
and tests/chat/render_ids.py; it uses only the standard library (tiktoken stays the caller's import).
"""
import base64

K3_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# offset within the special block -> name (K3: block at 163584; elsewhere right after the ranks)
K3_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
            6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
            19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
            254: "[UNK]", 255: "[PAD]"}


def k3_specials(base):
    """The 256 special tokens at ids base..base+255, unnamed slots as <|reserved_token_ID|>."""
    return {K3_NAMED.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(256)}


def load_ranks(path):
    """A .tiktoken file (`<base64 bytes> <rank>` lines) -> {bytes: rank}."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                b, r = line.split()
                ranks[base64.b64decode(b)] = int(r)
    return ranks
