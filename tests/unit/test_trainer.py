"""The trainer's pieces that need no process group: the model FLOPs come from the step's own
layout (one build_layout a step), and the llava model is the family interface the step, CP and
generate use."""

import pytest
import torch

from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.layout import build_layout
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.flops import batch_train_flops
from titan_vlm.models.llava.model import VLM
from titan_vlm.models.spec import VisionLanguageModel
from titan_vlm.parallel.context_parallel import shard_batch


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("cp, pad", [(1, 1), (2, 1), (4, 1), (2, 4)])
def test_any_cp_rank_layout_gives_the_whole_rows_attention_pairs(cp, pad, bidirectional):
    """What the FLOPs count: the pairs one device computes over the whole rows (the cp=1
    layout), read off any CP rank's layout, SP padding included."""
    batch = SyntheticCaptions(
        32, 16, 200, 1, sentences_per_image=3, images_per_sample=3, packing=True
    ).batch(0, 0, 1, 3)
    whole = build_layout(batch.doc, batch.image, bidirectional_images=bidirectional)[1]
    for rank in range(cp):
        _, layout = build_layout(batch.doc, batch.image, cp, rank, bidirectional, pad)
        assert layout.whole_work() == whole.rank_work()[0]


def test_llava_is_the_family_interface_and_forward_is_encode_then_decode():
    args = get_flavor("debug")
    torch.manual_seed(0)
    model = VLM(args)
    assert isinstance(model, VisionLanguageModel)
    assert (model.tokens_per_image, model.embed_dim, model.image_size) == (
        args.tokens_per_image,
        args.decoder.dim,
        args.vision.image_size,
    )
    batch = SyntheticCaptions(32, 16, 64, 0).batch(0, 0, 1, 2)
    tokens, _, layout = shard_batch(batch, None)
    embeds = model.encode_images(batch.images)
    assert torch.equal(model(batch.images, tokens, layout), model.decode(tokens, embeds, layout))
    assert batch_train_flops(args, batch, layout) > 0


def test_a_family_that_misses_a_verb_fails_at_construction():
    class NoDecode(VisionLanguageModel):
        def encode_images(self, images: torch.Tensor) -> torch.Tensor:
            return images

    with pytest.raises(TypeError, match="abstract"):
        NoDecode()  # type: ignore[abstract]
