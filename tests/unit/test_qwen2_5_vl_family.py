"""The qwen2_5_vl family's FLOPs / CP cost model (models/common/qwen_vl/flops.py), its job checks
(validate.py) and its parallelize's type check (parallelize.py): the decoder's weights equal the
llava family's formula for the same DecoderArgs; the vision tower's per-patch matmuls equal its
modules' weights; its attention pairs equal a brute-force count over the windows and frames
that vision.py's window_geometry cuts; each refusal is one line naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers

from titan_vlm.config import JobConfig
from titan_vlm.data.batch import Batch, Sample, collate
from titan_vlm.errors import ConfigError
from titan_vlm.layout import SeqLayout, build_layout
from titan_vlm.models.common.decoder import Decoder
from titan_vlm.models.common.qwen_vl.args import Qwen25VLArgs, VisionArgs
from titan_vlm.models.common.qwen_vl.flops import batch_train_flops, layout_cost
from titan_vlm.models.common.qwen_vl.images import QwenRule, QwenVisuals
from titan_vlm.models.common.qwen_vl.validate import validate
from titan_vlm.models.common.qwen_vl.vision_cost import image_train_flops, vision_patch_flops
from titan_vlm.models.common.text_args import DecoderArgs
from titan_vlm.models.llava.args import VLMArgs
from titan_vlm.models.llava.flops import layout_cost as llava_layout_cost
from titan_vlm.models.qwen2_5_vl.parallelize import parallelize
from titan_vlm.models.qwen2_5_vl.vision import VisionTower, window_geometry
from titan_vlm.parallel.context_parallel import CPContext
from titan_vlm.parallel_dims import ParallelDims
from titan_vlm.validate import validate_job

# Qwen2.5-VL-7B's shapes (its config.json), for the FLOPs only: nothing is built from them
DECODER_7B = DecoderArgs(
    dim=3584,
    n_layers=28,
    n_heads=28,
    n_kv_heads=4,
    ffn_dim=18944,
    vocab_size=152064,
    qkv_bias=True,
)
VISION_7B = VisionArgs(
    depth=32,
    hidden_size=1280,
    num_heads=16,
    intermediate_size=3420,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
    out_hidden_size=3584,
)
ARGS_7B = Qwen25VLArgs(vision=VISION_7B, decoder=DECODER_7B, mrope_section=(16, 24, 24))
# windows of 3 x 3 merge units (side not a power of 2), full attention in the first block only
ARGS_W3 = Qwen25VLArgs(
    vision=VisionArgs(depth=5, window_size=3 * 28, fullatt_block_indexes=(0,)),
)
ALL_ARGS = [Qwen25VLArgs(), ARGS_W3, ARGS_7B]

# (t, h, w) in patches (h, w multiples of merge = 2): square, sides not multiples of the window,
# one merge unit, videos, a strip
GRIDS = [(1, 2, 2), (1, 4, 4), (1, 4, 6), (1, 8, 4), (2, 4, 8), (1, 10, 14), (3, 6, 2)]
GRIDS += [(1, 22, 36), (4, 12, 18), (1, 2, 30)]


def brute_force_pairs(args: Qwen25VLArgs, grid: tuple[int, int, int]) -> int:
    """Query-key pairs of the tower's blocks on one grid from vision.py's own cut: sum of n^2
    over its windows (window blocks) and frames (full-attention blocks)."""
    v = args.vision
    g = window_geometry(torch.tensor([grid]), v)
    assert sum(g.windows) == sum(g.frames) == grid[0] * grid[1] * grid[2]
    full = sum(1 for i in range(v.depth) if i in v.fullatt_block_indexes)
    windows = sum(n * n for n in g.windows)
    frames = sum(n * n for n in g.frames)
    return (v.depth - full) * windows + full * frames


def matmul_weights(module: nn.Module) -> int:
    """Weights of the linear layers and convolutions in `module` (no biases, no norms)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv3d)))


@pytest.mark.parametrize("args", ALL_ARGS, ids=["debug", "window3", "7b"])
def test_layout_cost_decoder_is_llava_s_for_the_same_decoder(args: Qwen25VLArgs) -> None:
    cost = layout_cost(args)
    assert cost.slot > 0 and cost.pair > 0 and cost.image > 0
    theirs = llava_layout_cost(VLMArgs(decoder=args.decoder))
    assert cost.slot == theirs.slot
    assert cost.pair == theirs.pair


def test_per_slot_and_per_patch_costs_are_the_modules_weights() -> None:
    """6 FLOPs (forward 2, backward 4) per weight per row: a decoder slot every block's linear
    weights; a patch the embedding's and blocks' weights and 1/m^2 of the merger's."""
    args = ARGS_W3
    decoder = Decoder(args.decoder, "auto")
    assert layout_cost(args).slot == 6 * matmul_weights(decoder.layers)
    tower = VisionTower(args.vision, "auto")
    own = matmul_weights(tower.patch_embed) + matmul_weights(tower.layers)
    per_patch = own + matmul_weights(tower.merger) / args.vision.merge_unit
    assert vision_patch_flops(args.vision) == pytest.approx(6 * per_patch, rel=1e-12)
    assert layout_cost(args).image == vision_patch_flops(args.vision)


@pytest.mark.parametrize("args", ALL_ARGS, ids=["debug", "window3", "7b"])
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_image_train_flops_counts_window_attention_exactly(
    args: Qwen25VLArgs, grid: tuple[int, int, int]
) -> None:
    t, h, w = grid
    linear = vision_patch_flops(args.vision) * t * h * w
    attention = 3.0 * 4 * args.vision.hidden_size * brute_force_pairs(args, grid)
    assert image_train_flops(args, grid) == pytest.approx(linear + attention, rel=1e-12)


def test_window_attention_is_not_a_full_frame_s() -> None:
    """The window blocks cost less than they would attending over the whole frame, once a frame
    is wider than one window (the count does depend on the cut)."""
    args = ARGS_7B
    one_window = (1, 8, 8)  # 4 x 4 merge units: exactly one window
    assert brute_force_pairs(args, one_window) == args.vision.depth * 64**2
    wide = (1, 16, 24)
    assert brute_force_pairs(args, wide) < args.vision.depth * (16 * 24) ** 2


def test_image_train_flops_grows_with_the_grid() -> None:
    for args in ALL_ARGS:
        for t, h, w in GRIDS:
            flops = image_train_flops(args, (t, h, w))
            assert flops < image_train_flops(args, (t + 1, h, w))
            assert flops < image_train_flops(args, (t, h + 2, w))
            assert flops < image_train_flops(args, (t, h, w + 2))
        # frames are independent
        assert image_train_flops(args, (2, 8, 8)) == 2 * image_train_flops(args, (1, 8, 8))


def _pixels(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_batch_train_flops_of_a_packed_row() -> None:
    """Two samples in one row (an image of grid (1, 4, 6), a video of (2, 4, 8), another image
    of (1, 8, 4)) and padding: the tower on each grid, the decoder on 12 text tokens and 30
    image slots, its attention on the layout's pairs, the head on the text."""
    args = Qwen25VLArgs()
    rule = QwenRule(args)
    one = Sample(
        [[1, 2, 3], _pixels(3, 56, 84, seed=1), [4, 5, 6, 7], _pixels(4, 3, 56, 112, seed=2)]
    )
    two = Sample([[8, 9], _pixels(3, 112, 56, seed=3), [10, 11, 12, 13, 14, 15]])
    size = one.num_slots(rule) + two.num_slots(rule)
    batch = collate([[one, two]], size + 5, rule, rule.image_size, 0, slot_data=rule.positions)
    assert isinstance(batch.images, QwenVisuals)
    grids = [(1, 4, 6), (2, 4, 8), (1, 8, 4)]
    assert batch.images.grids() == grids
    _, _, layout = CPContext().place(batch, False)
    c, d = layout_cost(args), args.decoder
    text, slots = 3 + 4 + 2 + 6, 6 + 16 + 8
    want = (
        sum(image_train_flops(args, g) for g in grids)
        + c.slot * (text + slots)
        + c.pair * layout.whole_work()
        + 6.0 * d.dim * d.vocab_size * text
    )
    assert layout.whole_work() > 0
    assert batch_train_flops(args, batch, layout) == pytest.approx(want, rel=1e-12)


def test_batch_train_flops_of_a_tensor_batch() -> None:
    """Images as one [n, C, H, W] tensor (the core's native-size form): grid (1, H/p, W/p)."""
    args = Qwen25VLArgs()
    side, per = args.image_size, args.tokens_per_image  # 56 px: a (1, 4, 4) grid, 4 slots
    doc = torch.tensor([[0] * (2 * per + 3) + [-1]])
    image = torch.tensor([[0] * per + [1] * per + [-1] * 4])
    tokens = torch.zeros_like(doc)
    batch = Batch(torch.zeros(2, 3, side, side), tokens, tokens, doc, image)
    _, layout = build_layout(doc, image)
    assert isinstance(layout, SeqLayout)
    c, d = layout_cost(args), args.decoder
    want = (
        2 * image_train_flops(args, (1, 4, 4))
        + c.slot * (3 + 2 * per)
        + c.pair * layout.whole_work()
        + 6.0 * d.dim * d.vocab_size * 3
    )
    assert batch_train_flops(args, batch, layout) == pytest.approx(want, rel=1e-12)


# -- validate --------------------------------------------------------------------------------


def _dims(cp: int = 1, tp: int = 1) -> ParallelDims:
    return ParallelDims(1, 1, cp, tp, cp * tp)


def _refusal(args: Qwen25VLArgs, dims: ParallelDims, cfg: JobConfig, key: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(args, dims, cfg)
    message = str(e.value)
    assert "\n" not in message and key in message, message
    return message


def test_the_default_job_passes() -> None:
    validate(Qwen25VLArgs(), _dims(), JobConfig())
    cfg = JobConfig()
    cfg.parallelism.cp_comm_type = "a2a"
    validate(Qwen25VLArgs(), _dims(cp=2), cfg)  # 4 heads over 2 ranks


def test_refusals_are_one_line_naming_the_key() -> None:
    args = Qwen25VLArgs()
    cfg = JobConfig()
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.parallelism.enable_sequence_parallel = True
    cfg.parallelism.image_embed_tp_shard = True
    validate(args, _dims(tp=2), cfg)  # the tower, the merger and the decoder split in two
    cfg.parallelism.tensor_parallel_degree = 3
    message = _refusal(args, _dims(tp=3), cfg, "parallelism.tensor_parallel_degree=3")
    assert "vision num_heads (2)" in message
    vision = args.vision
    for bad, what in (
        (VisionArgs(hidden_size=64, num_heads=1, intermediate_size=64), "vision num_heads (1)"),
        (VisionArgs(intermediate_size=63), "vision intermediate_size (63)"),
    ):
        assert bad.out_hidden_size == args.decoder.dim and vision != bad
        message = _refusal(Qwen25VLArgs(vision=bad), _dims(tp=2), cfg, what)
        assert "parallelism.tensor_parallel_degree=2" in message
    decoder = DecoderArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=96, vocab_size=300, qkv_bias=True
    )
    _refusal(Qwen25VLArgs(decoder=decoder), _dims(tp=2), cfg, "decoder n_kv_heads (1)")
    cfg = JobConfig()
    cfg.parallelism.cp_comm_type = "a2a"  # 4 heads, 2 per tp rank, over cp = 4
    _refusal(args, _dims(cp=4, tp=2), cfg, "2 attention heads (per tp rank)")
    cfg = JobConfig()
    cfg.model.image_attention = "bidirectional"
    _refusal(args, _dims(), cfg, "model.image_attention")
    cfg = JobConfig()
    cfg.data.native_resolution_pixels = 448 * 448
    _refusal(args, _dims(), cfg, "data.native_resolution_pixels")
    cfg = JobConfig()
    cfg.parallelism.cp_comm_type = "a2a"
    _refusal(args, _dims(cp=3), cfg, "parallelism.cp_comm_type")
    heads = DecoderArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=3, ffn_dim=96, vocab_size=300, qkv_bias=True
    )
    _refusal(Qwen25VLArgs(decoder=heads), _dims(), JobConfig(), "n_kv_heads")


def test_validate_job_runs_the_family_s_checks() -> None:
    """Through validate.py's validate_job (the registry's qwen2_5_vl ModelSpec): the defaults
    pass, so does tp = 2; a tp that does not split the vision tower is one line."""
    cfg = JobConfig()
    cfg.model.name = "qwen2_5_vl"
    assert validate_job(cfg, 1) == _dims()
    cfg.parallelism.tensor_parallel_degree = 2
    assert validate_job(cfg, 2) == _dims(tp=2)
    cfg.parallelism.tensor_parallel_degree = 3
    with pytest.raises(ConfigError, match="tensor_parallel_degree=3 does not divide the vision"):
        validate_job(cfg, 3)


def _write_tokenizer(path: Path, words: int) -> None:
    """A WordLevel tokenizer.json of `words` words and Qwen's end-of-turn token."""
    vocab = {f"w{i}": i for i in range(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(path))


def test_the_tokenizer_must_fit_the_embeddings(tmp_path: Path) -> None:
    args = Qwen25VLArgs()  # 300 embeddings
    small, large = tmp_path / "small.json", tmp_path / "large.json"
    _write_tokenizer(small, 200)
    _write_tokenizer(large, 400)
    cfg = JobConfig()
    cfg.model.tokenizer_path = str(small)
    validate(args, _dims(), cfg)
    cfg.model.tokenizer_path = str(large)
    assert "403 ids" in _refusal(args, _dims(), cfg, "model.tokenizer_path")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    cfg = JobConfig()
    cfg.model.hf_path = str(folder)
    validate(args, _dims(), cfg)  # no tokenizer.json in the folder: unchecked
    _write_tokenizer(folder / "tokenizer.json", 400)
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _refusal(args, _dims(), cfg, "model.hf_path")


def test_parallelize_takes_the_family_s_model() -> None:
    with pytest.raises(TypeError, match="Qwen25VL"):
        parallelize(nn.Linear(2, 2), None, JobConfig())  # type: ignore[arg-type]


def test_an_images_work_prices_its_attention_as_it_is() -> None:
    """QwenVisuals.work is each image's whole tower cost in units of one patch's matmuls, so the
    CP cost model and cp_vision = "shard" see a large frame's full attention: an image of 192
    patches in one frame outweighs three of 64 (8x8-patch grids), and shard deals it alone,
    where dealing by patch counts would give its rank a small image too."""
    from titan_vlm.parallel.context_parallel import image_shard_sizes

    args = Qwen25VLArgs()
    rule = QwenRule(args)
    big = torch.zeros(3, 224, 168)  # grid (1, 16, 12): 192 patches
    visuals = QwenVisuals((big, *[torch.zeros(3, 112, 112)] * 4), rule)  # + 4 x 64 patches
    unit = vision_patch_flops(args.vision)
    assert visuals.work() == [image_train_flops(args, g) / unit for g in visuals.grids()]
    patches = [t * h * w for t, h, w in visuals.grids()]
    assert patches == [192, 64, 64, 64, 64]
    assert visuals.work()[0] > 3 * visuals.work()[1]
    assert image_shard_sizes(visuals.patches(), 2) == [1, 4]  # by cost
    assert image_shard_sizes(patches, 2) == [2, 3]  # by patches alone: the control


def test_a_video_s_frame_groups_encode_as_the_whole_video() -> None:
    """cp_vision = "shard" deals QwenVisuals.units: a video's frame groups encoded in separate
    ranges (as different CP ranks encode them) give exactly the rows of the video encoded
    whole, and one long video is spread over the ranks, none encoding all of it. The control:
    a cut that is not on a frame-group boundary changes the rows (the tower's temporal patches
    would pair other frames)."""
    from titan_vlm.models.qwen2_5_vl.model import Qwen25VL
    from titan_vlm.parallel.context_parallel import image_shard_sizes

    torch.manual_seed(0)
    args = Qwen25VLArgs()
    rule = QwenRule(args)
    model = Qwen25VL(args)
    video = _pixels(5, 3, 56, 84, seed=1)  # 5 frames: groups of 2, 2 and 1 (padded)
    image = _pixels(3, 56, 56, seed=2)
    visuals = QwenVisuals((image, video), rule)
    units = visuals.units()
    assert [tuple(t.shape[:1]) for t in units.tensors] == [(3,), (2,), (2,), (1,)]
    assert sum(units.slots()) == sum(visuals.slots())
    with torch.no_grad():
        whole = model.encode_images(visuals)
        parts = torch.cat([model.encode_images(units[:2]), model.encode_images(units[2:])])
        wrong_cut = QwenVisuals((image, video[:3], video[3:]), rule)
        wrong = model.encode_images(wrong_cut)
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
    assert wrong.shape == whole.shape and not torch.allclose(wrong, whole, atol=1e-3)

    long_video = QwenVisuals((_pixels(8, 3, 56, 56, seed=3),), rule)  # 4 frame groups
    assert image_shard_sizes(long_video.patches(), 4) == [1, 0, 0, 0]  # whole: one rank
    assert image_shard_sizes(long_video.units().patches(), 4) == [1, 1, 1, 1]
