"""Mixture-of-experts decoders against transformers, on tiny folders transformers writes: a
Qwen3-VL-MoE folder (fused experts, as transformers 5 saves them, and the hub's transposed
layout) and a LLaVA folder whose text model is Qwen3-MoE (one tensor per expert). For each: the
logits of every text slot, the router's load-balancing loss exactly as transformers computes it
(its aux_loss output; for LLaVA, its load_balancing_loss_func on the routers' logits), the
export read back by transformers. Controls: the top-k probabilities not renormalised, the aux
loss of one layer only, and an experts file with an expert missing (one line)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_folders import (
    END,
    IMAGE,
    LLAVA_IMAGE,
    QWEN3_MOE,
    START,
    TOWER,
    save_llava,
    save_qwen3_moe,
)
from safetensors.torch import load_file, save_file
from test_qwen3_vl_model import IMAGE_GRIDS, image_rows, pixels, relative_error
from transformers import CLIPVisionConfig, LlavaForConditionalGeneration, Qwen3MoeConfig
from transformers import Qwen3VLMoeForConditionalGeneration as HFQwen3VLMoe
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from titan_vlm.data.batch import Sample, collate
from titan_vlm.errors import ConfigError
from titan_vlm.generate import greedy
from titan_vlm.models.common.moe import RouterStats, aux_loss
from titan_vlm.models.common.qwen_vl.mrope import batch_rope_index
from titan_vlm.models.common.qwen_vl.processor import patchify_frames
from titan_vlm.models.hf_export import export_hf, hf_config, load_hf_model
from titan_vlm.models.llava.model import VLM
from titan_vlm.models.qwen3_vl.images import Qwen3Rule
from titan_vlm.models.qwen3_vl.model import Qwen3VL
from titan_vlm.models.registry import model_spec
from titan_vlm.parallel.context_parallel import CPContext

TOL = 1e-5


def qwen3_moe(folder: Path) -> Qwen3VL:
    model, _ = load_hf_model(hf_config(str(folder)))
    assert isinstance(model, Qwen3VL)
    return model


def qwen_forward(hf: Any, ours: Qwen3VL) -> tuple[float, float, float, RouterStats]:
    """(logits error, their aux, our aux, our router statistics) of one row with two images."""
    ids = image_rows(seed=3)
    px = pixels(IMAGE_GRIDS, seed=4)
    with torch.no_grad():
        out = hf(
            input_ids=ids,
            pixel_values=px,
            image_grid_thw=IMAGE_GRIDS,
            mm_token_type_ids=(ids == IMAGE).long(),
            output_router_logits=True,
        )
        got = ours(ids, px, IMAGE_GRIDS, batch_rope_index(ids, IMAGE_GRIDS, None, None, ours.args))
    router = ours.router_stats()
    assert router is not None and ours.router_stats() is None  # handed over once
    _, aux, _ = aux_loss(router, None)
    text = ids != IMAGE
    return relative_error(got[text], out.logits[text]), float(out.aux_loss), float(aux), router


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Qwen3VL, Path]:
    folder = tmp_path_factory.mktemp("qwen3_vl_moe")
    hf = save_qwen3_moe(folder)
    return hf, qwen3_moe(folder).eval(), folder


def test_qwen3_vl_moe_logits_and_router_loss_match_transformers(
    qwen_pair: tuple[Any, Qwen3VL, Path],
) -> None:
    """Qwen3VLMoeForConditionalGeneration's logits and its aux_loss (over every sparse layer and
    token of the row); the router loss's weight is the folder's router_aux_loss_coef. Controls:
    the top-k probabilities left unnormalised change the logits; the loss of one layer differs."""
    hf, ours, _ = qwen_pair
    d = ours.args.decoder
    assert d.moe is not None and d.moe.layers == (0, 2) and d.moe.aux_loss_coef == 0.05
    err, theirs, mine, router = qwen_forward(hf, ours)
    print(f"logits {err:.2e}; aux loss ours {mine:.8f} transformers {theirs:.8f}")
    assert err < TOL
    assert abs(mine - theirs) < 1e-6 * max(1.0, theirs)
    # controls
    plain = Qwen3VL(
        dataclasses.replace(
            ours.args,
            decoder=dataclasses.replace(d, moe=dataclasses.replace(d.moe, norm_topk_prob=False)),
        )
    )
    plain.load_state_dict(ours.state_dict())
    assert qwen_forward(hf, plain.eval())[0] > 1e-3
    _, one_layer, _ = aux_loss(RouterStats(router.stats[:1], router.args), None)
    assert abs(float(one_layer) - theirs) > 1e-4


def test_qwen3_vl_moe_hub_layout_and_export(
    qwen_pair: tuple[Any, Qwen3VL, Path], tmp_path: Path
) -> None:
    """The hub's transposed expert tensors load to the same model (transformers transposes them
    too); an export keeps its source's layout and transformers reads it back to the same
    logits; a folder missing one fused half is one line."""
    hf, ours, _ = qwen_pair
    hub = tmp_path / "hub"
    save_qwen3_moe(hub, hub_layout=True)
    files = load_file(hub / "model.safetensors")
    gate_up = files["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 64, 48)  # [E, dim, 2 ffn]: transposed
    from_hub = qwen3_moe(hub)
    for (name, a), b in zip(ours.state_dict().items(), from_hub.state_dict().values()):
        assert torch.equal(a, b), name
    hf_hub = HFQwen3VLMoe.from_pretrained(hub).eval()
    assert qwen_forward(hf_hub, from_hub)[0] < TOL

    out = tmp_path / "export"
    export_hf(from_hub, hf_config(str(hub)), out)
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(files)
    # written in its source's layout (transposed), which transformers transposes back on load
    assert exported["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 48)
    back = HFQwen3VLMoe.from_pretrained(out).eval()
    err, theirs, mine, _ = qwen_forward(back, ours)
    assert err < TOL and abs(mine - theirs) < 1e-6

    del files["model.language_model.layers.2.mlp.experts.down_proj"]
    save_file(files, hub / "model.safetensors")
    with pytest.raises(ConfigError, match="gate_up_proj and down_proj come together"):
        qwen3_moe(hub)


def test_qwen3_vl_moe_greedy_ids_equal_transformers_generate(
    qwen_pair: tuple[Any, Qwen3VL, Path],
) -> None:
    """generate.py's greedy decoding (the whole row again each step, M-RoPE positions from the
    family's rule) on text and two images of different aspect ratios: the same ids as
    transformers' generate (its KV cache and rope deltas) on the same pixels."""
    hf, ours, _ = qwen_pair
    rule = Qwen3Rule(ours.args)
    g = torch.Generator().manual_seed(5)
    prefix: list[Any] = [
        [7, 8, START],
        torch.rand(3, 64, 96, generator=g) * 2 - 1,  # grid (1, 4, 6): 6 slots
        [END, 9, START],
        torch.rand(3, 128, 64, generator=g) * 2 - 1,  # grid (1, 8, 4): 8 slots
        [END, 11, 12],
    ]
    ids = greedy(ours, prefix, {-1}, 6, 0, IMAGE, rule, rule.positions)
    v = ours.args.vision
    row: list[int] = []
    patches, grids = [], []
    for part in prefix:
        if isinstance(part, list):
            row += part
            continue
        x, grid = patchify_frames(
            part.unsqueeze(0), v.patch_size, v.spatial_merge_size, v.temporal_patch_size
        )
        patches.append(x)
        grids.append(grid)
        row += [IMAGE] * v.tokens(*grid)
    input_ids = torch.tensor([row])
    with torch.no_grad():
        out = hf.generate(
            input_ids=input_ids,
            pixel_values=torch.cat(patches),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(input_ids == IMAGE).long(),
            max_new_tokens=6,
            do_sample=False,
        )
    assert ids == out[0, input_ids.shape[1] :].tolist(), (ids, out)


def llava_moe(folder: Path) -> tuple[LlavaForConditionalGeneration, VLM]:
    hf = save_llava(folder, CLIPVisionConfig(**TOWER), Qwen3MoeConfig(**QWEN3_MOE))
    ours, _ = load_hf_model(hf_config(str(folder)))
    assert isinstance(ours, VLM)
    return hf, ours


def test_llava_with_a_qwen3_moe_text_model_matches_transformers(tmp_path: Path) -> None:
    """A LLaVA folder (one tensor per expert): the text slots' logits, and the router loss equal
    to load_balancing_loss_func over the routers' logits of the same forward (LLaVA's own loss
    adds none: the model's weight is 0); the export writes one tensor per expert again, and a
    folder missing an expert is one line naming it."""
    source = tmp_path / "source"
    hf, ours = llava_moe(source)
    d = ours.args.decoder
    assert d.moe is not None and d.moe.layers == (1,) and d.moe.aux_loss_coef == 0.0
    g = torch.Generator().manual_seed(1)
    image = torch.rand(3, 16, 16, generator=g) * 2 - 1
    before, after = [5, 9, 2, 7], [11, 3, 8, 1, 4, 6]
    tpi = ours.args.tokens_per_image
    ids = torch.tensor([before + [LLAVA_IMAGE] * tpi + after])
    router_logits: list[torch.Tensor] = []
    gates = [m for n, m in hf.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda m, i, o: router_logits.append(o[0])) for g in gates]
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=image[None]).logits[0]
    for h in hooks:
        h.remove()
    expected = load_balancing_loss_func(tuple(router_logits), 4, 2)
    batch = collate([[Sample([before, image, after])]], ids.shape[1], tpi, 16, 0)
    with torch.no_grad():
        logits, _, _ = ours.forward_local(batch, CPContext())
    text = (batch.doc[0] >= 0) & (batch.image[0] < 0)
    err = relative_error(logits[0][: int(text.sum())], theirs[ids[0] != LLAVA_IMAGE])
    router = ours.router_stats()
    assert router is not None
    _, aux, _ = aux_loss(router, None)
    print(f"logits {err:.2e}; aux {float(aux):.8f} vs {float(expected):.8f}")
    assert err < TOL and abs(float(aux) - float(expected)) < 1e-6

    out = tmp_path / "export"
    export_hf(ours, hf_config(str(source)), out)
    written = load_file(out / "model.safetensors")
    assert set(written) == set(load_file(source / "model.safetensors"))
    name = "language_model.model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(written[name], ours.decoder.layers[1].moe.experts.w3[3])
    back = LlavaForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, pixel_values=image[None]).logits[0], theirs)

    files = load_file(source / "model.safetensors")
    for proj in ("gate", "up", "down"):
        del files[f"language_model.model.layers.1.mlp.experts.2.{proj}_proj.weight"]
    save_file(files, source / "model.safetensors")
    with pytest.raises(
        ConfigError, match=r"layers\.1\.mlp\.experts\.2\.down_proj\.weight is missing"
    ):
        load_hf_model(hf_config(str(source)))


def test_a_config_json_with_experts_reads_both_key_spellings(tmp_path: Path) -> None:
    """num_experts (the hub's Qwen3-MoE configs) and num_local_experts (what transformers 5
    writes) are one setting; both present and different is one line; a config that leaves no
    layer sparse is a dense decoder."""
    save_llava(tmp_path, CLIPVisionConfig(**TOWER), Qwen3MoeConfig(**QWEN3_MOE))
    config = json.loads((tmp_path / "config.json").read_text())
    text = config["text_config"]
    assert text.get("num_local_experts") == 4
    text["num_experts"] = text.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = hf_config(str(tmp_path))
    assert model_spec(args).args(args).decoder.moe.num_experts == 4
    text["num_local_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_experts=4 is not supported"):
        model_spec(args).args(args)
    # no layer left sparse (every one in mlp_only_layers, or no experts): a dense decoder, as
    # transformers builds it
    del text["num_local_experts"]
    for change in ({"mlp_only_layers": [0, 1]}, {"num_experts": 0}, {"decoder_sparse_step": 3}):
        (tmp_path / "config.json").write_text(
            json.dumps({**config, "text_config": {**text, **change}})
        )
        assert model_spec(args).args(args).decoder.moe is None, change


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 16, 0], [0, 0, 0, 0]])
def test_grouped_mm_kernel_equals_the_loop(counts: list[int]) -> None:
    """The experts' two kernels (models/common/grouped.py KERNELS): torch._grouped_mm's output
    and every gradient (the rows', each expert's weights') equal one matmul per expert's, fp32,
    with experts that get no row and a batch of no rows; the registry and model.experts_kernel
    name the same kernels, and "auto" is the loop on the CPU and grouped_mm on CUDA. The
    control: a grouping off by one row gives other outputs."""
    from typing import get_args

    from titan_vlm.config import ExpertsKernel
    from titan_vlm.models.common.grouped import KERNEL_NAMES, experts, resolve

    assert set(KERNEL_NAMES) == set(get_args(ExpertsKernel))
    assert resolve("auto", torch.device("cpu")) == "loop"
    assert resolve("auto", torch.device("cuda")) == "grouped_mm"
    assert resolve("grouped_mm", torch.device("cpu")) == "grouped_mm"
    g = torch.Generator().manual_seed(0)
    e, dim, ffn = 4, 24, 16
    sizes = torch.tensor(counts)
    x = torch.randn(int(sizes.sum()), dim, generator=g)
    weights = [torch.randn(e, ffn, dim, generator=g), torch.randn(e, ffn, dim, generator=g)]
    weights.append(torch.randn(e, dim, ffn, generator=g))
    dy = torch.randn(x.shape[0], dim, generator=g)

    def run(kernel: str, groups: torch.Tensor) -> list[torch.Tensor]:
        xs = x.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in weights]
        y = experts(xs, groups, *ws, kernel=kernel)
        (y * dy).sum().backward()
        return [y.detach(), xs.grad, *(w.grad for w in ws)]  # type: ignore[misc]

    loop, grouped = run("loop", sizes), run("grouped_mm", sizes)
    for a, b in zip(loop, grouped):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    if counts[0] > 0:
        shifted = sizes.clone()
        shifted[0] -= 1
        shifted[1] += 1
        assert not torch.allclose(run("grouped_mm", shifted)[0], loop[0], atol=1e-3)


def test_the_config_chooses_the_experts_kernel() -> None:
    """model.experts_kernel reaches every MoE layer's experts, and a LLaVA + MoE model computes
    the same loss and gradients with either kernel."""
    from titan_vlm.config import JobConfig

    losses, grads = [], []
    assert JobConfig().model.experts_kernel == "auto"
    for kernel in ("loop", "grouped_mm"):
        cfg = JobConfig()
        cfg.model.flavor = "debug_moe"
        cfg.model.experts_kernel = kernel  # type: ignore[assignment]
        args = model_spec(cfg).args(cfg)
        torch.manual_seed(0)
        model = VLM(args)
        kernels = {m.kernel for m in model.modules() if hasattr(m, "ep_group")}
        assert kernels == {kernel}
        torch.manual_seed(1)
        tokens = torch.randint(0, 200, (1, 40))
        images = torch.randn(1, 3, args.vision.image_size, args.vision.image_size)
        embeds = model.encode_images(images)
        rows = collate([[Sample([images[0], tokens[0].tolist()])]], 40 + args.tokens_per_image,
                       args.tokens_per_image, args.vision.image_size, 0)  # fmt: skip
        placed_tokens, _, layout = CPContext().place(rows, model.bidirectional_images)
        logits = model.decode(placed_tokens, embeds, layout)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(*grads))
