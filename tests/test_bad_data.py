"""Bad input that is a counted skip (or one clear error), never a crash: JSON nested 100,000
deep, a lone surrogate in the text, bytes that are not UTF-8, a UTF-8 byte order mark; and a run
whose batches carry no loss token stops after data.max_empty_steps steps with one line."""

import json
import logging

import pytest
from test_jsonl_data import bad, kept
from test_jsonl_data import lines as kept_lines

from titan_vlm.config import ConfigError
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.data.tokenizer import ByteTokenizer

GOOD = json.dumps({"text": "a good sample."})


def dataset(path) -> JsonlDataset:
    return JsonlDataset(str(path), ByteTokenizer(), 32, 16, 96, 0, packing=False, shuffle=False)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_bad_text_is_a_counted_skip(tmp_path, caplog):
    lines = [
        GOOD.encode(),
        b"[" * 100_000 + b"]" * 100_000,  # 2: deeper than Python's recursion limit
        b'{"text": "a lone \\ud800 surrogate"}',  # 3: valid JSON, not valid Unicode
        b'{"image": "\\udfff.png", "text": "x"}',  # 4: in a path
        b'{"text": "caf\xe9"}',  # 5: Latin-1, not UTF-8
        GOOD.encode(),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="titan_vlm"):
        data = dataset(path)
    assert kept_lines(data) == [1, 6] and bad(data) == 4
    assert dict(data.skipped) == {"malformed JSON": 2, "undecodable text": 2}
    assert warnings_of(caplog) == [
        f"data: {path}:2: malformed JSON (nested too deeply) (skipped)",
        f"data: {path}:3: text is not valid Unicode (surrogates not allowed at character 7) "
        "(skipped)",
        f"data: {path}:4: text is not valid Unicode (surrogates not allowed at character 0) "
        "(skipped)",
        f"data: {path}:5: malformed JSON (not UTF-8) (skipped)",
    ]
    batch = data.batch(0, 0, 1, 2)  # the kept samples still read back and tokenize
    assert batch.num_rows == 2


def test_a_deeply_nested_json_array_is_one_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[\n" + GOOD + ",\n" + "[" * 100_000 + "]" * 100_000 + "\n]")
    with pytest.raises(ConfigError, match=r"bad.json:3: invalid JSON: nested too deeply"):
        dataset(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_byte_order_mark_does_not_cost_line_1(tmp_path, suffix):
    path = tmp_path / f"bom{suffix}"
    body = GOOD + "\n" + GOOD + "\n" if suffix == ".jsonl" else f"[{GOOD},\n{GOOD}]"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    data = dataset(path)
    assert bad(data) == 0 and kept_lines(data) == [1, 2]
    assert data.sample(kept(data)[0]).num_slots(16) == dataset_of_plain(tmp_path, body, suffix)


def dataset_of_plain(tmp_path, body, suffix) -> int:
    path = tmp_path / f"plain{suffix}"
    path.write_text(body)
    plain = dataset(path)
    return plain.sample(kept(plain)[0]).num_slots(16)


def test_batches_without_a_loss_token_stop_the_run_in_one_line(pool, tmp_path):
    """Every image fails to decode: every sample leaves its row; before, such a run trained
    with loss 0.0 and saved checkpoints."""
    (tmp_path / "junk.png").write_bytes(b"\x00 not an image" * 20)
    path = tmp_path / "junk.jsonl"
    path.write_text(
        "".join(json.dumps({"image": "junk.png", "text": "x."}) + "\n" for _ in range(8))
    )
    with pytest.raises(RuntimeError) as e:
        pool.run(
            "train_run",
            dp_shard=1,
            cp=2,
            steps=6,
            data__dataset=str(path),
            training__seq_len=96,
            training__local_batch_size=2,
            data__max_empty_steps=2,
            metrics__enable_tensorboard=False,
            job__dump_folder=str(tmp_path / "out"),
        )
    assert (
        "EmptyBatchesError: steps 1-2 carried no loss token (every sample of their batches was "
        "bad or empty: see the data: lines above; data.max_empty_steps=2)" in str(e.value)
    )
