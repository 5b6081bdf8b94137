"""A DP x CP training step written apart from cpsim's own examples, as user code
of the field is: a (dp, cp) DeviceMesh, torch.distributed.nn.functional's
autograd all_gather, a convolution halo passed rank to rank (each receive posted
before its send, gradients on the wire in fp16), next-token targets and the
token-mean loss with SUM, MAX and AVG reductions, on bfloat16 activations. The
faithful step holds under cpsim.torch.check; each planted bug is reported with
the rank, the call and where the step made it."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

import cpsim.torch as ct

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
from cp_step import layout_of  # noqa: E402 - the raw batch's documents (not what this step checks)

CASES = int(os.environ.get("CPSIM_HARNESS_CASES", "60")) // 2


def next_token_targets(tokens, doc_ids, padding):
    """tokens[t + 1] where t and t + 1 are real tokens of one document, else -100."""
    targets = torch.full_like(tokens, -100)
    keep = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] > 0) & ~padding[:, :-1] & ~padding[:, 1:]
    targets[:, :-1][keep] = tokens[:, 1:][keep]
    return targets


class RingHalo(torch.autograd.Function):
    """[B, L, C] -> [B, halo + L, C]: the `halo` positions before this rank's first,
    passed along the CP ranks (rank r receives from r - 1, then sends its own
    last `halo` positions, received ones included, to r + 1); the backward passes
    the halo's gradient the other way, in fp16."""

    @staticmethod
    def forward(ctx, x, halo, group, unwaited_send):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        B, L, C = x.shape
        ctx.halo, ctx.group = halo, group
        before = x.new_zeros(B, halo, C)
        if r > 0:
            buf = torch.empty(B, halo, C, dtype=x.dtype)
            dist.irecv(buf, src=dist.get_global_rank(group, r - 1), group=group).wait()
            before = buf
        window = torch.cat([before, x], dim=1)
        if r < n - 1:
            send = dist.isend(window[:, -halo:].contiguous(), dst=dist.get_global_rank(group, r + 1), group=group)
            if not unwaited_send:  # PLANTED when set: the send's request is dropped
                send.wait()
        return window

    @staticmethod
    def backward(ctx, grad):
        group, halo = ctx.group, ctx.halo
        r, n = dist.get_rank(group), dist.get_world_size(group)
        grad = grad.clone()
        if r < n - 1:  # the gradient of what this rank sent comes back from r + 1
            buf = torch.empty(grad.shape[0], halo, grad.shape[2], dtype=torch.float16)
            dist.irecv(buf, src=dist.get_global_rank(group, r + 1), group=group).wait()
            grad[:, -halo:] += buf.to(grad.dtype)
        if r > 0:
            dist.isend(grad[:, :halo].to(torch.float16).contiguous(), dst=dist.get_global_rank(group, r - 1),
                       group=group).wait()
        return grad[:, halo:], None, None, None


def make_step(bug=None):
    def step(case):
        mesh = case.device_mesh()  # init_device_mesh, (dp, cp) or interleaved as check(mesh=...) says
        cp_group, dp_group = mesh["cp"].get_group(), mesh["dp"].get_group()
        if bug == "global_rank_as_cp_rank":  # PLANTED: right only where CP groups are consecutive ranks
            r = dist.get_rank() % case.cp
        else:
            r = dist.get_rank(cp_group)
            assert r == case.rank and dist.get_world_size(dp_group) == case.dp
        lo, hi = case.cuts[r], case.cuts[r + 1]
        P = case.cuts[-1]

        ids, padding, _ = layout_of(case.batch)
        B, S = ids.shape
        doc = torch.zeros(B, P, dtype=torch.int64)
        doc[:, :S] = ids
        pad = torch.ones(B, P, dtype=torch.bool)
        pad[:, :S] = padding
        tokens = torch.zeros(B, P, dtype=torch.int64)
        tokens[:, :S] = case.tokens
        if bug == "shifted_targets":  # PLANTED: aligned after sharding
            targets = next_token_targets(tokens[:, lo:hi], doc[:, lo:hi], pad[:, lo:hi])
        else:
            targets = next_token_targets(tokens, doc, pad)[:, lo:hi]

        gathered = torch.cat(dist_nn.all_gather(case.x.contiguous(), group=cp_group), dim=1)
        halo = RingHalo.apply(case.x, case.conv_width - 1, cp_group, bug == "unwaited_send") \
            if case.conv_width > 1 else case.x

        valid = targets != -100
        V = case.logits.shape[-1]
        per_token = F.cross_entropy(case.logits.reshape(-1, V).double(), targets.reshape(-1).clamp(min=0),
                                    reduction="none")
        local_sum = torch.where(valid.reshape(-1), per_token, torch.zeros_like(per_token)).sum()
        count = valid.sum().double().reshape(1)
        busiest = count.clone()
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=cp_group)  # for the step's log line
        assert busiest.item() >= count.item()
        if bug == "per_rank_mean":  # PLANTED: every rank's own mean, averaged
            mean = local_sum / count.clamp(min=1)
            summed = mean.detach().clone()
            dist.all_reduce(summed, op=dist.ReduceOp.AVG, group=cp_group)
            loss = mean + (summed - mean).detach()
        else:
            if not (bug == "skipped_collective" and count.item() == 0):  # PLANTED when set
                dist.all_reduce(count, group=cp_group)
            summed = local_sum.detach().clone()
            dist.all_reduce(summed, group=cp_group)
            # Every rank's loss is the global sum / count; each differentiates its own term.
            loss = (local_sum + (summed - local_sum).detach()) / count.clamp(min=1)[0]
        # The data-parallel mean (the replicas hold the same case here: unchanged).
        averaged = loss.detach().clone()
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG, group=dp_group)
        loss = loss + (averaged - loss).detach()
        return {"gathered": gathered, "halo": halo, "targets": targets, "loss": loss}
    return step


def _check(bug, **kw):
    return ct.check(make_step(bug), cases=CASES, cps=[1, 2, 3, 4], dp=2, dtype="bf16", seed=7, **kw)


def test_the_dp_by_cp_step_holds():
    assert _check(None) == CASES


def test_the_dp_by_cp_step_holds_on_an_interleaved_mesh():
    assert _check(None, mesh="cp,dp") == CASES


def test_a_global_rank_taken_for_the_cp_rank_is_caught_on_an_interleaved_mesh():
    # On a (dp, cp) mesh, global rank % cp is the CP rank: the slip is invisible.
    assert _check("global_rank_as_cp_rank") == CASES
    with pytest.raises(ct.CheckFailed) as e:
        _check("global_rank_as_cp_rank", mesh="cp,dp")
    assert "targets" in e.value.failure and "(dp " in e.value.failure, e.value.failure


@pytest.mark.parametrize("bug,words", [
    ("per_rank_mean", ["loss:"]),
    ("shifted_targets", ["targets:", "-100"]),
    ("skipped_collective", ["all_reduce", "test_dp_cp_step.py:"]),
    ("unwaited_send", ["never waited", "send to rank", "test_dp_cp_step.py:"])])
def test_each_planted_bug_is_named_with_its_rank_and_call(bug, words):
    with pytest.raises(ct.CheckFailed) as e:
        _check(bug)
    failure = e.value.failure
    assert all(w in failure for w in words), (words, failure)
    assert "rank " in failure, failure
    assert e.value.cp >= 2, failure


# Ranks as processes: cpsim launch -n 4 -- python3 job_harness.py dp_cp,dp_cp:BUG,... CASES
# (dp=2, cp=2), each process one rank of a (dp, cp) mesh of the job's processes.
BUGS = [(None, []),
        ("per_rank_mean", ["rank 1 (dp 0, cp 1) loss:"]),
        ("shifted_targets", ["targets:", "-100"]),
        ("skipped_collective", ["all_reduce", "test_dp_cp_step.py:"]),
        ("unwaited_send", ["never waited", "send to rank", "test_dp_cp_step.py:"])]


@pytest.mark.parametrize("bug,words", BUGS)
def test_the_step_as_processes_of_a_launch(bug, words):
    from test_harness import launch_harness, variant_lines
    rc, out, _ = launch_harness(4, ["dp_cp" + (":" + b if b else "") for b, _ in BUGS], 12)
    assert rc == 1, out  # the planted ones fail
    mine = variant_lines(out, "dp_cp" + (":" + bug if bug else ""))
    assert mine.count("\n") == 3, out
    if bug is None:
        assert mine.count("12 layouts hold at cp 2") == 4, out
    else:
        assert all(w in mine for w in words), (words, out)
