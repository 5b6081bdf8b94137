"""cpsim.torch.check: property-test a user's per-rank PyTorch CP step.

    def step(case):                      # runs on every rank, as that rank
        local = my_shard_batch(case.batch, case.rank, case.cp, case.pad_token_id)
        return {"batch": local, "gathered": my_gather_sequence(case.x)}
    cpsim.torch.check(step, cases=200, max_cp=8)

cpsim's generators draw the layouts (random ones, or the members of a family
file); for each, cpsim's references (never the code under test) give every
rank's expected values, the ranks run `step` on a simulated group (torch
collectives land on cpsim's communicators, call-checked), and what the step
returned is compared with the expected values, forward and backward. A failure
is shrunk to the smallest layout and raised as CheckFailed (an AssertionError,
so a plain pytest test reports it), with the layout as a BATCH file that
`cpsim check` replays.

What the step may return (any subset; each is compared when present):

  "batch"          dict: the local batch after sharding (every key cpsim's
                   shard_batch gives: the batch's keys padded to P and cut,
                   input_ids global unless shard_primary, padding_mask and
                   position_ids)
  "padding"        [B, S] bool: the raw batch's padding (true where padding),
                   decided from the lengths (or the mask of an unpacked row)
  "position_ids"   [B, S] the position of every token in its document (given,
                   or derived: tail padding continues the last position)
  "doc_ids"        [B, P] global document ids (i + 1 on document i's span, 0 on
                   padding beyond the documents)
  "local_doc_ids"  [B, L] this rank's slice of them
  "cu_seqlens"     one 1-D tensor per row: the boundaries of the runs of equal
                   local doc ids, [0, ..., L]
  "gathered"       [B, P, C] gather_sequence(case.x); its gradient to case.x is
                   checked for the upstream gradient of this rank
  "halo"           [B, L + W - 1, C] convolution_history(case.x, W); its gradient
                   to case.x is checked for the conv's gradient of the window
  "attention_o"    [B, L, H, D] document-masked causal attention of case.q over
                   the gathered case.k, case.v after RoPE by position (scale
                   case.softmax_scale, base case.rope_base; 0 for a query that
                   sees no key); gradients to case.q, case.k, case.v checked
  "cp_context"     one entry per row: this rank's flash-linear-attention CP
                   context of the row (FLA's FLACPContext, or a dict), its
                   pre_num_conv_tokens, pre_num_ranks, post_num_ranks,
                   is_first_rank and is_last_rank compared
  "conv"           [B, L, C] the packed causal depthwise convolution of case.x
                   (weights case.conv_weight [C, W], w[:, W-1] on the token
                   itself; bias case.conv_bias; a tap before the token's segment
                   dropped; no activation); gradients to case.x (halo returns
                   included), case.conv_weight and case.conv_bias (this rank's
                   part, before any sum over ranks) checked
  "recurrence_o"   [B, L, H, V] the gated delta rule / KDA recurrence of
                   case.recurrence's q, k, v, beta, g (this rank's slices;
                   S_t = (I - beta k k^T) Diag(exp g) S_(t-1) + beta k v^T,
                   o_t = S_t^T q_t, no q scaling, S = 0 at every segment start,
                   state carried over the ranks before this one); gradients to
                   the five checked
  "layer"          a Layer: the step's own module on this rank (its output
                   [B, L, ...] from inputs drawn with case.activation, and its
                   parameters), compared with the same step run unsharded on a
                   group of one (case.cp == 1; the upstream gradient is
                   drawn, 0 on the CP padding): each rank's output and input
                   gradients against the unsharded run's positions, every
                   parameter's gradient summed over the CP ranks against the
                   unsharded one, within the Layer's tolerance
  "targets"        [B, L] this rank's next-token targets, aligned on whole rows
                   before sharding from case.tokens: tokens[t + 1] when t and
                   t + 1 are real tokens of one document, else -100
  "loss"           the token-mean cross entropy of case.logits [B, L, V] against
                   the targets over every rank: the sum of per-token losses and
                   the count of targets all-reduced, sum / count (0 when no
                   target); the same value on every rank. Its gradient to
                   case.logits (upstream 1) is checked: d(local sum) / count

A step whose library does not take a drawn layout (FLA: every rank at least W-1
tokens) raises OutsideContract(why) on every rank, before any collective: the
case is set aside, not counted, and another drawn in its place (check() says
how many were set aside, and why).

Gradients are taken in that order on every rank, one autograd.grad per output,
as a training step's backward would: a rank whose output has no path to a
collective (no anchor) skips that collective's backward, and its peers' wait is
reported by name, never a hang.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch

from cpsim import torch as ct  # spawn and the job: the harness builds on cpsim.torch
from cpsim.compare import difference as _difference, rms as _rms
from cpsim.layer import Layer  # noqa: F401 - cpsim.torch.Layer
from cpsim.layer import drawn as _drawn, layer_differences as _layer_differences, layer_run as _layer_run

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}

OUTPUTS = ("batch", "padding", "position_ids", "doc_ids", "local_doc_ids", "cu_seqlens", "cp_context", "gathered",
           "halo", "conv", "attention_o", "recurrence_o", "layer", "targets", "loss")
RECURRENCE_INPUTS = ("q", "k", "v", "beta", "g")
CP_CONTEXT_FIELDS = ("pre_num_conv_tokens", "pre_num_ranks", "post_num_ranks", "is_first_rank", "is_last_rank")


class OutsideContract(Exception):
    """Raised by a step, on every rank and before any collective, for a drawn
    layout its library does not take (the library's documented contract): the
    case is set aside and another drawn."""


class _Outside(str):
    """A case's verdict: set aside (the text says why)."""


class CheckFailed(AssertionError):
    """The step disagreed with cpsim's references. `batch` is the smallest failing
    layout as BATCH JSON text, `path` where it was saved, `cp` the CP size,
    `plan` and `seed` what replays it (check(step, batch=path, cp=cp, plan=plan,
    seed=seed)), `failure` what went wrong: every rank's first difference, one
    line each."""

    def __init__(self, message, failure, batch, path, cp, plan, seed=None):
        super().__init__(message)
        self.failure, self.batch, self.path, self.cp, self.plan, self.seed = failure, batch, path, cp, plan, seed


class Checked(int):
    """What check() returns: the number of cases run (an int), and `outside`, how
    many drawn cases were set aside as outside the step's contract, with
    `outside_why`, each reason given and how often ({why: count})."""

    def __new__(cls, ran, outside=0, outside_why=None):
        value = super().__new__(cls, ran)
        value.outside, value.outside_why = outside, dict(outside_why or {})
        return value


def load_safetensors(path):
    """A safetensors file as {key: torch tensor} (copies: the step may write to them)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = bytearray(data[8 + n:])
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = _DTYPES[entry["dtype"]]
        if end == begin:
            out[key] = torch.empty(entry["shape"], dtype=dtype)
        else:
            out[key] = torch.frombuffer(body[begin:end], dtype=dtype).reshape(entry["shape"]).clone()
    return out


class RankCase:
    """What one rank's step gets: the raw batch as the packer gave it (global
    [B, S] tensors, this rank's own copy), the CP geometry, and this rank's
    shards of the activations (leaves that require grad)."""

    def __init__(self, golden, rank, dp=1, dp_rank=0, unsharded=False):
        m = golden.manifest
        # unsharded: the whole case on a group of one (a Layer's reference run):
        # cp 1, the S positions of the rows (no CP padding).
        cuts = [0, m["S"]] if unsharded else golden.cuts
        lo, hi = cuts[rank], cuts[rank + 1]
        self.rank, self.cp = rank, (1 if unsharded else golden.cp)
        self._seed, self._lo, self._hi, self._P = m["seed"], lo, hi, m["P"]
        self._dtype, self._B = golden.inputs["x"].dtype, golden.inputs["x"].shape[0]
        # Data parallel replicas (check(dp=D)): D copies of the CP group, ranks
        # dp_rank * cp + rank, as init_device_mesh("cpu", (dp, cp)) lays them out;
        # every replica holds the same case.
        self.dp, self.dp_rank, self.world_rank = dp, dp_rank, dp_rank * golden.cp + rank
        self.batch = {k: v.clone() for k, v in golden.batch.items()}
        self.pad_token_id = m["pad_token_id"]
        self.conv_width = m["conv_width"]
        self.cuts = list(cuts)  # rank r holds [cuts[r], cuts[r+1]) of the padded rows
        self.S, self.P = m["S"], (m["S"] if unsharded else m["P"])
        self.shard_primary = m.get("shard_primary", False)
        self.softmax_scale, self.rope_base = m["softmax_scale"], m["rope_base"]

        def leaf(key):
            return golden.inputs[key][:, lo:hi].clone().requires_grad_(True)

        self.x = leaf("x")
        # The convolution's parameters: every rank's own copy (its gradient is this
        # rank's part, before a data-parallel sum would add them).
        self.conv_weight = golden.inputs["conv_weight"].clone().requires_grad_(True)
        self.conv_bias = golden.inputs["conv_bias"].clone().requires_grad_(True)
        self.q, self.k, self.v = leaf("attention_q"), leaf("attention_k"), leaf("attention_v")
        # The recurrence's inputs (the "recurrence_o" output): q, k, v [B, L, H, K|V],
        # beta [B, L, H], g [B, L, H, K] (log-decay, <= 0).
        self.recurrence = {name: leaf(name) for name in RECURRENCE_INPUTS}
        # The loss's inputs: the token ids folded into the vocabulary, global [B, S]
        # like the batch (the targets are aligned from them), and this rank's logits.
        self.tokens = golden.inputs["loss_tokens"][:, :self.S].clone()
        self.logits = leaf("logits")
        self.vocab = self.logits.shape[-1]

    def activation(self, name, *tail, dtype=None):
        """This rank's slice [B, L, *tail] of an activation drawn for the case
        from its seed and `name` (standard normal; the case's dtype unless
        given), a leaf that requires grad: the same global tensor on every
        rank and in the unsharded run, for a "layer" output's inputs."""
        whole = _drawn(self._seed, "activation." + name, (self._B, self._P) + tuple(tail), dtype or self._dtype)
        return whole[:, self._lo:self._hi].clone().requires_grad_(True)

    def __repr__(self):
        return "RankCase(rank=%d, cp=%d, dp_rank=%d, dp=%d, S=%d, P=%d)" % (self.rank, self.cp, self.dp_rank, self.dp,
                                                                         self.S, self.P)


class _Golden:
    def __init__(self, folder):
        with open(os.path.join(folder, "manifest.json")) as f:
            self.manifest = json.load(f)
        m = self.manifest
        self.cp = m["cp"]
        self.cuts = m.get("cuts") or [r * m["L"] for r in range(self.cp + 1)]
        self.inputs = load_safetensors(os.path.join(folder, "inputs.safetensors"))
        self.reference = load_safetensors(os.path.join(folder, "reference.safetensors"))
        self.folder = folder
        self._ranks = {}
        self.batch = {k.split(".", 1)[1]: v for k, v in self.inputs.items()
                      if k.startswith("inputs.") or k.startswith("stand_in.")}

    def rank(self, r):
        """Rank r's expected values, read once when first asked for (a process of a
        job reads only its own rank's file)."""
        if r not in self._ranks:
            self._ranks[r] = load_safetensors(os.path.join(self.folder, "rank_%d.safetensors" % r))
        return self._ranks[r]

    def tolerance(self, file, key):
        return self.manifest["files"][file][key]["tolerance"] or 0.0


def _run_rank(golden, step, rank, dp=1, dp_rank=0, layers=None, unsharded=False):
    """One rank: the step, then its outputs' comparisons and gradients, in the
    same order on every rank. Returns this rank's first difference as (0, why)
    for a value, (1, why) for a gradient (a gradient's difference may be a
    forward one's consequence), or None when none. A "layer" output's run
    (output and gradients) goes to layers[(dp_rank, rank)], compared once
    every rank and the unsharded run are done (_layer_differences)."""
    case = RankCase(golden, rank, dp, dp_rank, unsharded)
    if unsharded:  # the reference run of a Layer: nothing else is compared
        out = step(case)
        layers[None] = _layer_run(case, out.get("layer") if isinstance(out, dict) else None, "the unsharded run")
        return None
    who = "rank %d" % rank if dp == 1 else "rank %d (dp %d, cp %d)" % (case.world_rank, dp_rank, rank)
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
        given = upstream.clone() if isinstance(upstream, torch.Tensor) else upstream
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
            against("%s gradient (%s)" % (name, key), torch.zeros_like(leaf) if grad is None else grad, key,
                    floor=floors[i] if floors else 0.0)
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
    if "layer" in out:
        if layers is None:
            raise ValueError("a \"layer\" output is compared on thread ranks (check(backend='threads'), not in a job)")
        from cpsim import _C
        _C.set_site_context("the backward of the step's layer")
        try:
            layers[(dp_rank, rank)] = _layer_run(case, out["layer"], who)
        finally:
            _C.set_site_context("")
    if "targets" in out:
        against("targets", out["targets"], "targets")
    if "loss" in out:
        loss = out["loss"]
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.reshape(mine["loss"].shape)  # a scalar, as a loss is
        against("loss", loss, "loss")
        backward("loss", loss, [case.logits], torch.ones_like(loss) if isinstance(loss, torch.Tensor) else None,
                 ["loss_grad_logits"])
    if found:
        return (0, found[0])
    return (1, found_backward[0]) if found_backward else None


def _first_differences(per_rank):
    """Every rank's first difference, the values' before the gradients' (a wrong
    gradient often follows from a wrong value, maybe another rank's), one line
    each; '' when every rank agrees."""
    found = sorted((f[0], r, f[1]) for r, f in enumerate(per_rank) if f)
    return "\n".join(why for _, _, why in found)


def _verdict(folder, step, backend, timeout, dp=1):
    golden = _Golden(folder)
    cp = golden.cp
    layers = {}
    try:
        found = ct.spawn(lambda rank, world: _run_rank(golden, step, rank % cp, dp, rank // cp, layers), dp * cp,
                         backend=backend, timeout=timeout)
    except ct.RankFailed as e:
        if isinstance(e.__cause__, OutsideContract):
            return _Outside(str(e.__cause__))
        return "rank %d raised %s" % (e.rank, str(e).split(": ", 1)[1])
    except ct.RankStuck as e:
        return str(e)
    except ct.CollectiveError as e:
        return "the ranks' calls did not match: %s" % e
    if layers:  # the step's own layer, unsharded on a group of one: the reference of "layer"
        if backend != "threads":
            return "a \"layer\" output is compared on thread ranks (backend='threads'), not on %s" % backend
        try:
            ct.spawn(lambda rank, world: _run_rank(golden, step, 0, layers=layers, unsharded=True), 1,
                     backend=backend, timeout=timeout)
        except ct.RankFailed as e:
            return "the unsharded run (cp 1) raised %s" % str(e).split(": ", 1)[1]
        except (ct.RankStuck, ct.CollectiveError) as e:
            return "the unsharded run (cp 1): %s" % e
        for r, why in _layer_differences(layers, cp, dp, golden.manifest["S"]).items():
            if not found[r] or why[0] < found[r][0]:
                found[r] = why
    return _first_differences(found)


def _exchange(text, group):
    """Every process's text, over the job's own group (a length, then the bytes as int64)."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    data = torch.tensor(list(text.encode()), dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([data.numel()]), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.int64)
    padded[:data.numel()] = data
    parts = [torch.zeros(longest, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[:int(n)].tolist()).decode() for p, n in zip(parts, lengths)]


_job_checks = [0, 0]  # check() calls and cases of this process of a job so far


def _job_verdict(folder, step, case_number, dp=1):
    """One case in a job: this process runs its rank of the step on a fresh group
    of every process (the default group of a torch world of the case's own); the
    verdicts of all processes are agreed over the job's own group, so every
    process's generator takes the same branch."""
    import torch.distributed as dist
    job, main = ct._job, dist.group.WORLD
    rank = job.rank()
    golden = _Golden(folder)
    # Named apart from every earlier check() of this job (each counts its cases from 1).
    session = job.session("check%d-case%d" % (_job_checks[0], case_number))
    hook = sys.excepthook  # init_process_group wraps it (a "[rank N]:" prefix): once per case, undone
    saved = (getattr(ct._local, "world", None), getattr(ct._local, "source", None))
    ct._install()
    # The case's groups are named after the case (the program's own, on this
    # thread too, keep their names).
    world = ct._RankWorld()
    _job_checks[1] += 1  # torch registers group names process-wide: every case of every check apart
    world.group_count = 1000 * _job_checks[1]
    groups = []  # the case's other groups (a DeviceMesh's)
    ct._local.world, ct._local.source = world, ct._job_source([session], groups)
    own, outside, why = False, False, ""
    try:
        dist.init_process_group("cpsim", store=dist.HashStore(), rank=rank, world_size=job.size())
        mine = _run_rank(golden, step, rank % golden.cp, dp, rank // golden.cp)
        why = "%d%s" % mine if mine else ""
        ct._unwaited(job.ledger(), rank)
        unreceived = ct._end_sessions(groups + [session])
        if unreceived:
            why = "the ranks' calls did not match: " + unreceived
    except BaseException as e:  # noqa: B902 - every failure is this case's verdict
        if isinstance(e, OutsideContract):
            outside, why = True, str(e)
        elif any(s.collective_failed() for s in groups + [session]) or isinstance(e, ct.CollectiveError):
            why = "the ranks' calls did not match: %s" % e
        else:
            own, why = True, "rank %d raised %s: %s" % (rank, type(e).__name__, e)
        ct._fail_sessions(groups + [session], e)
    finally:
        ct._local.world, ct._local.source = saved
        ct._uninstall()
        sys.excepthook = hook
    # Each process's verdict: "1" and its own exception, "2" and why the case is
    # outside the step's contract, or "0" and a report of cpsim's, or "0", the
    # phase of its first difference (0 value, 1 gradient) and it.
    verdicts = _exchange(("1" if own else "2" if outside else "0") + why, main)
    del session, groups
    # A rank's own exception first (its peers' reports are its consequence).
    for v in verdicts:
        if v[:1] == "1":
            return v[1:]
    for v in verdicts:
        if v[:1] == "2":
            return _Outside(v[1:])
    for v in verdicts:
        if v[1:] and v[1] not in "01":
            return v[1:]
    return _first_differences([(int(v[1]), v[2:]) if v[1:] else None for v in verdicts])


def _cpsim_binary():
    binary = os.environ.get("CPSIM_BINARY")
    if binary:
        return binary
    try:
        from cpsim._build import CPSIM_BINARY  # written by the build
        return CPSIM_BINARY
    except ImportError:
        return shutil.which("cpsim") or "cpsim"


def check(step, cases=100, max_cp=8, family=None, plan="equal", seed=None, backend="threads", timeout=20.0,
          conv_width=4, shard_primary=False, out=None, cps=None, batch=None, cp=None, dp=1, dtype="f64",
          pad_multiple=1, min_shard=1, forms=None):
    """Property-tests `step(case) -> dict` (see the module's text) on `cases`
    layouts drawn by cpsim at the CP sizes `cps` (default 1..max_cp), each size
    as often as any other (a family file's members when `family` names one),
    every case on a simulated group of `backend` (threads or gloo). `plan`: how
    the ranks cut the padded rows: equal (the default: what an equal-interval
    implementation expects), balanced, or random (drawn cuts, empty intervals
    included: the step must follow case.cuts). Returns the number of cases run;
    raises CheckFailed with the smallest failing layout, saved as a BATCH file
    to `out` (default: a file in the temporary folder), and every rank's first
    difference (values before gradients).

    `batch=FILE, cp=N` replays the step on one saved layout (a CheckFailed's
    path, with its `plan`, and `seed` for the same inputs) instead of drawing.

    `dp=D` runs D data-parallel replicas of every case: D * cp ranks, rank
    dp_rank * cp + case.rank, as init_device_mesh("cpu", (D, cp)) lays them out
    (the step builds its mesh or groups; each replica holds the same case and is
    compared with the same expected values). `dtype` (f64, f32 or bf16): the
    dtype of every floating input the step gets and of the expected values,
    compared within the manifest's tolerance of that dtype. `pad_multiple=M`
    pads every sequence to a multiple of cp * M (case.P), as a library that
    pads to 2 * cp does (equal or balanced plan). `min_shard=N` draws only
    layouts whose equal shards hold at least N positions (a library's contract,
    as FLA's CP convolution's W - 1; a family's shorter members are discarded).
    `forms=[...]` draws random layouts only in these forms (a family file's
    form names: seq_lens_padded, seq_lens, cu_seqlens, cu_seqlens_only,
    cu_seqlens_padded_only, unpacked, position_ids): the batches a library
    takes.

    Returns the number of cases run (a Checked: an int with `outside`, the
    number of drawn cases the step set aside as outside its contract).

    In a process of a job (after cpsim.torch.init_process_group(), under
    `cpsim launch -n N`), every case runs at CP size N / dp, this process being
    its rank, on a fresh group of the processes (`backend` and `timeout` are the
    job's); every process must call check() with the same arguments.

    The layouts come from `cpsim harness` (the cpsim executable: CPSIM_BINARY,
    else the build's, else cpsim on the PATH), which draws and shrinks them
    with RapidCheck and writes each case's expected values."""
    replay = batch is not None
    if replay:
        if cp is None:
            raise ValueError("check(step, batch=FILE, cp=N): the CP size to replay the batch at")
        if plan == "random":
            raise ValueError("plan: a replay takes equal, balanced or a plan file, not random")
    elif plan not in ("equal", "balanced", "random"):
        raise ValueError("plan: equal, balanced or random, not %r" % (plan,))
    elif cp is not None:
        raise ValueError("cp= goes with batch=FILE (a replay); cps=[...] chooses the CP sizes drawn")
    if dtype not in ("f64", "f32", "bf16"):
        raise ValueError("dtype: f64, f32 or bf16, not %r" % (dtype,))
    if int(dp) < 1:
        raise ValueError("dp: at least 1, not %r" % (dp,))
    sizes = sorted(set(int(c) for c in (cps if cps is not None else range(1, int(max_cp) + 1))))
    if not sizes or sizes[0] < 1:
        raise ValueError("cps: CP sizes of at least 1, not %r" % (cps,))
    in_job = ct._job is not None
    if in_job:
        # A process of a job (init_process_group): every case at the job's size,
        # each process its rank; every process draws the same cases (one seed).
        import torch.distributed as dist
        chosen = torch.tensor([int.from_bytes(os.urandom(6), "little") if seed is None else int(seed)])
        dist.broadcast(chosen, src=0, group=dist.group.WORLD)
        if ct._job.size() % int(dp):
            raise ValueError("check(dp=%d) in a job of %d processes: dp must divide the job's size"
                             % (int(dp), ct._job.size()))
        seed, sizes = int(chosen), [ct._job.size() // int(dp)]
        _job_checks[0] += 1
        if replay and int(cp) != sizes[0]:
            raise ValueError("check(batch=..., cp=%d) in a job of %d processes at dp=%d: the CP size is %d"
                             % (int(cp), ct._job.size(), int(dp), sizes[0]))
    workdir = tempfile.mkdtemp(prefix="cpsim-check-")
    command = [_cpsim_binary(), "harness", "--workdir", workdir, "--cases", str(int(cases)), "--plan", plan,
               "--conv-width", str(int(conv_width)), "--dtype", dtype, "--pad-multiple", str(int(pad_multiple)),
               "--min-shard", str(int(min_shard))]
    if replay:
        command += ["--batch", os.fspath(batch), "--cp", str(int(cp))]
    else:
        command += ["--cps", ",".join(str(c) for c in sizes)]
    if in_job and not replay:
        command += ["--cp", str(sizes[0])]
    if family:
        command += ["--family", family]
    if forms:
        command += ["--forms", ",".join(forms)]
    if seed is not None:
        command += ["--seed", str(int(seed))]
    if shard_primary:
        command += ["--shard-primary"]
    try:
        generator = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     universal_newlines=True, bufsize=1)
        last_failure = None  # the last failing verdict is the smallest failure's, whole
        number = 0
        try:
            for line in generator.stdout:
                line = line.rstrip("\n")
                if line == "done":
                    break
                if not line.startswith("case "):
                    raise RuntimeError("cpsim harness said %r" % line)
                number += 1
                why = (_job_verdict(line[len("case "):], step, number, int(dp)) if in_job
                       else _verdict(line[len("case "):], step, backend, timeout, int(dp)))
                if isinstance(why, _Outside):
                    answer = "outside " + " | ".join(why.splitlines())
                elif why:
                    last_failure = why
                    answer = "fail " + " | ".join(why.splitlines())  # its first line leads, the rest joined
                else:
                    answer = "ok"
                generator.stdin.write(answer + "\n")
                generator.stdin.flush()
        except BaseException:
            generator.kill()
            generator.wait()
            raise
        generator.stdin.close()
        errors = generator.stderr.read()
        code = generator.wait()
        if code not in (0, 1):
            raise RuntimeError("cpsim harness exited %d: %s" % (code, errors.strip()))
        with open(os.path.join(workdir, "result.json")) as f:
            result = json.load(f)
        if result["ok"]:
            return Checked(result["ran"], result.get("outside", 0), result.get("outside_why"))
        if last_failure is not None:
            result["failure"] = last_failure
        if "batch" not in result:
            raise CheckFailed("cpsim.torch.check: %s" % result["report"], result["failure"], None, None, None, plan)
        path = out or os.path.join(tempfile.gettempdir(), "cpsim-counterexample-%d.json" % os.getpid())
        with open(path, "w") as f:
            f.write(result["batch"])
        references = "cpsim check %s --cp %d" % (path, result["cp"])
        plan_arg = "equal"
        if result["cuts"] is not None:
            plan_arg = path + ".plan.json"
            with open(plan_arg, "w") as f:
                json.dump({"cuts": result["cuts"]}, f)
            references += " --plan " + plan_arg
        elif result["plan"] != "equal":
            plan_arg = result["plan"].split(":")[0]
            references += " --plan " + plan_arg
        again = "cpsim.torch.check(step, batch=%r, cp=%d, plan=%r, seed=%d)" % (path, result["cp"], plan_arg,
                                                                               result["seed"])
        message = ("cpsim.torch.check: %s\n%s failing layout (cp=%d, plan %s), saved to %s:\n%s"
                   "\nreplay the step with: %s\nreplay the references with: %s"
                   % (result["failure"], "the replayed" if replay else "smallest", result["cp"], result["plan"],
                      path, json.dumps(json.loads(result["batch"])), again, references))
        raise CheckFailed(message, result["failure"], result["batch"], path, result["cp"], plan_arg, result["seed"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
