"""Tiny tokenizers for the tiny pipelines (``tiny_pipelines``), built offline in memory.

The tokenizers are byte-level BPE (CLIP, Qwen2: any text, no unknown tokens) or
character-level Unigram (T5: printable ASCII, anything else is ``<unk>``), each with a few
dozen whole-word entries ("a", "cat", "photo", ...); the Qwen2 tokenizer also knows the
words of QwenImage's prompt template, so the template's system prefix is exactly the 34
tokens the pipeline drops, as with the real tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CLIP_MAX_LENGTH", "QWEN_SPECIAL_TOKENS", "clip_tokenizer", "qwen2_tokenizer", "t5_tokenizer"]

# fmt: off
# Common words given whole-word tokens, so that prompts tokenize like natural text.
_WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "and", "in", "on", "with", "at", "by", "is", "photo", "cat",
    "dog", "man", "woman", "red", "blue", "green", "sky", "city", "tree", "house", "car",
    "high", "quality", "detailed", "low", "bad", "blurry", "image", "video", "astronaut",
    "riding", "horse", "beautiful", "landscape", "mountain", "water", "sunset",
)
# Words of QwenImage's prompt template (``"<|im_start|>system\nDescribe the image by ..."``).
_QWEN_TEMPLATE_WORDS: tuple[str, ...] = (
    "system", "user", "assistant", "Describe", " the", " image", " by", " detailing",
    " color", " shape", " size", " texture", " quantity", " text", " spatial",
    " relationships", " of", " objects", " and", " background",
)
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)
# fmt: on
CLIP_MAX_LENGTH = 77


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (byte-level BPE)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def _learn_bpe(words: Iterable[list[str]]) -> list[tuple[str, str]]:
    """Learn BPE merges that turn every word (a list of base symbols) into a single token.

    Plain BPE training: repeatedly merge the most frequent adjacent pair (ties: the
    smallest pair), so applying the merges in order reproduces the training segmentation
    and each word ends up as one token. Deterministic.
    """
    segments = [list(w) for w in words if w]
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for seg in segments:
            for pair in zip(seg, seg[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        for seg in segments:
            i = 0
            while i < len(seg) - 1:
                if (seg[i], seg[i + 1]) == best:
                    seg[i : i + 2] = [seg[i] + seg[i + 1]]
                i += 1


def _add_merges(vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))


def _byte_level(text: str, byte_map: dict[int, str]) -> list[str]:
    return [byte_map[b] for b in text.encode("utf-8")]


def clip_tokenizer():
    """A byte-level BPE :class:`~transformers.CLIPTokenizer` (626 tokens, 77 max length).

    Ids: ``<|startoftext|>=0`` (bos), ``<|endoftext|>=1`` (eos, pad, unk), the 256 byte
    symbols, the same with ``</w>``, then merges that make each of ``_WORDS`` one token.
    """
    from transformers import CLIPTokenizer

    byte_map = _bytes_to_unicode()
    vocab: dict[str, int] = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in byte_map.values():
        vocab[ch] = len(vocab)
    for ch in byte_map.values():
        vocab[ch + "</w>"] = len(vocab)
    words = [_byte_level(w, byte_map) for w in _WORDS]
    merges = _learn_bpe(w[:-1] + [w[-1] + "</w>"] for w in words)
    _add_merges(vocab, merges)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer():
    """A character-level Unigram :class:`~transformers.T5Tokenizer` with whole-word pieces.

    Ids: ``<pad>=0``, ``</s>=1``, ``<unk>=2``, then ``"▁"``, printable ASCII characters with
    and without the ``"▁"`` word prefix, then the words of ``_WORDS`` (231 tokens). Other
    characters map to ``<unk>``.
    """
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pieces += [(c, -8.0) for c in chars]
    pieces += [("▁" + c, -7.0) for c in chars]
    pieces += [("▁" + w, -4.0) for w in _WORDS if len(w) > 1]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def qwen2_tokenizer():
    """A byte-level BPE :class:`~transformers.Qwen2Tokenizer` (450 tokens).

    Ids: the 256 byte symbols, then ``<|endoftext|>`` (eos and pad), ``<|im_start|>``,
    ``<|im_end|>`` and the vision tokens, then merged words.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    byte_map = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for ch in byte_map.values():
        vocab[ch] = len(vocab)
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    words = _QWEN_TEMPLATE_WORDS + tuple(" " + w for w in _WORDS)
    merges = _learn_bpe(_byte_level(w, byte_map) for w in dict.fromkeys(words))
    _add_merges(vocab, merges)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL_TOKENS[1:]])
    return tokenizer
