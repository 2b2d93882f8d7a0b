"""The model-family boundary, in the spirit of torchtitan's TrainSpec.

A family (today: "llava", a vision tower + projector feeding a decoder) supplies everything the
trainer, the parallelisms and the checkpoint code need to know about its modules; they call
this interface and never reach into module names:

    args        the architecture, from a built-in flavor or a Hugging Face config.json (its
                validation: what the modules cannot express is a one-line ConfigError)
    build       the nn.Module (on whatever device is current: the trainer uses meta)
    init_rule   how each parameter starts when training from scratch (models/loading.py)
    after_to_empty  redo what `Module.to_empty` undoes: buffers (RoPE tables), tied weights
    hf_names / hf_unused / hf_same / hf_export_names
                the Hugging Face state-dict adapter, both directions (hf_same: file tensors the
                model holds once, e.g. a tied head, which must equal the one it loads;
                parameters that name one file tensor are its dim-0 pieces in the mapping's
                order, e.g. a fused qkv: common/hf_adapter.py hf_tensor_parts)
    parallelize TP, activation checkpointing, compile and FSDP, applied from outside
    flops       model FLOPs of a batch, given a CP rank's layout of it (no second layout)
    layout_cost the CP cost model's weights (layout.LayoutCost: per slot, attention pair and
                image), which the auto sample placement balances and cp_balance reports
    validate    what the family needs of the job's shapes and mesh (heads and tp, sequence
                length, vocabulary; validate.py runs it before any process group exists)
    data_rule   how its images take slots and travel in a batch, and its per-slot data (e.g.
                M-RoPE positions): what the dataset collates with (data/image_batch.py)
    inputs      its tokenizer and processor for the config (data/__init__.py model_inputs for a
                LLaVA folder)
    plan_shapes what the planner (python -m titan_vlm.plan) prices: its shapes on images of a
                size (None: its own), its parameters with the dim its TP plan splits, its FLOPs
                (plan/shapes.py ModelShapes)
    param_groups  which of PARAM_GROUPS (vision, projector, decoder) each parameter is in, by
                name prefix: what training.freeze and the per-group learning rates name

The module `build` returns is a `VisionLanguageModel`: the few verbs the trainer, context
parallelism (parallel/context_parallel.py) and generate.py use on it (encode the images, decode
text with image embeddings placed, which modules make the embeddings, and the shapes involved).
They never reach into a family's submodules or its args.

The next family (say Qwen3-VL) is a new folder, models/<model_type>/, with its own `ModelSpec`
and a model class that subclasses `VisionLanguageModel`, added to the one registry,
`models/registry.py`, which `model.name` (or a folder's model_type) chooses from; train.py,
trainer.py and context_parallel.py do not change.

Why an abstract base class and not a `Protocol` or more hooks on `ModelSpec`: the trainer needs
the model both as an `nn.Module` (FSDP, the optimizer, DCP state dicts) and as a family's verbs,
and a Protocol cannot say "is an nn.Module" without restating Module's API; hooks on the spec
would take the module as `Any` and split a family's forward between two places. A subclass that
misses a verb fails at construction, and mypy sees one type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from titan_vlm.config import JobConfig
    from titan_vlm.data.batch import Batch, SlotData
    from titan_vlm.data.hf_processor import HFProcessor
    from titan_vlm.data.image_batch import ImageRule, Images
    from titan_vlm.data.tokenizer import ByteTokenizer, HFTokenizer
    from titan_vlm.layout import LayoutCost, SeqLayout
    from titan_vlm.models.common.decoder import Decoder
    from titan_vlm.models.common.moe import RouterStats
    from titan_vlm.models.loading import Init
    from titan_vlm.parallel_dims import Mesh, ParallelDims
    from titan_vlm.plan.shapes import ModelShapes


class BatchContext(Protocol):
    """What a model's `forward_local` is handed: where this rank's share of a batch comes from
    (parallel/context_parallel.py CPContext implements it over the CP and TP groups; one
    process: no groups). The model decides what to encode and decode; the context decides who
    encodes which images and who holds which slots, and makes the collectives."""

    def encode_images(self, model: VisionLanguageModel, images: Images) -> torch.Tensor:
        """`model.encode_images` of every image of the batch, whole on every CP rank (their
        gradient summed over cp before it reaches the encoder), in batch order."""
        ...

    def place(
        self, batch: Batch, bidirectional_images: bool
    ) -> tuple[torch.Tensor, torch.Tensor, SeqLayout]:
        """This rank's text tokens and labels [B, T] and its SeqLayout (with the batch's
        slot_data at its local slots)."""
        ...


class VisionLanguageModel(nn.Module, ABC):
    """A family's model as the trainer, context parallelism and generate use it. Images enter
    only through `encode_images`; their embeddings reach the decoder only through `decode`,
    which places them into the rows' image slots (SeqLayout.place_images):

        images [n, C, H, W] --encode_images--> embeds [n, image_tokens(H, W), embed_dim]
        ImageList (mixed sizes) --encode_images--> embeds [sum of image_tokens, embed_dim]
        tokens [B, T] + embeds + layout --decode--> logits [B, T, vocab] of the text slots

    Either way the embeddings are the batch's image tokens in batch order, each image's in
    order, which is how the layout indexes them (SeqLayout.place_images flattens them to
    [tokens, D]). Between the two, context parallelism replicates the embeddings over the cp
    ranks (and sums their gradient there); single-device `forward` is
    `decode(encode_images(...))`. Every family's text model is a common/decoder.py Decoder held
    as `decoder`."""

    decoder: Decoder

    def forward_local(
        self, batch: Batch, ctx: BatchContext
    ) -> tuple[torch.Tensor, torch.Tensor, SeqLayout]:
        """This rank's forward of `batch` (the rows every rank of its CP group reads): the logits
        [B, T, vocab] of its local text section, their labels [B, T] and its layout. The images
        are encoded where `ctx` says and their embeddings are whole on every CP rank; `ctx`
        places the text (its CP layout); the decoder runs on this rank's slots. The one forward
        the trainer calls (step.py); a family whose forward needs more than encode, place,
        decode (per-slot rotary positions from layout.slot_data, features added in later decoder
        layers) overrides it, calling `ctx` for what crosses ranks."""
        embeds = ctx.encode_images(self, batch.images)
        tokens, labels, layout = ctx.place(batch, self.bidirectional_images)
        return self.decode(tokens, embeds, layout), labels, layout

    @abstractmethod
    def encode_images(self, images: Images) -> torch.Tensor:
        """images [n, C, H, W] (n may be 0) -> image embeddings [n, image_tokens(H, W),
        embed_dim]; an ImageList -> [sum of its images' image_tokens, embed_dim] (batch order)."""

    @abstractmethod
    def image_tokens(self, height: int, width: int) -> int:
        """Embeddings (image slots) of an image that enters the ViT at height x width pixels: the
        one rule the data pipeline, the batch's slot metadata and encode_images follow."""

    @abstractmethod
    def decode(self, tokens: torch.Tensor, embeds: torch.Tensor, layout: SeqLayout) -> torch.Tensor:
        """The logits [B, T, vocab] of the layout's text section: `tokens` [B, T] with the image
        embeddings of every image of the rows (`encode_images`' output, rows in order), placed
        by the layout into its image prefix and (samples a CP rank keeps whole) among the text
        (SeqLayout.place_images, inline_embeds)."""

    def decode_stage(
        self,
        tokens: torch.Tensor,
        embeds: torch.Tensor | None,
        layout: SeqLayout,
        h: torch.Tensor | None,
        layers: range,
        head: bool,
    ) -> torch.Tensor:
        """A pipeline stage's part of `decode` (parallel/pipeline.py StageModule): the first
        stage (`h` None) builds the first block's input from `tokens` and the image `embeds`
        (`stage_input`); every stage runs the decoder blocks in `layers` on it (h [B, L, dim]);
        with `head`, the final norm and head on the text section give the logits [B, T, vocab],
        else h is returned. It calls the decoder's parts, each an FSDP unit of its own under
        pipeline parallelism (parallel/parallelize.py decoder_units), never the decoder's
        forward."""
        decoder = self.decoder
        after = None
        if h is None:
            assert embeds is not None
            h, after = self.stage_input(tokens, embeds, layout)
        elif layers and layers.start < self.first_stage_layers:
            raise ValueError(
                f"decoder layer {layers.start} is one the family adds image features after, "
                f"which only the first pipeline stage has (it must hold layers 0-"
                f"{self.first_stage_layers - 1})"
            )
        h = decoder.run_layers(h, layout, after, layers)
        if not head:
            return h
        return decoder.output(decoder.norm(h[:, layout.num_image_tokens :]))

    def stage_input(
        self, tokens: torch.Tensor, embeds: torch.Tensor, layout: SeqLayout
    ) -> tuple[torch.Tensor, Callable[[int, torch.Tensor], torch.Tensor] | None]:
        """The first pipeline stage's start of `decode`: the first block's input [B, L, dim]
        (the embeddings placed as `decode` places them) and what the family adds after a block
        (run_layers' `after`; None: nothing). A family that adds image features after decoder
        layers (Qwen3-VL's DeepStack) overrides it; those layers are on the first stage
        (`first_stage_layers`)."""
        h, _ = self.decoder.local_sequence(
            tokens, layout.place_images(embeds), layout, layout.inline_embeds(embeds)
        )
        return h, None

    @property
    def first_stage_layers(self) -> int:
        """The decoder layers (0, 1, ...) a first pipeline stage must hold: those after which the
        family adds the image embeddings' features (Qwen3-VL's DeepStack), which exist on the
        first stage only. 0: none."""
        return 0

    @abstractmethod
    def router_stats(self) -> RouterStats | None:
        """The router statistics of the last forward's mixture-of-experts layers
        (models/common/moe.py), handed over once; None: the decoder has no experts."""

    @abstractmethod
    def vision_modules(self) -> list[nn.Module]:
        """The modules `encode_images` runs: their gradients come only from the image
        embeddings (cp_vision="broadcast" hands cp rank 0's to the other cp ranks)."""

    @property
    @abstractmethod
    def tokens_per_image(self) -> int:
        """Embeddings (image slots) per image of the native size (`image_tokens` of any other)."""

    @property
    @abstractmethod
    def embed_dim(self) -> int:
        """The width of an image embedding: the decoder's hidden size."""

    @property
    @abstractmethod
    def image_size(self) -> int:
        """The side, in pixels, of the model's native square images (its learned position grid;
        other sizes are interpolated to)."""

    @property
    @abstractmethod
    def bidirectional_images(self) -> bool:
        """Whether an image's slots attend to each other both ways (model.image_attention)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # the config.json model_types whose folders are this family (model.flavor = "hf" picks the
    # family by them: models/registry.py)
    hf_model_types: tuple[str, ...]
    args: Callable[[JobConfig], Any]
    build: Callable[[Any], VisionLanguageModel]
    init_rule: Callable[[Any, str, torch.Tensor], Init]
    after_to_empty: Callable[[nn.Module], None]
    hf_names: Callable[[Any, set[str], str], dict[str, str]]
    hf_unused: Callable[[Any, set[str]], dict[str, str]]
    hf_same: Callable[[Any, set[str]], list[tuple[str, str]]]
    hf_export_names: Callable[[Any], dict[str, str]]
    parallelize: Callable[[nn.Module, Mesh, JobConfig], None]
    flops: Callable[[Any, Batch, SeqLayout], float]
    layout_cost: Callable[[Any], LayoutCost]
    # what the family needs of the job's shapes and mesh, after validate.py's generic checks
    validate: Callable[[Any, ParallelDims, JobConfig], None]
    # how the family's images take slots and travel in a batch (None: each at the model's size,
    # tokens_per_image slots) and its per-slot data of a sample (None: none): the dataset's
    data_rule: Callable[[Any, JobConfig], tuple[ImageRule | None, SlotData | None]]
    # the tokenizer the job's text is encoded with, and the folder's processor (chat template,
    # image preprocessing) where the family reads a dataset file through one (else None)
    inputs: Callable[[JobConfig], tuple[ByteTokenizer | HFTokenizer, HFProcessor | None]]
    # what the planner (titan_vlm/plan) prices of the model on images of a size (None: its
    # own): shapes, parameters with their TP dims, FLOPs
    plan_shapes: Callable[[Any, tuple[int, int] | None], ModelShapes]
    # its parameters' groups (PARAM_GROUPS), as (name prefix, group) pairs, the longest matching
    # prefix winning (`param_group`): what training.freeze freezes and vision_lr / projector_lr
    # set (pairs, not a dict: a spec stays hashable)
    param_groups: tuple[tuple[str, str], ...]

    def group_of(self, name: str) -> str:
        """The PARAM_GROUPS group of parameter `name` (a name of the built model)."""
        return param_group(self.param_groups, name)


# The groups every family's parameters fall in (ModelSpec.param_groups maps them).
PARAM_GROUPS = ("vision", "projector", "decoder")


def param_group(prefixes: tuple[tuple[str, str], ...], name: str) -> str:
    """The group of parameter `name`: that of the longest prefix in `prefixes` it starts with.
    A name no prefix covers is a bug in the family's table (ValueError)."""
    matches = [(len(prefix), group) for prefix, group in prefixes if name.startswith(prefix)]
    if not matches:
        raise ValueError(f"parameter {name!r} is in none of the groups {prefixes}")
    return max(matches)[1]
