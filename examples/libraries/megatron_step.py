"""Megatron-core's context-parallel batch split (megatron-core 0.16.1),
unmodified, on cpsim's ranks, property-tested by cpsim.torch.check:

    .venv/bin/python examples/libraries/megatron_step.py
    .venv/bin/python examples/libraries/megatron_step.py --variant chunks_in_rank_order

`megatron.core.utils.get_batch_on_this_cp_rank` cuts every [B, S] key into
2 * cp chunks and gives rank r chunks r and 2 * cp - 1 - r (causal attention's
load balance). That layout is not contiguous, and cpsim's plans are (the
recurrent and convolution layers cpsim checks need one interval a rank), so
what is comparable is checked: the chunks Megatron gives every rank, put back
in sequence order through an all-gather of every rank's chunks, must be the
contiguous shard cpsim's shard_batch gives the same rank (every key, every
token once, the padding, positions and labels of the padded sequence). A
chunk given to the wrong rank, cut along the wrong dim or lost shows as this
rank's batch differing.

Megatron's split neither pads nor derives the layout: it takes a sequence
divisible by 2 * cp (checked at pad_multiple 2) whose keys its data pipeline
made. That glue, the padded global batch, is cpsim's checked example's
(examples/torch/cp_step.py: layout_of and its fills). Megatron's GPT batches
carry a [B, 1, S, S] attention_mask (cut along dim 2), not HF's [B, S] one:
batches with an HF mask are set aside (OutsideContract).
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
import library_cli  # noqa: E402
import cp_step  # noqa: E402 - cpsim's checked example: the padded global batch

from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

from cpsim.torch import OutsideContract  # noqa: E402

_FILL = {"labels": -100, "padding_mask": True, "loss_mask": 0}


def padded_global_batch(case):
    """Every [B, S] key of the batch, normalised (padding_mask and position_ids
    from the layout, lengths consumed), padded to P with its fill value."""
    whole, _, _ = cp_step.shard_batch(case.batch, 0, 1, case.pad_token_id, shard_primary=True)
    out = {}
    for key, value in whole.items():  # [B, S]; mRoPE's position_ids [3, B, S]
        S = value.shape[-1]
        if key == "position_ids":  # positions continue through the tail padding (in every plane)
            tail = value[..., S - 1:S] + torch.arange(1, case.P - S + 1)
            out[key] = torch.cat([value, tail], dim=-1)
            continue
        fill = case.pad_token_id if key == "input_ids" else _FILL.get(key, 0)
        out[key] = torch.cat([value, torch.full((*value.shape[:-1], case.P - S), fill, dtype=value.dtype)], dim=-1)
    return out


def make_step(chunks_in_rank_order=False, guarded=True):
    """guarded=False: mRoPE's position_ids are handed over too (finding M1)."""
    def step(case):
        if "attention_mask" in case.batch:
            raise OutsideContract("Megatron's attention_mask is [B, 1, S, S] (cut along dim 2), not HF's [B, S]")
        if guarded and library_cli.has_mrope_positions(case.batch):
            raise OutsideContract("finding M1 (docs/libraries.md): get_batch_on_this_cp_rank cuts every key but "
                                  "attention_mask along dim 1, mRoPE's [3, B, S] position_ids along their rows")
        group = dist.group.WORLD
        mine = get_batch_on_this_cp_rank(padded_global_batch(case), cp_group=group)
        cp, r = case.cp, case.rank
        chunk = case.P // (2 * cp)
        local = {}
        for key, value in sorted(mine.items()):
            # Every rank's two chunks, then each chunk put at its place in the sequence.
            parts = [torch.empty_like(value) for _ in range(cp)]
            dist.all_gather(parts, value.contiguous(), group=group)
            chunks = [None] * (2 * cp)
            for q, part in enumerate(parts):  # the sequence is the last axis (of mRoPE's planes too)
                first, second = (2 * q, 2 * q + 1) if chunks_in_rank_order else (q, 2 * cp - 1 - q)
                chunks[first], chunks[second] = part[..., :chunk], part[..., chunk:]
            local[key] = torch.cat(chunks, dim=-1)[..., r * 2 * chunk:(r + 1) * 2 * chunk]
        return {"batch": local}
    return step


step = make_step()
VARIANTS = {"chunks_in_rank_order": make_step(chunks_in_rank_order=True),  # PLANTED: rank q's chunks taken as 2q, 2q+1
            "unguarded": make_step(guarded=False)}  # mRoPE's position_ids handed over (finding M1)
SETTINGS = {"pad_multiple": 2, "shard_primary": True}


def main():
    import cpsim.torch
    args = library_cli.arguments(__doc__, VARIANTS)
    return library_cli.run(lambda: cpsim.torch.check(VARIANTS[args.variant] if args.variant else step, cases=args.cases,
                                                    max_cp=args.max_cp, family=args.family, seed=args.seed,
                                                    **SETTINGS),
                          "megatron-core get_batch_on_this_cp_rank")


if __name__ == "__main__":
    sys.exit(main())
