"""Tokenizers: the built-in byte-level one, or a Hugging Face `tokenizers` tokenizer.json. Both
expose encode / decode, the BOS / EOS / PAD / IMAGE ids and vocab_size.

A Hugging Face tokenizer comes two ways:
- a bare tokenizer.json (`model.tokenizer_path`): its special tokens are found by their common
  spellings (BOS_NAMES, ...);
- a model folder (`HFTokenizer.from_folder`, data/hf_processor.py): tokenizer.json with the
  folder's tokenizer_config.json (and special_tokens_map.json where present), read as
  transformers 5 reads them (its tokenizer_class: data/tokenizer_classes.py);
  `encode_text(text, add_special_tokens)` then equals transformers' tokenizer on the folder.
IMAGE is the id image slots hold (data/batch.py collate); the decoder never reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan_vlm.data.tokenizer_classes import load as load_tokenizer_class
from titan_vlm.errors import ConfigError
from titan_vlm.files import read_json, read_text


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

# The named special tokens of a tokenizer_config.json / special_tokens_map.json.
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A tokenizer.json (see the module docstring). `special_tokens`: the named special tokens
    (bos_token, eos_token, unk_token, pad_token -> their strings, those the files name);
    `adds_bos`: whether encode_text(..., add_special_tokens=True) puts BOS first."""

    def __init__(
        self,
        path: str,
        config: dict | None = None,
        key: str = "model.tokenizer_path",
        model_type: str | None = None,
    ):
        """`config`: the folder's tokenizer_config.json merged over its special_tokens_map.json
        (from_folder), or None for a bare tokenizer.json whose special tokens are guessed;
        `model_type`: the folder's config.json's (which class transformers loads it with)."""
        from tokenizers import Tokenizer

        if not Path(path).exists():
            raise ConfigError(f"{key}: file not found: {path}")
        if config is None:
            text = read_text(Path(path), key)  # a folder or an unreadable file: one line
            try:
                self.tok = Tokenizer.from_str(text)
            except Exception as e:  # the library's own parse errors
                raise ConfigError(f"{key}: {path} is not a tokenizer.json ({e})") from None
            self._guess(path, key)
        else:
            self.tok = load_tokenizer_class(Path(path), config, model_type)
            self._configure(path, config)
        self.tok.no_truncation()  # as transformers' tokenizer(text) (a file may set them)
        self.tok.no_padding()
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        self.adds_bos = self.BOS is not None and self.encode_text("", True)[:1] == [self.BOS]

    @classmethod
    def from_folder(cls, folder: str | Path, image_token: str | None = None) -> HFTokenizer:
        """The tokenizer of a model folder as transformers loads it: tokenizer.json (run as the
        class transformers picks runs it: data/tokenizer_classes.py), with tokenizer_config.json's
        special tokens (special_tokens_map.json fills keys it lacks).
        IMAGE is `image_token`'s id (which must be a token of the tokenizer), else PAD."""
        folder = Path(folder)
        config = read_json(folder / "tokenizer_config.json", "model.hf_path")
        extra = folder / "special_tokens_map.json"
        if extra.is_file():
            config = {**read_json(extra, "model.hf_path"), **config}
        model_type = None
        if (folder / "config.json").is_file():
            model_type = read_json(folder / "config.json", "model.hf_path").get("model_type")
        tok = cls(str(folder / "tokenizer.json"), config, "model.hf_path", model_type)
        if image_token is not None:
            image = tok.tok.token_to_id(image_token)
            if image is None:
                raise ConfigError(
                    f"model.hf_path: {folder}: the image token {image_token!r} is not a token of "
                    "tokenizer.json"
                )
            tok.IMAGE = image
        return tok

    def _guess(self, path: str, key: str) -> None:
        vocab = self.tok.get_vocab(with_added_tokens=True)

        def find(names: tuple[str, ...], what: str, default: int | None = None) -> int:
            for name in names:
                if name in vocab:
                    return vocab[name]
            if default is not None:
                return default
            raise ConfigError(f"{key}: {path} has no {what} token (looked for {', '.join(names)})")

        self.special_tokens: dict[str, str] = {}
        self.BOS: int | None = find(BOS_NAMES, "beginning-of-sequence")
        self.EOS = find(EOS_NAMES, "end-of-sequence")
        self.PAD = find(PAD_NAMES, "padding", default=self.EOS)  # padding carries no loss anyway
        self.IMAGE = find(IMAGE_NAMES, "image", default=self.PAD)  # image slots carry no loss

    def _configure(self, path: str, config: dict) -> None:
        """As transformers 5 sets up a tokenizer.json: every special token the config names
        becomes an added special token where it is not one yet; which special tokens encoding
        adds (BOS, EOS) is the file's post-processor alone: transformers 5 drops the config's
        add_bos_token / add_eos_token when there is a tokenizer.json (4.x wrote them into it)."""
        from tokenizers import AddedToken

        self.special_tokens = {k: t for k in SPECIAL_KEYS if (t := _content(config.get(k)))}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra
        added = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        for token in [*self.special_tokens.values(), *(_content(t) for t in extra)]:
            if token and token not in added:
                self.tok.add_special_tokens([AddedToken(token, special=True, normalized=False)])
                added.add(token)
        # every named token is a token now, so each has its id
        ids = {
            k: i
            for k, t in self.special_tokens.items()
            if (i := self.tok.token_to_id(t)) is not None
        }
        if "eos_token" not in ids:
            raise ConfigError(
                f"model.hf_path: {Path(path).parent}: tokenizer_config.json names no eos_token"
            )
        self.BOS = ids.get("bos_token")
        self.EOS = ids["eos_token"]
        self.PAD = ids.get("pad_token", self.EOS)  # padding carries no loss anyway
        self.IMAGE = self.PAD  # from_folder sets the image token's id

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text` as transformers' tokenizer encodes it (special tokens in the text are matched;
        `add_special_tokens`: the post-processor's BOS / EOS)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """`text`'s ids, after BOS (`bos`: where the tokenizer has one; Qwen2's has none, its
        sequences start with the text) and before EOS (`eos`)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        start = [self.BOS] if bos and self.BOS is not None else []
        return start + ids + ([self.EOS] if eos else [])

    def decode(self, ids: list[int]) -> str:
        specials = (self.BOS, self.EOS, self.PAD, self.IMAGE)
        return self.tok.decode([i for i in ids if i not in specials], skip_special_tokens=True)


def build_tokenizer(path: str = "") -> ByteTokenizer | HFTokenizer:
    return HFTokenizer(path) if path else ByteTokenizer()
