"""flash-linear-attention's CP code (fla-core 0.6.0, unmodified) on cpsim's ranks:
its context builder, its gather helpers and its CP convolution against cpsim's
references (examples/libraries/fla_step.py)."""
import pytest

import torch
import torch.distributed as dist

from libraries_common import FAMILIES, FAMILY, SEED, expect_reported

import cpsim.torch
import fla_step
from fla.ops.cp import build_cp_context


def test_random_layouts_hold_at_every_cp_size():
    before = fla_step.CONV_CASES[0]
    ran = cpsim.torch.check(fla_step.step, cases=200, max_cp=8, seed=SEED, min_shard=fla_step.MIN_SHARD)
    assert ran >= 200 and ran.outside == 0
    # min_shard = W - 1: every drawn rank ran FLA's convolution (at least one rank a case)
    assert fla_step.CONV_CASES[0] - before >= 200


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.rsplit("/", 1)[-1][:-5])
def test_every_shipped_family_holds(family):
    # A family's members shorter than W - 1 a rank return no convolution (FLA's contract).
    assert cpsim.torch.check(fla_step.step, cases=25, seed=SEED, family=family) >= 25


def test_the_tail_padding_joined_to_the_last_document_is_reported():
    expect_reported(lambda: cpsim.torch.check(fla_step.VARIANTS["padding_joins_last_document"], cases=200,
                                              seed=SEED, min_shard=fla_step.MIN_SHARD),
                    "cu_seqlens[0]: shape", "smallest failing layout")


def test_a_gather_backward_without_the_sum_over_ranks_is_reported():
    expect_reported(lambda: cpsim.torch.check(fla_step.VARIANTS["backward_local"], cases=200, seed=SEED,
                                              min_shard=fla_step.MIN_SHARD),
                    "gathered gradient (gather_grad_x)")


def test_finding_f1_ranks_shorter_than_the_window_break_the_convolution():
    # FLA's CP convolution takes W - 1 tokens from the previous rank only, and its
    # Triton path does not check that a rank holds them: a shape error, not a message.
    expect_reported(lambda: cpsim.torch.check(fla_step.VARIANTS["conv_always"], cases=50, seed=SEED,
                                              family=FAMILY["fewer_tokens_than_ranks"]),
                    "raised RuntimeError")


def test_finding_f2_a_context_built_from_a_buffer_updated_in_place_is_stale():
    from fla.ops.cp.context import get_cp_cu_seqlens
    import fla.utils
    saved, fla.utils.FLA_DISABLE_TENSOR_CACHE = fla.utils.FLA_DISABLE_TENSOR_CACHE, False
    try:
        cu = torch.tensor([0, 5, 12])  # a persistent boundaries buffer (static shapes, CUDA graphs)
        first = get_cp_cu_seqlens(cu, world_size=3, rank=1)
        cu.copy_(torch.tensor([0, 2, 12]))  # the next step's layout, written in place
        second = get_cp_cu_seqlens(cu, world_size=3, rank=1)
        fresh = get_cp_cu_seqlens(torch.tensor([0, 2, 12]), world_size=3, rank=1)
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = saved
    assert (first.cu_seqlens_cpu.tolist(), first.pre_num_conv_tokens) == ([0, 1, 4], 4)
    assert second is first  # the cache compares its arguments by identity, not by value
    assert (fresh.cu_seqlens_cpu.tolist(), fresh.pre_num_conv_tokens) == ([0, 4], 2)


def test_fla_s_convolution_outside_its_contract_is_probed():
    # Handed shards one position shorter than W - 1 (check's probes), FLA's CP
    # convolution raises a shape error, never a wrong result; but on the ranks
    # whose halo would span two ranks only: the others wait in a collective their
    # peers never join (a hang on NCCL, finding F1).
    ran = cpsim.torch.check(fla_step.VARIANTS["conv_always"], cases=60, max_cp=8, seed=SEED,
                            min_shard=fla_step.MIN_SHARD, probes=4)
    outcomes = [p["outcome"] for p in ran.probes]
    assert len(outcomes) == 4 and all(o.startswith("refused") for o in outcomes), ran.probe_report()
    assert "refused on some ranks" in outcomes, ran.probe_report()
    assert all("raised RuntimeError" in p["why"] for p in ran.probes), ran.probe_report()


def test_fla_refuses_a_total_not_divisible_by_the_cp_size_on_every_rank():
    # The adapter only hands FLA padded rows (P a multiple of cp), so the
    # divisibility contract is probed here, from outside: FLA's own context on
    # every rank of a group, for totals that are not a multiple of its size.
    # Each rank must raise (a tail silently dropped would be a wrong result;
    # a raise on some ranks only, a hang).
    def build(rank, world, total):
        try:
            build_cp_context(torch.tensor([0, total]), group=dist.group.WORLD, conv1d_kernel_size=4,
                             cu_seqlens_cpu=torch.tensor([0, total]))
        except ValueError as e:
            return str(e)
        return None

    for cp, total in ((2, 7), (3, 8), (4, 10), (8, 12), (3, 2)):
        said = cpsim.torch.spawn(build, cp, args=(total,))
        assert all(s is not None for s in said), (cp, total, said)
        assert all(("must be divisible by" in s) or ("must be at least" in s) for s in said), said
