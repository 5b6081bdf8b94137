"""The "user_loss" output: a user's own labels, loss mask and loss function,
sharded, against the same step unsharded (cpsim/user_loss.py). Two correct
conventions (token mean over every rank, per-document mean; a rank's share)
hold; each planted bug of the kind CP loss code ships is reported with what it
is: labels made after sharding, an all_reduce with autograd in the loss, a mean
of per-rank means, a rank's own mean, the CP padding counted, a share declared
as the whole."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpsim.torch as ct

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
import cp_step  # noqa: E402

V = 7  # the vocabulary of the drawn logits
CASES = 30


def user_step(bug=None, convention="token_mean", value_is="global", mask=False):
    def step(case):
        local, doc_ids, padding = cp_step.shard_batch(case.batch, case.rank, case.cp, case.pad_token_id,
                                                      case.shard_primary)
        L = local["padding_mask"].shape[1]
        start = case.rank * L
        tokens = torch.full(doc_ids.shape, case.pad_token_id, dtype=torch.int64)
        tokens[:, :case.S] = case.batch["input_ids"].reshape(tokens.shape[0], -1) % V
        if bug == "labels_after_sharding":
            labels = cp_step.next_token_targets(tokens[:, start:start + L], doc_ids[:, start:start + L],
                                                padding[:, start:start + L])
        else:
            labels = cp_step.next_token_targets(tokens, doc_ids, padding)[:, start:start + L]
        if bug == "padding_counts":  # the CP padding's labels are its pad tokens
            at = torch.arange(start, start + L) >= case.S
            labels[:, at] = case.pad_token_id
        valid = labels != -100
        logits = case.activation("logits", V, dtype=torch.float64)
        per_token = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1).clamp(min=0), reduction="none")
        per_token = torch.where(valid.reshape(-1), per_token, torch.zeros_like(per_token)).reshape(labels.shape)
        count = valid.sum().to(torch.float64)
        if convention == "per_document_mean":  # each document's token mean, then the mean over the documents
            docs = int(doc_ids.max()) + 1
            local_ids = doc_ids[:, start:start + L].clamp(min=0)
            sums = torch.zeros(docs, dtype=torch.float64).index_add(0, local_ids.reshape(-1), per_token.reshape(-1))
            counts = torch.zeros(docs, dtype=torch.float64).index_add(0, local_ids.reshape(-1),
                                                                     valid.reshape(-1).to(torch.float64))
            dist.all_reduce(counts)
            sums = cp_step._SumOverRanks.apply(sums)
            has = counts > 0
            value = (sums[has] / counts[has]).mean() if bool(has.any()) else sums.sum() * 0
        elif bug == "autograd_all_reduce":  # the sum reduced with autograd: each rank's gradient summed cp times
            from torch.distributed.nn.functional import all_reduce
            total = count.clone()
            dist.all_reduce(total)
            value = all_reduce(per_token.sum()) / total.clamp(min=1)
        elif bug == "per_rank_mean":  # each rank's mean, averaged over the ranks
            value = cp_step._SumOverRanks.apply(per_token.sum() / count.clamp(min=1)) / case.cp
        elif bug == "local_mean":  # this rank's own mean, never reduced
            value = per_token.sum() / count.clamp(min=1)
        elif bug == "one_more_without_cp" and case.cp == 1:  # the path without CP counts one token too many
            value = per_token.sum() / (count + 1)
        else:
            total = count.clone()
            dist.all_reduce(total)
            share = value_is == "share" or bug == "share_as_global"
            part = per_token.sum() if share else cp_step._SumOverRanks.apply(per_token.sum())
            value = part / total.clamp(min=1)
        declared = "global" if bug == "share_as_global" else value_is
        return {"user_loss": ct.Loss(value, logits, labels=None if mask else labels,
                                     loss_mask=valid.to(torch.int64) if mask else None, value_is=declared,
                                     tolerance=1e-9)}
    return step


@pytest.mark.parametrize("convention,value_is,mask", [("token_mean", "global", False),
                                                      ("token_mean", "share", False),
                                                      ("token_mean", "global", True),
                                                      ("per_document_mean", "global", False)])
def test_a_user_s_own_loss_holds_sharded_against_itself_unsharded(convention, value_is, mask):
    assert ct.check(user_step(convention=convention, value_is=value_is, mask=mask), cases=CASES, max_cp=4,
                    seed=11) == CASES


@pytest.mark.parametrize("bug,words", [
    ("labels_after_sharding", ["labels at row", "only at the shard's last position",
                               "shift the whole row, then shard"]),
    ("autograd_all_reduce", ["user_loss gradient to the logits", "times the unsharded gradient",
                             "torch.distributed.nn.all_reduce"]),
    ("per_rank_mean", ["user_loss value", "every rank has this value", "a mean of per-rank means"]),
    ("local_mean", ["user_loss value", "the ranks' values differ: each rank's own loss"]),
    ("padding_counts", ["the CP padding at row", "counts in its loss", "must be left out"]),
    ("share_as_global", ["user_loss value", "or its share: they sum to it", "value_is='share'"]),
])
def test_a_planted_loss_bug_is_reported_with_what_it_is(bug, words):
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(user_step(bug), cases=CASES, max_cp=4, seed=11)
    assert all(w in e.value.failure for w in words), (words, e.value.failure)


def test_the_report_says_which_side_cpsims_own_loss_agrees_with():
    # A bug in the step's path without CP (the unsharded run is the step on a
    # group of one) shows as a sharded run that differs from the unsharded one;
    # cpsim's own token-mean cross entropy of the same logits and labels says
    # which side is off.
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(user_step("one_more_without_cp"), cases=CASES, max_cp=4, seed=11)
    assert "user_loss value" in e.value.failure, e.value.failure
    assert ("is the sharded run's value, not the unsharded run's: the unsharded run (the step on a group of one, "
            "its path without CP) is off") in e.value.failure, e.value.failure
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(user_step("per_rank_mean"), cases=CASES, max_cp=4, seed=11)
    assert "is the unsharded run's value, not the sharded run's: the sharded run is off" in e.value.failure, \
        e.value.failure


def test_a_whole_loss_declared_as_a_share_is_named():
    # Every rank returns the whole loss, declared as its share: the sum over the
    # CP ranks is cp times the loss.
    def step(case):
        out = user_step()(case)
        loss = out["user_loss"]
        loss.value_is = "share"
        return out
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=CASES, max_cp=4, seed=11)
    assert "sum to" in e.value.failure and "every rank's value is the whole loss" in e.value.failure, e.value.failure


def test_a_step_that_calls_backward_itself_needs_no_retained_graph():
    # The step's own backward frees the graph: cpsim reads the gradient it left
    # on the logits. Its backward of the loss times cp (a reduction that
    # averages over the CP ranks follows) is that gradient too: declared "mean",
    # it holds; declared "sum", it is cp times the unsharded one at cp > 1.
    def step(scaled, gradient):
        def run(case):
            out = user_step()(case)
            loss = out["user_loss"]
            (loss.value * (case.cp if scaled else 1)).backward()  # no retain_graph
            loss.gradient = gradient
            return out
        return run
    assert ct.check(step(False, "sum"), cases=10, max_cp=4, seed=11) == 10
    assert ct.check(step(True, "mean"), cases=10, max_cp=4, seed=11) == 10
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step(True, "sum"), cases=10, max_cp=4, seed=11)
    assert "user_loss gradient to the logits" in e.value.failure, e.value.failure


def test_a_loss_is_taken_as_declared_or_refused():
    logits = torch.zeros(1, 2, V, requires_grad=True)
    with pytest.raises(ValueError, match="value_is is one of"):
        ct.Loss(logits.sum(), logits, value_is="mean")
    with pytest.raises(ValueError, match="gradient is one of"):
        ct.Loss(logits.sum(), logits, gradient="avg")

    def not_a_loss(case):
        return {"user_loss": case.activation("logits", V).sum()}
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(not_a_loss, cases=3, max_cp=2, seed=1)
    assert "must be a cpsim.torch.Loss" in e.value.failure, e.value.failure


def test_two_runs_of_the_steps_code_are_named_sharded_and_unsharded():
    # A layer whose sharded run is off: the report names both sides as runs of
    # the step, never "expected".
    def step(case):
        w = torch.nn.Parameter(torch.ones(()))
        out = case.activation("x", 4) * w
        if case.cp > 1:
            out = out * 1.5  # only the sharded run is off
        return {"layer": ct.Layer(out, {}, {"w": w}, tolerance=1e-9)}

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=10, max_cp=2, seed=3)
    text = str(e.value)
    assert "layer output" in text and "sharded " in text and ", unsharded " in text, text
    assert "expected" not in text.split("smallest failing layout")[0], text
