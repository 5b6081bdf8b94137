"""One rank of one case: the step, then its outputs compared with the golden
values and their gradients taken, in the same order on every rank."""
from cpsim.case import RankCase
from cpsim.compared import UNSHARDED as UNSHARDED_OUTPUTS, Side, unsharded_run
from cpsim.mesh import who as _who
from cpsim.outputs import OUTPUT_TABLE, OUTPUTS

__all__ = ("UNSHARDED_OUTPUTS", "first_differences", "run_rank")


def run_rank(golden, step, rank, dp=1, dp_rank=0, runs=None, unsharded=False, mesh="dp,cp", redraw=None):
    """One rank: the step, then its outputs' comparisons and gradients, in the
    order of OUTPUT_TABLE on every rank (cpsim.compared says how each is
    compared). Returns this rank's differences as (0, why) where a value
    differs, (1, why) where only gradients do (a gradient's difference may be
    a forward one's consequence): each output's first, a line each, the
    values' first; None when none. The run of an output compared with the
    unsharded step ("layer", "user_loss") goes to runs[name][(dp_rank, rank)]
    (runs[name][None]: the unsharded run's), compared once every rank and the
    unsharded run are done. With `redraw` (the leak property's run, cpsim.leak)
    the case's inputs at its positions are drawn again and only those runs are
    kept, in runs[name][(dp_rank, rank)]."""
    case = RankCase(golden, rank, dp, dp_rank, unsharded, mesh, redraw)
    who = _who(rank, dp_rank, case.cp, dp, mesh)
    if unsharded or redraw is not None:  # a run of the step's own outputs only: nothing else is compared
        out = step(case)
        for name, kind in UNSHARDED_OUTPUTS.items():
            if name in runs:
                runs[name][None if unsharded else (dp_rank, rank)] = unsharded_run(
                    kind, case, out.get(name) if isinstance(out, dict) else None,
                    "the unsharded run" if unsharded else who)
        return None
    out = step(case)
    if not isinstance(out, dict):
        raise TypeError("the step returned %s, not a dict of outputs" % type(out).__name__)
    unknown = sorted(set(out) - set(OUTPUTS))
    if unknown:
        raise ValueError("the step returned %s; cpsim.torch.check compares %s" % (unknown, list(OUTPUTS)))
    side = Side(golden, case, rank, who, runs, dp_rank)
    for o in OUTPUT_TABLE:
        if o.name in out:
            side.output(o.name, out[o.name])
    return side.first()


def first_differences(per_rank):
    """Every rank's differences (each output's first), the ranks where a value
    differs before those where only gradients do (a wrong gradient often
    follows from a wrong value, maybe another rank's); '' when every rank
    agrees."""
    found = sorted((f[0], r, f[1]) for r, f in enumerate(per_rank) if f)
    return "\n".join(why for _, _, why in found)
