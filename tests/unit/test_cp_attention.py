"""The all-to-all (Ulysses) attention with grouped-query heads: each CP rank receives only the
K/V heads its query heads use (cp_attention.a2a_kv_heads), never a copy per query head, and the
result is exact. The P ranks run as P threads of one process, whose collectives (`ThreadGroup`)
also record what each all-to-all sends."""

import threading

import pytest
import torch
from test_layout import packed_batch

from titan_vlm.attention import attention
from titan_vlm.layout import SeqLayout, build_layout
from titan_vlm.parallel.cp_attention import UlyssesAttention, a2a_kv_heads


class ThreadGroup:
    """CPGroup's collectives among the threads of one process, one thread per CP rank."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=120)
        self._slots: list[torch.Tensor | None] = [None] * size
        self.all_to_all_shapes: list[list[tuple[int, ...]]] = [[] for _ in range(size)]

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = x.contiguous()
        self._barrier.wait()
        every = list(self._slots)
        self._barrier.wait()
        return every

    def rank(self, rank: int) -> "RankGroup":
        return RankGroup(self, rank)

    def run(self, rank_main) -> list:
        """rank_main(rank) on one thread per rank; their results in rank order. An exception
        in any rank aborts the others' collectives and is raised here."""
        got: list = [None] * self.size

        def main(rank: int) -> None:
            try:
                got[rank] = rank_main(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                got[rank] = e
                self._barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for result in got:
            if isinstance(result, BaseException):
                raise result
        return got


class _Done:
    """A finished request (`CPGroup.shift`'s handles)."""

    def wait(self) -> None:
        pass


class RankGroup:
    """One rank's view of a ThreadGroup, with CPGroup's interface."""

    def __init__(self, shared: ThreadGroup, rank: int):
        self.shared, self.rank, self.size = shared, rank, shared.size

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        self.shared.all_to_all_shapes[self.rank].append(tuple(x.shape))
        every = self.shared._exchange(self.rank, x)
        return torch.stack([every[s][self.rank] for s in range(self.size)])

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.shared._exchange(self.rank, x))

    def shift(self, x: torch.Tensor) -> tuple[torch.Tensor, list["_Done"]]:
        """The ring's send to the next rank, receive from the previous one (already done)."""
        every = self.shared._exchange(self.rank, x)
        return every[(self.rank - 1) % self.size].clone(), [_Done()]

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        every = self.shared._exchange(self.rank, x)
        chunk = x.shape[0] // self.size
        return sum(every[1:], every[0].clone())[self.rank * chunk : (self.rank + 1) * chunk]


def local(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The row tensor x [B, H, S, D] at a layout's local slots (row positions `order` [B, L];
    -1, padding: zeros)."""
    b, h, _, d = x.shape
    index = order.clamp(min=0)[:, None, :, None].expand(b, h, -1, d)
    return x.gather(2, index) * (order >= 0)[:, None, :, None]


def to_row(x: torch.Tensor, order: torch.Tensor, length: int) -> torch.Tensor:
    """Local slots back to row positions (the inverse of `local`; padding dropped)."""
    b, h, _, d = x.shape
    row = x.new_zeros(b, h, length + 1, d)  # position `length` collects the padding
    index = order.masked_fill(order < 0, length)[:, None, :, None].expand(b, h, -1, d)
    return row.scatter_add(2, index, x)[:, :, :length]


def attend(layout: SeqLayout, row_qkv: list[torch.Tensor], grad: torch.Tensor) -> list:
    """The rank's local row positions, then out, dq, dk, dv of its local slots at row
    positions."""
    order = layout.slots("local").order
    q, k, v = (local(x, order).requires_grad_() for x in row_qkv)
    out = attention(q, k, v, layout, "auto")
    (out * local(grad, order)).sum().backward()
    length = grad.shape[2]
    return [order] + [to_row(t, order, length) for t in (out.detach(), q.grad, k.grad, v.grad)]


HEADS = {  # (H, Hkv, P): K/V heads per rank after the all-to-all (expanding sent H/P)
    "split_4q_2kv_cp2": (4, 2, 2, 1),
    "shared_4q_1kv_cp2": (4, 1, 2, 1),
    "shared_4q_2kv_cp4": (4, 2, 4, 1),
    "shared_8q_1kv_cp4": (8, 1, 4, 1),
    "uneven_6q_3kv_cp2": (6, 3, 2, 3),
}


@pytest.mark.parametrize("heads, kv_heads, cp, per_rank", HEADS.values(), ids=HEADS.keys())
def test_a2a_sends_each_rank_only_its_kv_heads_and_is_exact(heads, kv_heads, cp, per_rank):
    owned = a2a_kv_heads(heads, kv_heads, cp)
    group = heads // kv_heads
    local_heads = heads // cp
    for r, kv in enumerate(owned):  # each query head finds its K/V head at j // run locally
        run = local_heads // len(kv)
        assert [kv[j // run] for j in range(local_heads)] == [
            (r * local_heads + j) // group for j in range(local_heads)
        ]
    assert {len(kv) for kv in owned} == {per_rank}

    batch = packed_batch(rows=2)
    b, s, d = batch.doc.shape[0], batch.doc.shape[1], 8
    torch.manual_seed(0)
    row_qkv = [torch.randn(b, n, s, d) for n in (heads, kv_heads, kv_heads)]
    grad = torch.randn(b, heads, s, d)
    _, whole = build_layout(batch.doc, batch.image)
    want = attend(whole, row_qkv, grad)[1:]

    threads_group = ThreadGroup(cp)

    def rank_main(rank: int) -> list[torch.Tensor]:
        _, layout = build_layout(batch.doc, batch.image, cp, rank)
        algorithm = UlyssesAttention.__new__(UlyssesAttention)
        algorithm.g = threads_group.rank(rank)  # type: ignore[assignment]
        layout.cp = algorithm
        # the image outputs are every rank's: each rank backprops 1/P of their gradient
        image = (batch.image >= 0)[:, None, :, None]
        return attend(layout, row_qkv, torch.where(image, grad / cp, grad))

    got = threads_group.run(rank_main)
    results = [r for r in got if isinstance(r, list)]
    # forward: q, k, v to heads, out back: the K/V all-to-alls carry `per_rank` heads for
    # every rank (P x per_rank heads of this rank's T text slots, not H)
    t_local = build_layout(batch.doc, batch.image, cp, 0)[0].shape[1]
    shapes = threads_group.all_to_all_shapes[0]
    assert shapes[0] == (cp, b, local_heads, t_local, d)
    assert shapes[1] == shapes[2] == (cp, b, per_rank, t_local, d)
    for rank, (order, out, *_) in enumerate(results):
        assert (local(out, order) - local(want[0], order)).abs().max() < 1e-5, rank
    # every text slot is held by one rank, the image slots by all: their gradients sum
    for i, name in ((2, "dq"), (3, "dk"), (4, "dv")):
        summed = sum(r[i] for r in results)
        assert (summed - want[i - 1]).abs().max() < 1e-4, name
