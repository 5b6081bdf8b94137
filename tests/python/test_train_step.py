"""The "train" output: a user's whole DP x CP training step (user_cp.py: its
own model, loss over the global label count, gradients all-reduced over every
rank, global-norm clipping, SGD; here with a routing-bias-like buffer updated
from token counts, as GLM-5.3's MoE gate is) against the same step on one
rank holding every replica's rows. The faithful step holds at dp 1 and 2 on
both meshes; each planted bug of the step's DP x CP side is reported with what
is wrong."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import cpsim.torch as ct

sys.path.insert(0, os.path.dirname(__file__))
import user_cp  # noqa: E402

CASES = int(os.environ.get("CPSIM_TRAIN_CASES", "8"))
# Short rows: the model's recurrence is a Python loop over positions.
DRAW = dict(forms=["seq_lens_padded", "seq_lens"], long_every=0, cps=[1, 2, 3])
BIAS_RATE = 0.25


def update_bias(model, cb, comm, bug):
    """A routing-bias-like buffer: each token id's load over every rank's real
    tokens against the mean load moves the bias by its sign (an aux-loss-free
    balance, as GLM-5.3's gate does with its experts)."""
    real = ~cb.pad[:, cb.lo:cb.hi]
    load = torch.bincount(cb.ids[real], minlength=user_cp.V).to(torch.float64)
    if bug == "bias_local_counts":  # PLANTED: the load of this rank's tokens only
        pass
    elif bug == "bias_replica_counts":  # PLANTED: summed over the replica's CP ranks, not over DP
        dist.all_reduce(load, group=comm.cp_group)
    else:
        dist.all_reduce(load)
    with torch.no_grad():
        model.load_bias += BIAS_RATE * torch.sign(load.mean() - load)


def clip_rank_order(model, max_norm, rank):
    """Global-norm clipping whose squared norms are summed in an order of the
    rank's own (PLANTED: the same norm up to rounding, so ranks part by bits)."""
    params = list(model.parameters())
    params = params[::-1] if rank % 2 else params
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        p.grad.mul_(scale)
    return total


CLIP = [False]  # the planted clipping in use
_user_clip = user_cp.clip


def _clip(model, max_norm):
    return clip_rank_order(model, max_norm, dist.get_rank()) if CLIP[0] else _user_clip(model, max_norm)


def make_step(bug=""):
    def step(case):
        b = case.replica_batch  # this replica's rows (every row in the unsharded run)
        if "seq_lens" not in b:
            raise ct.OutsideContract("the packer emits rows with seq_lens")
        user_cp.BUG = bug if bug in USER_CP_BUGS else ""
        comm = user_cp.CPComm(case.device_mesh())
        cb = user_cp.CPBatch(b, case.cp, case.rank)
        model = user_cp.TinyHybrid(seed=1)
        model.register_buffer("load_bias", torch.zeros(user_cp.V, dtype=torch.float64))
        if bug == "replica_weight" and case.dp_rank == 1:  # PLANTED: one replica starts from another weight
            with torch.no_grad():
                model.attn.wq[0, 0] += 1e-3
        user_cp.clip = _clip  # (every rank thread sets the same: user_cp's own clip, or this file's planted one)
        CLIP[0] = bug == "clip_rank_order"
        logged, logits, _ = user_cp.train_step(model, cb, comm)
        update_bias(model, cb, comm, bug)
        # The logits and labels at this rank's positions: compared at them, and
        # the leak property holds each document's to its own tokens.
        return {"train": ct.TrainStep(model, logged, positions={"logits": logits, "labels": cb.labels},
                                      tolerance=1e-9)}
    return step


# The bugs user_cp.py plants itself (the others are this file's).
USER_CP_BUGS = {"loss_cp_count", "dp_avg_local_mean", "grad_dp_only", "grad_cp_only", "sgd_before_allreduce",
                "clip_local_norm", "label_shift_local", "loss_local_count", "attn_no_doc_mask", "padding_in_loss"}


def _check(bug="", dp=2, mesh="dp,cp", **kw):
    options = dict(DRAW, cases=CASES, dp=dp, mesh=mesh, seed=5)
    options.update(kw)
    return ct.check(make_step(bug), **options)


@pytest.mark.parametrize("dp,mesh", [(1, "dp,cp"), (2, "dp,cp"), (2, "cp,dp")])
def test_the_faithful_training_step_holds(dp, mesh):
    assert _check(dp=dp, mesh=mesh) == CASES


# Each planted bug, what the report must say (every line of it is in the failure).
PLANTED = [
    # The loss over the replica's own count, gradients summed over every rank:
    # each replica's loss part is weighted by its own count.
    ("loss_cp_count", ["train:", "the loss reported", "off by dp", "gradient of"]),
    # DDP's convention: the replica's mean, gradients averaged over DP: right
    # only when every replica counts as many labels.
    ("dp_avg_local_mean", ["train:", "gradient of"]),
    ("loss_local_count", ["train:", "the loss reported"]),
    # Summed over the replicas only: each rank's gradient lacks its CP peers' parts.
    ("grad_dp_only", ["train:", "gradient of", "the reduction left out CP"]),
    # Summed over the CP ranks only: the replicas' gradients never meet.
    ("grad_cp_only", ["train:", "gradient of", "the reduction left out DP"]),
    ("sgd_before_allreduce", ["train:", "parameter", "after the step", "the update did not use them"]),
    ("clip_local_norm", ["train:", "gradient of"]),
    # labels made on the shard: the last position of a shard loses its label
    ("label_shift_local", ["train:", "labels (positions", "wrong elements", "-100, unsharded"]),
    ("bias_local_counts", ["train:", "buffer load_bias after the step"]),
    ("bias_replica_counts", ["train:", "buffer load_bias after the step"]),
    ("replica_weight", ["(dp 1, cp 0) train: 1 of the step's results", "parameter attn.wq after the step"]),
    ("clip_rank_order", ["train:", "after the step differs from rank 0", "replicas must be identical"]),
    # In the step and in its unsharded run alike: only the leak property sees them.
    ("attn_no_doc_mask", ["train logits changed at row", "when document", "documents must not see each other"]),
    ("padding_in_loss", ["changed when the padding's inputs", "were drawn again: padding must never count"]),
]


LEAKS = ("attn_no_doc_mask", "padding_in_loss")


@pytest.mark.parametrize("bug,says", PLANTED, ids=[b for b, _ in PLANTED])
def test_each_planted_bug_of_the_step_is_reported(bug, says):
    # The leak property runs each case three times: only where the bug is a leak.
    with pytest.raises(ct.CheckFailed) as e:
        _check(bug, cps=[2, 3] if bug in ("label_shift_local", "clip_rank_order") else [1, 2, 3],
               leaks=bug in LEAKS)
    for s in says:
        assert s in e.value.failure, "%s: %r not in:\n%s" % (bug, s, e.value.failure)


def test_a_loss_over_the_replicas_own_count_fails_and_its_replay_line_reproduces_it():
    with pytest.raises(ct.CheckFailed) as e:
        _check("dp_avg_local_mean", leaks=False)
    message = str(e.value)
    assert "dp=2, mesh='dp,cp')" in message, message
    # The replay line as printed: the same layout, replicas and mesh fail again.
    with pytest.raises(ct.CheckFailed) as again:
        ct.check(make_step("dp_avg_local_mean"), batch=e.value.path, cp=e.value.cp, plan=e.value.plan,
                 seed=e.value.seed, dp=2, mesh="dp,cp")
    assert again.value.failure.split("\n")[0] == e.value.failure.split("\n")[0]
    # At dp 1 the same layout holds: the bug needs replicas with rows of their own.
    assert ct.check(make_step("dp_avg_local_mean"), batch=e.value.path, cp=e.value.cp, plan=e.value.plan,
                    seed=e.value.seed) == 1


def test_every_differing_parameter_is_listed_worst_first():
    with pytest.raises(ct.CheckFailed) as e:
        _check("grad_dp_only", cps=[2], leaks=False)
    assert "train: the same 18 differences as rank 1 (dp 0, cp 1)" in e.value.failure, e.value.failure
    first = e.value.failure.split("\n")
    lines = [line for line in first[1:first.index(next(x for x in first[1:] if not x.startswith("  ")))]]
    hint = lines.pop()  # after the listing: which group the reduction left out
    assert hint.startswith("  the CP ranks of a replica hold different gradients"), e.value.failure
    assert lines[-1].startswith("  and "), e.value.failure
    named = [line.split(":")[0].strip() for line in lines[:-1]]
    errors = [float(line.split("relative RMSE ")[1].split(" ")[0]) for line in lines[:-1]]
    assert len(named) == 8 and len(set(named)) == 8 and errors == sorted(errors, reverse=True), e.value.failure
    assert "gradient of emb" in e.value.failure and "gradient of lm_head" in e.value.failure


@pytest.mark.parametrize("bug", ["attn_no_doc_mask", "padding_in_loss"])
def test_a_bug_in_both_runs_passes_without_the_leak_property(bug):
    # The control of the two above: the sharded step agrees with its unsharded run.
    assert _check(bug, leaks=False) == CASES


def test_each_replica_trains_on_its_own_rows():
    seen = {}

    def step(case):
        seen[(case.dp_rank, case.rank)] = (case.rows, case.replica_batch["input_ids"].shape[0],
                                           case.activation("x", 2).shape[0], case.batch["input_ids"].shape[0])
        raise ct.OutsideContract("looked")

    with pytest.raises(ct.CheckFailed):
        ct.check(step, cases=1, dp=2, cps=[2], forms=["seq_lens"], probes=0)
    rows = {k: v[0] for k, v in seen.items() if k[0] >= 0}
    B = next(iter(seen.values()))[3]
    assert B % 2 == 0 and B >= 2
    assert rows[(0, 0)] == rows[(0, 1)] == slice(0, B // 2) and rows[(1, 0)] == slice(B // 2, B), seen
    assert all(v[1] == v[2] == B // 2 for v in seen.values()), seen


def test_a_train_output_is_a_train_step():
    def step(case):
        return {"train": torch.zeros(1)}
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=1, cps=[1])
    assert "must be a cpsim.torch.TrainStep, not Tensor" in str(e.value)


def accumulating_step(per_microbatch=False):
    """Gradient accumulation over case.microbatches: each microbatch's loss sum
    over the window's label count (every microbatch of every rank), backward
    after each, then one reduction, clipping and update. PLANTED with
    per_microbatch: each microbatch normalised by its own count."""
    def step(case):
        import torch.nn.functional as F
        if "seq_lens" not in case.batch:
            raise ct.OutsideContract("the packer emits rows with seq_lens")
        user_cp.BUG, user_cp.clip, CLIP[0] = "", _clip, False
        comm = user_cp.CPComm(case.device_mesh())
        model = user_cp.TinyHybrid(seed=1)
        parts = [user_cp.CPBatch({k: v[mb] for k, v in case.batch.items()}, case.cp, case.rank)
                 for mb in case.microbatches]
        window = sum((p.labels != user_cp.IGNORE).sum() for p in parts).to(torch.float64)
        dist.all_reduce(window)
        logged, logits = torch.zeros((), dtype=torch.float64), []
        for cb in parts:
            out = model(cb, comm)
            total = F.cross_entropy(out.reshape(-1, user_cp.V), cb.labels.reshape(-1), ignore_index=user_cp.IGNORE,
                                    reduction="sum")
            count = window
            if per_microbatch:
                count = (cb.labels != user_cp.IGNORE).sum().to(torch.float64)
                dist.all_reduce(count)
            loss = total / count.clamp(min=1)
            loss.backward()
            logged += loss.detach()
            logits.append(out)
        user_cp.all_reduce_grads(model, comm)
        user_cp.clip(model, user_cp.MAX_NORM)
        user_cp.sgd(model, user_cp.LR)
        dist.all_reduce(logged)
        return {"train": ct.TrainStep(model, logged, positions={"logits": torch.cat(logits, 0)})}
    return step


def test_gradient_accumulation_over_microbatches_holds_against_one_batch_of_every_row():
    assert ct.check(accumulating_step(), microbatches=2, **dict(DRAW, cases=CASES, dp=2, seed=5)) == CASES


def test_a_window_normalised_per_microbatch_is_reported():
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(accumulating_step(per_microbatch=True), microbatches=2, leaks=False,
                 **dict(DRAW, cases=CASES, dp=2, seed=5))
    assert "train:" in e.value.failure and "gradient of" in e.value.failure, e.value.failure
    assert "microbatches=2" in str(e.value)
