"""Megatron-core's CP batch split (megatron-core 0.16.1, unmodified) on cpsim's
ranks: the 2 * cp chunks every rank gets, put back in order, are cpsim's
contiguous shards (examples/libraries/megatron_step.py)."""
import pytest
import torch

from libraries_common import FAMILIES, SEED, expect_reported

import cpsim.torch
import megatron_step


def test_random_layouts_hold_at_every_cp_size():
    ran = cpsim.torch.check(megatron_step.step, cases=200, max_cp=8, seed=SEED, **megatron_step.SETTINGS)
    assert ran >= 200


# mRoPE's position_ids lie outside get_batch_on_this_cp_rank's contract (finding
# M1, docs/libraries.md): handed over, they are cut along their rows.
OUTSIDE = ("vision_language_mrope", "vision_language_mrope_rows", "vision_language_mrope_unpacked")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.rsplit("/", 1)[-1][:-5])
def test_every_shipped_family_holds_or_shows_its_finding(family):
    if family.rsplit("/", 1)[-1][:-5] in OUTSIDE:
        expect_reported(lambda: cpsim.torch.check(megatron_step.VARIANTS["unguarded"], cases=25, seed=SEED,
                                                  family=family, **megatron_step.SETTINGS),
                        "position_ids", "smallest failing layout")
    else:
        assert cpsim.torch.check(megatron_step.step, cases=25, seed=SEED, family=family,
                                 **megatron_step.SETTINGS) >= 25


def test_finding_m1_mrope_positions_cut_along_their_rows_are_silently_wrong(tmp_path):
    # Four rows at cp 2: 2 * cp divides the rows, so the cut raises nothing; each
    # rank gets every position of half the rows ([3, 2, P]), not its half of
    # every row ([3, 4, P / 2]).
    batch = tmp_path / "rows.json"
    batch.write_text('{"input_ids": [[5, 9, 9, 6], [7, 8, 4, 3], [1, 2, 3, 4], [9, 9, 9, 9]], '
                     '"seq_lens": [[4], [4], [4], [4]], '
                     '"position_ids": [[[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 0, 0]], '
                     '[[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 1, 1]], '
                     '[[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 1]]]}')
    failure = expect_reported(lambda: cpsim.torch.check(megatron_step.VARIANTS["unguarded"], batch=str(batch), cp=2,
                                                        **megatron_step.SETTINGS),
                              "batch position_ids: shape [3, 2, 2], expected [3, 4, 2]")
    assert "raised" not in failure.failure, failure.failure


def test_chunks_put_back_in_the_wrong_order_are_reported():
    expect_reported(lambda: cpsim.torch.check(megatron_step.VARIANTS["chunks_in_rank_order"], cases=200, seed=SEED,
                                              **megatron_step.SETTINGS),
                    "batch", "smallest failing layout (cp=2")


def test_megatron_refuses_a_sequence_not_divisible_by_twice_the_cp_size_on_every_rank():
    # The adapter pads to a multiple of 2 * cp (pad_multiple 2), so the contract
    # is probed here, from outside: every rank must raise, none may cut chunks of
    # unequal length or drop the tail.
    from megatron.core.utils import get_batch_on_this_cp_rank

    def split(rank, world, S):
        batch = {"tokens": torch.arange(S).reshape(1, S), "position_ids": torch.arange(S).reshape(1, S)}
        try:
            get_batch_on_this_cp_rank(batch, cp_group=torch.distributed.group.WORLD)
        except RuntimeError as e:
            return str(e)
        return None

    for cp, S in ((2, 6), (2, 7), (3, 9), (4, 12)):
        said = cpsim.torch.spawn(split, cp, args=(S,))
        assert all(s is not None and "is invalid for input of size" in s for s in said), (cp, S, said)


def _expert_bias_counts(tokens, experts, padding):
    """megatron-core's expert-bias token count (TopKRouter._apply_expert_bias,
    unmodified, eager) for `tokens` tokens all routed to expert 0, `padding` the
    router's padding mask (True: a padding token)."""
    from megatron.core.transformer.moe.router import TopKRouter
    count = TopKRouter._apply_expert_bias
    count = getattr(count, "_torchdynamo_orig_callable", count)  # under torch.compile: its eager function

    class Router:
        enable_expert_bias = True
        local_tokens_per_expert = torch.zeros(experts)

    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    routing_map[:, 0] = True
    router = Router()
    count(router, routing_map, padding_mask=None if padding is None else torch.tensor(padding))
    return router.local_tokens_per_expert.tolist()


def test_finding_m2_the_expert_bias_count_broadcasts_the_padding_mask_along_experts():
    # Live in megatron-core 0.16.1 (Megatron-LM #6114, fixed upstream since): the
    # [tokens] mask meets the [tokens, experts] routing map along the experts
    # axis. Four tokens, four experts, the last token padding: the mask drops
    # expert 3's column instead of token 3's row, and the count is [4, 0, 0, 0]
    # where 3 real tokens went to expert 0. When the pin brings the fix, this
    # test fails: revisit docs/libraries.md (M2).
    assert _expert_bias_counts(4, 4, [False, False, False, True]) == [4.0, 0.0, 0.0, 0.0]
    # With tokens != experts the broadcast raises instead, whatever the mask holds.
    for padding in ([False] * 5 + [True], [False] * 6):
        with pytest.raises(RuntimeError, match="must match the size"):
            _expert_bias_counts(6, 4, padding)
    # Without a mask the count is right.
    assert _expert_bias_counts(6, 4, None) == [6.0, 0.0, 0.0, 0.0]
