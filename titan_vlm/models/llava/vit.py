"""Vision transformer: patch embedding, learned positions, pre-norm blocks, bidirectional
attention. With the right ViTArgs it is a SigLIP or a CLIP vision tower as LLaVA uses it (the
features of `hidden_states[vision_feature_layer]`).

Images of any size that is a whole number of patches: the learned positions (a square grid at
`image_size`) are resized bicubically to each image's grid (`position_embeddings`, what
transformers' `interpolate_pos_encoding=True` computes for SigLIP and CLIP), and at the native
grid used as they are, so a native-size batch computes exactly what it always did. Images of
different sizes (an ImageList, data.native_resolution_pixels > 0) run as one packed sequence
through every block, each image attending only to itself (one varlen plan), so every block runs
once per step on every rank whatever the sizes (FSDP and TP collectives stay in step)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_vlm.attention import attention, planned_attention
from titan_vlm.data.image_batch import Images
from titan_vlm.data.images import ImageList
from titan_vlm.models.common.activations import ACT_FNS
from titan_vlm.models.llava.args import ViTArgs
from titan_vlm.varlen import PackedPlan, pack


class ViTAttention(nn.Module):
    """Separate q/k/v projections (as SigLIP's and CLIP's q_proj/k_proj/v_proj): a fused [3*dim]
    output split column-wise would give a tensor-parallel rank a mix of q and k columns, while
    separate ones split cleanly into whole heads per rank. Head counts are inferred (-1): the
    local count."""

    def __init__(self, a: ViTArgs, attention_kernel: str):
        super().__init__()
        self.attention_kernel = attention_kernel  # model.attention_kernel
        self.head_dim = a.dim // a.n_heads
        self.q = nn.Linear(a.dim, a.dim)
        self.k = nn.Linear(a.dim, a.dim)
        self.v = nn.Linear(a.dim, a.dim)
        self.proj = nn.Linear(a.dim, a.dim)

    def forward(self, x: torch.Tensor, plan: PackedPlan | None = None) -> torch.Tensor:
        """x [n, L, dim]; `plan`: None, every token of a row sees its row (one image a row), or
        the packed images' plan (x [1, total, dim], each image sees itself: ViT.forward)."""
        # unflatten/flatten infer the head count from the last dim alone: a rank may encode no
        # images (cp_vision=shard), and view(b, n, -1, ...) cannot infer -1 for zero elements
        q, k, v = (
            w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
            for w in (self.q, self.k, self.v)
        )
        if plan is None:
            out = attention(q, k, v, None, self.attention_kernel)
        else:
            out = planned_attention(q, k, v, plan, self.attention_kernel)
        return self.proj(out.transpose(1, 2).flatten(2))


class ViTBlock(nn.Module):
    def __init__(self, a: ViTArgs, attention_kernel: str):
        super().__init__()
        self.act = ACT_FNS[a.act]
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attn = ViTAttention(a, attention_kernel)
        self.norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc1 = nn.Linear(a.dim, a.mlp_dim)
        self.fc2 = nn.Linear(a.mlp_dim, a.dim)

    def forward(self, x: torch.Tensor, plan: PackedPlan | None = None) -> torch.Tensor:
        # attn always takes (x, plan), plan None for one image a row: sequence parallelism's
        # input plan for it (parallelize.apply_tp) names both inputs
        normed = self.norm1(x)
        x = x + self.attn(normed, plan)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """images [n, C, H, W] -> features [n, image_tokens(H, W), dim]; an ImageList (images of
    different sizes) -> features [sum of image_tokens, dim], each image's in order, the images in
    batch order.

    embeddings = patches (+ class token in front) + the positions of the image's grid
    (`position_embeddings`) -> pre_norm -> the `n_layers` blocks -> norm (post_norm) -> position 0
    dropped (drop_first). Parameters (class_embedding [dim], pos_embed [positions, dim]) have the
    Hugging Face tensors' shapes; `pre_norm` and `norm` exist only when the args ask for them."""

    def __init__(self, a: ViTArgs, attention_kernel: str):
        super().__init__()
        self.args = a
        self.patch_embed = nn.Conv2d(
            a.channels, a.dim, kernel_size=a.patch_size, stride=a.patch_size, bias=a.patch_bias
        )
        if a.class_token:
            self.class_embedding = nn.Parameter(torch.empty(a.dim))
        self.pos_embed = nn.Parameter(torch.zeros(a.num_positions, a.dim))
        if a.pre_norm:
            self.pre_norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.layers = nn.ModuleList(ViTBlock(a, attention_kernel) for _ in range(a.n_layers))
        if a.post_norm:
            self.norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        # The packed sequence of an ImageList is padded with zero rows to a multiple of this:
        # sequence parallelism cuts it over tp (apply_tp sets it to tp_degree). The padding rows
        # are in no sequence of the plan (they attend to nothing and nothing attends to them)
        # and are dropped after the blocks, so they change no output and get no gradient.
        self.sequence_multiple = 1
        self._init_embeddings()

    def _init_embeddings(self) -> None:
        nn.init.normal_(self.pos_embed, std=0.02)
        if self.args.class_token:
            nn.init.normal_(self.class_embedding, std=0.02)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter in place, drawing from the random generator in the order
        construction does: after the same seed, a model built on the meta device and
        materialised (to_empty) gets the weights a model built on the CPU has."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear, nn.LayerNorm)):
                m.reset_parameters()
        self._init_embeddings()

    def position_embeddings(self, rows: int, cols: int) -> torch.Tensor:
        """The learned positions [positions, dim] for a grid of rows x cols patches: `pos_embed`
        itself at the native grid (image_size / patch_size per side, so native images compute
        bit for bit what they always did); else its patch rows, as the square grid they are,
        resized to rows x cols (bicubic, align_corners=False, as transformers'
        interpolate_pos_encoding) and flattened row-major as the patches are, the class token's
        row kept in front unchanged."""
        side = self.args.image_size // self.args.patch_size
        if (rows, cols) == (side, side):
            return self.pos_embed
        table = self.pos_embed
        first = int(self.args.class_token)
        grid = table[first:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        patches = grid.permute(0, 2, 3, 1).reshape(rows * cols, -1)
        return torch.cat([table[:first], patches]) if first else patches

    def _embed(self, images: torch.Tensor) -> torch.Tensor:
        """images [n, C, H, W] (one size) -> the blocks' input [n, positions, dim]."""
        x = self.patch_embed(images)
        rows, cols = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        if self.args.class_token:
            x = torch.cat([self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embeddings(rows, cols)

    def _blocks(self, x: torch.Tensor, plan: PackedPlan | None) -> torch.Tensor:
        if self.args.pre_norm:
            x = self.pre_norm(x)
        for layer in self.layers:
            # always (x, plan), plan None for one image a row: sequence parallelism's wrappers
            # of a block (parallelize.apply_tp) plan for both inputs
            x = layer(x, plan)
        if self.args.post_norm:
            x = self.norm(x)
        return x

    def forward(self, images: Images) -> torch.Tensor:
        if isinstance(images, torch.Tensor):
            x = self._blocks(self._embed(images), None)
            return x[:, 1:] if self.args.drop_first else x
        if not isinstance(images, ImageList):
            raise TypeError(f"the LLaVA ViT encodes tensors or an ImageList, not {type(images)}")
        # Images of different sizes: embedded per size (one patch convolution each), then
        # packed in batch order into one sequence [1, total, dim] that each block runs once.
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, size in enumerate(images.sizes()):
            by_size.setdefault(size, []).append(i)
        embedded: list[torch.Tensor | None] = [None] * len(images)
        for members in by_size.values():
            out = self._embed(torch.stack([images.tensors[i] for i in members]))
            for j, i in enumerate(members):
                embedded[i] = out[j]
        pieces = [e for e in embedded if e is not None]
        lengths = [len(e) for e in pieces]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        total = sum(lengths)
        blocks = [
            (slice(0, 1), slice(a, a + n), slice(a, a + n), False) for a, n in zip(starts, lengths)
        ]
        padded = total + -total % self.sequence_multiple
        order = torch.arange(padded).unsqueeze(0)
        packed = torch.cat(pieces)
        if padded > total:
            packed = torch.cat([packed, packed.new_zeros(padded - total, packed.shape[1])])
        x = self._blocks(packed.unsqueeze(0), pack(blocks, order, order))[0, :total]
        if not self.args.drop_first:
            return x
        keep = torch.ones(total, dtype=torch.bool)
        keep[torch.tensor(starts)] = False
        return x[keep.to(x.device)]
