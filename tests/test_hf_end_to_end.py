"""A Hugging Face LLaVA folder, as transformers writes it (model, tokenizer, chat template, image
processor), through the whole of titan_vlm: the trainer loads it sharded, its first CP=2 loss
equals transformers' loss on the same rows, `--export-hf` gives a folder transformers loads with
no missing or unexpected tensor and the same logits, and `generate` answers what transformers'
`generate` answers, from the folder and from a trained checkpoint.

Four folders (LLAVA_FOLDERS): LLaVA-1.5's CLIP tower (cut at layer -2, the class token dropped, BOS,
LLaVA's template) with a Llama 3.1-RoPE or a Mistral decoder, and a SigLIP tower (every
position, a ChatML template, no BOS) with a Qwen2 (q/k/v biases, tied embeddings) or a Qwen3
(q/k norms) decoder.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

import pytest
import torch
from hf_folders import LLAVA_FOLDERS, save_llava_folder
from safetensors import safe_open
from test_hf_processor import draw_png

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoProcessor,
    LlavaForConditionalGeneration,
)

from titan_vlm.data import build_dataset, model_inputs  # noqa: E402
from titan_vlm.data.batch import IGNORE_INDEX  # noqa: E402
from titan_vlm.models.hf_export import hf_config  # noqa: E402
from titan_vlm.models.llava.hf_adapter import hf_names  # noqa: E402
from titan_vlm.models.registry import get_model_spec  # noqa: E402

RUN = dict(
    steps=1,
    model__flavor="hf",
    data__packing=False,
    data__images_per_sample=1,
    training__seq_len=80,
    training__local_batch_size=2,
    metrics__enable_tensorboard=False,
)


@pytest.fixture(scope="module", params=list(LLAVA_FOLDERS))
def folder(request, tmp_path_factory) -> Path:
    return save_llava_folder(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(path: Path) -> LlavaForConditionalGeneration:
    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def test_each_rank_loads_its_shards_of_the_files(pool, folder):
    """dp_shard=2 x cp=2 (FSDP over 4) and dp_shard=2 x tp=2: every parameter, gathered, is its
    file tensor bit for bit."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        files = {k: f.get_tensor(k) for k in f.keys()}
    args = get_model_spec("llava").args(hf_config(str(folder)))
    names = hf_names(args, set(files))
    for dp_shard, cp, tp in ((2, 2, 1), (2, 1, 2)):
        built = pool.run(
            "built_weights",
            dp_shard=dp_shard,
            cp=cp,
            tp=tp,
            model__flavor="hf",
            model__hf_path=str(folder),
        )[0]
        assert set(built) == set(names)  # tied embeddings: one parameter, named once
        wrong = [n for n, t in built.items() if not torch.equal(t, files[names[n]])]
        assert wrong == [], (dp_shard, cp, tp)


def reference_loss(model: LlavaForConditionalGeneration, batch) -> float:
    """transformers' loss on titan_vlm's rows: each row's ids (its image slots as the image
    token), its images, titan_vlm's (already shifted) labels, mean over every label."""
    ids = batch.tokens.clone()
    ids[batch.image >= 0] = model.config.image_token_index
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(ids.shape[0]):
            used = batch.image[row][batch.image[row] >= 0].unique()
            images = batch.images[used]
            logits = model(input_ids=ids[row : row + 1], pixel_values=images).logits[0]
            labels = batch.labels[row]
            keep = labels != IGNORE_INDEX
            total += float(
                torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
            )
            count += int(keep.sum())
    return total / count


def test_first_cp2_loss_equals_transformers(pool, folder):
    cfg = hf_config(str(folder))
    for dotted, value in RUN.items():
        if "__" in dotted:
            section, key = dotted.split("__")
            setattr(getattr(cfg, section), key, value)
    args = get_model_spec("llava").args(cfg)
    batch = build_dataset(cfg, args, *model_inputs(cfg)).batch(0, 0, 1, 2)
    assert batch.images.shape[0] == 2 and int((batch.labels != IGNORE_INDEX).sum()) > 10
    ours = pool.run("train_run", dp_shard=1, cp=2, model__hf_path=str(folder), **RUN)[0]
    theirs = reference_loss(hf_model(folder), batch)
    assert abs(ours[0]["loss"] - theirs) < 1e-6 * max(1.0, theirs), (ours[0]["loss"], theirs)
    # negative control: the same rows through the other feature layer change the loss
    other = hf_model(folder)
    other.config.vision_feature_layer = -2 if other.config.vision_feature_layer == -1 else -1
    assert abs(reference_loss(other, batch) - theirs) > 1e-3


def run(module: str, *argv: str) -> str:
    """`python -m <module> <argv>` in this process (its main(argv)); what it printed."""
    main = importlib.import_module(module).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(argv))
    return out.getvalue()


def transformers_answer(path: Path, image: str, prompt: str, raw: bool, n: int) -> list[int]:
    from PIL import Image

    processor = AutoProcessor.from_pretrained(path)
    if not raw:
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
        ]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=Image.open(image), text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf_model(path).generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def ids_of(stdout: str) -> list[int]:
    return [int(i) for i in stdout.strip().splitlines()[-1].split()]


def test_generate_from_the_folder_equals_transformers(folder, tmp_path):
    image = draw_png(tmp_path / "shapes.png")
    raw = "USER: <image>\nWhat is this? ASSISTANT:"
    for prompt, flags in (("What is this?", []), (raw, ["--raw-prompt"])):
        out = run(
            "titan_vlm.generate", "--hf-path", str(folder), "--image", image,
            "--prompt", prompt, "--max-new-tokens", "8", "--print-ids", *flags,
        )  # fmt: skip
        theirs = transformers_answer(folder, image, prompt, bool(flags), 8)
        assert ids_of(out) == theirs, (prompt, out)


def test_trained_model_exports_to_transformers(pool, folder, tmp_path):
    """Train 2 steps at cp=2 from the folder, export, load the export in transformers: no
    missing or unexpected tensor, trained weights (not the source's), the same answers as
    titan_vlm's generate on the checkpoint; tied embeddings stay one tensor."""
    dump = tmp_path / "run"
    run_cfg = dict(RUN, steps=2, checkpoint__enable=True, checkpoint__interval=2)
    pool.run(
        "train_run", dp_shard=1, cp=2, model__hf_path=str(folder), job__dump_folder=str(dump),
        **run_cfg,
    )  # fmt: skip
    ckpt = dump / "copy0" / "checkpoint"
    for max_gb, n_files in (("5", 1), ("0.00001", None)):
        out = tmp_path / f"export_{max_gb}"
        run("titan_vlm.checkpoint", "--export-hf", str(ckpt), str(out),
            "--max-shard-gb", max_gb)  # fmt: skip
        files = sorted(out.glob("*.safetensors"))
        assert len(files) == 1 if n_files == 1 else len(files) > 1
        assert (out / "model.safetensors.index.json").is_file() == (len(files) > 1)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (out / name).is_file(), name
        exported, info = LlavaForConditionalGeneration.from_pretrained(
            out, dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"], info
        assert not info["unexpected_keys"] and not info["mismatched_keys"], info
        source = hf_model(folder)
        moved = [
            n for n, p in exported.named_parameters()
            if not torch.equal(p, dict(source.named_parameters())[n])
        ]  # fmt: skip
        assert len(moved) > 10  # the export holds the trained weights
        lm_head = exported.get_output_embeddings().weight
        tied = exported.get_input_embeddings().weight
        assert (lm_head.data_ptr() == tied.data_ptr()) == ("tied" in folder.name)
    image = draw_png(tmp_path / "ask.png")
    ours = run(
        "titan_vlm.generate", "--checkpoint", str(ckpt), "--image", image,
        "--prompt", "What is this?", "--max-new-tokens", "8", "--print-ids",
    )  # fmt: skip
    assert ids_of(ours) == transformers_answer(out, image, "What is this?", False, 8)
