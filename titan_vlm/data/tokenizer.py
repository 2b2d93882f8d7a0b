"""Tokenizers: the built-in byte-level one, or a Hugging Face `tokenizers` tokenizer.json
(`model.tokenizer_path`). Both expose encode / decode, the BOS / EOS / PAD / IMAGE ids and
vocab_size.
IMAGE is the id image slots hold (data/batch.py collate); the decoder never reads it."""

from __future__ import annotations

from pathlib import Path

from titan_vlm.config import ConfigError


class ByteTokenizer:
    """ids 0..255 are bytes, then BOS, EOS, PAD, IMAGE."""

    BOS, EOS, PAD, IMAGE = 256, 257, 258, 259
    vocab_size = 260

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Special-token spellings of common tokenizer.json files, first match wins.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|im_start|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>")
PAD_NAMES = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>")
IMAGE_NAMES = ("<image>", "<|image_pad|>", "<|image|>")  # LLaVA, Qwen2-VL, Llama 3.2 vision


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not Path(path).is_file():
            raise ConfigError(f"model.tokenizer_path: file not found: {path}")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the library's own parse errors
            raise ConfigError(
                f"model.tokenizer_path: {path} is not a tokenizer.json ({e})"
            ) from None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1

        def find(names: tuple[str, ...], what: str, default: int | None = None) -> int:
            for name in names:
                if name in vocab:
                    return vocab[name]
            if default is not None:
                return default
            raise ConfigError(
                f"model.tokenizer_path: {path} has no {what} token (looked for {', '.join(names)})"
            )

        self.BOS = find(BOS_NAMES, "beginning-of-sequence")
        self.EOS = find(EOS_NAMES, "end-of-sequence")
        self.PAD = find(PAD_NAMES, "padding", default=self.EOS)  # padding carries no loss anyway
        self.IMAGE = find(
            IMAGE_NAMES, "image", default=self.PAD
        )  # image slots carry no loss either

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.BOS] if bos else []) + ids + ([self.EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        specials = (self.BOS, self.EOS, self.PAD, self.IMAGE)
        return self.tok.decode([i for i in ids if i not in specials], skip_special_tokens=True)


def build_tokenizer(path: str = "") -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(path) if path else ByteTokenizer()
