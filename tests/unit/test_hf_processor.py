"""A Hugging Face model folder's input side (data/hf_processor.py) against transformers itself,
offline: tiny folders that transformers writes (LlavaProcessor.save_pretrained with a byte-level
BPE tokenizer, a chat template and a CLIP or SigLIP image processor, LlavaConfig for config.json),
then our tokenizer, chat template and image preprocessing against transformers' processor loaded
from the same folder."""

import json
import shutil

import pytest
import torch
from hf_folders import PROCESSORS, save_llava_processor, save_sentencepiece_tokenizer
from PIL import Image, ImageDraw

from titan_vlm.config import ConfigError
from titan_vlm.data.batch import IGNORE_INDEX, Prompt, Sample, collate, is_image
from titan_vlm.data.hf_processor import ChatError, HFProcessor, chat_prompt
from titan_vlm.data.jsonl import JsonlDataset
from titan_vlm.data.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: save_llava_processor(root / kind, kind) for kind in PROCESSORS}


def hf_processor(folder):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def draw_png(path, size=(45, 31), mode="RGB") -> str:
    """A non-square image with sharp edges and a gradient (resampling shows in every pixel)."""
    img = Image.new(mode, size, (30, 60, 90, 255)[: len(mode)])
    draw = ImageDraw.Draw(img)
    for x in range(size[0]):
        draw.line(
            [(x, 0), (x, size[1] // 3)], fill=(x * 5 % 256, 255 - x * 3, 128, 200)[: len(mode)]
        )
    draw.ellipse([5, 8, 25, 28], fill=(250, 20, 20, 100)[: len(mode)])
    img.save(path)
    return str(path)


def messages(*turns, image: str) -> list[dict]:
    """HF chat messages for alternating user / assistant turns, the image in the first."""
    out = []
    for i, text in enumerate(turns):
        content = [{"type": "text", "text": text}]
        if i == 0:
            content.insert(0, {"type": "image", "path": image})
        out.append({"role": ("user", "assistant")[i % 2], "content": content})
    return out


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
def test_folder_settings_and_tokenizer(folders, kind):
    ours, theirs = HFProcessor.from_folder(folders[kind]), hf_processor(folders[kind])
    assert ours.image_token_id == theirs.image_token_id
    assert ours.tokenizer.special_tokens == theirs.tokenizer.special_tokens_map
    assert (ours.tokenizer.BOS, ours.tokenizer.EOS, ours.tokenizer.PAD) == (
        theirs.tokenizer.bos_token_id,
        theirs.tokenizer.eos_token_id,
        theirs.tokenizer.pad_token_id,
    )
    assert ours.tokenizer.adds_bos == (kind == "clip")
    patches = (PROCESSORS[kind]["size"] // PROCESSORS[kind]["patch"]) ** 2
    # CLIP: the class token and then the first position dropped ("default"), as LLaVA-1.5's 576
    assert ours.tokens_per_image == patches
    for text in ["What is this?", " A red circle.\n", "<s>yes <image><|im_end|>\nno", ""]:
        for special in (True, False):
            expected = theirs.tokenizer(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, special) == expected, (text, special)


def test_add_bos_token_is_the_tokenizer_json_s(folders, tmp_path):
    """Which special tokens encoding adds comes from tokenizer.json's post-processor: transformers
    5 ignores tokenizer_config.json's add_bos_token / add_eos_token; a bare tokenizer.json still
    has its special tokens guessed by their spellings."""
    from transformers import AutoTokenizer

    folder = shutil.copytree(folders["siglip"], tmp_path / "f")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", add_bos_token=True, add_eos_token=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = HFTokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in ["What is this?", "<image> yes"]:
        assert ours.encode_text(text, True) == theirs(text)["input_ids"]
    assert ours.BOS == 1 and not ours.adds_bos
    guessed = HFTokenizer(str(folder / "tokenizer.json"))
    assert (guessed.BOS, guessed.EOS, guessed.IMAGE) == (1, 2, 4)


TEXTS = [
    "USER: <image>\nWhat is this? ASSISTANT:",
    " A red circle.",
    "<s>USER: hi",
    "e\u0301  x\n\ny",
]


def test_tokenizer_class_as_transformers_loads_it(folders, tmp_path):
    """Which class transformers 5 runs tokenizer.json with: a llava folder keeps the file
    whatever tokenizer_class says; LlamaTokenizer and Qwen2Tokenizer elsewhere rebuild its
    pre-tokenization (for a 4.x Llama file that changes the ids after special tokens)."""
    from transformers import AutoTokenizer, LlamaConfig, Qwen2Config

    def folder(name, config, tokenizer_class, source=None):
        path = tmp_path / name
        path.mkdir()
        if source is None:
            save_sentencepiece_tokenizer(path)
        else:
            shutil.copy(source, path / "tokenizer.json")
        special = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                dict(
                    tokenizer_class=tokenizer_class,
                    legacy=False,
                    **special,
                    extra_special_tokens=["<image>"],
                )
            )
        )
        config.save_pretrained(str(path))
        return path

    llava = shutil.copy(folders["clip"] + "/config.json", tmp_path / "llava.json")
    cases = {
        "llama": folder("llama", LlamaConfig(), "LlamaTokenizer"),
        "llava": folder("llava", transformers.LlavaConfig.from_json_file(llava), "LlamaTokenizer"),
        "qwen2": folder(
            "qwen2", Qwen2Config(), "Qwen2Tokenizer", folders["siglip"] + "/tokenizer.json"
        ),
    }
    ids = {}
    for name, path in cases.items():
        ours, theirs = HFTokenizer.from_folder(path), AutoTokenizer.from_pretrained(str(path))
        for text in TEXTS:
            for special in (True, False):
                expected = theirs(text, add_special_tokens=special)["input_ids"]
                assert ours.encode_text(text, special) == expected, (name, text, special)
        ids[name] = ours.encode_text(TEXTS[0], True)
    assert ids["llama"] != ids["llava"]  # the same files, run two ways
    bert = folder("bert", LlamaConfig(), "BertTokenizer")
    with pytest.raises(ConfigError, match=r"tokenizer_class 'BertTokenizer' is not supported"):
        HFTokenizer.from_folder(bert)


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
@pytest.mark.parametrize("size,mode", [((45, 31), "RGB"), ((23, 50), "RGBA"), ((28, 28), "L")])
def test_pixel_values_equal_the_image_processor(folders, tmp_path, kind, size, mode):
    """Wide, tall (with transparency) and grey square images: bit for bit transformers'."""
    path = draw_png(tmp_path / "a.png", size, mode)
    ours, theirs = HFProcessor.from_folder(folders[kind]), hf_processor(folders[kind])
    assert theirs.image_processor.backend == "pil"  # no torchvision here: what transformers runs
    expected = theirs.image_processor(Image.open(path), return_tensors="pt")["pixel_values"][0]
    got = ours.preprocess_image(path)
    assert got.shape == (3, ours.image_size, ours.image_size) and got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert torch.equal(ours.preprocess_image(Image.open(path)), expected)


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
def test_raw_prompt_with_image(folders, tmp_path, kind):
    """Each <image> becomes the image's tokens, the tokenizer's own BOS first: LlavaProcessor."""
    path = draw_png(tmp_path / "a.png")
    ours, theirs = HFProcessor.from_folder(folders[kind]), hf_processor(folders[kind])
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    expected = theirs(text=text, images=[Image.open(path)], return_tensors="pt")
    image = ours.preprocess_image(path)
    parts = ours.prompt_parts(text, [image])
    assert sum(is_image(p) for p in parts) == 1 and all(
        isinstance(p, Prompt) for p in parts if not is_image(p)
    )
    ids = ours.input_ids(parts, ours.tokens_per_image)
    assert ids == expected["input_ids"][0].tolist()
    assert torch.equal(image, expected["pixel_values"][0])
    with pytest.raises(ValueError, match=r"1 image token\(s\) '<image>' for 2 image\(s\)"):
        ours.prompt_parts(text, [image, image])


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
def test_chat_prompt_equals_apply_chat_template(folders, tmp_path, kind):
    path = draw_png(tmp_path / "a.png")
    ours, theirs = HFProcessor.from_folder(folders[kind]), hf_processor(folders[kind])
    msgs = messages("What is this?", image=path)
    text = theirs.apply_chat_template(msgs, add_generation_prompt=True)
    assert ours.render(msgs, add_generation_prompt=True) == text
    expected = theirs.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    parts = chat_prompt(ours, "What is this?", [ours.preprocess_image(path)])
    assert ours.input_ids(parts, ours.tokens_per_image) == expected["input_ids"][0].tolist()
    end = ("ASSISTANT:", "<|im_start|>assistant\n")[kind == "siglip"]
    assert ours.tokenizer.tok.decode(parts[-1], skip_special_tokens=False).endswith(end)


def test_a_template_in_tokenizer_config_is_applied_as_the_tokenizer_does(folders, tmp_path):
    """Without a processor template, tokenizer_config.json's: transformers' processor has none
    then, its tokenizer's apply_chat_template renders it and adds no special tokens (here no
    BOS, which the processor would add)."""
    from transformers import AutoTokenizer

    folder = shutil.copytree(folders["clip"], tmp_path / "f")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    edit_json(folder, "tokenizer_config.json", chat_template=template)
    ours, theirs = HFProcessor.from_folder(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    msgs = messages("What is this?", image="a.png")
    expected = theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    parts = chat_prompt(ours, "What is this?", [torch.zeros(3, 30, 30)])
    assert ours.input_ids(parts, 1) == list(expected["input_ids"])
    assert expected["input_ids"][0] != ours.tokenizer.BOS and ours.tokenizer.adds_bos


def test_transformers_4_layout(tmp_path):
    """The layout transformers 4.x writes: the image processor in preprocessor_config.json, the
    template in chat_template.json, special_tokens_map.json beside tokenizer_config.json."""
    folder = tmp_path / "f"
    save_llava_processor(folder, "clip", transformers4=True)
    path = draw_png(tmp_path / "a.png")
    ours, theirs = HFProcessor.from_folder(str(folder)), hf_processor(str(folder))
    assert ours.template_file.endswith("chat_template.json") and ours.tokenizer.PAD == 3
    msgs = messages("What is this?", image=path)
    expected = theirs.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    image = ours.preprocess_image(path)
    parts = chat_prompt(ours, "What is this?", [image])
    assert ours.input_ids(parts, ours.tokens_per_image) == expected["input_ids"][0].tolist()
    assert torch.equal(image, expected["pixel_values"][0])


ANSWERS = ("A red circle.", "yes.")


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
def test_two_turn_conversation_trains_on_the_answers(folders, tmp_path, kind):
    """The whole rendering's ids are apply_chat_template's; the trained targets decode to exactly
    the answers with what the template writes after them (ChatML: <|im_end|> and a newline; the
    LLaVA template: a space, a token of its own in this vocabulary; a vocabulary with a token
    ' USER' would leave that space to the next user turn: a token that crosses a span's edge is
    context)."""
    path = draw_png(tmp_path / "a.png")
    ours, theirs = HFProcessor.from_folder(folders[kind]), hf_processor(folders[kind])
    turns = ["<image>\nWhat is this?", ANSWERS[0], "Are you sure?", ANSWERS[1]]
    image = ours.preprocess_image(path)
    parts = ours.conversation_parts([(i % 2 == 0, t) for i, t in enumerate(turns)], [image])
    msgs = messages("What is this?", ANSWERS[0], "Are you sure?", ANSWERS[1], image=path)
    expected = theirs.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_tensors="pt"
    )
    n = ours.tokens_per_image
    assert ours.input_ids(parts, n) == expected["input_ids"][0].tolist()

    batch = collate([[Sample(parts)]], len(expected["input_ids"][0]), n, ours.image_size, 0)
    labels = batch.labels[0].tolist()
    answers, run = [], []
    for label in labels + [IGNORE_INDEX]:  # runs of trained targets, one per answer
        if label != IGNORE_INDEX:
            run.append(label)
        elif run:
            answers.append(ours.tokenizer.tok.decode(run, skip_special_tokens=False))
            run = []
    if kind == "clip":
        assert answers == [f" {a} " for a in ANSWERS]
    else:
        assert answers == [f"{a}<|im_end|>\n" for a in ANSWERS]


def test_jsonl_dataset_uses_the_folder(folders, tmp_path):
    """JsonlDataset with a processor: the folder's chat template and image preprocessing."""
    folder = folders["siglip"]
    proc = HFProcessor.from_folder(folder)
    draw_png(tmp_path / "a.png")
    record = {
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": ANSWERS[0]},
        ],
    }
    caption = {"text": "It is blue."}
    image_in_answer = {
        "image": "a.png",
        "conversations": [
            {"from": "human", "value": "What is this?"},
            {"from": "gpt", "value": "<image> this."},
        ],
    }
    lines = [json.dumps(r) for r in (record, caption, image_in_answer)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    n, seq = proc.tokens_per_image, 128
    data = JsonlDataset(
        str(tmp_path / "d.jsonl"), proc.tokenizer, 28, n, seq, 0, shuffle=False, processor=proc
    )
    assert data.skipped == {"chat template": 1}  # an image in an answer: a bad sample
    batch = data.batch(0, 0, 1, 1)
    theirs = hf_processor(folder)
    msgs = messages("What is this?", ANSWERS[0], image=str(tmp_path / "a.png"))
    expected = theirs.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids = expected["input_ids"][0]
    assert batch.tokens[0, : len(ids)].tolist() == ids.tolist()
    assert torch.equal(batch.images[0], expected["pixel_values"][0])
    caption = proc.encode("It is blue.", False) + [proc.tokenizer.EOS]  # no BOS in this tokenizer
    assert data.batch(0, 1, 2, 1).tokens[0, : len(caption)].tolist() == caption
    with pytest.raises(ConfigError, match=r"images of 28 pixels, the model takes 32"):
        JsonlDataset(str(tmp_path / "d.jsonl"), proc.tokenizer, 32, n, seq, 0, processor=proc)


def test_a_video_is_one_image_of_the_processor_per_frame(folders, tmp_path):
    """A record's video through the folder's processor: each kept frame one image item of the
    chat template (one image token, then its image's tokens), as transformers renders the same
    conversation with one image per frame."""
    folder = folders["siglip"]
    proc = HFProcessor.from_folder(folder)
    frames = [draw_png(tmp_path / f"f{i}.png", size=(45 + 3 * i, 31)) for i in range(5)]
    record = {
        "video": [f"f{i}.png" for i in range(5)],
        "conversations": [
            {"from": "human", "value": "What moves?\n<video>"},
            {"from": "gpt", "value": ANSWERS[0]},
        ],
    }
    (tmp_path / "v.jsonl").write_text(json.dumps(record) + "\n")
    n = proc.tokens_per_image
    data = JsonlDataset(
        str(tmp_path / "v.jsonl"), proc.tokenizer, 28, n, 256, 0, processor=proc, max_frames=3
    )
    batch = data.batch(0, 0, 1, 1)
    kept = [frames[i] for i in (0, 2, 4)]
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What moves?"},
                *({"type": "image", "path": f} for f in kept),
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]},
    ]
    expected = hf_processor(folder).apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids = expected["input_ids"][0]
    assert batch.tokens[0, : len(ids)].tolist() == ids.tolist()
    assert torch.equal(batch.images, expected["pixel_values"])


def edit_json(folder, name, **changes):
    path = folder / name
    value = json.loads(path.read_text())
    for key, change in changes.items():
        if change is None:
            value.pop(key, None)
        elif isinstance(change, dict) and isinstance(value.get(key), dict):
            value[key].update(change)
        else:
            value[key] = change
    path.write_text(json.dumps(value))


def test_folder_errors(folders, tmp_path):
    """Each missing or contradictory piece: one line naming the folder or file."""

    def copy(kind="clip"):
        return shutil.copytree(folders[kind], tmp_path / f"f{len(list(tmp_path.iterdir()))}")

    with pytest.raises(ConfigError, match=r"model.hf_path: folder not found: .*nowhere"):
        HFProcessor.from_folder(str(tmp_path / "nowhere"))
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        folder = copy()
        (folder / name).unlink()
        with pytest.raises(ConfigError, match=rf"model.hf_path: .*{name}"):
            HFProcessor.from_folder(str(folder))
    folder = copy()
    edit_json(folder, "processor_config.json", image_processor=None)
    with pytest.raises(ConfigError, match=r"no image processor settings \(preprocessor_config"):
        HFProcessor.from_folder(str(folder))
    folder = copy()
    edit_json(
        folder, "processor_config.json", image_processor={"crop_size": {"height": 20, "width": 30}}
    )
    with pytest.raises(
        ConfigError,
        match=r"processor_config.json: the image processor makes images of 20x30 pixels, "
        r"config.json's vision_config.image_size is 30",
    ):
        HFProcessor.from_folder(str(folder))
    folder = copy()
    edit_json(folder, "processor_config.json", image_processor={"image_processor_type": "X"})
    with pytest.raises(ConfigError, match=r"image_processor_type 'X' is not supported"):
        HFProcessor.from_folder(str(folder))
    folder = copy()
    edit_json(folder, "config.json", image_token_index=3)
    with pytest.raises(ConfigError, match=r"config.json: image_token_index=3 but the tokenizer's"):
        HFProcessor.from_folder(str(folder))
    folder = copy()
    (folder / "chat_template.jinja").unlink()
    proc = HFProcessor.from_folder(str(folder))  # raw prompts still work
    with pytest.raises(ConfigError, match=r"has no chat template"):
        proc.render([], add_generation_prompt=True)
    # A template that rewrites earlier turns (here: only the last user turn keeps its text).
    folder = copy("siglip")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if loop.last or m['role'] == 'assistant' %}{{ m['content'][-1]['text'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    proc = HFProcessor.from_folder(str(folder))
    with pytest.raises(ConfigError, match=r"chat_template.jinja: the chat template is not prefix"):
        proc.conversation_parts([(True, "What is this?"), (False, "A circle.")], [])
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m }")
    with pytest.raises(ConfigError, match=r"chat_template.jinja: chat template line 1: "):
        HFProcessor.from_folder(str(folder))
    # A template's raise_exception is about one conversation: a bad sample, not the folder's.
    (folder / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one turn only') }}{% endif %}x"
    )
    proc = HFProcessor.from_folder(str(folder))
    with pytest.raises(ChatError, match=r"chat_template.jinja: TemplateError: one turn only"):
        proc.conversation_parts([(True, "What is this?"), (False, "A circle.")], [])
