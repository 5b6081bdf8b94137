"""flash-linear-attention's context parallelism (fla-core 0.6.0), unmodified, on
cpsim's ranks: its CP context builder, its communication helpers and its CP
causal convolution, property-tested by cpsim.torch.check.

    .venv/bin/python examples/libraries/fla_step.py                  # the faithful adapter
    .venv/bin/python examples/libraries/fla_step.py --variant padding_joins_last_document

What runs is FLA's own code: `fla.ops.cp.build_cp_context` (one context per
packed row, as Automodel's Kimi-Linear builds them), `all_gather_into_tensor` and
`all_reduce_sum` (the sequence gather and its backward), and
`fla.modules.causal_conv1d.cp.causal_conv1d_cp` (FLA's autograd Function with its
halo exchange, `conv_cp_send_recv_fwd`, and its gradient return,
`conv_cp_send_recv_bwd`). Only the convolution kernel itself (Triton, GPU only)
is replaced, through FLA's own backend registry (`fla.backends.register`), by
`torch_conv_forward` / `torch_conv_backward` below: a plain torch convolution of
each local sequence from its initial state, as FLA's kernel computes it.
examples/libraries/fla_kernels_step.py runs the same step with FLA's own Triton
kernel instead (Triton's interpreter, on the CPU).

The glue is small and cpsim-checked: the document layout of the raw batch comes
from examples/torch/cp_step.py (`layout_of`, `segment_cu_seqlens`: the
segments of the padded row, padding runs included, which is what FLA's
partitioning expects: they tile the row, so the token count is a multiple of the
CP size).

FLA's contract, drawn within: equal contiguous shards (plan "equal"; its zigzag
layout is not contiguous, see docs/libraries.md), and, for the convolution, every
rank at least W - 1 tokens (FLA's CUDA backend says so; its Triton path breaks
with a shape error below that): random layouts are drawn with min_shard = W - 1,
and on a family's shorter members the step returns no "conv".
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
import cp_step  # noqa: E402 - cpsim's checked example: the layout of the raw batch

import library_cli  # noqa: E402
import fla  # noqa: E402
import fla.utils  # noqa: E402
from fla.backends import BaseBackend, register  # noqa: E402
from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd  # noqa: E402
from fla.modules.causal_conv1d.cp import causal_conv1d_cp  # noqa: E402
from fla.ops.cp import all_gather_into_tensor, all_reduce_sum, build_cp_context  # noqa: E402

from cpsim.torch import OutsideContract  # noqa: E402

# FLA memoises get_cp_cu_seqlens on its arguments' identity in one cache per
# process; cpsim's ranks are threads of one process, which would share (and
# concurrently mutate) it. Each rank recomputes its context instead.
fla.utils.FLA_DISABLE_TENSOR_CACHE = True


# --- the convolution kernel, in torch (FLA's Triton kernel needs a GPU) ---

def _conv_sequences(x, weight, bias, residual, initial_state, activation, cu_seqlens):
    """x [1, T, D] convolved sequence by sequence ([cu[n], cu[n+1])), each from
    its initial state [N, D, W] (entries 1..W-1: the W-1 positions before the
    sequence, the last one nearest), taps w[:, W-1] on the token itself."""
    W = weight.shape[1]
    T, D = x.shape[1], x.shape[2]
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    ys = []
    for n in range(len(bounds) - 1):
        seq = x[0, bounds[n]:bounds[n + 1]]
        history = initial_state[n, :, 1:].transpose(0, 1) if initial_state is not None else x.new_zeros(W - 1, D)
        ext = torch.cat([history.to(x.dtype), seq])
        n_tokens = seq.shape[0]
        y = sum(ext[j:j + n_tokens] * weight[:, j] for j in range(W))
        ys.append(y + bias if bias is not None else y)
    y = torch.cat(ys)[None] if ys else x.new_zeros(x.shape)
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    return y + residual if residual is not None else y


STAND_IN = [True]  # fla_kernels_step.py turns it off: FLA's own Triton kernel runs (interpreted)


class TorchConv(BaseBackend):
    """cpsim's stand-in for FLA's convolution kernel: first in FLA's dispatch
    while STAND_IN[0] holds."""
    backend_type = "cpsim_torch"
    priority = -100

    def is_enabled(self):
        return STAND_IN[0]


@register(causal_conv1d_fwd, backend=TorchConv)
def torch_conv_forward(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                       activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                       layout_fallback=False):
    if output_final_state:
        raise NotImplementedError("the torch stand-in does not return a final state (FLA's CP path asks none)")
    with torch.no_grad():
        return _conv_sequences(x, weight, bias, residual, initial_state, activation, cu_seqlens), None


@register(causal_conv1d_bwd, backend=TorchConv)
def torch_conv_backward(x, dy, dht=None, weight=None, bias=None, residual=None, initial_state=None, activation=None,
                        cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                        layout_fallback=False):
    """(dx, dw, db, dresidual, dinitial_state), as FLA's kernel returns them."""
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, weight, bias, initial_state)]
    with torch.enable_grad():
        y = _conv_sequences(leaves[0], leaves[1], leaves[2], None, leaves[3], activation, cu_seqlens)
        wanted = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(y, wanted, dy, allow_unused=True))
    dx, dw, db, dh0 = [next(grads) if t is not None else None for t in leaves]
    dh0 = torch.zeros_like(initial_state) if initial_state is not None and dh0 is None else dh0
    return dx, dw, db, (dy if residual is not None else None), dh0


# --- the sequence gather: FLA's helpers, the autograd around them ---

class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group, backward_local):
        ctx.group, ctx.backward_local = group, backward_local
        parts, _ = all_gather_into_tensor(local.movedim(1, 0).contiguous(), group=group)  # [world, L, B, ...]
        return parts.flatten(0, 1).movedim(0, 1)

    @staticmethod
    def backward(ctx, grad):
        rank, L = dist.get_rank(ctx.group), grad.shape[1] // dist.get_world_size(ctx.group)
        if not ctx.backward_local:  # PLANTED (backward_local): no sum over the ranks' gradients
            # (all_reduce_sum reduces in place: on a copy, never on grad_output)
            grad, _ = all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), group=ctx.group)
        return grad[:, rank * L:(rank + 1) * L].contiguous(), None, None


# --- one rank's step ---

def padded_doc_ids(case):
    """[B, P] the raw batch's global doc ids (cpsim's example), 0 on the CP padding."""
    ids, _, _ = cp_step.layout_of(case.batch)
    padded = torch.zeros(ids.shape[0], case.P, dtype=torch.int64)
    padded[:, :case.S] = ids
    return padded


def row_context(row, group, conv_width):
    """FLA's context of one padded row: its segments (runs of equal doc ids,
    padding runs included) tile the row, as FLA's partitioning expects."""
    cu = cp_step.segment_cu_seqlens(row)
    return build_cp_context(cu, group=group, conv1d_kernel_size=conv_width, cu_seqlens_cpu=cu)


def make_step(padding_joins_last_document=False, backward_local=False, conv_always=False):
    def step(case):
        W = case.conv_width
        # FLA's convolution takes ranks of at least W - 1 tokens (a CP group of one
        # too: its gradient return adds to the last W - 1 positions): below that
        # the step returns no "conv" (the context and the gather are checked still).
        with_conv = case.x.shape[1] >= W - 1 or conv_always
        CONV_CASES[0] += with_conv
        group = dist.group.WORLD
        padded = padded_doc_ids(case)
        contexts, convs = [], []
        for b in range(padded.shape[0]):
            row = padded[b].clone()
            if padding_joins_last_document:  # PLANTED: the tail padding counted as the last document's
                real = (row != 0).nonzero()
                if len(real):
                    row[int(real.max()) + 1:] = row[int(real.max())]
            context = row_context(row, group, W)
            contexts.append(context)
            if with_conv:
                convs.append(causal_conv1d_cp(case.x[b:b + 1], case.conv_weight, case.conv_bias,
                                              cp_context=context))
        out = {"cu_seqlens": [c.cu_seqlens_cpu for c in contexts],
               "cp_context": contexts,
               "gathered": _GatherSequence.apply(case.x, group, backward_local)}
        if with_conv:
            out["conv"] = torch.cat(convs)
        return out
    return step


step = make_step()
MIN_SHARD = 3  # W - 1 at the harness's conv_width 4: random layouts all within FLA's convolution contract
CONV_CASES = [0]  # rank-cases that ran the convolution (a count for the reports)
VARIANTS = {
    "padding_joins_last_document": make_step(padding_joins_last_document=True),
    "backward_local": make_step(backward_local=True),
    "conv_always": make_step(conv_always=True),  # finding F1 drawn: ranks shorter than W - 1 fail
}


def main():
    import cpsim.torch
    args = library_cli.arguments(__doc__, VARIANTS)
    return library_cli.run(lambda: cpsim.torch.check(VARIANTS[args.variant] if args.variant else step, cases=args.cases,
                                                    max_cp=args.max_cp, family=args.family, seed=args.seed,
                                                    min_shard=1 if args.family else MIN_SHARD),
                          lambda: "fla-core %s (%d rank-cases ran the convolution)" % (fla.__version__, CONV_CASES[0]))


if __name__ == "__main__":
    sys.exit(main())
