"""Qwen2.5-VL folders, as transformers itself writes them, load into titan_vlm and compute what
transformers computes (models/qwen2_5_vl).

One tiny random Qwen2_5_VLForConditionalGeneration (no downloads) is built from transformers'
config classes, perturbed (so that no bias or norm sits at its initial value) and
save_pretrained()ed; titan_vlm parses its config.json and loads its safetensors. The shapes make
every mechanism matter: window_size 56 with 14-pixel patches and 2x2 merging is a window of 2x2
merge units, which cuts the images (grids (1, 4, 6), (1, 8, 4)) and each frame of the video
(grid (2, 4, 8)); blocks 1 and 3 attend over whole frames, 0 and 2 over windows; mrope_section
(2, 3, 3) splits the 8 frequencies of head_dim 16 over the three axes. Tolerance: max abs
difference / max abs value < 1e-5, in fp32.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_folders import END, IMAGE, START, VIDEO, VOCAB, save_qwen
from safetensors import safe_open
from transformers import Qwen2_5_VLConfig

from titan_vlm.errors import ConfigError
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs
from titan_vlm.models.common.qwen_vl.mrope import batch_rope_index, mrope_cos_sin, rope_index
from titan_vlm.models.qwen2_5_vl.hf_adapter import (
    IN_MEMORY,
    SAVED,
    export_names,
    hf_names,
    hf_same,
    key_style,
    unused_hf_tensors,
)
from titan_vlm.models.qwen2_5_vl.hf_config import args_from_hf_config
from titan_vlm.models.qwen2_5_vl.model import Qwen25VL, from_hf_folder
from titan_vlm.models.qwen2_5_vl.vision import VisionTower, window_geometry

TOL = 1e-5
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size^2
IMAGE_GRIDS = torch.tensor([[1, 4, 6], [1, 8, 4]])  # 6 and 8 merged tokens
VIDEO_GRIDS = torch.tensor([[2, 4, 8]])  # 16 merged tokens
# seconds per temporal patch: tokens_per_second 2 makes the frames' temporal step 2.5 -> 2
SECONDS = torch.tensor([1.25])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Qwen25VL, Path]:
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = save_qwen(folder)
    return hf, from_hf_folder(folder).eval(), folder


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def pixels(grids: torch.Tensor, seed: int) -> torch.Tensor:
    """Flat patches [sum of t*h*w, PATCH_DIM], as the processor makes them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grids.prod(-1).sum()), PATCH_DIM, generator=g)


def text(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, IMAGE, (n,), generator=g).tolist()


def image_sample(g: torch.Generator) -> list[int]:
    """Text, an image of 6 tokens, text, an image of 8 tokens, text (the processor's expansion:
    each image's pad tokens between vision_start and vision_end)."""
    first = [START] + [IMAGE] * 6 + [END]
    second = [START] + [IMAGE] * 8 + [END]
    return text(3, g) + first + text(4, g) + second + text(2, g)


def video_sample(g: torch.Generator, length: int) -> list[int]:
    """Text, a video of 16 tokens, text up to `length` tokens."""
    head = text(2, g) + [START] + [VIDEO] * 16 + [END]
    return head + text(length - len(head), g)


def text_slots(ids: torch.Tensor) -> torch.Tensor:
    """The slots whose logits a model gives (its text: no loss is ever on an image slot)."""
    return (ids != IMAGE) & (ids != VIDEO)


def token_types(ids: torch.Tensor) -> torch.Tensor:
    """transformers' mm_token_type_ids: 0 text, 1 image, 2 video."""
    return (ids == IMAGE).long() + 2 * (ids == VIDEO).long()


def test_vision_tower_matches_transformers(pair: tuple[Any, Qwen25VL, Path]) -> None:
    """Two images of different grids and a 2-frame video in one packed call: the tower's merged
    embeddings equal transformers' (windows cut every grid); every block attending whole frames
    (no windows) gives other embeddings."""
    hf, ours, _ = pair
    grids = torch.cat([IMAGE_GRIDS, VIDEO_GRIDS])
    geometry = window_geometry(grids, ours.args.vision)
    assert len(geometry.windows) == 2 + 2 + 2 * 2 > len(geometry.frames) == 4
    x = pixels(grids, seed=1)
    with torch.no_grad():
        theirs = hf.model.visual(x, grid_thw=grids).pooler_output
        got = ours.encode(x, grids)
        full = dataclasses.replace(ours.args.vision, fullatt_block_indexes=(0, 1, 2, 3))
        no_windows = VisionTower(full, "auto")
        no_windows.load_state_dict(ours.vision.state_dict())
        unwindowed = no_windows(x, grids)
    assert got.shape == theirs.shape == (6 + 8 + 16, 64)
    err = relative_error(got, theirs)
    control = relative_error(unwindowed, theirs)
    print(f"vision tower: max abs diff / max abs = {err:.2e} (no windows: {control:.2e})")
    assert err < TOL
    assert control > 1e-3


@pytest.mark.parametrize("window_size", [28, 56, 84, 112])
def test_window_order_is_transformers(window_size: int) -> None:
    """The window order, the windows' lengths and each patch's (row, column) equal transformers'
    get_vision_window_index / get_vision_position_ids, for grids that windows of 1 to 4 units
    fit exactly, cut, or do not cut at all."""
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    vision = dataclasses.replace(Qwen25VLArgs().vision, window_size=window_size)
    grids = torch.tensor([[1, 2, 2], [3, 6, 10], [1, 16, 4], [2, 8, 8], [1, 4, 12]])
    geometry = window_geometry(grids, vision)
    window_index, cu_windows = get_vision_window_index(grids, 2, window_size, 14)
    assert torch.equal(geometry.unit_order, window_index)
    assert torch.tensor([0, *geometry.windows]).cumsum(0).tolist() == cu_windows.tolist()
    hw = get_vision_position_ids(grids, 2)  # [N, 2] in the processor's patch order
    assert torch.equal(geometry.hw, hw[geometry.patch_order])


def test_gradients_reach_every_parameter() -> None:
    """A backward pass through the packed window attention and the decoder reaches every
    parameter (the tower's patch embedding included)."""
    torch.manual_seed(0)
    args = Qwen25VLArgs()
    model = Qwen25VL(args)
    ids = torch.tensor([[1, 2, START] + [IMAGE] * 6 + [END, 3]])
    positions = batch_rope_index(ids, IMAGE_GRIDS[:1], None, None, args)
    model(
        ids, pixels(IMAGE_GRIDS[:1], seed=7), IMAGE_GRIDS[:1], positions
    ).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_padded_sequence_changes_nothing() -> None:
    """Sequence parallelism pads the packed patch sequence with zero rows to a multiple of tp
    (VisionTower.sequence_multiple): the rows attend to nothing and are dropped, so the
    embeddings and every parameter's gradient are those of the unpadded tower (here 28 patches
    padded to 32, as tp = 8 would)."""
    torch.manual_seed(0)
    grids = torch.tensor([[1, 4, 6], [1, 2, 2]])  # 24 + 4 patches
    x = pixels(grids, seed=8)
    towers = [VisionTower(Qwen25VLArgs().vision, "auto") for _ in range(2)]
    towers[1].load_state_dict(towers[0].state_dict())
    towers[1].sequence_multiple = 8
    lengths: list[int] = []
    towers[1].layers[0].register_forward_pre_hook(lambda _, a: lengths.append(a[0].shape[1]))
    g = torch.randn(7, 64, generator=torch.Generator().manual_seed(9))
    outs = []
    for tower in towers:
        out = tower(x, grids)
        (out * g).sum().backward()
        outs.append(out.detach())
    assert lengths == [32]
    assert relative_error(outs[1], outs[0]) < 1e-6
    grads = [dict(t.named_parameters()) for t in towers]
    for name, p in grads[0].items():
        assert relative_error(grads[1][name].grad, p.grad) < 1e-5, name


def test_rope_index_matches_transformers(pair: tuple[Any, Qwen25VL, Path]) -> None:
    """rope_index of one sample equals get_rope_index: text, an image, text, an image, text; and
    text, a video with second_per_grid_ts (temporal step 2.5 truncated), text."""
    hf, ours, _ = pair
    g = torch.Generator().manual_seed(2)
    images = torch.tensor(image_sample(g))
    video = torch.tensor(video_sample(g, 26))
    cases = ((images, IMAGE_GRIDS, None, None), (video, None, VIDEO_GRIDS, SECONDS))
    for ids, image_grids, video_grids, seconds in cases:
        theirs, _ = hf.model.get_rope_index(
            ids[None], token_types(ids[None]), image_grids, video_grids, seconds
        )
        got = rope_index(ids, image_grids, video_grids, seconds, ours.args)
        assert torch.equal(got, theirs[:, 0])
    # the video's frames: temporal positions 3 and 3 + floor(2.5) = 5
    assert got[0, 3:19].unique().tolist() == [3, 5]


def test_rope_index_text_after_a_long_video() -> None:
    """Text after a video resumes after the video's largest position, temporal included (Qwen's
    rule): the example of transformers' Qwen2.5-VL docstring, 3 frames of 2x2 merged units 50
    apart (tokens_per_second 25, 2 s per temporal patch), after 2 text tokens."""
    args = Qwen25VLArgs(tokens_per_second=25)
    ids = torch.tensor([5, 6] + [VIDEO] * 12 + [7, 8, 9])
    got = rope_index(ids, None, torch.tensor([[3, 4, 4]]), torch.tensor([2.0]), args)
    expected_video = torch.tensor(
        [[0] * 4 + [50] * 4 + [100] * 4, [0, 0, 1, 1] * 3, [0, 1, 0, 1] * 3]
    )
    assert torch.equal(got[:, :2], torch.tensor([[0, 1]] * 3))
    assert torch.equal(got[:, 2:14], expected_video + 2)
    assert torch.equal(got[:, 14:], torch.tensor([[103, 104, 105]] * 3))


def test_rope_index_refuses_tokens_that_do_not_fit_the_grids() -> None:
    args = Qwen25VLArgs()
    with pytest.raises(ValueError, match="needs 6 consecutive image tokens"):
        rope_index(torch.tensor([1] + [IMAGE] * 5 + [2]), IMAGE_GRIDS[:1], None, None, args)
    with pytest.raises(ValueError, match="grids are given"):
        rope_index(torch.tensor([1] + [IMAGE] * 6), IMAGE_GRIDS, None, None, args)


def test_logits_match_transformers(pair: tuple[Any, Qwen25VL, Path]) -> None:
    """Two rows (text + two images; text + a video) through the whole model: the logits of every
    text slot equal transformers' forward on the same input_ids, which computes its own 3-D
    positions from mm_token_type_ids. 1-D positions in place of M-RoPE give other logits."""
    hf, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    first = image_sample(g)
    ids = torch.tensor([first, video_sample(g, len(first))])
    image_px, video_px = pixels(IMAGE_GRIDS, seed=4), pixels(VIDEO_GRIDS, seed=5)
    with torch.no_grad():
        theirs = hf(
            input_ids=ids,
            pixel_values=image_px,
            image_grid_thw=IMAGE_GRIDS,
            pixel_values_videos=video_px,
            video_grid_thw=VIDEO_GRIDS,
            second_per_grid_ts=SECONDS,
            mm_token_type_ids=token_types(ids),
        ).logits
        positions = batch_rope_index(ids, IMAGE_GRIDS, VIDEO_GRIDS, SECONDS, ours.args)
        got = ours(ids, image_px, IMAGE_GRIDS, positions, video_px, VIDEO_GRIDS)
        flat = torch.arange(ids.shape[1]).expand(3, *ids.shape)
        one_d = ours(ids, image_px, IMAGE_GRIDS, flat, video_px, VIDEO_GRIDS)
    assert got.shape == theirs.shape == (2, len(first), VOCAB)
    text = text_slots(ids)
    err = relative_error(got[text], theirs[text])
    control = relative_error(one_d[text], theirs[text])
    print(f"logits: max abs diff / max abs = {err:.2e} (1-D positions: {control:.2e})")
    assert err < TOL
    assert control > 1e-3


def test_mrope_with_equal_axes_is_plain_rope() -> None:
    """With the three positions equal, M-RoPE's cos / sin are the decoder's 1-D tables."""
    from titan_vlm.models.common.decoder import rope_tables
    from titan_vlm.models.common.text_args import Rope

    positions = torch.arange(40).expand(3, 2, 40)
    cos, sin = mrope_cos_sin(positions, 16, 10000.0, (2, 3, 3))
    table_cos, table_sin = rope_tables(16, 40, 10000.0, Rope())
    assert torch.equal(cos, table_cos.expand(2, 1, 40, 16))
    assert torch.equal(sin, table_sin.expand(2, 1, 40, 16))


def test_tied_embeddings_load_and_match(tmp_path: Path) -> None:
    """tie_word_embeddings: the file has no lm_head, the model's head IS its embedding table, and
    the logits of a text + image prompt equal transformers'."""
    hf = save_qwen(tmp_path, tie=True)
    ours = from_hf_folder(tmp_path).eval()
    assert ours.decoder.output.weight is ours.decoder.tok_embeddings.weight
    ids = torch.tensor([[1, 2, START] + [IMAGE] * 6 + [END, 3, 4]])
    px = pixels(IMAGE_GRIDS[:1], seed=6)
    with torch.no_grad():
        theirs = hf(
            input_ids=ids,
            pixel_values=px,
            image_grid_thw=IMAGE_GRIDS[:1],
            mm_token_type_ids=token_types(ids),
        ).logits
        positions = batch_rope_index(ids, IMAGE_GRIDS[:1], None, None, ours.args)
        got = ours(ids, px, IMAGE_GRIDS[:1], positions)
    text = text_slots(ids)
    err = relative_error(got[text], theirs[text])
    print(f"tied logits: max abs diff / max abs = {err:.2e}")
    assert err < TOL


def file_keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_hf_names_map_every_parameter(pair: tuple[Any, Qwen25VL, Path]) -> None:
    """Every parameter is named, every file tensor is taken (save_pretrained's names, and
    transformers 5's in-memory ones); export_names writes the names it loads; a stray tensor or
    a missing one is a one-line error; a tied head in the files is unused but must equal the
    embedding."""
    hf, ours, folder = pair
    keys = file_keys(folder)
    assert key_style(keys) == SAVED
    names = hf_names(ours.args, keys, "f")
    assert set(names) == {n for n, _ in ours.named_parameters()}
    assert set(names.values()) == keys
    assert export_names(ours.args) == names
    in_memory = {n for n, _ in hf.named_parameters()}  # model.visual.*, model.language_model.*
    assert key_style(in_memory) == IN_MEMORY
    assert set(hf_names(ours.args, in_memory).values()) == in_memory
    assert export_names(ours.args, IN_MEMORY) == hf_names(ours.args, in_memory)

    stray = keys | {"visual.blocks.9.attn.qkv.weight"}
    with pytest.raises(ConfigError) as e:
        hf_names(ours.args, stray, "f")
    assert "'visual.blocks.9.attn.qkv.weight'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'visual.merger.ln_q.weight' not found"):
        hf_names(ours.args, keys - {"visual.merger.ln_q.weight"}, "f")

    tied = dataclasses.replace(
        ours.args, decoder=dataclasses.replace(ours.args.decoder, tie_embeddings=True)
    )
    assert "lm_head.weight" not in hf_names(tied, keys).values()
    assert "lm_head.weight" in unused_hf_tensors(tied, keys)
    assert hf_same(tied, keys) == [("lm_head.weight", "model.embed_tokens.weight")]
    assert hf_names(tied, keys - {"lm_head.weight"}) == export_names(tied)
    with pytest.raises(ConfigError, match="'lm_head.weight' not found"):
        hf_names(ours.args, keys - {"lm_head.weight"})


def test_fused_qkv_splits_on_load_and_fuses_on_export(
    pair: tuple[Any, Qwen25VL, Path], tmp_path: Path
) -> None:
    """The tower's q, k, v are the thirds of transformers' fused attn.qkv (its weight and bias,
    every block), and --export-hf fuses them back: the folder from_pretrained loads from the
    export holds every tensor of the original bit for bit. A qkv of the wrong shape is one line
    naming the file's tensor and all three parameters."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from titan_vlm.models.hf_export import export_hf, hf_config

    hf, ours, folder = pair
    for block, theirs in zip(ours.vision.layers, hf.model.visual.blocks):
        for kind in ("weight", "bias"):
            thirds = getattr(theirs.attn.qkv, kind).chunk(3)
            parts = [getattr(getattr(block.attn, name), kind) for name in ("q", "k", "v")]
            assert all(torch.equal(a, b) for a, b in zip(parts, thirds, strict=True))
    export_hf(ours, hf_config(str(folder)), tmp_path / "out")
    back, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not any(info.values()), info
    want, got = hf.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["visual.blocks.0.attn.qkv.weight"] = tensors["visual.blocks.0.attn.qkv.weight"][:-1]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        from_hf_folder(bad)
    message = str(e.value)
    assert "'visual.blocks.0.attn.qkv.weight' has shape (95, 32)" in message, message
    assert "vision.layers.0.attn.q.weight + vision.layers.0.attn.k.weight + " in message
    assert "need (96, 32)" in message and "\n" not in message


# A config.json as transformers 4.x and the hub's Qwen/Qwen2.5-VL-* folders write it: text keys
# at the top level, rope_scaling of type "mrope", the tower's model_type the model's.
FLAT_4X: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 2,
    "max_position_embeddings": 128000,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "image_token_id": IMAGE,
    "video_token_id": VIDEO,
    "vision_start_token_id": START,
    "vision_end_token_id": END,
    "vision_config": {
        "model_type": "qwen2_5_vl",
        "depth": 4,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 48,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1, 3],
        "window_size": 56,
        "tokens_per_second": 2,
        "in_chans": 3,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "hidden_act": "silu",
    },
}


def test_config_json_of_both_transformers_versions(pair: tuple[Any, Qwen25VL, Path]) -> None:
    """The saved (5.x) config.json gives the model's args; a 4.x flat one gives what transformers
    5 reads from it (its own conversion, to_dict, read again)."""
    _, ours, folder = pair
    a = ours.args
    assert a.mrope_section == (2, 3, 3) and a.tokens_per_second == 2
    assert (a.decoder.dim, a.decoder.head_dim, a.decoder.norm_eps) == (64, 16, 1e-5)
    assert a.decoder.qkv_bias and not a.decoder.o_bias and not a.decoder.tie_embeddings
    assert a.vision.fullatt_block_indexes == (1, 3) and a.vision.window_units == 2
    flat = args_from_hf_config(FLAT_4X, "flat.json")
    converted = Qwen2_5_VLConfig.from_dict(json.loads(json.dumps(FLAT_4X))).to_dict()
    assert flat == args_from_hf_config(converted, "converted.json")
    assert flat == dataclasses.replace(
        a, decoder=dataclasses.replace(a.decoder, norm_eps=1e-6, max_seq_len=128000)
    )


@pytest.mark.parametrize(
    "change, key",
    [
        ({"attention_dropout": 0.1}, "text_config.attention_dropout"),
        ({"use_sliding_window": True}, "text_config.use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        (
            {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 2]}},
            "text_config.rope_parameters.mrope_section",
        ),
        ({"head_dim": 32}, "text_config.head_dim"),
        ({"hidden_act": "gelu"}, "text_config.hidden_act"),
    ],
)
def test_unsupported_text_keys_are_one_line_errors(
    pair: tuple[Any, Qwen25VL, Path], change: dict[str, Any], key: str
) -> None:
    _, _, folder = pair
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(change)
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config, "cfg.json")
    message = str(e.value)
    assert message.startswith("cfg.json: ") and key in message and "\n" not in message


@pytest.mark.parametrize(
    "change, key",
    [
        ({"rope_parameters": {"rope_type": "default"}}, "vision_config.rope_parameters.rope_type"),
        ({"hidden_act": "swish"}, "vision_config.hidden_act"),
        ({"out_hidden_size": 32}, "vision_config.out_hidden_size"),
        ({"fullatt_block_indexes": [1, 7]}, "fullatt_block_indexes"),
        ({"window_size": 14}, "window_size"),
    ],
)
def test_unsupported_vision_keys_are_one_line_errors(
    pair: tuple[Any, Qwen25VL, Path], change: dict[str, Any], key: str
) -> None:
    _, _, folder = pair
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"].update(change)
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config, "cfg.json")
    message = str(e.value)
    assert message.startswith("cfg.json: ") and key in message and "\n" not in message
