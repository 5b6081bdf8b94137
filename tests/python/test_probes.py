"""A step's contract probed from outside (check(min_shard=, forms=, probes=)):
once every drawn layout held, layouts just outside each contract go to the
step. Refusing one loudly (OutsideContract, or an exception of its own on the
ranks) or handling it right passes, and Checked.probes says which; taking one
and giving a wrong result fails the check with that layout, the contract named."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import cpsim.torch as ct

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
import cp_step  # noqa: E402

W = 4  # the convolution's width: a halo of W - 1 = 3 positions, so min_shard 3


def previous_rank_halo(x, width):
    """The halo from the previous rank alone, as a ring's one hop gives it: right
    only when every shard holds at least width - 1 positions."""
    halo = width - 1
    B, L, C = x.shape
    rank = dist.get_rank()
    tails = cp_step.gather_sequence(x[:, max(0, L - halo):], dim=1)
    m = min(L, halo)
    before = tails[:, (rank - 1) * m:rank * m] if rank > 0 else tails[:, :0]
    return torch.cat([x.new_zeros((B, halo - before.shape[1], C)), before, x], dim=1)


def halo_step(short="refuse"):
    def step(case):
        L = case.x.shape[1]
        if L < W - 1:
            if short == "refuse":
                raise ct.OutsideContract("shards of %d positions: the one-hop halo needs %d" % (L, W - 1))
            if short == "raise":
                raise ValueError("a shard of %d positions is shorter than the halo" % L)
        if short == "handle":
            return {"halo": cp_step.convolution_history(case.x, W)}
        return {"halo": previous_rank_halo(case.x, W)}
    return step


@pytest.mark.parametrize("short,outcome", [("refuse", "refused"), ("raise", "refused"), ("handle", "accepted")])
def test_a_step_that_refuses_or_handles_what_is_outside_its_contract_passes(short, outcome):
    checked = ct.check(halo_step(short), cases=30, max_cp=4, seed=5, conv_width=W, min_shard=W - 1)
    assert checked == 30
    assert len(checked.probes) == 2, checked.probes
    for p in checked.probes:
        assert p["contract"].startswith("min_shard 3: its equal shards hold 2 positions"), p
        assert p["outcome"] == outcome, checked.probe_report()
    if short == "raise":
        assert "rank" in checked.probes[0]["why"] and "ValueError" in checked.probes[0]["why"], checked.probes


def test_a_step_that_takes_a_layout_outside_its_contract_and_is_wrong_fails():
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(halo_step("wrong"), cases=30, max_cp=4, seed=5, conv_width=W, min_shard=W - 1)
    text = str(e.value)
    assert text.startswith("cpsim.torch.check: outside its contract (min_shard 3: its equal shards hold 2 positions)"
                           " the step took the layout and gave a wrong result"), text
    assert "halo" in e.value.failure and "the probed failing layout" in text, text


def test_every_form_left_out_is_probed_and_no_probe_runs_without_a_contract():
    def only_seq_lens(case):
        if "seq_lens" not in case.batch:
            raise ct.OutsideContract("this step reads seq_lens")
        return {"gathered": cp_step.gather_sequence(case.x)}
    checked = ct.check(only_seq_lens, cases=10, max_cp=2, seed=2, forms=["seq_lens"], probes=3)
    assert [p["outcome"] for p in checked.probes] == ["refused"] * 3, checked.probe_report()
    assert all(p["contract"].startswith("forms seq_lens: a layout in form ") for p in checked.probes), checked.probes
    assert ct.check(halo_step("handle"), cases=5, max_cp=2, seed=2).probes == []
    assert ct.check(halo_step("refuse"), cases=5, max_cp=4, seed=2, conv_width=W, min_shard=W - 1,
                    probes=0).probes == []
