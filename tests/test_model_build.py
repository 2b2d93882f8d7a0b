"""The trainer builds the model on the meta device and each rank fills only its own shards
(models/build.py); the weights must not depend on the layout that built them."""

import torch

RELAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]  # (dp_shard, cp, tp)


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_initial_weights_are_the_same_at_every_layout(pool):
    one = pool.run("built_weights", dp_shard=1, cp=1)[0]
    for dp_shard, cp, tp in RELAYOUTS:
        other = pool.run("built_weights", dp_shard=dp_shard, cp=cp, tp=tp)[0]
        assert _equal(one, other) == [], (dp_shard, cp, tp)
    # negative control: another seed gives other weights, everywhere
    reseeded = pool.run("built_weights", dp_shard=2, cp=1, training__seed=1)[0]
    assert len(_equal(one, reseeded)) == len([n for n, t in one.items() if t.std() > 0])


def test_experts_start_the_same_at_every_expert_parallel_degree(pool):
    """A mixture-of-experts decoder's experts (one generator per expert) whatever splits them:
    FSDP alone, or expert parallelism over 2 or 4 ranks with FSDP over the rest."""
    one = pool.run("built_weights", dp_shard=1, cp=1, model__flavor="debug_moe")[0]
    assert any(".experts." in n for n in one)
    for dp_shard, cp, ep in [(2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 1, 2)]:
        other = pool.run(
            "built_weights", dp_shard=dp_shard, cp=cp, ep=ep, model__flavor="debug_moe"
        )[0]
        assert _equal(one, other) == [], (dp_shard, cp, ep)


def test_activation_checkpointing_and_compile_do_not_change_the_initial_weights(pool):
    """The checkpoint wrapper (and torch.compile's `_orig_mod`) put their own prefixes into
    `named_parameters()`; each parameter is seeded by its canonical name (models/loading.py
    canonical_name, a checkpoint's key), so the weights are bit for bit the unwrapped ones."""
    one = pool.run("built_weights", dp_shard=1, cp=1)[0]
    for mode in ("full", "selective"):
        for dp_shard, cp in ((1, 1), (2, 1), (1, 2)):
            other = pool.run(
                "built_weights", dp_shard=dp_shard, cp=cp, activation_checkpoint__mode=mode
            )[0]
            assert _equal(one, other) == [], (mode, dp_shard, cp)
    both = pool.run(
        "built_weights", dp_shard=2, cp=1, activation_checkpoint__mode="full", compile__enable=True
    )[0]
    assert _equal(one, both) == []


def test_initial_weights_follow_the_init_rule(pool):
    """Spot checks of the scheme (models/llava/spec.py init_rule) on the debug flavor."""
    w = pool.run("built_weights", dp_shard=2, cp=2)[0]
    assert torch.equal(w["decoder.norm.weight"], torch.ones_like(w["decoder.norm.weight"]))
    assert abs(float(w["decoder.tok_embeddings.weight"].std()) - 0.02) < 0.002
    fc1 = w["vision.layers.0.fc1.weight"]  # uniform in +-1/sqrt(fan_in)
    assert float(fc1.abs().max()) <= fc1.shape[1] ** -0.5
    assert float(fc1.abs().max()) > 0.9 * fc1.shape[1] ** -0.5
