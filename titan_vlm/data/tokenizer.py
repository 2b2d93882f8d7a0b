"""Byte-level tokenizer: ids 0..255 are bytes, then a few special tokens."""

from __future__ import annotations


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
