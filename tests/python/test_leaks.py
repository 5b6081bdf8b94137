"""The leak property (cpsim/leak.py), on the "layer" and "user_loss" outputs
(the "train" one is tests/python/test_train_step.py's): a bug that the step
and its unsharded run share passes the comparison of the two and is caught by
running the step again with one document's inputs, then the padding's, drawn
again. Each control is checked both ways: caught with the property, passing
without it."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpsim.torch as ct
from cpsim.leak import redraws, redrawn_batch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
import cp_step  # noqa: E402

CASES = 20
V = 7


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lo, hi):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.lo, ctx.hi = lo, hi
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad[:, ctx.lo:ctx.hi], None, None


def mix_step(by_document=True):
    """A layer: y_t = x_t + the mean of x over the earlier real tokens of t's
    document (all the earlier tokens of the row when not by_document: PLANTED)."""
    def step(case):
        doc, padding, _ = cp_step.layout_of(case.replica_batch)
        B = doc.shape[0]
        ids = torch.zeros(B, case.P, dtype=torch.int64)
        real = torch.zeros(B, case.P, dtype=torch.bool)
        ids[:, :case.S], real[:, :case.S] = doc, ~padding & (doc > 0)
        lo, hi = case.cuts[case.rank], case.cuts[case.rank + 1]
        x = case.activation("x", 3)
        full = _Gather.apply(x, lo, hi)
        q = torch.arange(lo, hi)
        seen = (torch.arange(case.P)[None, :] <= q[:, None])[None] & real[:, None, :]
        if by_document:
            seen = seen & (ids[:, q][:, :, None] == ids[:, None, :])
        w = seen.to(x.dtype)
        y = x + torch.einsum("bts,bsc->btc", w, full) / w.sum(-1, keepdim=True).clamp(min=1)
        return {"layer": ct.Layer(y, {"x": x}, {}, 1e-10)}
    return step


def loss_step(padding_counts=False):
    """A token-mean loss over next-token labels; PLANTED: labels made from the
    document ids alone, so the last real token's label is the padding after it."""
    def step(case):
        doc, padding, _ = cp_step.layout_of(case.replica_batch)
        B = doc.shape[0]
        tokens = case.replica_batch["input_ids"].reshape(B, -1) % V
        keep = (doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] > 0)
        if not padding_counts:
            keep = keep & ~padding[:, :-1] & ~padding[:, 1:]
        labels = torch.full((B, case.P), -100, dtype=torch.int64)
        labels[:, :case.S - 1][keep] = tokens[:, 1:][keep]
        lo, hi = case.cuts[case.rank], case.cuts[case.rank + 1]
        labels = labels[:, lo:hi]
        logits = case.activation("logits", V, dtype=torch.float64)
        total = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum")
        count = (labels != -100).sum().to(torch.float64)
        dist.all_reduce(count)
        return {"user_loss": ct.Loss(total / count.clamp(min=1), logits, labels=labels, value_is="share")}
    return step


def test_correct_steps_hold_with_the_leak_property():
    assert ct.check(mix_step(), cases=CASES, max_cp=3, seed=4) == CASES
    assert ct.check(loss_step(), cases=CASES, max_cp=3, seed=4) == CASES


@pytest.mark.parametrize("step,says", [
    (mix_step(by_document=False), ["layer output changed at row", "was drawn again",
                                   "documents must not see each other", "the unsharded run (cp 1) moves too"]),
    (loss_step(padding_counts=True), ["user_loss", "were drawn again: padding must never count",
                                      "the unsharded run (cp 1) moves too"]),
], ids=["layer_across_documents", "loss_counts_padding"])
def test_a_bug_in_both_runs_is_caught_by_the_leak_property_alone(step, says):
    assert ct.check(step, cases=CASES, max_cp=3, seed=4, leaks=False) == CASES
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=CASES, max_cp=3, seed=4)
    for s in says:
        assert s in e.value.failure, e.value.failure


def test_the_redraws_are_one_document_with_another_after_it_and_the_padding():
    class G:  # a case's golden folder, as cpsim.leak reads it: two rows, documents 1 2 | 1, padding
        reference = {"doc_ids": torch.tensor([[1, 1, 0, 0], [1, 1, 2, 0]]),
                     "padding": torch.tensor([[False, False, True], [False, False, False]])}
    document, padding = redraws(G)
    assert document.mask.tolist() == [[False] * 4, [True, True, False, False]]
    assert "document 1 of row 1 (positions 0..2)" == document.what
    assert padding.mask.tolist() == [[False, False, True, True], [False, False, False, True]]
    batch = {"input_ids": torch.tensor([[3, 4, 0], [5, 6, 7]]), "labels": torch.tensor([[4, -100, -100],
                                                                                        [6, -100, 1]])}
    again = redrawn_batch(batch, document, seed=1, S=3)
    moved = again["input_ids"] != batch["input_ids"]
    assert moved.tolist() == [[False, False, False], [True, True, False]]
    assert (again["labels"] != batch["labels"]).tolist() == [[False, False, False], [True, False, False]]
    assert int(again["input_ids"].max()) <= 8  # ids of the batch's range (0 .. max + 1)
