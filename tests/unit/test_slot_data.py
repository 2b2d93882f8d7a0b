"""A family's per-slot data (Batch.slot_data, e.g. M-RoPE's three positions per slot) goes
wherever its slot goes under every CP layout: split or whole samples, replicated or sharded image
slots, rows joined under "auto". A slot's rotary position and its causal order are different
things: the data is gathered by the slot's row position, never by its position in the sample."""

from __future__ import annotations

import pytest
import torch

from titan_vlm.data.synthetic import SyntheticCaptions
from titan_vlm.layout import build_layout

TPI = 16  # debug flavor: slots per image


def _batch_with_slot_data():
    batch = SyntheticCaptions(
        32, TPI, 200, 3, sentences_per_image=3, images_per_sample=3, packing=True
    ).batch(0, 0, 1, 3)
    rows, seq = batch.doc.shape
    # three numbers per slot, each naming its (row, slot) so any misplacement shows
    code = torch.arange(rows)[:, None] * 1000 + torch.arange(seq)[None, :] + 1
    batch.slot_data = {"positions3": torch.stack([code, 2 * code, 3 * code])}
    return batch


@pytest.mark.parametrize("placement", ["split", "auto"])
@pytest.mark.parametrize("image_tokens", ["replicate", "shard"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_slot_data_follows_every_slot_to_its_rank(cp, placement, image_tokens):
    batch = _batch_with_slot_data()
    if placement == "auto" and cp > 1:
        batch = batch.as_one_row()  # as shard_batch places it
    code = batch.slot_data["positions3"]
    held = torch.zeros_like(batch.doc)
    for rank in range(cp):
        _, layout = build_layout(
            batch.doc, batch.image, cp, rank, placement=placement, image_tokens=image_tokens
        )
        local = layout.gather_slot_data(batch.slot_data)["positions3"]
        order = layout.slots("local").order
        assert local.shape == (3, *order.shape)
        real = order >= 0
        rows = torch.arange(order.shape[0])[:, None].expand_as(order)
        want = code[:, rows[real], order[real]]
        assert torch.equal(local[:, real], want)
        assert bool((local[:, ~real] == 0).all())  # padding slots
        held[rows[real], order[real]] = 1
    assert bool(held[batch.doc >= 0].all())  # every real slot is on some rank


def test_the_rope_position_in_a_sample_is_not_the_row_position():
    """Negative control: gathering by each local slot's position within its sample (the 1-D
    RoPE position) instead of its row position misplaces the data of every packed sample but
    the first."""
    batch = _batch_with_slot_data()
    _, layout = build_layout(batch.doc, batch.image, 2, 0)
    order, in_sample = layout.slots("local").order, layout.positions
    data = batch.slot_data["positions3"][0]
    right = data.gather(1, order.clamp(min=0))
    wrong = data.gather(1, in_sample)
    assert not torch.equal(right[order >= 0], wrong[order >= 0])


def test_rows_and_devices_keep_slot_data():
    batch = _batch_with_slot_data()
    code = batch.slot_data["positions3"]
    assert torch.equal(batch.rows(1, 3).slot_data["positions3"], code[:, 1:3])
    assert torch.equal(batch.to("cpu").slot_data["positions3"], code)
    joined = batch.as_one_row().slot_data["positions3"]
    assert torch.equal(joined, code.reshape(3, 1, -1))


def test_collate_writes_each_samples_slot_data_at_its_slots():
    """A family's per-sample data (collate's slot_data, e.g. M-RoPE positions computed from a
    sample's own parts) lands at that sample's slots of its row; padding slots hold 0."""
    from titan_vlm.data.batch import Sample, collate

    def positions3(sample: Sample) -> dict[str, torch.Tensor]:
        n = sample.num_slots(TPI)
        first = sample.parts[0][0] if isinstance(sample.parts[0], list) else 0
        return {"p": torch.stack([torch.arange(n) + first + k for k in range(3)])}

    rows = [[Sample([[100, 1, 2]]), Sample([[200, 3]])], [Sample([[300, 4, 5, 6]])]]
    batch = collate(rows, 8, TPI, 32, 0, slot_data=positions3)
    p = batch.slot_data["p"]
    assert p.shape == (3, 2, 8)
    assert p[0, 0].tolist() == [100, 101, 102, 200, 201, 0, 0, 0]
    assert p[2, 1].tolist() == [302, 303, 304, 305, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="slot data 'p' of 4 slots for 3"):
        collate(rows, 8, TPI, 32, 0, slot_data=lambda s: {"p": torch.zeros(4)})
