"""The tiny LDM's tokenizer: a real byte-level BPE ``CLIPTokenizer`` built from a locally written ``vocab.json`` +
``merges.txt`` whose merges assemble each word of a small closed vocabulary (digit names, "photo", "style", domain
words, ...) into one token; the FedBiP placeholder tokens (``<fedbip-s0>``, ``<fedbip-v0>``, ...) are in the vocab
and registered as added tokens so that they tokenize atomically.
"""

from __future__ import annotations

import json
import os
import tempfile

from ..pipelines.pipeline_fedbip import placeholder_tokens  # the one definition of the token strings

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Words the tiny tokenizer knows as single tokens. Anything else falls back to characters (still valid BPE).
BASE_WORDS = (
    "a", "an", "of", "the", "in", "on", "with", "and", "is", "style", "photo", "image", "picture", "digit",
    "number", "handwritten", "printed", "drawing", "sketch", "painting", "clipart", "cartoon", "art", "real",
    "quickdraw", "infograph", "product", "mnist", "usps", "svhn", "syn", "synthetic", "mnistm", "street", "view",
    "house", "font", "rendered", "color", "colored", "colorful", "noisy", "noise", "rotated", "blurry", "clean",
    "gray", "grayscale", "black", "white", "background", "foreground", "domain", "class", "type", "centered",
    "satellite", "dermatoscopic", "skin", "lesion", "lesions", "medical", "small", "large", "low", "resolution",
    "scanned", "blended", "texture", "textured", "inverted", "thin", "thick", "bold", "shifted", "jitter",
    "colorful", "blurry",
)

MAX_PLACEHOLDERS = 8  # per kind, in the tiny vocab; the pipeline adds more to any tokenizer at run time if needed

def _bpe(word_syms: list[str], ranks: dict) -> list[str]:
    """CLIP's BPE on one pre-split word (lowest-rank adjacent pair merged first, all its occurrences at once)."""
    word = list(word_syms)
    while len(word) > 1:
        pairs = {(a, b) for a, b in zip(word, word[1:])}
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        out, i = [], 0
        while i < len(word):
            if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                out.append(word[i] + word[i + 1])
                i += 2
            else:
                out.append(word[i])
                i += 1
        word = out
    return word


def write_clip_bpe_files(folder: str, words=BASE_WORDS + DIGIT_NAMES, n_placeholders: int = MAX_PLACEHOLDERS):
    """Write ``vocab.json`` + ``merges.txt`` for a byte-level BPE CLIP tokenizer over a closed word list.

    Every lowercase letter / digit / punctuation mark is in the vocab (alone and with the ``</w>`` end-of-word
    suffix), and the merges make every listed word a single ``word</w>`` token. BPE applies merges by *rank*, not
    left to right, so a naive left-to-right chain per word breaks words whose pairs another word merges earlier
    ("three" became ``th re e``, "nine" ``n in e``). Fixed by simulating CLIP's BPE: while a word still ends in
    several pieces, append merges that join its pieces (a merge appended last never changes a word that already
    ends as one token, so the loop converges).
    """
    os.makedirs(folder, exist_ok=True)
    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}

    def add(tok):
        if tok not in vocab:
            vocab[tok] = len(vocab)

    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-_:;()[]<>*"
    for c in chars:
        add(c)
    for c in chars:
        add(c + "</w>")
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}

    def add_merge(a, b):
        if (a, b) not in ranks:
            ranks[(a, b)] = len(merges)
            merges.append((a, b))
            add(a + b)

    uniq = list(dict.fromkeys(w.lower() for w in words))  # ordered, unique
    for w in uniq:  # left-to-right chains first (most words end as one token with these alone)
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        cur = syms[0]
        for s in syms[1:]:
            add_merge(cur, s)
            cur = cur + s
    for _ in range(100):
        broken = [(w, p) for w in uniq if len(p := _bpe(list(w[:-1]) + [w[-1] + "</w>"], ranks)) > 1]
        if not broken:
            break
        for _, pieces in broken:
            cur = pieces[0]
            for s in pieces[1:]:
                add_merge(cur, s)
                cur = cur + s
    else:  # pragma: no cover
        raise RuntimeError(f"BPE merges did not converge for {[w for w, _ in broken]}")
    s_toks, v_toks = placeholder_tokens(n_placeholders, n_placeholders)
    for t in s_toks + v_toks:
        add(t)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    return vocab, s_toks + v_toks


def build_tiny_tokenizer(folder: str | None = None, model_max_length: int = 16, words=None):
    """A real ``CLIPTokenizer`` from locally written vocab/merges (no download)."""
    from transformers import CLIPTokenizer

    folder = folder or tempfile.mkdtemp(prefix="hfpfl_tiny_clip_tok_")
    vocab, placeholders = write_clip_bpe_files(folder, words=words or (BASE_WORDS + DIGIT_NAMES))
    tok = CLIPTokenizer(
        vocab=os.path.join(folder, "vocab.json"),
        merges=os.path.join(folder, "merges.txt"),
        model_max_length=model_max_length,
    )
    tok.add_tokens(placeholders)  # already in the vocab: keep their ids, match atomically
    return tok

