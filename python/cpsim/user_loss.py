"""The "user_loss" output of cpsim.torch.check: a step's own labels, loss mask
and loss function on this rank's shard, checked end to end against the same
step run unsharded on a group of one (as "layer" is): whatever the loss's
convention (token mean over every rank, per-document mean, sum), the sharded
run must give the unsharded run's labels at each rank's positions, its value
(every rank, or summed over the CP ranks) and its gradient to the logits."""
import functools
import re

import torch

from cpsim.compare import RUNS, close, difference, known_factor, ratio, rms
from cpsim.mesh import ranks_with, world_rank

VALUES = ("global", "share")
GRADIENTS = ("sum", "mean")


class Loss:
    """What a step returns as "user_loss": its own loss on this rank.

    value: the scalar its training step backpropagates on this rank.
    logits: the leaf it was computed from, [B, L, V] at this rank's positions
        (case.activation("logits", V): the same global tensor on every rank and
        in the unsharded run).
    labels, loss_mask: optional [B, L] tensors of this rank (its next-token
        targets; its mask of the tokens that count), compared exactly with the
        unsharded run's at the same positions. At the CP padding (positions from
        case.S, which the unsharded run does not have) a position must be left
        out: its label `ignore_index` or its mask 0.
    value_is: "global" (every rank's value is the whole loss: reduced across
        the ranks, dp x cp with replicas) or "share" (the ranks' values sum to
        the whole loss).
    gradient: the convention of the gradients the ranks' backwards give (the
        logits' .grad where the step called backward itself, else value's
        gradient, which cpsim takes). "sum"
        (the ranks' gradients add up to the unsharded loss's: each rank's
        gradient to its logits is the unsharded one at its rows and positions)
        or "mean" (a reduction that averages over the dp x cp ranks follows:
        each rank's is dp x cp times it).
    With check(dp=D) each replica computes its loss on its own rows
    (case.rows) and the unsharded run on every replica's rows at once: a loss
    normalised by its replica's own count differs from the whole batch's.
    tolerance: the relative error every value and gradient is held to."""

    def __init__(self, value, logits, labels=None, loss_mask=None, ignore_index=-100, value_is="global",
                 gradient="sum", tolerance=1e-6):
        if value_is not in VALUES:
            raise ValueError("cpsim.torch.Loss: value_is is one of %s, not %r" % (VALUES, value_is))
        if gradient not in GRADIENTS:
            raise ValueError("cpsim.torch.Loss: gradient is one of %s, not %r" % (GRADIENTS, gradient))
        self.value, self.logits, self.labels, self.loss_mask = value, logits, labels, loss_mask
        self.ignore_index, self.value_is, self.gradient = int(ignore_index), value_is, gradient
        self.tolerance = float(tolerance)


def loss_run(case, loss, who):
    """A Loss's value, labels, mask and gradient to the logits on one rank (or
    the unsharded run)."""
    if not isinstance(loss, Loss):
        raise TypeError("%s: \"user_loss\" must be a cpsim.torch.Loss, not %s" % (who, type(loss).__name__))
    value, logits = loss.value, loss.logits
    if not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise TypeError("%s: the Loss's value must be a one-element tensor, not %s" % (who, type(value).__name__))
    if not (isinstance(logits, torch.Tensor) and logits.requires_grad):
        raise TypeError("%s: the Loss's logits must be the leaf it was computed from (case.activation)" % who)
    grad = logits.grad  # the step's own backward left it (its graph may be freed: no retain_graph asked)
    if grad is None and value.requires_grad:
        (grad,) = torch.autograd.grad(value.reshape(()), [logits], retain_graph=True, allow_unused=True)

    def kept(t):
        return None if t is None else torch.as_tensor(t).detach().clone()
    return {"value": float(value.detach().double().reshape(())), "logits": logits.detach(),
            "grad": torch.zeros_like(logits) if grad is None else grad.detach(),
            "labels": kept(loss.labels), "loss_mask": kept(loss.loss_mask), "ignore_index": loss.ignore_index,
            "value_is": loss.value_is, "gradient": loss.gradient, "tolerance": loss.tolerance,
            "lo": case._lo, "hi": case._hi, "rows": case.rows}


def _close(a, b, tolerance):
    return close(a, b, max(tolerance, 1e-12))


def _positions(name, who, got, want, lo, S, rows):
    """'' when a rank's labels or mask equal the unsharded run's at its rows and
    positions before S, else the first that differs (row, position: the whole
    batch's)."""
    n = min(got.shape[1], max(S - lo, 0))
    want = want[rows]
    if tuple(got.shape[:1]) != tuple(want.shape[:1]) or got.dim() != want.dim():
        return "%s %s: shape %s, the unsharded run's %s" % (who, name, list(got.shape), list(want.shape))
    mine, theirs = got[:, :n].long(), want[:, lo:lo + n].long()
    wrong = (mine != theirs).nonzero()
    if not len(wrong):
        return ""
    b, t = (int(i) for i in wrong[0])
    why = "%s %s at row %d position %d: %d, the unsharded run's %d (positions that differ: %d)" % (
        who, name, rows.start + b, lo + t, int(mine[b, t]), int(theirs[b, t]), len(wrong))
    if all(int(p) == n - 1 for p in wrong[:, 1]) and lo + n < want.shape[1]:
        why += ("; only at the shard's last position: %s made after sharding lose the next rank's first token "
                "(shift the whole row, then shard)" % name)
    return why


def _left_out(who, run, S):
    """'' when every CP padding position of a rank is left out of its loss."""
    lo, hi = run["lo"], run["hi"]
    if hi <= S:
        return ""
    start = max(S - lo, 0)
    out = None
    if run["labels"] is not None:
        out = run["labels"][:, start:] == run["ignore_index"]
    if run["loss_mask"] is not None:
        masked = run["loss_mask"][:, start:] == 0
        out = masked if out is None else (out | masked)
    if out is None or bool(out.all()):
        return ""
    b, t = (int(i) for i in (~out).nonzero()[0])
    return ("%s: the CP padding at row %d position %d counts in its loss (label not %d%s): padding positions "
            "from %d on must be left out" % (who, b, lo + start + t, run["ignore_index"],
                                             ", mask not 0" if run["loss_mask"] is not None else "", S))


def _value_hint(values, whole, tolerance, dp=1):
    """Why the ranks' values are not the whole loss, where it shows."""
    if len(values) < 2:
        return ""
    if all(_close(v, values[0], tolerance) for v in values):
        return ("; every rank has this value: the ranks' parts were reduced with the wrong weights (a mean of "
                "per-rank means is the whole only when every rank counts as many tokens)")
    why = "; the ranks' values differ: each rank's own loss%s, not reduced over the %s" % (
        "" if dp == 1 else " (or its replica's)", "CP ranks" if dp == 1 else "dp x cp ranks")
    if _close(sum(values), whole, tolerance):
        why += ", or its share: they sum to it (Loss(..., value_is='share') says so, if meant)"
    return why


def _counted(run, whole, who, lo, S):
    """The first way a rank counts other tokens than the unsharded run (its
    labels or mask, its CP padding), or ''."""
    for name in ("labels", "loss_mask"):
        if (run[name] is None) != (whole[name] is None):
            return "%s gave %s %s, the unsharded run %s" % (
                who, "no" if run[name] is None else "its", name, "none" if whole[name] is None else "its")
        if run[name] is not None:
            why = _positions(name, who, run[name], whole[name], lo, S, run["rows"])
            if why:
                return why
    return _left_out(who, run, S)


def loss_differences(losses, cp, dp, S, mesh="dp,cp"):
    """Each rank's labels, mask, value and gradient to its logits against the
    unsharded run's (at the replica's rows: each replica trains on its own);
    per world rank its first difference (0 value, 1 gradient). The conventions
    are over every rank the loss is reduced over, dp x cp: a "global" value is
    the whole batch's loss on every rank, "share"s sum to it over the dp x cp
    ranks, a "mean" gradient is dp x cp times the unsharded one."""
    whole = losses[None]
    found = {}
    ranks = []  # (run, who, world rank, lo, positions before S) of each rank that gave a user_loss
    for run, who, at in ranks_with(losses, "user_loss", cp, dp, mesh, found):
        ranks.append((run, who, at, run["lo"], max(min(run["hi"], S) - run["lo"], 0)))
    world = dp * cp
    values = [run["value"] for run, *_ in ranks]
    for run, who, at, lo, _ in ranks:
        why = _counted(run, whole, who, lo, S)
        if why:
            found.setdefault(at, (0, why))
    # A value that differs where the labels or the mask do follows from them.
    counted_wrong = bool(found)
    # Which side cpsim's own loss of the unsharded run's inputs agrees with, if
    # either: worked out once, at the first difference (a case that holds needs none).
    @functools.cache
    def reference_side():
        if ranks and len(values) == world:
            return _reference_side(whole, values, ranks[0][0]["value_is"], ranks[0][0]["tolerance"])
        return "", ""
    for run, who, at, lo, n in ranks:
        tolerance, rows = run["tolerance"], run["rows"]
        if run["value_is"] == "global" and not _close(run["value"], whole["value"], tolerance):
            hint = ("; it follows from the tokens counted (the labels or mask reported)" if counted_wrong else
                    "" if reference_side()[0] == "unsharded" else _value_hint(values, whole["value"], tolerance, dp))
            found.setdefault(at, (0, "%s user_loss value %.10g, the unsharded run's %.10g%s" % (
                who, run["value"], whole["value"], hint)))
        scale = world if run["gradient"] == "mean" else 1
        want = whole["grad"][rows, lo:lo + n] * scale
        got = run["grad"][:, :n]
        where = "positions %d..%d%s" % (lo, lo + n, "" if dp == 1 else ", rows %d..%d" % (rows.start, rows.stop))
        why = difference("%s user_loss gradient to the logits (%s)" % (who, where), got,
                         want, tolerance, floor=rms(whole["grad"]) * scale, sides=RUNS)
        if why:
            why += _gradient_hint(ratio(got, want), cp, dp)
            found.setdefault(at, (1, why))
        if bool((run["grad"][:, n:] != 0).any()):
            found.setdefault(at, (1, "%s user_loss gradient to the logits is not 0 at the CP padding "
                                     "(positions from %d)" % (who, S)))
    if len(values) == world and ranks[0][0]["value_is"] == "share":
        total, tolerance = sum(values), ranks[0][0]["tolerance"]
        if not _close(total, whole["value"], tolerance):
            why = "the %s ranks' user_loss values (%s) sum to %.10g; the unsharded run's loss is %.10g" % (
                "CP" if dp == 1 else "dp x cp", ", ".join("%.6g" % v for v in values), total, whole["value"])
            if all(_close(v, whole["value"], tolerance) for v in values):
                why += "; every rank's value is the whole loss (Loss(..., value_is='global') says so)"
            found.setdefault(world_rank(0, 0, cp, dp, mesh), (0, why))
    side = reference_side()[1] if found else ""
    if side:
        at = min(found, key=lambda r: (found[r][0], r))
        found[at] = (found[at][0], found[at][1] + side)
    return found


def _reference_side(whole, values, value_is, tolerance):
    """Which side cpsim's own loss agrees with, where it has one for the
    unsharded run's inputs: the token-mean cross entropy of its logits and
    labels (its mask too), value and gradient: (the side that is off,
    "sharded" or "unsharded", and a line for the report), or ("", "") (no
    labels, no token counted, or another convention: neither side is it)."""
    if whole["labels"] is None or tuple(whole["labels"].shape) != tuple(whole["logits"].shape[:-1]):
        return "", ""
    logits = whole["logits"].double().detach().requires_grad_(True)
    counted = whole["labels"] != whole["ignore_index"]
    if whole["loss_mask"] is not None:
        counted = counted & (whole["loss_mask"] != 0)
    count = int(counted.sum())
    if count == 0:
        return "", ""
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                  whole["labels"].reshape(-1).long().clamp(min=0), reduction="none")
    mean = (per_token * counted.reshape(-1)).sum() / count
    (grad,) = torch.autograd.grad(mean, [logits])
    mean = float(mean.detach())
    mine = "cpsim's own token-mean cross entropy of the unsharded run's logits and labels (%.10g)" % mean
    sharded = values[0] if value_is == "global" else sum(values)
    if _close(whole["value"], mean, tolerance):
        if not _close(sharded, mean, tolerance):
            return "sharded", "\n  %s is the unsharded run's value, not the sharded run's: the sharded run is off" % (
                mine)
        if difference("", whole["grad"].double(), grad, tolerance, floor=rms(grad)):
            return "unsharded", ("\n  %s is the unsharded run's value, but its gradient to the logits is not the "
                                 "unsharded run's: the unsharded run's backward is off" % mine)
        return "sharded", "\n  %s is the unsharded run's, value and gradient: the sharded run is off" % mine
    if _close(sharded, mean, tolerance):
        return "unsharded", ("\n  %s is the sharded run's value, not the unsharded run's: the unsharded run (the step "
                             "on a group of one, its path without CP) is off" % mine)
    return "", ""


def _gradient_hint(r, cp, dp):
    """What a gradient off by a known factor of the unsharded one means."""
    known = known_factor(r, cp, dp, 1e-3)
    if known is None:
        return ""
    factor, names, inverse = known
    if inverse:
        return ("\n  it is 1/%s of the unsharded gradient at its positions: the loss was divided by %s once too "
                "often (a mean over the ranks of a loss already reduced)" % (names, re.sub(r" \(\d+\)", "", names)))
    if dp == 1:
        return ("\n  it is cp (%d) times the unsharded gradient at its positions: an all_reduce with "
                "autograd (torch.distributed.nn.all_reduce) sums the ranks' upstream gradients into "
                "each; all_reduce a detached count or sum instead (or Loss(..., gradient='mean') if "
                "a reduction that averages over the ranks follows)" % cp)
    return ("\n  it is %s times the unsharded gradient at its positions: a loss divided by the count of "
            "fewer ranks than its reduction sums over, or summed over ranks with autograd "
            "(Loss(..., gradient='mean') if a reduction that averages over the dp x cp ranks follows)" % names)
