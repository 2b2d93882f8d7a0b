"""Block plans packed into variable-length sequences (titan_vlm/varlen.py) and their executor.

The packing is held to the mask rule (layout.visible) directly: every visible query-key pair is
computed exactly once, by a sequence whose mask is what FlashAttention's varlen kernel applies
(bottom-right causal or dense, query head h on K/V head h // (H / Hkv)). Numerically, the
executor is checked against a float64 dense masked softmax, once with a float64 varlen kernel
written here from those semantics (no head copies) and once with the CPU path (aten's CPU flash
in a loop over the sequences)."""

import math

import pytest
import torch
from test_layout import packed_batch
from torch.distributed.utils import _apply_to_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from titan_vlm.data.batch import Sample, collate
from titan_vlm.kernels import KERNELS
from titan_vlm.layout import build_layout, visible
from titan_vlm.parallel.cp_attention import CP_ATTENTION, attention_plans, kernel_launches
from titan_vlm.varlen import PackedPlan, VarlenCall, VarlenKernel, run_plan, run_plan_backward

TPI = 16


def plan_names(cp: int, rank: int) -> list[tuple[str, str | int]]:
    """Every plan an algorithm runs on `rank`: local (ring step 0, cp = 1), each other rank's
    text (ring steps), everything gathered (all-gather), the whole row (all-to-all)."""
    names = [("local", "local"), ("local", "all"), ("all", "all")]
    return names + [("local", s) for s in range(cp) if s != rank]


def sequence_mask(lq: int, lk: int, causal: bool) -> torch.Tensor:
    """The varlen kernel's mask of one sequence: dense, or causal aligned bottom-right."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool)
    return torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)


def coverage(plan: PackedPlan) -> torch.Tensor:
    """How many times the packed plan computes each (row, query slot, key slot) pair."""
    cover = torch.zeros(plan.rows, plan.lq, plan.lk, dtype=torch.long)
    for call in plan.calls:
        cq, ck = call.cu_q.tolist(), call.cu_k.tolist()
        assert (call.bounds_q, call.bounds_k) == (tuple(cq), tuple(ck))
        for i in range(len(cq) - 1):
            qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            rows = call.q_rows[qs]
            assert (call.k_rows[ks] == rows[0]).all() and (rows == rows[0]).all()
            mask = sequence_mask(qs.stop - qs.start, ks.stop - ks.start, call.causal).long()
            cover[rows[0]].index_put_(
                (call.q_slots[qs, None], call.k_slots[None, ks]), mask, accumulate=True
            )
    return cover


def row_of_samples(n: int, seq_len: int, images: bool = True) -> torch.Tensor:
    """Rows of n samples (every other one with an image mid-text), as doc/image metadata."""
    image = torch.zeros(3, 8, 8)
    per = seq_len // n
    samples = []
    for s in range(n):
        text = list(range(per - TPI - 1)) if images and s % 2 else list(range(per - 1))
        parts = [text[:3], image, text[3:]] if images and s % 2 else [text]
        samples.append(Sample(parts))
    return collate([samples, samples[1:]], seq_len, TPI, 8, pad_id=0)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal_images", "bidir_images"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_packed_plans_compute_every_visible_pair_exactly_once(cp, bidirectional):
    batch = packed_batch()
    for rank in range(cp):
        _, layout = build_layout(batch.doc, batch.image, cp, rank, bidirectional)
        for queries, keys in plan_names(cp, rank):
            plan = layout.packed(queries, keys)
            want = visible(layout.slots(queries), layout.slots(keys), bidirectional).long()
            assert torch.equal(coverage(plan), want), (rank, queries, keys)
            # a plan never merges: each query slot lies in one sequence at most
            for call in plan.calls:
                flat = call.q_rows * plan.lq + call.q_slots
                assert flat.unique().numel() == flat.numel()
            assert len(plan.calls) <= 2
            assert [c.causal for c in plan.calls] in ([True], [False], [True, False], [])
            for call in plan.calls:
                assert all(lk >= lq > 0 for lq, lk in call.lengths()) or not call.causal


def test_one_causal_sequence_per_sample_at_cp1_and_no_key_copied():
    """Text, image, text of a sample chain into one sequence: K/V are gathered once."""
    batch = packed_batch()
    _, layout = build_layout(batch.doc, batch.image)
    (call,) = layout.packed("local", "local").calls
    assert call.causal
    samples = sum(len(torch.unique(d[d >= 0])) for d in batch.doc)
    assert call.num_sequences == samples
    assert call.k_slots.numel() == int((batch.doc >= 0).sum())  # each real slot once


class Float64Varlen(VarlenKernel):
    """FlashAttention's varlen semantics in float64: bottom-right causal, K/V head h // group,
    backward from the final out and lse (dS = P (dP - rowsum(dO O)))."""

    name = "float64_reference"

    def launches(self, call: VarlenCall) -> int:
        return 1

    def _scores(self, q, k, call, i, scale):
        cq, ck = call.cu_q.tolist(), call.cu_k.tolist()
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        group = q.shape[1] // k.shape[1]
        heads = torch.arange(q.shape[1]) // group
        s = torch.einsum("qhd,khd->hqk", q[qs], k[ks][:, heads]) * scale
        mask = sequence_mask(qs.stop - qs.start, ks.stop - ks.start, call.causal)
        return qs, ks, heads, s.masked_fill(~mask, float("-inf"))

    def forward(self, q, k, v, call, scale):
        out, lse = torch.zeros_like(q), q.new_zeros(q.shape[1], q.shape[0])
        for i in range(call.num_sequences):
            qs, ks, heads, s = self._scores(q, k, call, i, scale)
            lse[:, qs] = s.logsumexp(-1)
            out[qs] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[ks][:, heads])
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, call, scale, aux):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i in range(call.num_sequences):
            qs, ks, heads, s = self._scores(q, k, call, i, scale)
            p = torch.exp(s - lse[:, qs, None])
            vh, kh = v[ks][:, heads], k[ks][:, heads]
            dp = torch.einsum("qhd,khd->hqk", dout[qs], vh)
            ds = p * (dp - (dout[qs] * out[qs]).sum(-1).t()[:, :, None])
            dq[qs] = torch.einsum("hqk,khd->qhd", ds, kh) * scale
            dk_h = torch.einsum("hqk,qhd->khd", ds, q[qs]) * scale
            dv_h = torch.einsum("hqk,qhd->khd", p, dout[qs])
            dk[ks] = dk_h.unflatten(1, (k.shape[1], -1)).sum(2)
            dv[ks] = dv_h.unflatten(1, (k.shape[1], -1)).sum(2)
        return dq, dk, dv


def dense_reference(q, k, v, mask):
    """float64 masked softmax attention with K/V heads repeated; fully masked rows give 0."""
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        ~mask[:, None], float("-inf")
    )
    return torch.softmax(scores, -1).nan_to_num(0) @ ve


@pytest.mark.parametrize("kernel", ["float64_reference", "cpu_flash"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal_images", "bidir_images"])
def test_executor_equals_the_dense_masked_softmax(kernel, bidirectional):
    """cp = 2, rank 1: the plan against the other rank's text (dense calls only) and the local
    plan (causal and, with bidirectional images, dense), grouped-query heads (4 over 2)."""
    batch = packed_batch(rows=2)
    _, layout = build_layout(batch.doc, batch.image, 2, 1, bidirectional)
    run = Float64Varlen() if kernel == "float64_reference" else KERNELS["cpu_flash"]
    dtype = torch.float64 if kernel == "float64_reference" else torch.float32
    torch.manual_seed(0)
    for queries, keys in [("local", "local"), ("local", 0), ("local", "all")]:
        qs, ks = layout.slots(queries), layout.slots(keys)
        mask = visible(qs, ks, bidirectional)
        q = torch.randn(2, 4, len(qs), 8, dtype=torch.float64, requires_grad=True)
        k, v = (
            torch.randn(2, 2, len(ks), 8, dtype=torch.float64, requires_grad=True) for _ in "kv"
        )
        seen = mask.any(-1)[:, None, :, None]  # queries with no key here: out 0, no gradient
        grad = torch.randn(q.shape, dtype=torch.float64) * seen
        ref = dense_reference(q, k, v, mask)
        (ref * grad).sum().backward()
        plan = layout.packed(queries, keys)
        out, lse, auxes = run_plan(run, q.to(dtype), k.to(dtype), v.to(dtype), plan)
        got = [torch.zeros_like(t) for t in (q, k, v)]
        run_plan_backward(
            run, grad.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out, lse, plan, auxes, *got
        )
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert (out.double() - ref).abs().max() < tol
        assert torch.isinf(lse[~seen[:, :, :, 0].expand_as(lse)]).all()
        for mine, theirs in zip(got, (q.grad, k.grad, v.grad)):
            assert (mine - theirs).abs().max() < 20 * tol


LAYOUTS = [(1, None)] + [(cp, comm) for cp in (2, 4) for comm in CP_ATTENTION]


@pytest.mark.parametrize("cp, comm", LAYOUTS, ids=[f"cp{cp}_{comm}" for cp, comm in LAYOUTS])
def test_cuda_launches_do_not_depend_on_the_samples_per_row(cp, comm):
    """The CUDA path launches one varlen call per packed call: per plan at most one causal and
    one dense, whatever the number of samples (and images) in a row. Under the "split"
    placement every row gives the same count; under "auto" (images sharded) the count
    stays within two per plan (it falls where a plan has nothing to attend to, e.g. no sample
    split). The CPU loop's launches grow with the samples (the control)."""
    cuda, cpu, auto = {}, {}, {}
    plans = len(attention_plans(comm, cp, 0))
    for n in (2, 8, 32, 128):
        batch = row_of_samples(n, 4096)
        for rank in range(cp):
            _, layout = build_layout(batch.doc, batch.image, cp, rank)
            cuda[n, rank] = kernel_launches(layout, comm, KERNELS["cuda_flash"])
            cpu[n, rank] = kernel_launches(layout, comm, KERNELS["cpu_flash"])
            if cp > 1 and n in (8, 32):
                _, placed = build_layout(
                    batch.doc, batch.image, cp, rank, placement="auto", image_tokens="shard"
                )
                auto[n, rank] = kernel_launches(placed, comm, KERNELS["cuda_flash"])
    assert len(set(cuda.values())) == 1, cuda
    assert max(cuda.values()) <= 2 * plans
    assert max(auto.values(), default=0) <= 2 * plans, auto
    assert cpu[128, 0] > cpu[2, 0]


def test_copies_of_a_layout_share_its_plans():
    """FSDP's mixed-precision input casting rebuilds the layout (dataclasses.replace) for every
    block it wraps: the copies must not plan again, and each gets its own op handle."""
    batch = packed_batch()
    _, layout = build_layout(batch.doc, batch.image, 2, 0)
    copy = _apply_to_tensors(lambda t: t, layout)  # what FSDP's input casting does
    assert copy is not layout
    assert copy.packed("local", 1) is layout.packed("local", 1)
    assert copy.handle.layout is copy and layout.handle.layout is layout


class AtenOps(TorchDispatchMode):
    """Records the aten ops run inside it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.names.count(name)


# kernel -> its dtype here, and the aten ops it runs: a varlen call's forward and backward, and
# the ViT's dense batch forward (FlashAttention's is the batched op; the others loop over blocks)
CUDA_OPS = {
    "cuda_flash": (
        torch.bfloat16,
        "_flash_attention_forward",
        "_flash_attention_backward",
        "_scaled_dot_product_flash_attention",
    ),
    "cuda_efficient": (
        torch.float32,
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_efficient_attention",
    ),
    "cuda_cudnn": (
        torch.bfloat16,
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_cudnn_attention",
    ),
}


@pytest.mark.parametrize("name", list(CUDA_OPS))
def test_cuda_kernels_run_every_plan_through_torchs_op_schemas_on_the_meta_device(name):
    """No GPU here, but aten's CUDA attention ops have shape functions on the meta device: the
    CUDA kernels run every plan of a cp = 2 rank (bidirectional images, 4 query heads over 2
    K/V heads) forward and backward through this torch's op signatures, and the executor gets
    its shapes and dtypes back. Each kernel runs as many attention ops as `launches` counts;
    FlashAttention runs one varlen op per call and no K/V head copy (repeat_interleave)."""
    dtype, forward_op, backward_op, dense_op = CUDA_OPS[name]
    kernel = KERNELS[name]
    batch = packed_batch(rows=2)
    _, layout = build_layout(batch.doc, batch.image, 2, 1, True)
    for queries, keys in [("local", "local"), ("local", 0), ("local", "all"), ("all", "all")]:
        plan = layout.packed(queries, keys)
        q = torch.empty(2, 4, plan.lq, 16, dtype=dtype, device="meta")
        k, v = (torch.empty(2, 2, plan.lk, 16, dtype=dtype, device="meta") for _ in "kv")
        ops = AtenOps()
        with ops:
            out, lse, auxes = run_plan(kernel, q, k, v, plan)
            grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
            run_plan_backward(kernel, out, q, k, v, out, lse, plan, auxes, *grads)
        assert (out.shape, out.dtype) == (q.shape, dtype)
        assert (lse.shape, lse.dtype) == (q.shape[:3], torch.float32)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        launches = sum(kernel.launches(c) for c in plan.calls)
        assert ops.count(forward_op) == ops.count(backward_op) == launches, (queries, keys)
        if name == "cuda_flash":
            assert launches == len(plan.calls) and ops.count("repeat_interleave") == 0
    # the ViT's batch of dense blocks: one launch for all images
    q, k = (torch.empty(3, 4, 16, 16, dtype=dtype, device="meta") for _ in "qk")
    ops = AtenOps()
    with ops:
        out, lse, aux = kernel.dense(q, k, k, 0.25)
        grads = kernel.dense_backward(out, q, k, k, out, lse, 0.25, aux)
    assert (out.shape, lse.shape) == (q.shape, q.shape[:3])
    assert [g.shape for g in grads] == [q.shape] * 3
    assert ops.count(dense_op) == 1
