"""One case of cpsim.torch.check as the step sees it: the golden folder cpsim
harness wrote (Golden) and one rank's view of it (RankCase)."""
import json
import os
import struct

import torch

from cpsim.layer import drawn as _drawn, generator as _generator
from cpsim.leak import redrawn_activation, redrawn_batch
from cpsim.mesh import world_rank
from cpsim.outputs import RECURRENCE_INPUTS

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


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

    def __init__(self, golden, rank, dp=1, dp_rank=0, unsharded=False, mesh="dp,cp", redraw=None):
        m = golden.manifest
        # unsharded: the whole case on a group of one (a Layer's reference run):
        # cp 1, the S positions of the rows (no CP padding).
        cuts = [0, m["S"]] if unsharded else golden.cuts
        lo, hi = cuts[rank], cuts[rank + 1]
        self.rank, self.cp = rank, (1 if unsharded else golden.cp)
        self._seed, self._lo, self._hi, self._P = m["seed"], lo, hi, m["P"]
        self._dtype, self._B = golden.inputs["x"].dtype, golden.inputs["x"].shape[0]
        # Data parallel replicas (check(dp=D)): D CP groups, laid out as `mesh`
        # says (world_rank). The case is one global batch of a multiple of D rows
        # ([B, S] row forms: the draw gives them); replica d trains on its own
        # B / D of them, `rows` (every row at dp 1 and in the unsharded run,
        # which holds every replica's rows). cpsim's operator outputs are
        # compared on every row (every replica the whole case); "layer",
        # "user_loss" and "train" on the replica's rows.
        self.dp, self.dp_rank, self.mesh = dp, dp_rank, mesh
        self.world_rank = world_rank(rank, dp_rank, self.cp, dp, mesh)
        k = 1 if unsharded else golden.microbatches
        if self._B % (dp * k):
            raise ValueError("the batch has %d rows; check(dp=%d, microbatches=%d) gives each replica's microbatch "
                             "its own rows of it: a multiple of %d rows" % (self._B, dp, k, dp * k))
        share = self._B // dp
        self.rows = slice(dp_rank * share, (dp_rank + 1) * share)
        # Gradient accumulation (check(microbatches=K)): the replica's rows in K
        # microbatches, in order (one, every row, in the unsharded run).
        self.microbatches = [slice(self.rows.start + i * (share // k), self.rows.start + (i + 1) * (share // k))
                             for i in range(k)]
        self.batch = {k: v.clone() for k, v in golden.batch.items()}
        # The leak property's run (cpsim.leak): some positions' inputs drawn again.
        self._redraw = redraw
        if redraw is not None:
            self.batch = redrawn_batch(self.batch, redraw, self._seed, m["S"])
        self.pad_token_id = m["pad_token_id"]
        self.conv_width = m["conv_width"]
        # Whether case.recurrence's gates were drawn live (check(live_gates_every=N)).
        self.live_gates = bool(m.get("live_gates", False))
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

    @property
    def replica_batch(self):
        """The rows of case.batch this replica trains on (case.rows; the whole
        batch at dp 1 and in the unsharded run), global [b, S] tensors (mRoPE's
        position_ids [3, b, S])."""
        if self.dp == 1:  # every row (a THD stream's [S] too)
            return {k: v.clone() for k, v in self.batch.items()}
        return {k: (v[:, self.rows] if k == "position_ids" and v.dim() == 3 else v[self.rows]).clone()
                for k, v in self.batch.items()}

    def activation(self, name, *tail, dtype=None):
        """This rank's slice [b, L, *tail] of an activation drawn for the case
        from its seed and `name` (standard normal; the case's dtype unless
        given), a leaf that requires grad: the same global tensor on every
        rank and in the unsharded run, at this replica's rows (case.rows), for
        the inputs of a "layer", "user_loss" or "train" output."""
        whole = _drawn(self._seed, "activation." + name, (self._B, self._P) + tuple(tail), dtype or self._dtype)
        if self._redraw is not None:
            whole = redrawn_activation(whole, self._redraw, self._seed, name)
        return whole[self.rows, self._lo:self._hi].clone().requires_grad_(True)

    def generator(self, name):
        """A torch.Generator seeded from the case's seed and `name`: the same
        draws on every rank and in the unsharded run (a model's initial
        weights), apart from the process's default generator, which the rank
        threads share."""
        return _generator(self._seed, name)

    def device_mesh(self):
        """The (dp, cp) DeviceMesh of the case's ranks, laid out as check(mesh=...)
        says; mesh["cp"] is this rank's CP submesh, mesh["dp"] its DP one."""
        from torch.distributed.device_mesh import init_device_mesh
        if self.mesh == "dp,cp":
            return init_device_mesh("cpu", (self.dp, self.cp), mesh_dim_names=("dp", "cp"))
        return init_device_mesh("cpu", (self.cp, self.dp), mesh_dim_names=("cp", "dp"))

    def __repr__(self):
        return "RankCase(rank=%d, cp=%d, dp_rank=%d, dp=%d, rows=%d:%d, S=%d, P=%d)" % (
            self.rank, self.cp, self.dp_rank, self.dp, self.rows.start, self.rows.stop, self.S, self.P)


class Golden:
    """A case's golden folder: its manifest, inputs, references and each rank's
    expected values (read when first asked for)."""

    def __init__(self, folder, tolerance=None, microbatches=1):
        with open(os.path.join(folder, "manifest.json")) as f:
            self.manifest = json.load(f)
        self.tolerance_given, self.microbatches = tolerance, int(microbatches)
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
        """The relative RMSE an output is compared within: the manifest's for its
        dtype, or check()'s `tolerance`; 0 (bitwise) stays bitwise."""
        written = self.manifest["files"][file][key]["tolerance"] or 0.0
        return float(self.tolerance_given) if written and self.tolerance_given is not None else written
