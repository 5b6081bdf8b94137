"""flash-linear-attention's own Triton CP kernels (fla-core 0.6.0, unmodified),
run on the CPU by Triton's interpreter on cpsim's ranks, property-tested by
cpsim.torch.check:

    .venv/bin/python examples/libraries/fla_kernels_step.py kda            # chunk_kda with cp_context
    .venv/bin/python examples/libraries/fla_kernels_step.py conv           # the CP convolution's Triton kernel
    .venv/bin/python examples/libraries/fla_kernels_step.py kda --variant no_state_across_ranks
    .venv/bin/python examples/libraries/fla_kernels_step.py kda --dtype bf16   # in bf16 (fp32 by default)

* `kda`: `fla.ops.kda.chunk_kda(q, k, v, g, beta, scale=1, cp_context=...)`, one
  packed row at a time with FLA's context of the row (fla_step.row_context:
  `build_cp_context` of the row's segments): FLA's chunked KDA forward and
  backward, and its CP kernels (`fla/ops/cp/chunk_fwd.py`, `chunk_bwd.py`,
  `chunk_merge.py`, `chunk_delta_h.py`: every rank's affine summary, their
  all-gather, and the fold over the ranks before it, mirrored in backward).
  Returned as "recurrence_o", compared with cpsim's reference recurrence:
  output and the gradients of q, k, v, beta, g.
* `conv`: fla_step.py's step (FLA's context, gather, CP convolution) with FLA's
  own Triton convolution kernel in place of the torch stand-in.

The conventions mapped (docs/libraries.md, "Conventions that differ"):
cpsim's recurrence is FLA's KDA with scale 1 (cpsim does not scale q), the gate
g the per-token log-decay (FLA's `g` without `use_gate_in_kernel`, cumulated
inside the kernel), beta as given (no sigmoid in the kernel), no l2 norm in the
kernel (cpsim's keys are drawn normalised). cpsim's heads are K = V = 4 wide;
FLA's kernels are written for widths of at least 16 (tl.dot), so the adapter
pads K and V with zeros to 16 and cuts the output back: a zero key or value
channel adds nothing to the state and reads nothing from it, so the padded
recurrence's first V channels are the unpadded one exactly (and the padded
channels' gradients are not compared).

Every adjustment that lets the kernels run on a CPU is in triton_cpu.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_cpu  # noqa: E402 - before triton and fla: the interpreter is chosen when kernels are defined

triton_cpu.enable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import library_cli  # noqa: E402
import fla  # noqa: E402
import fla_step  # noqa: E402
from fla.ops.kda import chunk_kda  # noqa: E402

WIDTH = 16  # the head width FLA's kernels are written for (tl.dot takes 16 and up)


def _widen(t):
    """[B, L, H, n] zero-padded to [B, L, H, WIDTH] (exact: see the module's text)."""
    return F.pad(t, (0, WIDTH - t.shape[-1]))


# A quiet stretch: beta 0 there, tokens that write nothing to the state, and
# every log-decay times QUIET_GATE (the drawn [-1, 0] to [-0.01, 0]: every head
# keeps about e^-0.3 of its state over a 64-token chunk, not exactly 1).
QUIET_GATE = 0.01
# FLA's sharded run against its own unsharded run over a quiet rank: the state
# the rank received leaves it through the CP summary's transform alone (its
# decay), which FLA keeps in fp32 (its #740), so both runs round one fp32 state
# to bf16 alike. Measured (the quiet test: one 192-token document at CP 3, bf16,
# five seeds): 0 every time; the transform rounded to bf16 at every chunk,
# 0.0013 and up (docs/libraries.md). On a GPU the transform's dots are TF32x3,
# an fp32 rounding apart: a rare flip of a bf16 rounding, far below 2e-4.
QUIET_TOLERANCE = {torch.bfloat16: 2e-4, torch.float16: 2e-4}


def make_kda_step(gate_unscaled=False, skip_merge=False, quiet=None):
    """FLA's chunk_kda on the case's recurrence, returned as "recurrence_o"
    (against cpsim's reference). quiet=(lo, hi): beta 0 at the row
    positions lo..hi and the gates times QUIET_GATE, in both runs, and the
    output is a "layer" instead: FLA's sharded run against its unsharded run
    (QUIET_TOLERANCE; 1e-5 in fp32), the carried state's precision through a
    rank that writes nothing."""
    def step(case):
        group = dist.group.WORLD
        r = case.recurrence
        V = r["v"].shape[-1]
        outs = []
        for b, row in enumerate(fla_step.padded_doc_ids(case)):
            context, cu = fla_step.row_context(row, group, case.conv_width), None
            if skip_merge:  # PLANTED: no state from the ranks before (each shard a sequence of its own)
                context, cu = None, context.cu_seqlens
            q, k, v, g = (_widen(r[n][b:b + 1]) for n in ("q", "k", "v", "g"))
            if gate_unscaled:  # PLANTED: the gate handed over as a decay factor, not its log
                g = g.exp()
            beta = r["beta"][b:b + 1]
            if quiet is not None:
                g = g * QUIET_GATE
                at = torch.arange(case.cuts[case.rank], case.cuts[case.rank] + beta.shape[1])
                beta = beta.masked_fill(((at >= quiet[0]) & (at < quiet[1]))[None, :, None], 0.0)
            o, _ = chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=None,
                             output_final_state=False, cu_seqlens=cu, cp_context=context)
            outs.append(o[..., :V])
        o = torch.cat(outs)
        if quiet is not None:
            import cpsim.torch
            return {"layer": cpsim.torch.Layer(o, r, {}, QUIET_TOLERANCE.get(o.dtype, 1e-5))}
        return {"recurrence_o": o}
    return step


STEPS = {"kda": make_kda_step, "conv": fla_step.make_step}
VARIANTS = {
    "kda": {"no_state_across_ranks": make_kda_step(skip_merge=True),
            "gate_unscaled": make_kda_step(gate_unscaled=True)},
    "conv": {"conv_always": fla_step.make_step(conv_always=True)},  # finding F1, with FLA's own kernel
}
# The shapes the interpreter affords (a few seconds a case): documents of tens of
# tokens, CP 1-4; FLA's contract: equal shards, every rank W - 1 tokens for the conv.
# KDA: 1 in 8 layouts long, each rank's shard 65-80 tokens (two of FLA's 64-token
# chunks: the state carried chunk to chunk inside a rank, ~15 s a case at CP 2),
# and 1 in 4 cases with live gates (check's default), heads decaying apart.
SETTINGS = {"kda": {"dtype": "f32", "max_cp": 4, "long_every": 8, **library_cli.LONG_SHARDS},
            "conv": {"dtype": "f32", "max_cp": 4, "min_shard": fla_step.MIN_SHARD, "long_every": 0}}


def check(name, step=None, **kwargs):
    import cpsim.torch
    settings = dict(SETTINGS[name])
    if kwargs.get("family"):
        settings.pop("min_shard", None)
    settings.update({k: v for k, v in kwargs.items() if v is not None})
    saved, fla_step.STAND_IN[0] = fla_step.STAND_IN[0], False  # FLA's own Triton convolution kernel, interpreted
    try:
        return cpsim.torch.check(step or STEPS[name](), **settings)
    finally:
        fla_step.STAND_IN[0] = saved


def main():
    return library_cli.run_steps(__doc__, STEPS, VARIANTS, check, lambda name: "fla-core %s %s, Triton's interpreter "
                                "(%d kernel launches)" % (fla.__version__, name, triton_cpu.LAUNCHES[0]), max_cp=4)


if __name__ == "__main__":
    sys.exit(main())
