"""The leak property of cpsim.torch.check, which needs no reference: documents
never see each other and padding never counts. A case whose step returns a
"layer", "user_loss" or "train" output is run again (sharded, every rank) with
one document's inputs drawn again, and once more with the padding's: every
other document's per-position results (a layer's output and input gradients,
a loss's labels and gradient to its logits, a training step's `positions`)
must stay as they were; with the padding redrawn, every result of a loss or a
training step (its value, the gradients, the parameters after the step) must. A bug in the step and in its
unsharded run alike (attention across documents, padding counted in the loss)
agrees with itself, and shows here."""
import collections

import torch

from cpsim.compare import rms
from cpsim.layer import drawn, generator
from cpsim.mesh import who as _who, world_rank

# mask: [B, P] bool, the positions whose inputs are drawn again; what: how a
# report names them; name: the draws' own name (new numbers for each redraw).
Redraw = collections.namedtuple("Redraw", "mask what name")


def _real(golden):
    """[B, P] bool: the positions that are a document's real token."""
    doc, pad = golden.reference["doc_ids"], golden.reference["padding"]
    B, P = doc.shape
    S = pad.shape[-1]
    real = torch.zeros(B, P, dtype=torch.bool)
    real[:, :S] = ~pad.reshape(B, S).bool() & (doc[:, :S] > 0)
    return real


def redraws(golden):
    """A case's redraws: one document's real tokens (the first document of a
    row that has another after it, whose tokens could see it; else the first
    document), and the padding (the raw batch's and the CP padding), where the
    case has them."""
    doc = golden.reference["doc_ids"]
    B, P = doc.shape
    real = _real(golden)
    chosen = None
    for b in range(B):
        for d in sorted(set(int(x) for x in doc[b][real[b]])):
            mine = real[b] & (doc[b] == d)
            last = int(mine.nonzero().max())
            after = bool((real[b, last + 1:] & (doc[b, last + 1:] != d)).any())
            if chosen is None or (after and not chosen[2]):
                chosen = (b, d, after)
    out = []
    if chosen is not None:
        b, d, _ = chosen
        mask = torch.zeros(B, P, dtype=torch.bool)
        mask[b] = real[b] & (doc[b] == d)
        at = mask[b].nonzero()[:, 0]
        out.append(Redraw(mask, "document %d of row %d (positions %d..%d)" % (d, b, int(at.min()), int(at.max()) + 1),
                          "document"))
    if bool((~real).any()):
        out.append(Redraw(~real, "the padding's inputs (every position that is no document's real token)",
                          "padding"))
    return out


def redrawn_batch(batch, redraw, seed, S):
    """The raw batch with the redraw's tokens drawn again (input_ids, and the
    labels that are not -100): other ids of the batch's range."""
    out = {k: v.clone() for k, v in batch.items()}
    mask = redraw.mask[:, :S]
    g = generator(seed, "redrawn.%s.ids" % redraw.name)
    ids = out.get("input_ids")
    top = max(int(ids.max()), 0) + 2 if ids is not None and ids.numel() else 2  # ids 0..max + 1
    for key in ("input_ids", "labels"):
        if key not in out:
            continue
        ids = out[key]
        m = mask.reshape(ids.shape) if ids.numel() == mask.numel() else None
        if m is None:
            continue
        if key == "labels":
            m = m & (ids != -100)
        shift = torch.randint(1, top, ids.shape, generator=g, dtype=ids.dtype)
        ids[m] = (ids[m] + shift[m]) % top
    return out


def redrawn_activation(whole, redraw, seed, name):
    """An activation [B, P, ...] with the redraw's positions drawn again."""
    again = drawn(seed, "redrawn.%s.%s" % (redraw.name, name), tuple(whole.shape), whole.dtype)
    mask = redraw.mask.reshape(redraw.mask.shape + (1,) * (whole.dim() - 2))
    return torch.where(mask, again, whole)


def _per_position(name, run, padding=False):
    """A run's results at its positions: {what: [b, L, ...] tensor}. With the
    padding redrawn, a layer's output only: the upstream gradient cpsim draws
    for it is not 0 at the padding, so a padding position's output (which may
    read the real tokens before it, in its document's padded slot) sends a
    gradient back to them that depends on the padding's own values, rightly."""
    if name == "layer":
        out = {"layer output": run["output"]}
        if not padding:
            out.update({"layer gradient of %s" % n: g for n, g in run["grads"].items()
                        if not n.startswith("parameter ")})
        return out
    if name == "user_loss":
        out = {"user_loss gradient to the logits": run["grad"]}
        out.update({"user_loss %s" % k: run[k] for k in ("labels", "loss_mask") if run[k] is not None})
        return out
    return {"train %s" % n: t for n, t in run["positions"].items()}


def _whole_results(name, run):
    """A run's results that every document reaches and the padding must not:
    {what: tensor}. (A layer has none: the upstream gradient cpsim draws for it
    is not 0 at the padding, so its parameters' gradients read the padding's
    outputs, rightly.)"""
    if name == "layer":
        return {}
    if name == "user_loss":
        return {"user_loss value": torch.tensor(run["value"], dtype=torch.float64)}
    out = {"train loss": torch.tensor(run["loss"], dtype=torch.float64)}
    out.update({"train " + n: t for n, t in list(run["grads"].items()) + list(run["values"].items()) +
                list(run["tensors"].items()) if t is not None})
    return out


def _moved(new, old, tolerance):
    """Where new is not old: per element beyond `tolerance` times old's RMS (bit
    for bit for integers), a NaN or an inf on one side only included."""
    if new.shape != old.shape:
        return None
    if not old.is_floating_point():
        return new != old
    n, o = new.double(), old.double()
    # `not |n - o| <= bound`: a NaN on either side moved, unless both are NaN or equal (inf)
    return ~((n == o) | ((n - o).abs() <= tolerance * max(rms(o), 1e-300)) | (n.isnan() & o.isnan()))


def leak_differences(name, before, after, redraw, golden, cp, dp, mesh):
    """Each rank's results after the redraw against its own before it: every
    position of a document not redrawn, and with the padding redrawn every
    result; {world rank: (0, why)}."""
    doc = golden.reference["doc_ids"]
    S = golden.reference["padding"].shape[-1]
    kept = _real(golden) & ~redraw.mask
    padding = redraw.name == "padding"
    found = {}
    for dp_rank in range(dp):
        for rank in range(cp):
            old, new = before.get((dp_rank, rank)), after.get((dp_rank, rank))
            if old is None or new is None:
                continue
            who, at = _who(rank, dp_rank, cp, dp, mesh), world_rank(rank, dp_rank, cp, dp, mesh)
            rows, lo = old["rows"], old["lo"]
            n = max(min(old["hi"], S) - lo, 0)
            mine = kept[rows, lo:lo + n]
            tolerance = old["tolerance"]
            for what, t in _per_position(name, old, padding).items():
                u = _per_position(name, new, padding).get(what)
                if u is None:
                    continue
                moved = _moved(u[:, :n], t[:, :n], tolerance)
                if moved is None:
                    continue
                moved = (moved.flatten(2).any(-1) if moved.dim() > 2 else moved) & mine
                if bool(moved.any()):
                    b, p = (int(i) for i in moved.nonzero()[0])
                    row = rows.start + b
                    found.setdefault(at, (0, "%s %s changed at row %d position %d (document %d) when %s %s: %s" % (
                        who, what, row, lo + p, int(doc[row, lo + p]),
                        redraw.what, "were drawn again" if padding else "was drawn again",
                        "padding must never count (a padding token's label counted, its value read)" if padding
                        else "documents must not see each other (attention, a convolution or a state across a "
                             "document boundary)")))
            if not padding or at in found:
                continue
            for what, t in _whole_results(name, old).items():
                u = _whole_results(name, new).get(what)
                moved = None if u is None else _moved(u, t, tolerance)
                if moved is not None and bool(moved.any()):
                    found[at] = (0, "%s %s changed when %s were drawn again: padding must never count (a "
                                    "padding token's label counted, its value read)" % (who, what, redraw.what))
                    break
    return found
