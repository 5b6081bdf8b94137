"""What the adapters of examples/libraries/ share: the command line, the
shield that keeps finding K4 from the tensors around a gather, and how a batch's
position_ids are told to be mRoPE's."""
import argparse

import torch


def has_mrope_positions(batch):
    """Whether the batch's position_ids are mRoPE's planes ([3, B, S], or [3, S]
    beside a THD row's [S] keys): three positions for each token."""
    positions = batch.get("position_ids")
    return positions is not None and positions.numel() == 3 * batch["input_ids"].numel()


# Long layouts whose every rank's shard spans two of FLA's 64-token chunks (the
# KDA steps' `long_lengths` and `long_per_rank`).
LONG_SHARDS = {"long_lengths": (65, 80), "long_per_rank": True}
LIVE_FACTORS = (1.0, 0.01, 0.1, 1e-4)  # head h's decay rate times LIVE_FACTORS[h % 4] on a live case


def live_kda_gates(module, case):
    """On a case whose gates are drawn live (case.live_gates: check(live_gates_every=N)),
    every KDA layer's per-head decay rate exp(A_log) (GLM-5.3's, Kimi-Linear's) scaled by its head's factor
    (1, 0.01, 0.1, 1e-4 in turn), as cpsim's own live gates: heads that differ,
    a state that outlives a 64-token chunk. GLM-5.3's init draws A_log in
    log [1, 16], a state gone within a few tokens. Same weights in the sharded
    and the unsharded run."""
    if case.live_gates:
        with torch.no_grad():
            for sub in module.modules():
                a_log = sub._parameters.get("A_log")
                if a_log is not None:
                    factors = [LIVE_FACTORS[h % len(LIVE_FACTORS)] for h in range(a_log.numel())]
                    a_log.add_(torch.tensor(factors, dtype=a_log.dtype).log().view_as(a_log))
    return module


class FreshGradient(torch.autograd.Function):
    """Identity whose backward hands on a copy of its gradient: it keeps finding
    K4 (a gather's backward that all-reduces its grad_output in place, Kimi-Linear's
    and GLM-5.3's) from the tensors around it, so that the rest can be compared."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


def arguments(doc, variants, steps=None, max_cp=8, dtype=False):
    """--variant (a planted bug or a finding's unguarded step), --cases, --max-cp,
    --family, --seed; the step's name when an adapter has several; --dtype
    where the adapter takes it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if steps:
        parser.add_argument("step", choices=sorted(steps))
    parser.add_argument("--variant", choices=sorted(variants), help="a planted bug in the adapter's glue")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--max-cp", type=int, default=max_cp)
    parser.add_argument("--family", help="draw this layout family's members")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--long-every", type=int, help="1 in N layouts long (the step's default otherwise)")
    parser.add_argument("--dp", type=int, help="data-parallel replicas, each on its own rows (check(dp=N))")
    if dtype:
        parser.add_argument("--dtype", choices=["f64", "f32", "bf16"], help="the inputs' dtype (the step's default otherwise)")
    return parser.parse_args()


def run(check, what):
    """Runs check() (cpsim.torch.check of the step); prints what held (`what`, or
    what() once it ran), or the failure; returns the exit status."""
    import cpsim.torch
    try:
        ran = check()
    except cpsim.torch.CheckFailed as failure:
        print(failure)
        return 1
    what = what() if callable(what) else what
    aside = "; ".join("%s: %d" % why for why in ran.outside_why.items())
    print("%s: %d cases held (%d set aside%s)" % (what, ran, ran.outside, ": " + aside if aside else ""))
    return 0


def run_steps(doc, steps, variants, check, what, max_cp=8):
    """main() of an adapter with several steps: `check(name, step, **settings)`
    runs one, `what(name)` names it in the report."""
    names = {name for by_step in variants.values() for name in by_step}
    args = arguments(doc, names, steps, max_cp=max_cp, dtype=True)
    if args.variant and args.variant not in variants.get(args.step, {}):
        raise SystemExit("%s has the variants %s" % (args.step, sorted(variants.get(args.step, {}))))
    step = variants[args.step][args.variant] if args.variant else None
    return run(lambda: check(args.step, step, cases=args.cases, max_cp=args.max_cp, family=args.family,
                             seed=args.seed, long_every=args.long_every, dp=args.dp, dtype=args.dtype),
               lambda: what(args.step))
