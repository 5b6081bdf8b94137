"""One rank of one case: the step, then its outputs compared with the golden
values and their gradients taken, in the same order on every rank."""
import collections

import torch

from cpsim.case import RankCase
from cpsim.loss import hint as _loss_hint
from cpsim.mesh import who as _who
from cpsim.compare import difference as _difference, rms as _rms
from cpsim.layer import layer_differences as _layer_differences, layer_run as _layer_run
from cpsim.user_loss import loss_differences as _loss_differences, loss_run as _loss_run
from cpsim.outputs import CP_CONTEXT_FIELDS, OUTPUTS, RECURRENCE_INPUTS
from cpsim.upstream import laid_out, layout_for


# The outputs compared with the step itself run unsharded (on a group of one):
# how each one's run on a rank is taken (run(case, output, who)), how the runs
# are compared (differences(runs, cp, dp, S, mesh) -> {world rank: (phase, why)})
# and what its backward is called in reports.
Unsharded = collections.namedtuple("Unsharded", "run differences noun")
UNSHARDED_OUTPUTS = {"layer": Unsharded(_layer_run, _layer_differences, "layer"),
                     "user_loss": Unsharded(_loss_run, _loss_differences, "loss")}


def run_rank(golden, step, rank, dp=1, dp_rank=0, runs=None, unsharded=False, mesh="dp,cp"):
    """One rank: the step, then its outputs' comparisons and gradients, in the
    same order on every rank. Returns this rank's first difference as (0, why)
    for a value, (1, why) for a gradient (a gradient's difference may be a
    forward one's consequence), or None when none. The run of an output
    compared with the unsharded step ("layer", "user_loss") goes to
    runs[name][(dp_rank, rank)] (runs[name][None]: the unsharded run's),
    compared once every rank and the unsharded run are done."""
    case = RankCase(golden, rank, dp, dp_rank, unsharded, mesh)
    if unsharded:  # the reference run: nothing else is compared
        out = step(case)
        for name, kind in UNSHARDED_OUTPUTS.items():
            if name in runs:
                runs[name][None] = kind.run(case, out.get(name) if isinstance(out, dict) else None,
                                            "the unsharded run")
        return None
    who = _who(rank, dp_rank, case.cp, dp, mesh)
    out = step(case)
    if not isinstance(out, dict):
        raise TypeError("the step returned %s, not a dict of outputs" % type(out).__name__)
    unknown = sorted(set(out) - set(OUTPUTS))
    if unknown:
        raise ValueError("the step returned %s; cpsim.torch.check compares %s" % (unknown, list(OUTPUTS)))
    mine = golden.rank(rank)
    rfile = "rank_%d.safetensors" % rank
    found, found_backward = [], []

    def against(name, got, key, file=rfile, want=None, floor=0.0):
        want = mine[key] if want is None else want
        entry = golden.manifest["files"][file][key]
        scale = golden.rank(rank)[entry["scale"]] if entry.get("scale") and file == rfile else None
        why = _difference("%s %s" % (who, name), got, want, golden.tolerance(file, key), scale, floor)
        if why:
            found.append(why)

    if "batch" in out:
        local = out["batch"]
        for key in sorted(k for k in mine if k.startswith("batch.")):
            name = key[len("batch."):]
            if name not in local:
                found.append("%s batch: no %s (shard_batch gives %s)" % (
                    who, name, sorted(k[6:] for k in mine if k.startswith("batch."))))
            else:
                against("batch " + name, local[name], key)
    for name in ("padding", "position_ids"):
        if name in out:
            against(name, out[name], name, "reference.safetensors", golden.reference[name])
    if "doc_ids" in out:
        against("doc_ids", out["doc_ids"], "doc_ids", "reference.safetensors", golden.reference["doc_ids"])
    if "local_doc_ids" in out:
        against("local_doc_ids", out["local_doc_ids"], "local_doc_ids")
    if "cu_seqlens" in out:
        rows = [k for k in mine if k.startswith("row_cu_seqlens.")]
        if len(out["cu_seqlens"]) != len(rows):
            found.append("%s cu_seqlens: %d rows, expected %d" % (who, len(out["cu_seqlens"]), len(rows)))
        else:
            for b, cu in enumerate(out["cu_seqlens"]):
                key = "row_cu_seqlens.%d" % b
                against("cu_seqlens[%d]" % b, torch.as_tensor(cu).to(mine[key].dtype), key)
    if "cp_context" in out:
        contexts = list(out["cp_context"])
        rows = mine["cp_context.pre_num_ranks"].shape[0]
        if len(contexts) != rows:
            found.append("%s cp_context: %d rows, expected %d" % (who, len(contexts), rows))
        else:
            for field in CP_CONTEXT_FIELDS:
                key = "cp_context." + field
                values = [c[field] if isinstance(c, dict) else getattr(c, field) for c in contexts]
                against("cp_context %s (a value per row)" % field,
                        torch.tensor([int(v) for v in values], dtype=mine[key].dtype), key)

    lo, hi = golden.cuts[rank], golden.cuts[rank + 1]

    def backward(name, output, leaves, upstream, expected, floors=None):
        """This rank's part of the output's backward (collectives included)."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            # No path back from this output: a training step would not run its
            # backward here, and neither does the harness.
            for leaf, key in zip(leaves, expected):
                if mine[key].abs().sum() != 0:
                    found_backward.append("%s %s: no gradient reaches the inputs (the output does not "
                                          "require grad)" % (who, name))
                    break
            return
        from cpsim import _C
        # A collective of this backward has no frame of the step's own on the stack.
        _C.set_site_context("the backward of the step's %s" % name)
        # Each rank gets its own copy of the upstream gradient (data-parallel
        # replicas share the expected values), kept to see whether the backward
        # wrote into it: autograd hands one gradient tensor to every input of an
        # add, so a backward that changes its grad_output in place changes a
        # sibling's gradient too.
        # It comes in the layout drawn for this case and output (cpsim.upstream).
        layout = "contiguous"
        given = upstream
        if isinstance(upstream, torch.Tensor):
            given, layout = laid_out(upstream, layout_for(golden.manifest["seed"], name))
        try:
            grads = torch.autograd.grad(output, leaves, grad_outputs=given, retain_graph=True, allow_unused=True)
        finally:
            _C.set_site_context("")
        if isinstance(upstream, torch.Tensor) and not torch.equal(given, upstream):
            found_backward.append("%s %s: the backward wrote into the upstream gradient it was given (a backward "
                                  "that modifies grad_output in place changes the gradient autograd gives the "
                                  "output's other consumers)" % (who, name))
        before = len(found)
        for i, (leaf, grad, key) in enumerate(zip(leaves, grads, expected)):
            against("%s gradient (%s)%s" % (name, key, "" if layout == "contiguous" else
                                            " from a %s upstream gradient" % layout),
                    torch.zeros_like(leaf) if grad is None else grad, key, floor=floors[i] if floors else 0.0)
        found_backward.extend(found[before:])
        del found[before:]

    if "gathered" in out:
        against("gathered", out["gathered"], "gathered")
        backward("gathered", out["gathered"], [case.x], golden.inputs["gather_grad.%d" % rank], ["gather_grad_x"])
    if "halo" in out:
        against("halo", out["halo"], "halo")
        backward("halo", out["halo"], [case.x], mine["halo_grad"], ["conv_dx"])
    if "conv" in out:
        against("conv", out["conv"], "conv_y")
        backward("conv", out["conv"], [case.x, case.conv_weight, case.conv_bias],
                 golden.inputs["conv_grad_y"][:, lo:hi], ["conv_dx", "conv_dw_partial", "conv_dbias_partial"])
    if "attention_o" in out:
        against("attention_o", out["attention_o"], "attention_o")
        backward("attention_o", out["attention_o"], [case.q, case.k, case.v],
                 golden.inputs["attention_grad_o"][:, lo:hi],
                 ["attention_dq", "attention_dk", "attention_dv"])
    if "recurrence_o" in out:
        # Each held to the whole case's scale where this rank's expected values are
        # smaller, and dg, dbeta to that of dq and dk at least: a chunked kernel
        # computes them as differences of terms of that size (a reverse cumulative
        # sum), so its rounding is of that size even where the exact value is 0 (dg
        # on a segment's first token: its decay multiplies a zero state).
        def rms(*keys):
            return max(_rms(golden.reference[k]) for k in keys)
        against("recurrence_o", out["recurrence_o"], "o", floor=rms("o"))
        backward("recurrence_o", out["recurrence_o"], [case.recurrence[n] for n in RECURRENCE_INPUTS],
                 golden.inputs["recurrence_grad_o"][:, lo:hi], ["d" + n for n in RECURRENCE_INPUTS],
                 [rms("dq"), rms("dk"), rms("dv"), rms("dbeta", "dq", "dk"), rms("dg", "dq", "dk")])
    for name, kind in UNSHARDED_OUTPUTS.items():
        if name not in out:
            continue
        if runs is None:
            raise ValueError("a \"%s\" output is compared on thread ranks (check(backend='threads'), not in a job)"
                             % name)
        from cpsim import _C
        _C.set_site_context("the backward of the step's %s" % kind.noun)
        try:
            runs.setdefault(name, {})[(dp_rank, rank)] = kind.run(case, out[name], who)
        finally:
            _C.set_site_context("")
    if "targets" in out:
        against("targets", out["targets"], "targets")
    if "loss" in out:
        loss = out["loss"]
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.reshape(mine["loss"].shape)  # a scalar, as a loss is
        before = len(found)
        against("loss", loss, "loss")
        if len(found) > before:  # which convention it is, where it is a known one
            found[-1] += _loss_hint(golden, rank, loss, golden.tolerance(rfile, "loss"))
        backward("loss", loss, [case.logits], torch.ones_like(loss) if isinstance(loss, torch.Tensor) else None,
                 ["loss_grad_logits"])
    if found:
        return (0, found[0])
    return (1, found_backward[0]) if found_backward else None


def first_differences(per_rank):
    """Every rank's first difference, the values' before the gradients' (a wrong
    gradient often follows from a wrong value, maybe another rank's), one line
    each; '' when every rank agrees."""
    found = sorted((f[0], r, f[1]) for r, f in enumerate(per_rank) if f)
    return "\n".join(why for _, _, why in found)
