"""The "train" output of cpsim.torch.check: a step's whole training step (its
forward, loss, backward, gradient reduction, clipping, optimizer step, buffer
updates) on this rank, against the same step run unsharded on a group of one
(dp = cp = 1) holding the rows of every replica, from the same weights: the
loss it reports, every parameter's gradient as its reduction left it, every
parameter, buffer and optimizer state after the step, and every replica
against every other (identical after a step)."""
import torch

from cpsim.compare import RUNS, close, difference, known_factor, ratio, rms
from cpsim.mesh import ranks_with

# How many differing tensors one report lists before it counts the rest.
LISTED = 8


class TrainStep:
    """What a step returns as "train": its training step, done on this rank.

    module: the torch.nn.Module after the step (its parameters and buffers are
        compared; a DTensor's whole value, full_tensor(), so FSDP2 fits).
    loss: the loss the step reports (logs): a number or a one-element tensor,
        the whole batch's loss (every replica's rows) on every rank.
    optimizer: optionally the torch.optim.Optimizer the step stepped: every
        tensor of its state after the step compared (Adam's moments, ...).
    grads: compare every parameter's .grad as the step left it (after its
        reduction over the ranks and its clipping); False when the step frees
        them (zero_grad(set_to_none=True) after the update).
    tensors: {name: tensor} anything else the step produces that every rank
        holds whole (a gradient norm, a token count, a routing bias): compared
        on every rank with the unsharded run's.
    positions: {name: [b, L, ...] tensor} per-position results of this rank
        (its replica's rows, its positions): compared at them.
    tolerance: the relative RMSE every comparison is held to (rms(unsharded -
        sharded) / rms(unsharded), a tensor's RMS at least that of its kind:
        all gradients, all parameters); replicas are compared bit for bit.

    The unsharded run calls the same step with case.cp == case.dp == 1 and
    case.rows every row: a step builds its module from case.generator(...) (the
    same weights on every rank and in that run), never from the process's
    default generator, which the rank threads share."""

    def __init__(self, module, loss, optimizer=None, grads=True, tensors=None, positions=None, tolerance=1e-9):
        if not isinstance(module, torch.nn.Module):
            raise TypeError("cpsim.torch.TrainStep: module is a torch.nn.Module, not %s" % type(module).__name__)
        self.module, self.loss, self.optimizer, self.grads = module, loss, optimizer, bool(grads)
        self.tensors, self.positions = dict(tensors or {}), dict(positions or {})
        self.tolerance = float(tolerance)


def _whole(t):
    """A tensor's whole value on this rank (a DTensor's gathered: a collective
    every rank makes in the same order), detached."""
    full = getattr(t, "full_tensor", None)
    if full is not None:
        t = full()
    return t.detach().clone()


def train_run(case, step, who):
    """A TrainStep's results on one rank (or the unsharded run)."""
    if not isinstance(step, TrainStep):
        raise TypeError("%s: \"train\" must be a cpsim.torch.TrainStep, not %s" % (who, type(step).__name__))
    loss = step.loss
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise TypeError("%s: the TrainStep's loss has %d elements, not one" % (who, loss.numel()))
        loss = _whole(loss).double().reshape(())
    named = dict(step.module.named_parameters())
    values = {"parameter " + n: _whole(p) for n, p in named.items()}
    values.update({"buffer " + n: _whole(b) for n, b in step.module.named_buffers()})
    grads = {}
    if step.grads:
        for n, p in named.items():
            grads["gradient of " + n] = None if p.grad is None else _whole(p.grad)
    if step.optimizer is not None:
        name_of = {id(p): n for n, p in named.items()}
        for p, state in step.optimizer.state.items():
            for k, v in sorted(state.items()):
                if isinstance(v, torch.Tensor) and k != "step":  # a step count is the same everywhere
                    values["optimizer %s of %s" % (k, name_of.get(id(p), "?"))] = _whole(v)
    return {"loss": float(loss), "values": values, "grads": grads,
            "tensors": {n: _whole(torch.as_tensor(t)) for n, t in step.tensors.items()},
            "positions": {n: t.detach().clone() for n, t in step.positions.items()},
            "tolerance": step.tolerance, "lo": case._lo, "hi": case._hi, "rows": case.rows}


def _factor(r, cp, dp):
    """A known factor a gradient or a loss is off by, named; '' for none."""
    known = known_factor(r, cp, dp, 1e-6)
    if not known:
        return ""
    factor, names, inverse = known
    return " (%s the unsharded: off by %s)" % ("1/%s of" % _number(factor) if inverse else "%s times" % _number(r), names)


def _number(x):
    return ("%.6g" % x).rstrip("0").rstrip(".") if "." in "%.6g" % x else "%.6g" % x


def _compared(kind, got, want, tolerance, floor, cp, dp):
    """(error, why) of one tensor against the unsharded run's, or None (neither
    has one: a parameter no path reaches has no gradient in either run)."""
    if got is None and want is None:
        return None
    if got is None:
        got = torch.zeros_like(want)
    if want is None:
        want = torch.zeros_like(got)
    why = difference(kind, got, want, tolerance, floor=floor, sides=RUNS)
    if not why:
        return None
    err = float((got.double() - want.double()).pow(2).mean().sqrt()) if got.shape == want.shape else float("inf")
    scale = max(rms(want), floor)
    if got.shape == want.shape and want.is_floating_point():
        # A known factor, named where got is that multiple of want within the tolerance.
        r = ratio(got, want)
        named = _factor(r, cp, dp)
        if named and not difference(kind, got.double(), want.double() * r, tolerance, floor=floor * abs(r)):
            why += named
    return (err / scale if scale > 0 else float("inf"), why)


def _listed(header, groups):
    """A header and every difference found, group by group (the step's values:
    its loss, tensors and per-position results; the gradients; what the update
    left), each worst first: LISTED of them, then a count."""
    found = [f for g in groups for f in sorted(g, key=lambda f: -f[0] if f[0] == f[0] else float("-inf"))]
    lines = [why for _, why in found[:LISTED]]
    if len(found) > LISTED:
        lines.append("and %d more" % (len(found) - LISTED))
    return header + "".join("\n  " + line for line in lines)


def _first_index(a, b):
    """The first index where two tensors of one shape differ, and their values."""
    at = (a != b) & ~(torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a != b
    where = at.nonzero()
    index = tuple(int(i) for i in where[0]) if len(where) else ()
    return index, a[index].item() if a.dim() else a.item(), b[index].item() if b.dim() else b.item()


def _values_differing(run, whole, S, cp, dp):
    """A rank's values against the unsharded run's, as (error, why): the loss
    it reported, its tensors, its per-position results at its rows and
    positions."""
    tolerance, lines = whole["tolerance"], []
    if not close(run["loss"], whole["loss"], max(tolerance, 1e-12)):
        lines.append((float("inf"), "the loss reported %.10g, the unsharded run's %.10g%s" % (
            run["loss"], whole["loss"], _factor(run["loss"] / whole["loss"] if whole["loss"] else None, cp, dp))))
    for name, want in whole["tensors"].items():
        got = run["tensors"].get(name)
        d = ((float("inf"), "no tensor %s (the unsharded run gave one)" % name) if got is None else
             _compared(name, got, want, tolerance, 0.0, cp, dp))
        if d:
            lines.append(d)
    rows, lo, n = run["rows"], run["lo"], max(min(run["hi"], S) - run["lo"], 0)
    for name, want in whole["positions"].items():
        got = run["positions"].get(name)
        d = ((float("inf"), "no %s (the unsharded run gave it)" % name) if got is None else
             _compared("%s (positions %d..%d, rows %d..%d)" % (name, lo, lo + n, rows.start, rows.stop),
                       got[:, :n], want[rows, lo:lo + n], tolerance, rms(want), cp, dp))
        if d:
            lines.append(d)
    return lines


def train_differences(runs, cp, dp, S, mesh="dp,cp"):
    """Each rank's step against the unsharded run's: the loss reported, every
    gradient, every parameter, buffer and optimizer state after the step, the
    tensors and per-position results; then every rank's values against world
    rank 0's (replicas identical). Per world rank its first difference: 0 for
    the loss or a value, 1 where only gradients differ."""
    whole = runs[None]
    tolerance = whole["tolerance"]
    grad_floor = rms(torch.cat([g.reshape(-1).double() for g in whole["grads"].values() if g is not None] or
                               [torch.zeros(1)]))
    value_floor = {}
    for name, v in whole["values"].items():
        kind = name.split(" ", 1)[0]
        value_floor.setdefault(kind, []).append(v.reshape(-1).double())
    value_floor = {k: rms(torch.cat(v)) for k, v in value_floor.items()}
    found, reported = {}, {}  # reported: each report's body, the first rank that gave it
    first = None  # (world rank, its run): the replica every other is held to, bit for bit
    for run, who, at in ranks_with(runs, "train", cp, dp, mesh, found):
        lines = _values_differing(run, whole, S, cp, dp)
        phase = 0 if lines else 1
        grads = [d for d in (_compared(name, run["grads"].get(name), want, tolerance, grad_floor, cp, dp)
                             for name, want in whole["grads"].items()) if d]
        values = [d for d in (_compared(name + " after the step", run["values"].get(name), want, tolerance,
                                        value_floor[name.split(" ", 1)[0]], cp, dp)
                              for name, want in whole["values"].items()) if d]
        missing = sorted(set(whole["values"]) - set(run["values"]))
        hint = ""
        if values and not grads:
            phase = 0  # the update is wrong where every gradient is right
            if whole["grads"] and any(why.startswith("parameter ") for _, why in values):
                hint = ("\n  every gradient, as the step's reduction left it, is the unsharded run's: the "
                        "update did not use them (an optimizer step before the reduction, or on gradients "
                        "changed after it)")
        if lines or grads or values or missing:
            groups = [lines, grads, values + [(float("inf"), "no %s (the unsharded run has it)" % m)
                                              for m in missing]]
            parts = [f for g in groups for f in g]
            body = _listed("", groups) + hint
            if body in reported:  # the same differences as a rank before it: named once
                found[at] = (phase, "%s train: the same %d differences as %s" % (who, len(parts),
                                                                               reported[body]))
            else:
                reported[body] = who
                found[at] = (phase, "%s train: %d of the step's results differ from the unsharded run's (values, "
                                    "gradients, then the update, each worst first)%s" % (who, len(parts), body))
            continue
        if first is None:
            first = (at, who, run)
            continue
        why = _drift(first, who, run)
        if why:
            found[at] = (0, why)
    hint = _reduction_hint(runs, cp, dp, mesh, tolerance, grad_floor)
    if hint and any("\n  gradient of " in why for _, why in found.values()):
        at = min(found, key=lambda r: (found[r][0], r))
        found[at] = (found[at][0], found[at][1] + hint)
    return found


def _reduction_hint(runs, cp, dp, mesh, tolerance, floor):
    """Which group the gradient reduction left out, where the ranks' gradients
    show it: every rank of a replica must hold the same reduced gradients, and
    every replica too."""
    grads = {(d, r): runs[(d, r)]["grads"] for d in range(dp) for r in range(cp) if runs.get((d, r))}
    if len(grads) != dp * cp or all(g is None for g in grads[(0, 0)].values()):
        return ""

    def same(a, b):
        return all(difference(n, b[n] if b.get(n) is not None else torch.zeros_like(g),
                              g if g is not None else torch.zeros_like(b[n]), tolerance, floor=floor) == ""
                   for n, g in a.items() if g is not None or b.get(n) is not None)
    within = all(same(grads[(d, r)], grads[(d, 0)]) for d in range(dp) for r in range(1, cp))
    across = all(same(grads[(d, r)], grads[(0, r)]) for d in range(1, dp) for r in range(cp))
    if cp > 1 and not within and across:
        return ("\n  the CP ranks of a replica hold different gradients%s: the reduction left out CP (each CP rank's "
                "gradient is its own tokens' part: a DDP or FSDP mesh over DP only, say)" % (
                    ", the replicas the same ones" if dp > 1 else ""))
    if dp > 1 and within and not across:
        return ("\n  the replicas hold different gradients, the CP ranks of each the same ones: the reduction left "
                "out DP (reduced over CP only)")
    return ""


def _drift(first, who, run):
    """Where a replica's values after the step are not bit for bit world rank 0's."""
    at0, who0, run0 = first
    for name, v0 in run0["values"].items():
        v = run["values"].get(name)
        if v is None or v.shape != v0.shape or v.dtype != v0.dtype:
            return "%s train: %s is %s, %s's is %s (replicas must hold the same after a step)" % (
                who, name, None if v is None else list(v.shape), who0, list(v0.shape))
        if not torch.equal(v, v0):
            index, mine, theirs = _first_index(v, v0)
            return ("%s train: %s after the step differs from %s's at %s: %r, %r (replicas must be identical after "
                    "a step; both are within the tolerance of the unsharded run)" % (
                        who, name, who0, list(index), mine, theirs))
    return ""
