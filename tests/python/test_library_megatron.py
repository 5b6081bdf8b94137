"""Megatron-core's CP batch split (megatron-core 0.16.1, unmodified) on cpsim's
ranks: the 2 * cp chunks every rank gets, put back in order, are cpsim's
contiguous shards (examples/libraries/megatron_step.py)."""
import pytest

from libraries_common import FAMILIES, SEED, expect_reported

import cpsim.torch
import megatron_step


def test_random_layouts_hold_at_every_cp_size():
    ran = cpsim.torch.check(megatron_step.step, cases=200, max_cp=8, seed=SEED, **megatron_step.SETTINGS)
    assert ran >= 200


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.rsplit("/", 1)[-1][:-5])
def test_every_shipped_family_holds(family):
    assert cpsim.torch.check(megatron_step.step, cases=25, seed=SEED, family=family, **megatron_step.SETTINGS) >= 25


def test_chunks_put_back_in_the_wrong_order_are_reported():
    expect_reported(lambda: cpsim.torch.check(megatron_step.VARIANTS["chunks_in_rank_order"], cases=200, seed=SEED,
                                              **megatron_step.SETTINGS),
                    "batch", "smallest failing layout (cp=2")
