#!/usr/bin/env python3
"""Generates tests/data/embed_reference.jsonl: the reference token ids and
embeddings of all-MiniLM-L6-v2 computed by the real sentence-transformers
(PyTorch, float32, CPU) for a fixed set of sentences, so that
tests/unit/embed/sentence_encoder_test.cc can check kvserve's own encoder
(embed/) against it: ids equal, cosine >= the test's tolerance.

Run once, in a throwaway venv outside the repository:
  python3 -m venv /tmp/st-venv && /tmp/st-venv/bin/pip install sentence-transformers
  /tmp/st-venv/bin/python tests/data/make_embed_reference.py models/all-MiniLM-L6-v2

Each JSONL line: {"text", "ids" (what sentence-transformers feeds the model,
[CLS] ... [SEP], truncated to max_seq_length), "embedding" (384 floats,
L2-normalised, 7 significant digits)}. A first line {"meta": ...} records
the versions.

It also writes tests/data/embed_tokenizer_fuzz.jsonl: random strings drawn
from many scripts, combining marks, controls, spaces, emoji, special-token
text and arbitrary codepoints (fixed seed), with the Hugging Face ids, for
a differential test of the tokenizer ({"text", "ids"} per line).
"""

import json
import random
import sys

import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

LONG_PARAGRAPH = (
    "The response cache sits at the front door of the serving daemon. An exact hit replays a "
    "stored answer; a semantic hit is verified by the model before it is served, so greedy "
    "answers never change. Embeddings come from a small BERT encoder, all-MiniLM-L6-v2, whose "
    "tokenizer splits words into WordPiece units such as 'embed', '##ding' and '##s'. "
)

SENTENCES = [
    # Plain and short.
    "",
    "a",
    "Hello world",
    "hello world",
    "HELLO WORLD!!!",
    "The quick brown fox jumps over the lazy dog.",
    "How do I enable 2FA on my account?",
    "How do I disable 2FA on my account?",
    "What is the capital of France?",
    "Tell me the capital city of France.",
    "Paris is the capital of France, not Lyon.",
    "I don't think it's going to rain; won't you take an umbrella anyway?",
    # Whitespace and control characters.
    "   leading and trailing spaces   ",
    "   \t\n  ",
    "tab\there\nnewline\r\nend",
    "zero\u200bwidth\u200cjoiners\u200d and soft\u00adhyphen",
    "non\u00a0breaking\u2003em\u3000ideographic spaces",
    "null\x00byte and \ufffd replacement and \x07 bell \x1b escape",
    # Punctuation, numbers, code.
    "U.S.A. vs. E.U.: a-b_c~d, (x) [y] {z} <w> \"q\" 'r' `s` #t $u %v &w *x +y =z |a \\b /c ^d @e",
    "!!!???...,,,;;;:::---",
    "The price is $1,234.56 (about \u20ac1.100,00) on 2024-03-15 at 09:30.",
    "3.14159265358979323846264338327950288419716939937510",
    "def f(x): return x**2 + 1  # squares, then adds one",
    "https://example.com/path/to/page?query=1&b=two#frag and mail to a.b@example.org",
    # Accents, case, compatibility forms.
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u00e0 la fran\u00e7aise, na\u00efve r\u00e9sum\u00e9",
    "Cafe\u0301 with a combining acute accent",
    "Stra\u00dfe, \u0130stanbul, \u039f\u0394\u03a5\u03a3\u03a3\u0395\u03a5\u03a3, \u00c5ngstr\u00f6m",
    "\uff21\uff22\uff23\uff11\uff12\uff13 fullwidth and the \ufb01ne ligature",
    "\u2211 x\u00b2 \u2264 \u221e, \u00bd + \u00bc = \u00be, \u2460 \u2461 \u2462",
    # Other scripts.
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\u6211\u559c\u6b22\u81ea\u7136\u8bed\u8a00\u5904\u7406\u3002",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3082",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd and \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
    # Emoji (old and newer Unicode versions, sequences).
    "I love pizza \U0001F355\U0001F355 so much \U0001F600",
    "new emoji \U0001F970 \U0001FAE0 and a family \U0001F468\u200d\U0001F469\u200d\U0001F467 \U0001F44D\U0001F3FD",
    # Special tokens written in the text.
    "[CLS] is a token, [SEP] too, and [MASK] and [PAD] and [UNK]",
    "[cls] lowercase is not special",
    # Long words and long inputs (truncation to max_seq_length).
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "x" * 101 + " and " + "y" * 100,
    LONG_PARAGRAPH * 4,
    "word " * 300,
    ("\u00e9t\u00e9 " * 150) + "end",
    "Semantic caching is great. " * 20,
]


# Pools the random strings draw from: (weight, list of codepoint ranges).
FUZZ_POOLS = [
    (30, [(0x61, 0x7A), (0x41, 0x5A), (0x30, 0x39)]),
    (10, [(0x20, 0x20)]),
    (8, [(0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E)]),
    (6, [(0xC0, 0x24F)]),                      # Latin-1 supplement, Latin extended
    (5, [(0x300, 0x36F), (0x1AB0, 0x1AFF)]),   # combining marks
    (4, [(0x0, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x200B, 0x200F), (0xFEFF, 0xFEFF), (0xFFFD, 0xFFFD)]),
    (4, [(0x9, 0xD), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
         (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0x85, 0x85)]),
    (4, [(0x370, 0x3FF), (0x400, 0x4FF)]),     # Greek, Cyrillic
    (4, [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF)]),  # CJK, kana
    (3, [(0xAC00, 0xD7A3), (0x1100, 0x11FF)]),  # Hangul syllables, jamo
    (3, [(0x600, 0x6FF), (0x900, 0x97F), (0x590, 0x5FF), (0xE00, 0xE7F)]),
    (3, [(0x1F300, 0x1FAFF), (0x2600, 0x27BF), (0x1F3FB, 0x1F3FF)]),  # emoji, modifiers
    (3, [(0x2000, 0x2BFF), (0xFF00, 0xFFEF), (0xFB00, 0xFB4F)]),  # symbols, fullwidth, ligatures
    (3, [(0x0, 0xD7FF), (0xE000, 0x10FFFF)]),  # anything
]
FUZZ_SPECIALS = ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[cls]", "[SEP", "##", "##ing"]


def fuzz_strings(n, seed=19):
    rng = random.Random(seed)
    weights = [w for w, _ in FUZZ_POOLS]
    out = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.03:
                parts.append(rng.choice(FUZZ_SPECIALS))
                continue
            ranges = rng.choices(FUZZ_POOLS, weights)[0][1]
            a, b = rng.choice(ranges)
            parts.append(chr(rng.randint(a, b)))
        if i % 25 == 0:
            parts.append(" " + "ab" * rng.randint(45, 55))  # around max_input_chars_per_word
        out.append("".join(parts))
    return out


def main():
    model_dir = sys.argv[1]
    out_path = sys.argv[2] if len(sys.argv) > 2 else "tests/data/embed_reference.jsonl"
    torch.set_num_threads(1)
    model = SentenceTransformer(model_dir, device="cpu")
    emb = model.encode(SENTENCES, batch_size=1, convert_to_numpy=True, normalize_embeddings=False)
    with open(out_path, "w", encoding="utf-8") as out:
        meta = {
            "model_dir": model_dir.rstrip("/").split("/")[-1],
            "max_seq_length": model.max_seq_length,
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__,
        }
        out.write(json.dumps({"meta": meta}) + "\n")
        for text, vec in zip(SENTENCES, emb):
            ids = model.tokenize([text])["input_ids"][0].tolist()
            out.write(json.dumps({"text": text, "ids": ids,
                                  "embedding": [float("%.7g" % x) for x in vec]},
                                 ensure_ascii=True) + "\n")
    print("wrote %d sentences to %s" % (len(SENTENCES), out_path))
    fuzz_path = out_path.replace("embed_reference.jsonl", "embed_tokenizer_fuzz.jsonl")
    texts = fuzz_strings(400)
    with open(fuzz_path, "w", encoding="utf-8") as out:
        for text in texts:
            ids = model.tokenize([text])["input_ids"][0].tolist()
            out.write(json.dumps({"text": text, "ids": ids}, ensure_ascii=True) + "\n")
    print("wrote %d random strings to %s" % (len(texts), fuzz_path))


if __name__ == "__main__":
    main()
