"""Model shapes, flavors and the built-in data."""

import torch

from titan_vlm.data.batch import IGNORE_INDEX
from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.data.tokenizer import ByteTokenizer
from titan_vlm.models.accounting import param_counts, state_bytes_per_rank
from titan_vlm.models.llava.args import get_flavor
from titan_vlm.models.llava.flops import train_flops
from titan_vlm.models.llava.model import VLM
from titan_vlm.parallel.context_parallel import shard_batch


def test_debug_forward_shapes():
    args = get_flavor("debug")
    torch.manual_seed(0)
    model = VLM(args)
    data = SyntheticCaptions(args.vision.image_size, args.tokens_per_image, 64, seed=0)
    batch = data.batch(0, 0, 1, 3)
    tokens, _, layout = shard_batch(batch, None)
    logits = model(batch.images, tokens, layout)
    longest_text = int(
        ((batch.doc >= 0) & (batch.image < 0)).sum(1).max()
    )  # row padding is not computed
    assert logits.shape == (3, longest_text, args.decoder.vocab_size)


def test_llava7b_flavor_is_7b_shaped():
    with torch.device("meta"):
        model = VLM(get_flavor("llava7b"))
    counts = param_counts(model)
    assert 0.29e9 < counts["vision"] < 0.32e9  # CLIP ViT-L/14 tower
    assert 6.6e9 < counts["decoder"] < 6.8e9  # Llama-2-7B
    assert get_flavor("llava7b").tokens_per_image == 576
    # ~6 * params * tokens dominates at short text
    flops = train_flops(
        get_flavor("llava7b"), num_images=1, text_tokens=1024, attention_pairs=1600 * 1601 // 2
    )
    assert 6 * 6.5e9 * 1600 < flops < 6 * 7.5e9 * 1600 * 1.3
    # dp_shard=2 x cp=4: 16 bytes per parameter, decoder and vision sharded 8 ways
    # -> ~13.9 GB a rank
    assert 13.5e9 < state_bytes_per_rank(counts, 8, 8) < 14.5e9
    assert state_bytes_per_rank(counts, 8, 2) > state_bytes_per_rank(counts, 8, 8)


def test_data_is_deterministic_per_seed_and_rank_and_labels_are_shifted():
    data = SyntheticCaptions(32, 16, 80, seed=5, sentences_per_image=3)
    a, b = data.batch(2, 1, 2, 4), data.batch(2, 1, 2, 4)
    assert torch.equal(a.images, b.images) and torch.equal(a.tokens, b.tokens)
    # rank 1 of 2 at step 2 reads rows 20..23 of the global sequence of samples
    whole = data.batch(2, 0, 1, 8)
    assert torch.equal(a.tokens, whole.tokens[4:])
    other_seed = SyntheticCaptions(32, 16, 80, seed=6).batch(2, 1, 2, 4)
    assert not torch.equal(a.tokens, other_seed.tokens)
    tokens, labels = a.tokens[0, 16:], a.labels[0, 16:]  # after the image's 16 slots
    n = int((labels != IGNORE_INDEX).sum())
    assert tokens[0] == ByteTokenizer.BOS
    assert torch.equal(labels[:n], tokens[1 : n + 1])  # label j is token j+1
    assert labels[n - 1] == ByteTokenizer.EOS and (a.labels[0, :16] == IGNORE_INDEX).all()


def test_blank_images_keep_the_captions():
    seeing = SyntheticCaptions(32, 16, 64, seed=1).batch(0, 0, 1, 2)
    blind = SyntheticCaptions(32, 16, 64, seed=1, blank_images=True).batch(0, 0, 1, 2)
    assert torch.equal(seeing.tokens, blind.tokens)
    assert blind.images.eq(-1).all() and not seeing.images.eq(-1).all()
