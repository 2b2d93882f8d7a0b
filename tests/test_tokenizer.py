"""model.tokenizer_path: a Hugging Face tokenizer.json (made here with the `tokenizers` library)
drives the data and the model; bad files fail in one line naming the key."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from titan_vlm.config import ConfigError, load_config
from titan_vlm.data.synthetic import CELLS, COLORS, COUNTS, SHAPES, SyntheticCaptions
from titan_vlm.data.tokenizer import HFTokenizer
from titan_vlm.validate import validate_job


def write_tokenizer(path, specials=("<pad>", "<s>", "</s>", "<unk>"), extra_words=0) -> str:
    words = {w for phrase in (*COLORS, *SHAPES, *COUNTS, *CELLS) for w in phrase.split()}
    words |= {s + "s" for s in SHAPES} | {
        "crosses",
        "are",
        "is",
        "the",
        "there",
        "nothing",
        "image",
        ".",
        ":",
    }
    words |= {f"w{i}" for i in range(extra_words)}
    vocab = {tok: i for i, tok in enumerate([*specials, *sorted(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>" if "<unk>" in vocab else None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def test_hf_tokenizer_encodes_the_captions(tmp_path):
    tok = HFTokenizer(write_tokenizer(tmp_path / "tokenizer.json"))
    assert (tok.PAD, tok.BOS, tok.EOS) == (0, 1, 2)
    ids = tok.encode("three red circles.")
    assert ids[0] == tok.BOS and ids[-1] == tok.EOS and len(ids) == 2 + 4
    assert tok.decode(ids) == "three red circles ."
    data = SyntheticCaptions(32, 16, 48, seed=0, tokenizer=tok)
    batch = data.batch(0, 0, 1, 1)
    assert batch.tokens[0, 16] == tok.BOS and int(batch.labels.max()) < tok.vocab_size


def test_training_with_a_hf_tokenizer(pool, tmp_path):
    path = write_tokenizer(tmp_path / "tokenizer.json")
    history = pool.run(
        "train_run",
        dp_shard=1,
        cp=2,
        steps=30,
        model__tokenizer_path=path,
        training__seq_len=48,
        metrics__enable_tensorboard=False,
        job__dump_folder=str(tmp_path / "run"),
    )[0]
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]


def test_bad_tokenizer_files(tmp_path):
    no_bos = write_tokenizer(tmp_path / "a.json", specials=("<pad>", "</s>", "<unk>"))
    with pytest.raises(
        ConfigError, match=r"model.tokenizer_path: .* has no beginning-of-sequence token"
    ):
        HFTokenizer(no_bos)
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.tokenizer_path: .* is not a tokenizer.json"):
        HFTokenizer(str(tmp_path / "b.json"))
    big = write_tokenizer(tmp_path / "c.json", extra_words=400)
    cfg = load_config([f"--model.tokenizer_path={big}"])
    with pytest.raises(ConfigError, match=r"the tokenizer has \d+ ids, flavor 'debug' embeds 264"):
        validate_job(cfg, 1)
