"""Qwen2.5-VL's input side (models/common/qwen_vl/processor.py) against transformers 5 itself,
offline: tiny folders written by transformers (Qwen2VLImageProcessorPil.save_pretrained, next
to a tiny WordLevel tokenizer with Qwen's special tokens), read by QwenVLProcessor.from_folder,
then our patches, grids and prompts against transformers' on the same inputs.

References: Qwen2VLImageProcessorPil (what AutoImageProcessor picks for a Qwen2.5-VL folder
without torchvision, as here) for images; Qwen2_5_VLProcessor for the prompt's expansion. The
video processor (Qwen2VLVideoProcessor) needs torchvision, which would also switch the image
processor to its torchvision backend, so it cannot run here: its frames are referenced by the
PIL image processor's own steps (process_image, resize, rescale, normalize) on each frame, laid
out by Qwen2VLVideoProcessor.patchify's own source, compiled from transformers' file without
importing the module (which imports torchvision first)."""

import ast
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl import processor as qp
from titan_vlm.models.common.qwen_vl.processor import (
    DEFAULT_FPS,
    QwenVLProcessor,
    VisionTokens,
    patchify,
    preprocess_frames,
    preprocess_image,
    second_per_grid_t,
    smart_resize,
)

transformers = pytest.importorskip("transformers")
from transformers.image_utils import SizeDict  # noqa: E402
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_qwen2_vl  # noqa: E402

SPECIALS = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
]
WORDS = ["[UNK]", "describe", "these", "and", "this", "video", "user", "assistant"]
# Resizing both up (below MIN_PIXELS) and down (above MAX_PIXELS) for the test images.
MIN_PIXELS, MAX_PIXELS = 56 * 56 * 2, 28 * 28 * 20
# Qwen's own layout (14-pixel patches, 2x2 merge, 2 frames) and an odd one: 8-pixel patches,
# 3 frames per temporal patch, bilinear, one-number mean / std, another rescale factor.
SETTINGS = {
    "qwen": dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    "odd": dict(
        min_pixels=4000,
        max_pixels=6000,
        patch_size=8,
        temporal_patch_size=3,
        merge_size=2,
        resample=2,
        image_mean=0.5,
        image_std=0.25,
        rescale_factor=1 / 127.5,
    ),
}


def noise_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """A width x height image in `mode` of noise with shapes drawn on it (RGBA: partly
    transparent)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    if mode == "RGBA":
        pixels[: height // 2, :, 3] = rng.integers(0, 256, (height // 2, width), dtype=np.uint8)
        pixels[height // 2 :, : width // 3, 3] = 0  # fully transparent corner
    else:
        pixels[..., 3] = 255
    image = Image.fromarray(pixels)  # uint8 [H, W, 4]: RGBA
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 5, width * 4 // 5, height * 3 // 5), fill=(200, 30, 60))
    return image if mode == "RGBA" else image.convert(mode)


# (width, height, mode): 37x91 and 64x48 below MIN_PIXELS, 500x120 and 200x150 above MAX_PIXELS,
# 100x90 only rounded to whole groups
IMAGES = [
    (37, 91, "RGB"),
    (500, 120, "RGB"),
    (200, 150, "RGBA"),
    (64, 48, "L"),
    (45, 61, "LA"),
    (100, 90, "RGB"),
]


def write_tokenizer(folder: Path, config: dict | None = None) -> None:
    """A WordLevel tokenizer.json with Qwen's special tokens, and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    base = {"tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))


def build_folder(folder: Path, kind: str) -> "hf_qwen2_vl.Qwen2VLImageProcessorPil":
    """A folder with transformers' image processor of SETTINGS[kind] saved into it (its
    preprocessor_config.json) and the tiny tokenizer; the processor returned is the reference."""
    hf = hf_qwen2_vl.Qwen2VLImageProcessorPil(**SETTINGS[kind])
    hf.save_pretrained(folder)
    write_tokenizer(folder)
    return hf


@pytest.fixture(scope="module", params=list(SETTINGS))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, build_folder(path, request.param)


def hf_video_class() -> ast.ClassDef:
    """Qwen2VLVideoProcessor's class definition from transformers' source file."""
    path = Path(hf_qwen2_vl.__file__).parent / "video_processing_qwen2_vl.py"
    tree = ast.parse(path.read_text())
    return next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor"
    )


def hf_video_patchify():
    """Qwen2VLVideoProcessor.patchify, compiled from transformers' source (it uses torch alone);
    called as patchify(None, videos [B, N, C, H, W], patch_size=, merge_size=,
    temporal_patch_size=) -> (patches [B, t*h*w, D], t, h, w)."""
    fn = next(
        n for n in hf_video_class().body if isinstance(n, ast.FunctionDef) and n.name == "patchify"
    )
    namespace: dict = {"torch": torch}
    exec(
        compile(ast.Module(body=[fn], type_ignores=[]), "video_processing_qwen2_vl", "exec"),
        namespace,
    )
    return namespace["patchify"]


def hf_video_defaults() -> dict:
    """Qwen2VLVideoProcessor's class attributes that are plain expressions."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

    names = {
        "OPENAI_CLIP_MEAN": OPENAI_CLIP_MEAN,
        "OPENAI_CLIP_STD": OPENAI_CLIP_STD,
        "PILImageResampling": PILImageResampling,
    }
    values = {}
    for node in hf_video_class().body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                value = eval(compile(ast.Expression(node.value), "class", "eval"), dict(names))
            except NameError:  # valid_kwargs and the like
                continue
            values[node.targets[0].id] = value
    return values


def hf_frames(frames, hf, min_pixels: int, max_pixels: int):
    """pixel_values_videos and video_grid_thw of one video, each frame through `hf`'s (a
    Qwen2VLImageProcessorPil's) own PIL steps with the video's bounds, laid out by
    Qwen2VLVideoProcessor.patchify."""
    size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
    factor = hf.patch_size * hf.merge_size
    processed = []
    for frame in frames:
        pixels = hf.process_image(frame, do_convert_rgb=hf.do_convert_rgb)
        pixels = hf.resize(pixels, size=size, resample=hf.resample, factor=factor)
        pixels = hf.normalize(hf.rescale(pixels, hf.rescale_factor), hf.image_mean, hf.image_std)
        processed.append(torch.from_numpy(np.ascontiguousarray(pixels)))
    videos = torch.stack(processed).unsqueeze(0)
    patches, t, h, w = hf_video_patchify()(
        None,
        videos,
        patch_size=hf.patch_size,
        merge_size=hf.merge_size,
        temporal_patch_size=hf.temporal_patch_size,
    )
    return patches[0], torch.tensor([[t, h, w]])


def video_frames(count: int, width: int = 90, height: int = 70) -> list[Image.Image]:
    return [noise_image(width, height, "RGB", seed=100 + i) for i in range(count)]


# -- smart_resize --------------------------------------------------------------------------------


def test_smart_resize_equals_transformers():
    sides = [1, 2, 13, 27, 28, 29, 41, 56, 99, 100, 333, 1000, 4001, 12000]
    bounds = [(56 * 56, 28 * 28 * 1280), (MIN_PIXELS, MAX_PIXELS), (3136, 12845056), (100, 900)]
    checked = refused = 0
    for factor in (28, 14, 16):
        for low, high in bounds:
            for h in sides:
                for w in sides:
                    args = (h, w, factor, low, high)
                    try:
                        expected = hf_qwen2_vl.smart_resize(*args)
                    except ValueError:
                        with pytest.raises(ValueError, match="aspect ratio"):
                            smart_resize(*args)
                        refused += 1
                        continue
                    assert smart_resize(*args) == expected, args
                    checked += 1
    assert checked > 1500 and refused > 50  # extreme aspect ratios among them
    assert smart_resize(1, 200, 28, 3136, 10**6) == hf_qwen2_vl.smart_resize(
        1, 200, 28, 3136, 10**6
    )
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 28, 3136, 10**6)
    with pytest.raises(ValueError):
        smart_resize(0, 5, 28, 3136, 10**6)


# -- images --------------------------------------------------------------------------------------


def test_auto_image_processor_is_the_pil_backend(folder):
    """The class transformers picks for the folder is the PIL backend we match."""
    path, _ = folder
    auto = transformers.AutoImageProcessor.from_pretrained(path)
    assert type(auto).__name__ == "Qwen2VLImageProcessorPil" and auto.backend == "pil"


def test_images_bit_equal(folder, tmp_path):
    path, hf = folder
    proc = QwenVLProcessor.from_folder(path)
    assert proc.image.pixel_bounds == (hf.size.shortest_edge, hf.size.longest_edge)
    resized = set()
    for i, (width, height, mode) in enumerate(IMAGES):
        image = noise_image(width, height, mode, seed=i)
        expected = hf(images=[image], return_tensors="pt")
        patches, grid = proc.preprocess_image(image)
        assert patches.dtype == torch.float32
        assert patches.shape == expected["pixel_values"].shape, (width, height, mode)
        assert torch.equal(patches, expected["pixel_values"]), (width, height, mode)
        assert list(grid) == expected["image_grid_thw"][0].tolist()
        assert grid == proc.image.grid(height, width)
        area = grid[1] * grid[2] * proc.image.patch_size**2
        resized.add("up" if area > width * height else "down")
        # the same image from a file (PNG keeps every mode used here)
        file = tmp_path / f"{i}.png"
        image.save(file)
        from_file, file_grid = proc.preprocess_image(file)
        assert torch.equal(from_file, patches) and file_grid == grid
        assert proc.image_grid(file) == grid
    assert resized == {"up", "down"}


def test_negative_controls(folder):
    """Bit-equality is not an accident: another PIL filter, or patches not grouped by
    merge_size, break it."""
    path, hf = folder
    proc = QwenVLProcessor.from_folder(path)
    image = noise_image(500, 120, "RGB", seed=7)
    expected = hf(images=[image], return_tensors="pt")["pixel_values"]
    other = 0 if proc.image.resample != 0 else 3
    patches, _ = preprocess_image(image, dataclasses.replace(proc.image, resample=other))
    assert patches.shape == expected.shape and not torch.equal(patches, expected)
    frames = (
        proc.image.pixels(image).unsqueeze(0).expand(proc.image.temporal_patch_size, -1, -1, -1)
    )
    ungrouped, _ = patchify(frames, dataclasses.replace(proc.image, merge_size=1))
    assert ungrouped.shape == expected.shape and not torch.equal(ungrouped, expected)
    grouped, _ = patchify(frames, proc.image)
    assert torch.equal(grouped, expected)


def test_no_resize_rescale_or_normalize(tmp_path):
    """do_resize, do_rescale and do_normalize false: raw 0..255 values of an image already in
    whole groups; one that is not is refused (transformers cannot cut it into patches either)."""
    hf = hf_qwen2_vl.Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False)
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    proc = QwenVLProcessor.from_folder(tmp_path)
    assert proc.image.pixel_bounds is None and proc.image.mean is None
    image = noise_image(84, 56, "RGBA", seed=5)
    patches, grid = proc.preprocess_image(image)
    expected = hf(images=[image], return_tensors="pt")
    assert torch.equal(patches, expected["pixel_values"]) and patches.max() > 200
    assert list(grid) == expected["image_grid_thw"][0].tolist()
    odd = noise_image(37, 91, "RGB", seed=6)
    with pytest.raises(ValueError):
        hf(images=[odd])
    with pytest.raises(ValueError, match="multiples of 28"):
        proc.preprocess_image(odd)


# -- video frames --------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [4, 5])
def test_frames_equal_transformers_layout(folder, count):
    path, hf = folder
    proc = QwenVLProcessor.from_folder(path)
    # no video settings in the folder: the image processor's file, read with the video class
    assert proc.video_file.endswith("preprocessor_config.json")
    assert proc.video == proc.image
    frames = video_frames(count)
    expected, grid = hf_frames(frames, hf, *proc.video.pixel_bounds)
    patches, ours = proc.preprocess_frames(frames)
    assert list(ours) == grid[0].tolist()
    assert ours[0] == -(-count // proc.video.temporal_patch_size)  # the last frame repeated
    assert torch.equal(patches, expected)
    # frames as decoders give them: uint8 [H, W, 3] RGB arrays
    arrays, _ = preprocess_frames([np.asarray(f) for f in frames], proc.video)
    assert torch.equal(arrays, expected)


def test_video_settings_file(tmp_path):
    """video_preprocessor_config.json's own settings (as Qwen2VLVideoProcessor writes them)
    rule the frames; the class defaults fill what a file leaves out (Qwen2VLVideoProcessor's:
    another size than the image processor's)."""
    hf = build_folder(tmp_path, "qwen")
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": 28 * 28 * 3, "longest_edge": 28 * 28 * 6},
        "max_pixels": 28 * 28 * 8,  # over size.longest_edge, as transformers reads it
    }
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video))
    proc = QwenVLProcessor.from_folder(tmp_path)
    assert proc.video.pixel_bounds == (28 * 28 * 3, 28 * 28 * 8)
    assert proc.image.pixel_bounds == (MIN_PIXELS, MAX_PIXELS)
    frames = video_frames(5, 300, 200)  # 60000 pixels: down to at most 6272
    expected, grid = hf_frames(frames, hf, *proc.video.pixel_bounds)
    patches, ours = proc.preprocess_frames(frames)
    assert list(ours) == grid[0].tolist() and torch.equal(patches, expected)

    defaults = hf_video_defaults()
    for key in ("resample", "image_mean", "image_std", "patch_size", "temporal_patch_size"):
        assert np.array_equal(qp.VIDEO_DEFAULTS[key], defaults[key]), key
    assert qp.VIDEO_DEFAULTS["size"] == defaults["size"]
    hf_image = hf_qwen2_vl.Qwen2VLImageProcessorPil
    assert qp.IMAGE_DEFAULTS["size"] == hf_image.size
    for key in ("resample", "image_mean", "image_std", "rescale_factor", "merge_size"):
        assert np.array_equal(qp.IMAGE_DEFAULTS[key], getattr(hf_image, key)), key
    bare = tmp_path / "bare"
    write_tokenizer(bare)
    (bare / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Qwen2VLImageProcessor"})
    )
    proc = QwenVLProcessor.from_folder(bare)
    auto = transformers.AutoImageProcessor.from_pretrained(bare)
    assert proc.image.pixel_bounds == (auto.size.shortest_edge, auto.size.longest_edge)
    size = defaults["size"]
    assert proc.video.pixel_bounds == (size["shortest_edge"], size["longest_edge"])


def test_second_per_grid_t():
    assert second_per_grid_t(DEFAULT_FPS, 2) == 2 / 24
    assert second_per_grid_t(2.0, 2) == 1.0
    with pytest.raises(ValueError):
        second_per_grid_t(0, 2)


# -- the prompt ----------------------------------------------------------------------------------


class StandInVideoProcessor:
    """What Qwen2_5_VLProcessor asks of its video processor, computed by the reference frames
    path (hf_frames) with the image processor's settings, as a folder without video settings
    gives Qwen2VLVideoProcessor; no metadata, so transformers' default sampled fps (24)."""

    def __init__(self, hf):
        self.hf = hf
        self.merge_size = hf.merge_size
        self.temporal_patch_size = hf.temporal_patch_size

    def __call__(self, videos, **kwargs):
        from transformers.video_utils import VideoMetadata

        outputs = [
            hf_frames(v, self.hf, self.hf.size.shortest_edge, self.hf.size.longest_edge)
            for v in videos
        ]
        return {
            "pixel_values_videos": torch.cat([p for p, _ in outputs]),
            "video_grid_thw": torch.cat([g for _, g in outputs]),
            "video_metadata": [VideoMetadata(total_num_frames=len(v)) for v in videos],
        }


def hf_processor(hf, tokenizer):
    """transformers' Qwen2_5_VLProcessor with the stand-in video processor (its constructor
    checks the class of a video processor, which needs torchvision to exist)."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    class Processor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return Processor(
        image_processor=hf, tokenizer=tokenizer, video_processor=StandInVideoProcessor(hf)
    )


def test_prompt_equals_transformers(folder):
    from tokenizers import Tokenizer

    path, hf = folder
    proc = QwenVLProcessor.from_folder(path)
    reference = hf_processor(hf, transformers.AutoTokenizer.from_pretrained(path))
    prompt = (
        "<|im_start|>user describe <|vision_start|><|image_pad|><|vision_end|> and "
        "<|vision_start|><|video_pad|><|vision_end|> and this "
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|> <|im_start|>assistant"
    )
    images = [noise_image(500, 120, "RGB", seed=1), noise_image(37, 91, "RGBA", seed=2)]
    frames = video_frames(5)
    out = reference(text=[prompt], images=images, videos=[frames], return_tensors="pt")

    grids = [proc.preprocess_image(image)[1] for image in images]
    video_patches, video_grid = proc.preprocess_frames(frames)
    assert grids[0] != grids[1]
    assert out["image_grid_thw"].tolist() == [list(g) for g in grids]
    assert out["video_grid_thw"].tolist() == [list(video_grid)]
    assert torch.equal(out["pixel_values_videos"], video_patches)
    assert torch.equal(out["second_per_grid_ts"], torch.tensor([proc.second_per_grid_t()]))

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    expanded = proc.expand_prompt(prompt, grids, [video_grid])
    ids = tokenizer.encode(expanded, add_special_tokens=False).ids
    assert ids == out["input_ids"][0].tolist()
    plain = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert proc.expand_ids(plain, grids, [video_grid]) == ids
    assert ids.count(proc.tokens.image_id) == sum(proc.image.tokens(g) for g in grids)
    assert ids.count(proc.tokens.video_id) == proc.video.tokens(video_grid)

    with pytest.raises(ValueError, match="placeholder"):
        proc.expand_prompt(prompt, grids[:1], [video_grid])
    with pytest.raises(ValueError, match="placeholder"):
        proc.expand_ids(plain, grids, [])


@pytest.mark.parametrize(
    "config, special_map",
    [
        ({}, None),
        ({"image_token": "<|vision_start|>"}, None),
        ({"extra_special_tokens": {"video_token": "<|im_start|>"}}, None),
        (
            {"image_token": "<|im_start|>", "extra_special_tokens": {"image_token": "<|im_end|>"}},
            None,
        ),
        ({"image_token": {"content": "<|vision_end|>"}}, None),  # ignored by transformers
        ({}, {"image_token": {"content": "<|vision_end|>", "special": True}}),
        ({"image_token": "<|im_start|>"}, {"image_token": "<|vision_end|>"}),
        ({"image_token": "<|im_start|>"}, {"extra_special_tokens": {"image_token": "<|im_end|>"}}),
        ({"added_tokens_decoder": {}}, {"image_token": "<|vision_end|>"}),  # map not read
    ],
)
def test_tokens_as_transformers_names_them(tmp_path, config, special_map):
    write_tokenizer(tmp_path, config)
    if special_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokens = VisionTokens.from_folder(tmp_path)
    # Qwen2_5_VLProcessor.__init__'s rule
    image = tok.image_token if hasattr(tok, "image_token") else "<|image_pad|>"
    video = tok.video_token if hasattr(tok, "video_token") else "<|video_pad|>"
    assert (tokens.image, tokens.video) == (image, video)
    assert tokens.image_id == tok.convert_tokens_to_ids(image)
    assert tokens.video_id == tok.convert_tokens_to_ids(video)


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "file, settings, match",
    [
        (
            "preprocessor_config.json",
            {"image_processor_type": "CLIPImageProcessor"},
            "image_processor_type",
        ),
        ("preprocessor_config.json", {"size": {"shortest_edge": 3136}}, "max_pixels"),
        ("preprocessor_config.json", {"size": 224}, "size"),
        ("preprocessor_config.json", {"resample": None}, "resample"),
        ("preprocessor_config.json", {"image_mean": [0.5, 0.5]}, "image_mean"),
        ("preprocessor_config.json", {"merge_size": 0}, "merge_size"),
        ("video_preprocessor_config.json", {"cap_pixels_per_frame": True}, "cap_pixels_per_frame"),
        ("video_preprocessor_config.json", {"video_processor_type": "X"}, "video_processor_type"),
    ],
)
def test_config_errors(tmp_path, file, settings, match):
    write_tokenizer(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{}")
    (tmp_path / file).write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=match) as e:
        QwenVLProcessor.from_folder(tmp_path)
    assert file in str(e.value) and "\n" not in str(e.value)


def test_missing_files(tmp_path):
    write_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        QwenVLProcessor.from_folder(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"extra_special_tokens": {"image_token": "<nope>"}})
    )
    with pytest.raises(ConfigError, match="<nope>"):
        QwenVLProcessor.from_folder(tmp_path)
    with pytest.raises(ConfigError, match="folder not found"):
        QwenVLProcessor.from_folder(tmp_path / "absent")


def test_released_preprocessor_config(tmp_path):
    """Qwen2.5-VL-7B-Instruct's preprocessor_config.json (top-level min_pixels / max_pixels, no
    size), and the same with a size they override: our bounds are AutoImageProcessor's."""
    write_tokenizer(tmp_path)
    released = {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    for extra in ({}, {"size": {"shortest_edge": 10, "longest_edge": 20}}):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**released, **extra}))
        auto = transformers.AutoImageProcessor.from_pretrained(tmp_path)
        proc = QwenVLProcessor.from_folder(tmp_path)
        assert proc.image.pixel_bounds == (auto.size.shortest_edge, auto.size.longest_edge)
        assert proc.image.pixel_bounds == proc.video.pixel_bounds == (3136, 12845056)


def test_processor_config_json_nesting(tmp_path):
    """transformers 5 may nest both processors' settings in processor_config.json."""
    write_tokenizer(tmp_path)
    nested = {
        "image_processor": {"min_pixels": 1000, "max_pixels": 9000},
        "video_processor": {"size": {"shortest_edge": 2000, "longest_edge": 8000}},
    }
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 5}))  # unused
    proc = QwenVLProcessor.from_folder(tmp_path)
    assert proc.image.pixel_bounds == (1000, 9000) and proc.video.pixel_bounds == (2000, 8000)
    assert proc.image_file.endswith("processor_config.json")


def test_fast_enough():
    """A 1280x960 photo at the image processor's default bounds (at most 1003520 pixels: resized
    down to 1148x840, 1230 tokens) goes through the whole path in well under a second (a loose
    bound here: 2 busy cores)."""
    settings = qp.vision_settings({"min_pixels": 3136, "max_pixels": 28 * 28 * 1280}, "x", False)
    image = noise_image(1280, 960, "RGB", seed=3)
    start = time.perf_counter()
    patches, grid = preprocess_image(image, settings)
    assert patches.shape == (grid[1] * grid[2], settings.patch_dim)
    assert time.perf_counter() - start < 5.0
