"""How transformers 5 builds a tokenizer from a model folder's tokenizer.json.

transformers 5 does not always run tokenizer.json as written. Which class loads it follows
AutoTokenizer's rules; the ones repeated here:
- config.json's model_type "llava": always TokenizersBackend, the file as written (transformers
  lists llava among the models whose Hub tokenizer_class is wrong), whatever tokenizer_class
  tokenizer_config.json names;
- otherwise tokenizer_config.json's `tokenizer_class`: TokenizersBackend (PreTrainedTokenizerFast)
  keeps the file; LlamaTokenizer and Qwen2Tokenizer take only the vocabulary, merges,
  post-processor and added tokens from it and rebuild the rest (normalizer, pre-tokenizer,
  decoder) their way. For a file that transformers 4.x wrote (Llama 2's: a "Prepend ▁"
  normalizer that also prepends after every special token) that changes the ids. A
  LlamaTokenizer whose file is byte-level keeps the file, as transformers does. Other classes
  are a one-line ConfigError. (transformers also weighs config.json's model_type against the
  declared class; for llava, llama and qwen2 folders with their usual classes the two agree.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from titan_vlm.errors import ConfigError
from titan_vlm.files import read_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _bpe(file: dict, path: Path) -> tuple[dict, list[tuple[str, str]]]:
    model = file.get("model", {})
    if model.get("type") != "BPE":
        raise ConfigError(
            f"model.hf_path: {path}: a {model.get('type')} model, the tokenizer_class expects BPE"
        )
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges  # type: ignore[return-value]


def llama(file: dict, config: dict, path: Path) -> Tokenizer:
    """transformers 5 LlamaTokenizer: byte-fallback BPE, no normalizer, a Metaspace
    pre-tokenizer that prepends ▁ to the first piece of text only (legacy=false, the default),
    to every piece (legacy=true) or never (add_prefix_space=false)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _bpe(file, path)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tok.normalizer = None
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def qwen2(file: dict, config: dict, path: Path) -> Tokenizer:
    """transformers 5 Qwen2Tokenizer: byte-level BPE after NFC and Qwen2's split regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab, merges = _bpe(file, path)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.decoder = decoders.ByteLevel()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False
            ),
        ]
    )
    return tok


REBUILDS: dict[str, Callable[[dict, dict, Path], Tokenizer] | None] = {
    "TokenizersBackend": None,
    "PreTrainedTokenizerFast": None,
    "LlamaTokenizer": llama,
    "LlamaTokenizerFast": llama,
    "Qwen2Tokenizer": qwen2,
    "Qwen2TokenizerFast": qwen2,
}


def load(path: Path, config: dict, model_type: str | None) -> Tokenizer:
    """tokenizer.json as transformers 5 runs it for this folder (see the module docstring);
    `config`: tokenizer_config.json, `model_type`: config.json's, None without one."""
    from tokenizers import Tokenizer

    name = config.get("tokenizer_class")
    if model_type == "llava":
        rebuild = None
    elif isinstance(name, str) and name in REBUILDS:
        rebuild = REBUILDS[name]
    else:
        raise ConfigError(
            f"model.hf_path: {path.parent}/tokenizer_config.json: tokenizer_class {name!r} is not "
            f"supported (supported: {', '.join(REBUILDS)})"
        )
    text = read_text(path, "model.hf_path")  # a missing or unreadable file: one line
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the library's own parse errors
        raise ConfigError(f"model.hf_path: {path} is not a tokenizer.json ({e})") from None
    if rebuild is llama and '"ByteLevel"' in text:  # transformers: "tokenizer.json is ByteLevel"
        rebuild = None
    if rebuild is None:
        return tok
    new = rebuild(json.loads(text), config, path)
    new.post_processor = tok.post_processor
    for token_id, token in sorted(tok.get_added_tokens_decoder().items()):
        new.add_tokens([token])
        if new.token_to_id(token.content) != token_id:
            raise ConfigError(
                f"model.hf_path: {path}: added token {token.content!r} (id {token_id}) does not "
                "keep its id when the tokenizer is rebuilt"
            )
    return new
