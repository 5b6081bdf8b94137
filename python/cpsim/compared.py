"""How each output of cpsim.torch.check is compared: one entry per output of
cpsim.outputs.OUTPUT_TABLE (the text), in COMPARED (the comparison). A tensor
output names its expected value's key and, when it has a backward, the inputs
its gradients go to, the upstream gradient and the expected gradients' keys; a
structured output (the batch, per-row lists, the step's own module or loss)
names a function of its own. run_rank walks the table in its order, which is
the order every rank's backwards (and their collectives) run in.

Adding an output is one row of OUTPUT_TABLE and one entry here (a test holds
the two sets equal)."""
import collections

import torch

from cpsim.compare import difference as _difference, rms as _rms
from cpsim.layer import layer_differences, layer_run
from cpsim.loss import hint as _loss_hint
from cpsim.outputs import CP_CONTEXT_FIELDS, RECURRENCE_INPUTS
from cpsim.train import train_differences, train_run
from cpsim.upstream import laid_out, layout_for
from cpsim.user_loss import loss_differences, loss_run

# A tensor output: `key`, its expected value (this rank's file, or the whole
# case's reference with `reference`); with `leaves` (case -> the inputs its
# gradients go to), `upstream` (side -> the upstream gradient) and `grads` (the
# expected gradients' keys), its backward; `floors` (side -> one floor per
# gradient) and `floor` (side -> the value's) hold small values to a larger
# scale. A structured output: `compare(side, value)` does all of it.
# An output compared with the step itself run unsharded (on a group of one):
# `unsharded` says how each one's run on a rank is taken (run(case, output,
# who)), how the runs are compared (differences(runs, cp, dp, S, mesh) ->
# {world rank: (phase, why)}) and what its backward is called in reports.
Compared = collections.namedtuple("Compared", "key reference leaves upstream grads floors floor compare unsharded",
                                  defaults=(None,) * 9)
Unsharded = collections.namedtuple("Unsharded", "run differences noun")


class Side:
    """One rank's comparison of one case: the differences found, values first."""

    def __init__(self, golden, case, rank, who, runs, dp_rank):
        self.golden, self.case, self.rank, self.who, self.runs, self.dp_rank = golden, case, rank, who, runs, dp_rank
        self.mine = golden.rank(rank)
        self.file = "rank_%d.safetensors" % rank
        self.lo, self.hi = golden.cuts[rank], golden.cuts[rank + 1]
        self.found, self.found_backward = [], []
        self.firsts = []  # (phase, why): each output's first difference, in the table's order

    def against(self, name, got, key, file=None, want=None, floor=0.0):
        file = file or self.file
        want = self.mine[key] if want is None else want
        entry = self.golden.manifest["files"][file][key]
        scale = self.mine[entry["scale"]] if entry.get("scale") and file == self.file else None
        why = _difference("%s %s" % (self.who, name), got, want, self.golden.tolerance(file, key), scale, floor)
        if why:
            self.found.append(why)

    def rms(self, *keys):
        return max(_rms(self.golden.reference[k]) for k in keys)

    def backward(self, name, output, leaves, upstream, expected, floors=None):
        """This rank's part of the output's backward (collectives included)."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            # No path back from this output: a training step would not run its
            # backward here, and neither does the harness.
            if any(self.mine[key].abs().sum() != 0 for key in expected):
                self.found_backward.append("%s %s: no gradient reaches the inputs (the output does not require "
                                           "grad)" % (self.who, name))
            return
        from cpsim import _C
        # A collective of this backward has no frame of the step's own on the stack.
        _C.set_site_context("the backward of the step's %s" % name)
        # Each rank gets its own copy of the upstream gradient (data-parallel
        # replicas share the expected values), kept to see whether the backward
        # wrote into it: autograd hands one gradient tensor to every input of an
        # add, so a backward that changes its grad_output in place changes a
        # sibling's gradient too. It comes in the layout drawn for this case and
        # output (cpsim.upstream).
        layout, given = "contiguous", upstream
        if isinstance(upstream, torch.Tensor):
            given, layout = laid_out(upstream, layout_for(self.golden.manifest["seed"], name))
        try:
            grads = torch.autograd.grad(output, leaves, grad_outputs=given, retain_graph=True, allow_unused=True)
        finally:
            _C.set_site_context("")
        if isinstance(upstream, torch.Tensor) and not torch.equal(given, upstream):
            self.found_backward.append("%s %s: the backward wrote into the upstream gradient it was given (a "
                                       "backward that modifies grad_output in place changes the gradient autograd "
                                       "gives the output's other consumers)" % (self.who, name))
        before = len(self.found)
        for i, (leaf, grad, key) in enumerate(zip(leaves, grads, expected)):
            via = "" if layout == "contiguous" else " from a %s upstream gradient" % layout
            self.against("%s gradient (%s)%s" % (name, key, via), torch.zeros_like(leaf) if grad is None else grad,
                         key, floor=floors[i] if floors else 0.0)
        self.found_backward.extend(self.found[before:])
        del self.found[before:]

    def tensor(self, name, c, value):
        """A tensor output by its entry: the value, then its backward."""
        if c.reference:
            self.against(name, value, c.key, "reference.safetensors", self.golden.reference[c.key])
        else:
            self.against(name, value, c.key, floor=c.floor(self) if c.floor else 0.0)
        if c.leaves:
            self.backward(name, value, c.leaves(self.case), c.upstream(self), c.grads,
                          c.floors(self) if c.floors else None)

    def output(self, name, value):
        """One output of the step compared, by its entry; its first difference
        (its value's, else its gradient's) kept for the report."""
        values, grads = len(self.found), len(self.found_backward)
        compare(self, name, value)
        if len(self.found) > values:
            self.firsts.append((0, self.found[values]))
        elif len(self.found_backward) > grads:
            self.firsts.append((1, self.found_backward[grads]))

    def first(self):
        """Each output's first difference, as (phase, why): phase 0 where a value
        differs, 1 where only gradients do; why one line an output, the values'
        first. None when every output agrees."""
        return combined(*self.firsts) if self.firsts else None


def _batch(side, local):
    names = sorted(k[len("batch."):] for k in side.mine if k.startswith("batch."))
    for name in names:
        if name not in local:
            side.found.append("%s batch: no %s (shard_batch gives %s)" % (side.who, name, names))
        else:
            side.against("batch " + name, local[name], "batch." + name)


def _cu_seqlens(side, rows):
    keys = [k for k in side.mine if k.startswith("row_cu_seqlens.")]
    if len(rows) != len(keys):
        side.found.append("%s cu_seqlens: %d rows, expected %d" % (side.who, len(rows), len(keys)))
        return
    for b, cu in enumerate(rows):
        key = "row_cu_seqlens.%d" % b
        side.against("cu_seqlens[%d]" % b, torch.as_tensor(cu).to(side.mine[key].dtype), key)


def _cp_context(side, contexts):
    contexts = list(contexts)
    rows = side.mine["cp_context.pre_num_ranks"].shape[0]
    if len(contexts) != rows:
        side.found.append("%s cp_context: %d rows, expected %d" % (side.who, len(contexts), rows))
        return
    for field in CP_CONTEXT_FIELDS:
        key = "cp_context." + field
        values = [c[field] if isinstance(c, dict) else getattr(c, field) for c in contexts]
        side.against("cp_context %s (a value per row)" % field,
                     torch.tensor([int(v) for v in values], dtype=side.mine[key].dtype), key)


def _unsharded(side, name, kind, value):
    """This rank's run of an output compared with the step run unsharded, kept
    in side.runs[name][(dp_rank, rank)] and compared once every rank is done."""
    if side.runs is None:
        raise ValueError("a \"%s\" output is compared on thread ranks (check(backend='threads'), not in a job)"
                         % name)
    side.runs.setdefault(name, {})[(side.dp_rank, side.rank)] = unsharded_run(kind, side.case, value, side.who)


def unsharded_run(kind, case, value, who):
    """kind.run(case, value, who), its collectives named as the backward of the
    step's output (no frame of the step's own is on the stack)."""
    from cpsim import _C
    _C.set_site_context("the backward of the step's %s" % kind.noun)
    try:
        return kind.run(case, value, who)
    finally:
        _C.set_site_context("")


def _loss(side, loss):
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.reshape(side.mine["loss"].shape)  # a scalar, as a loss is
    before = len(side.found)
    side.against("loss", loss, "loss")
    if len(side.found) > before:  # which convention it is, where it is a known one
        side.found[-1] += _loss_hint(side.golden, side.rank, loss, side.golden.tolerance(side.file, "loss"))
    side.backward("loss", loss, [side.case.logits], torch.ones_like(loss) if isinstance(loss, torch.Tensor) else None,
                  ["loss_grad_logits"])


def _grad_y(key):
    return lambda side: side.golden.inputs[key][:, side.lo:side.hi]


COMPARED = {
    "batch": Compared(compare=_batch),
    "padding": Compared("padding", reference=True),
    "position_ids": Compared("position_ids", reference=True),
    "doc_ids": Compared("doc_ids", reference=True),
    "local_doc_ids": Compared("local_doc_ids"),
    "cu_seqlens": Compared(compare=_cu_seqlens),
    "cp_context": Compared(compare=_cp_context),
    "gathered": Compared("gathered", leaves=lambda case: [case.x],
                         upstream=lambda side: side.golden.inputs["gather_grad.%d" % side.rank],
                         grads=["gather_grad_x"]),
    "halo": Compared("halo", leaves=lambda case: [case.x], upstream=lambda side: side.mine["halo_grad"],
                     grads=["conv_dx"]),
    "conv": Compared("conv_y", leaves=lambda case: [case.x, case.conv_weight, case.conv_bias],
                     upstream=_grad_y("conv_grad_y"), grads=["conv_dx", "conv_dw_partial", "conv_dbias_partial"]),
    "attention_o": Compared("attention_o", leaves=lambda case: [case.q, case.k, case.v],
                            upstream=_grad_y("attention_grad_o"),
                            grads=["attention_dq", "attention_dk", "attention_dv"]),
    # Each held to the whole case's scale where this rank's expected values are
    # smaller, and dg, dbeta to that of dq and dk at least: a chunked kernel
    # computes them as differences of terms of that size (a reverse cumulative
    # sum), so its rounding is of that size even where the exact value is 0 (dg
    # on a segment's first token: its decay multiplies a zero state).
    "recurrence_o": Compared("o", leaves=lambda case: [case.recurrence[n] for n in RECURRENCE_INPUTS],
                             upstream=_grad_y("recurrence_grad_o"), grads=["d" + n for n in RECURRENCE_INPUTS],
                             floor=lambda side: side.rms("o"),
                             floors=lambda side: [side.rms("dq"), side.rms("dk"), side.rms("dv"),
                                                  side.rms("dbeta", "dq", "dk"), side.rms("dg", "dq", "dk")]),
    "layer": Compared(unsharded=Unsharded(layer_run, layer_differences, "layer")),
    "user_loss": Compared(unsharded=Unsharded(loss_run, loss_differences, "loss")),
    "train": Compared(unsharded=Unsharded(train_run, train_differences, "training step")),
    "targets": Compared("targets"),
    "loss": Compared(compare=_loss),
}


UNSHARDED = {name: c.unsharded for name, c in COMPARED.items() if c.unsharded}


def combined(*reports):
    """Several outputs' differences of one rank, (phase, why) each (None: none),
    as one: the lowest phase, the lines of the values' differences before the
    gradients' (in the order given within each)."""
    reports = [r for r in reports if r]
    if not reports:
        return None
    ordered = sorted(reports, key=lambda r: r[0])  # stable: the order given within a phase
    return (ordered[0][0], "\n".join(why for _, why in ordered))


def compare(side, name, value):
    """One output of the step, by its entry."""
    c = COMPARED[name]
    if c.unsharded:
        _unsharded(side, name, c.unsharded, value)
    elif c.compare:
        c.compare(side, value)
    else:
        side.tensor(name, c, value)
