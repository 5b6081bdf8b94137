"""How the harness compares a value with its expected one: bitwise, or within a
relative RMSE; a NaN or an inf on one side only is always a difference (the
comparison is `not err <= tolerance`, which fails on NaN)."""
import math

import torch


def rms(t):
    """The root mean square of a tensor's finite values (0 when it has none): the
    scale a comparison is held to."""
    t = t.detach().double()
    t = t[t.isfinite()]
    return t.square().mean().sqrt().item() if t.numel() else 0.0


def ratio(got, want):
    """got as a multiple of want (least squares), or None when want is 0."""
    den = float((want.double() * want.double()).sum())
    return float((got.double() * want.double()).sum()) / den if den > 0 else None


def known_factor(r, cp, dp, within):
    """The group size a ratio r is (or 1 over), within `within` relative:
    (factor, its names, whether r is 1 / factor), or None. The sizes are dp,
    cp and dp x cp, where each is more than 1 (equal ones named together)."""
    if r is None:
        return None
    known = [(f, n) for f, n, given in ((dp, "dp (%d)" % dp, dp > 1), (cp, "cp (%d)" % cp, cp > 1),
                                        (dp * cp, "dp x cp (%d)" % (dp * cp), dp > 1 and cp > 1)) if given]
    for factor in sorted(set(f for f, _ in known)):
        names = " or ".join(n for f, n in known if f == factor)
        if abs(r - factor) <= within * factor:
            return factor, names, False
        if abs(r - 1.0 / factor) <= within / factor:
            return factor, names, True
    return None


def close(a, b, tolerance):
    """Whether the number a is b within `tolerance` relative to b (|b| at least
    1e-12); a NaN on either side is never close."""
    return abs(a - b) <= tolerance * max(abs(b), 1e-12)


def _nonfinite_mismatch(got, want):
    """The first position where one side holds a NaN or an inf that the other does
    not (the same non-finite value on both agrees), as a list; None when none."""
    if not (got.is_floating_point() or want.is_floating_point()):
        return None
    g, w = got.double(), want.double()
    off = (~(g.isfinite() & w.isfinite()) & ~((g == w) | (g.isnan() & w.isnan()))).nonzero()
    return [int(i) for i in off[0]] if len(off) else None


# How a report names the two sides: cpsim's expected value, or two runs of the
# user's own code (layer, user_loss: the sharded run against the unsharded one).
EXPECTED = ("", "expected ")
RUNS = ("sharded ", "unsharded ")


def difference(name, got, want, tolerance, scale=None, floor=0.0, sides=EXPECTED):
    """'' when got matches want (bitwise, or within the relative RMSE: rms(want - got)
    over rms(want), or over rms(scale) for a sum held to its terms; over `floor`
    where that is larger and finite), else why not, each side named by `sides`
    (EXPECTED: "0.3, expected 0.4"; RUNS: "sharded 0.3, unsharded 0.4"). A NaN
    or an inf on one side only is always a difference."""
    mine, other = sides
    if not isinstance(got, torch.Tensor):
        try:
            got = torch.as_tensor(got)
        except Exception as e:  # noqa: BLE001 - reported as the step's mistake
            return "%s: not a tensor (%s)" % (name, e)
    got = got.detach()
    if tuple(got.shape) != tuple(want.shape):
        return "%s: shape %s%s, %s%s" % (name, mine, list(got.shape), other, list(want.shape))
    bad = _nonfinite_mismatch(got, want) if got.dtype != torch.bool else None
    if bad is not None:
        return "%s: %s%r at %s, %s%r (a NaN or an inf on one side only)" % (
            name, mine, got[tuple(bad)].item(), bad, other, want[tuple(bad)].item())
    if want.is_floating_point() and tolerance > 0:
        w, g = want.double(), got.double()
        s = w if scale is None else scale.double()
        keep = w.isfinite() & g.isfinite()  # the same non-finite value on both sides agrees
        d = torch.where(keep, w - g, torch.zeros_like(w))
        den = torch.where(keep & s.isfinite(), s, torch.zeros_like(s)).square().mean().sqrt().item() if w.numel() else 0.0
        if math.isfinite(floor) and floor > den:
            den = floor
        num = d.square().mean().sqrt().item() if w.numel() else 0.0
        err = 0.0 if num == 0 else (float("inf") if not den > 0 else num / den)
        if not err <= tolerance:
            off = (~((w - g).abs() <= tolerance * max(den, 1e-300))).nonzero()
            found = len(off) > 0  # (a 0-d tensor's index is [])
            at = [int(i) for i in off[0]] if found else []
            return "%s: %s %.3g > %.3g; first differs at %s: %s%r, %s%r" % (
                name, "relative RMSE" if scale is None else "RMSE relative to the summed terms", err, tolerance,
                at, mine, g[tuple(at)].item() if found else None, other, w[tuple(at)].item() if found else None)
        return ""
    g, w = got, want
    if got.dtype != want.dtype and not want.is_floating_point():
        # Integers of another width (or bools) agree by value; a floating value
        # only where it is that integer exactly (2.7 is not 2).
        g, w = (got.double(), want.double()) if got.is_floating_point() else (got.to(want.dtype), want)
    if g.dtype != w.dtype:
        wrong = None
    elif g.is_floating_point():  # bit for bit, a NaN on both sides agreeing (NaN != NaN)
        wrong = ((g != w) & ~(g.isnan() & w.isnan())).nonzero()
    else:
        wrong = (g != w).nonzero()
    if wrong is None:
        return "%s: dtype %s%s, %s%s" % (name, mine, got.dtype, other, want.dtype)
    if len(wrong):
        at = tuple(int(i) for i in wrong[0])
        return "%s: %d wrong elements, first at %s: %s%r, %s%r" % (
            name, len(wrong), list(at), mine, g[at].item(), other, want[at].item())
    return ""
