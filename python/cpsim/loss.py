"""When a step's loss differs from cpsim's (the token mean over every CP rank's
targets), which other convention it is: the conventions CP code ships by
mistake, each computed from the case's own logits and expected targets, and
named when the step's value is one of them."""
import torch
import torch.nn.functional as F

from cpsim.compare import close

IGNORE = -100  # the targets' ignore index

# (name, value of rank r from every rank's (sum, count)): what a report calls it.
_CONVENTIONS = (
    ("the mean of per-rank means (each rank's own token mean, averaged over the CP ranks)",
     lambda sums, counts, r: sum(s / max(c, 1) for s, c in zip(sums, counts)) / len(sums)),
    ("this rank's own token mean (its targets only, not reduced across the CP ranks)",
     lambda sums, counts, r: sums[r] / max(counts[r], 1)),
    ("the sum of every rank's per-token losses, not divided by the count of targets",
     lambda sums, counts, r: sum(sums)),
    ("this rank's own sum of per-token losses",
     lambda sums, counts, r: sums[r]),
    ("the sum over every rank divided by this rank's own count of targets",
     lambda sums, counts, r: sum(sums) / max(counts[r], 1)),
)


def _sums_and_counts(golden):
    """Each CP rank's sum of per-token cross entropies and count of targets, in
    float64, from the case's logits and each rank's expected targets."""
    logits = golden.inputs["logits"].double()
    sums, counts = [], []
    for r in range(golden.cp):
        lo, hi = golden.cuts[r], golden.cuts[r + 1]
        targets = golden.rank(r)["targets"].reshape(-1)
        mine = logits[:, lo:hi].reshape(-1, logits.shape[-1])
        valid = targets != IGNORE
        per_token = F.cross_entropy(mine, targets.clamp(min=0), reduction="none")
        sums.append(float(per_token[valid].sum()))
        counts.append(int(valid.sum()))
    return sums, counts


def convention(golden, rank, got, tolerance):
    """The name of the convention the step's loss `got` on CP rank `rank` follows,
    when it is one of the others (within `tolerance` relative, at least 1e-9),
    else ''."""
    try:
        value = float(got.detach().double().reshape(-1)[0]) if isinstance(got, torch.Tensor) else float(got)
    except (TypeError, ValueError, IndexError):
        return ""
    sums, counts = _sums_and_counts(golden)
    reference = sum(sums) / max(sum(counts), 1)
    near = max(float(tolerance) * 4, 1e-9)
    for name, of in _CONVENTIONS:
        candidate = of(sums, counts, rank)
        if not close(candidate, reference, near) and close(value, candidate, near):
            return name
    return ""


def hint(golden, rank, got, tolerance):
    """The line a loss difference gets when its convention is known."""
    name = convention(golden, rank, got, tolerance)
    if not name:
        return ""
    return ("\n  the step's loss is %s; cpsim's is the token mean over every rank's targets (the sums of per-token "
            "losses and the counts of targets, each all-reduced: sum / count)" % name)
