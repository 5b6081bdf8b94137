"""The "layer" output of cpsim.torch.check: a step's own module, sharded on the
CP ranks, against the same step run unsharded on a group of one."""
import torch

from cpsim.mesh import ranks_with, world_rank
from cpsim.compare import RUNS, difference, rms
from cpsim.upstream import laid_out, layout_for


class Layer:
    """What a step returns as "layer": its own module run on this rank's shard.
    `output` [B, L, ...] (the rank's positions), `inputs` {name: leaf} made by
    case.activation (the only inputs whose gradients are compared), `parameters`
    {name: tensor} (module.named_parameters(): every rank's own copy, its
    gradient this rank's part), `tolerance` the relative RMSE every comparison
    is held to (rms(unsharded - sharded) / rms(unsharded); a NaN or an inf on one
    side only always fails). The harness draws the upstream gradient of the
    output, takes the gradients, and compares them with the same step run
    unsharded (case.cp == 1, case.S positions: no CP padding)."""

    def __init__(self, output, inputs, parameters, tolerance):
        self.output, self.inputs, self.tolerance = output, dict(inputs), float(tolerance)
        self.parameters = dict(parameters)


def generator(seed, name):
    """A torch.Generator seeded from the case's seed and a name."""
    return torch.Generator().manual_seed((int(seed) * 1000003 + sum(ord(c) * 131 ** i for i, c in
                                                                     enumerate(name))) % (2 ** 63))


def drawn(seed, name, shape, dtype):
    """A tensor drawn from the case's seed and a name: the same numbers on every
    rank and in the unsharded run (standard normal)."""
    return torch.randn(shape, generator=generator(seed, name), dtype=torch.float64).to(dtype)


def layer_run(case, layer, who):
    """A Layer's output and gradients on one rank (or the unsharded run): the
    upstream gradient is drawn for the whole output and sliced to the rank, in
    the case's drawn layout."""
    if not isinstance(layer, Layer):
        raise TypeError("%s: \"layer\" must be a cpsim.torch.Layer, not %s" % (who, type(layer).__name__))
    output = layer.output
    upstream = drawn(case._seed, "layer_grad", (case._B, case._P) + tuple(output.shape[2:]), output.dtype)
    upstream[:, case.S:] = 0  # no loss reaches the CP padding (the unsharded run has no such position)
    # This rank's slice, in the layout drawn for the case (cpsim.upstream).
    upstream, _ = laid_out(upstream[case.rows, case._lo:case._hi].contiguous(), layout_for(case._seed, "layer"))
    names = list(layer.inputs) + ["parameter " + n for n in layer.parameters]
    wanted = list(layer.inputs.values()) + list(layer.parameters.values())
    # A tensor that does not require grad (a rank's frozen copy) has no gradient: 0.
    live = [i for i, t in enumerate(wanted) if t.requires_grad]
    grads = [None] * len(wanted)
    if output.requires_grad and live:
        found = torch.autograd.grad(output, [wanted[i] for i in live], grad_outputs=upstream, retain_graph=True,
                                    allow_unused=True)
        for i, g in zip(live, found):
            grads[i] = g
    return {"output": output.detach(), "tolerance": layer.tolerance, "lo": case._lo, "hi": case._hi, "rows": case.rows,
            "grads": {n: (torch.zeros_like(t) if g is None else g.detach()) for n, g, t in zip(names, grads, wanted)}}


def layer_differences(layers, cp, dp, S, mesh="dp,cp"):
    """Each rank's layer output and input gradients against the unsharded run's
    at its replica's rows and its positions (those before S: the CP padding
    has no counterpart), and the parameter gradients summed over every rank
    (each replica its own rows) against the unsharded ones; per rank, its
    first difference (0 value, 1 gradient).
    Each is held to the relative RMSE over the unsharded tensor's RMS, a
    rank's positions to the whole tensor's, and a parameter's gradient to the
    RMS of all the layer's parameter gradients where its own is smaller: a
    gradient that is 0 in exact arithmetic (a query's, where its document has
    one key) is rounding, whose size is that of the layer's gradients."""
    whole = layers[None]
    tolerance = whole["tolerance"]
    parameters = [g for n, g in whole["grads"].items() if n.startswith("parameter ")]
    parameter_scale = rms(torch.cat([g.reshape(-1) for g in parameters])) if parameters else 0.0
    found = {}
    sums = {}
    for run, who, at in ranks_with(layers, "layer", cp, dp, mesh, found):
        lo, hi, rows = run["lo"], min(run["hi"], S), run["rows"]
        n = max(hi - lo, 0)
        where = "positions %d..%d%s" % (lo, lo + n, "" if dp == 1 else ", rows %d..%d" % (rows.start, rows.stop))
        why = difference("%s layer output (%s)" % (who, where), run["output"][:, :n],
                         whole["output"][rows, lo:lo + n], tolerance, floor=rms(whole["output"]), sides=RUNS)
        if why:
            found.setdefault(at, (0, why))
        for name, grad in run["grads"].items():
            if name.startswith("parameter "):
                sums[name] = grad.clone() if name not in sums else sums[name] + grad
                continue
            want = whole["grads"][name]
            why = difference("%s layer gradient of %s (%s)" % (who, name, where),
                             grad[:, :n], want[rows, lo:lo + n], tolerance, floor=rms(want), sides=RUNS)
            if why:
                found.setdefault(at, (1, why))
    for name, total in sums.items():
        why = difference("layer gradient of %s summed over the %s" % (
            name[len("parameter "):], "CP ranks" if dp == 1 else "%d ranks (dp x cp, each replica its rows)" % (
                dp * cp)), total, whole["grads"][name], tolerance, floor=parameter_scale, sides=RUNS)
        if why:
            found.setdefault(world_rank(0, 0, cp, dp, mesh), (1, why))
    return found
