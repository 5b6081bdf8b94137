#!/usr/bin/env python3
"""Check a context-parallel implementation against cpsim's golden vectors.

    build/cpsim golden examples/spec_example.json --cp 3 --out golden/
    /usr/bin/python3 examples/golden_check.py golden/             # the numpy implementation below
    /usr/bin/python3 examples/golden_check.py golden/ --torch     # the PyTorch one (needs torch)

Needs the standard library and numpy (torch optional): Debian's /usr/bin/python3
has numpy once `make` installed python3-numpy; another interpreter needs its own. Load the folder with
load_golden(), then hand your functions to check(): each receives what one
training step gives it (the batch, a rank's shard, ...) and returns numpy arrays
or torch tensors; check() compares them with every rank's expected values and
raises AssertionError naming the first difference.
"""
import json
import os
import struct
import sys

import numpy as np

_DTYPES = {"F64": "<f8", "F32": "<f4", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def load_safetensors(path):
    """A safetensors file as {key: numpy array} (BF16 widened to float32)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = body[begin:end]
        if entry["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=_DTYPES[entry["dtype"]])
        out[key] = arr.reshape(entry["shape"])
    return out


class Golden:
    def __init__(self, folder):
        with open(os.path.join(folder, "manifest.json")) as f:
            self.manifest = json.load(f)
        self.inputs = load_safetensors(os.path.join(folder, "inputs.safetensors"))
        self.reference = load_safetensors(os.path.join(folder, "reference.safetensors"))
        self.cp = self.manifest["cp"]
        self.ranks = [load_safetensors(os.path.join(folder, "rank_%d.safetensors" % r)) for r in range(self.cp)]
        self.batch = {k[len("batch."):]: v for k, v in self.inputs.items() if k.startswith("batch.")}


def load_golden(folder):
    return Golden(folder)


def _numpy(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def compare(name, got, want, tolerance=None):
    """Bitwise, or within a relative RMSE (rms(want - got) / rms(want)) when a tolerance is given."""
    got = _numpy(got)
    if got.shape != want.shape:
        raise AssertionError("%s: shape %s, expected %s" % (name, got.shape, want.shape))
    if tolerance is None:
        wrong = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        if wrong.size:
            i = wrong[0]
            raise AssertionError("%s: %d wrong elements, first at flat index %d: %r, expected %r"
                                 % (name, wrong.size, i, got.reshape(-1)[i], want.reshape(-1)[i]))
        return 0.0
    den = np.sqrt(np.mean(np.square(want.astype(np.float64)))) if want.size else 0.0
    num = np.sqrt(np.mean(np.square(want.astype(np.float64) - got.astype(np.float64)))) if want.size else 0.0
    err = 0.0 if num == 0 else (float("inf") if den == 0 else num / den)
    if err > tolerance:
        raise AssertionError("%s: relative RMSE %.3g > %.3g" % (name, err, tolerance))
    return err


def check(golden, shard=None, halo=None, gather=None, log=print):
    """Compares the given functions with every rank's expected values.

    shard(batch, rank, cp, pad_token_id) -> dict: the local batch after shard_batch
    halo(shards, width) -> list: every rank's convolution history [B, L+W-1, C]
    gather(shards) -> list: every rank's gathered tensor [B, P, C]
    (shards: the list of every rank's [B, L, C] shard of the activation x)
    """
    m = golden.manifest
    L, width = m["L"], m["conv_width"]
    x = golden.inputs["x"]
    shards = [x[:, r * L:(r + 1) * L] for r in range(golden.cp)]
    checked = 0
    if shard is not None:
        for r in range(golden.cp):
            local = shard(golden.batch, r, golden.cp, m["pad_token_id"])
            for key, want in golden.ranks[r].items():
                if key.startswith("batch."):
                    compare("rank %d %s" % (r, key), local[key[len("batch."):]], want)
                    checked += 1
    if halo is not None:
        for r, got in enumerate(halo(shards, width)):
            compare("rank %d halo" % r, got, golden.ranks[r]["halo"])
            checked += 1
    if gather is not None:
        for r, got in enumerate(gather(shards)):
            compare("rank %d gathered" % r, got, golden.ranks[r]["gathered"])
            checked += 1
    log("golden_check: %d comparisons hold (cp=%d, batch %s)" % (checked, golden.cp, m["batch"]))
    return checked


# ---------------------------------------------------------------------------
# A reference implementation in numpy: how a training step's CP code behaves.

_FILL = {"input_ids": None, "labels": -100, "padding_mask": True, "loss_mask": 0, "attention_mask": 0}


def numpy_shard(golden):
    """shard_batch (docs/sharding.md), from the reference layout the folder carries."""
    m = golden.manifest
    S, P, L = m["S"], m["P"], m["L"]
    ref = golden.reference

    def shard(batch, rank, cp, pad_token_id):
        out = {}
        rows = ref["padding"].shape[0]
        keys = [k for k in batch if k not in ("seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded")]
        keys += ["padding_mask", "position_ids"]
        for key in set(keys):
            if key == "padding_mask":
                src = ref["padding"]
            elif key == "position_ids":
                src = ref["position_ids"]
            else:
                src = batch[key].reshape(rows, S)
            fill = pad_token_id if key == "input_ids" else _FILL.get(key, 0)
            padded = np.empty((rows, P), dtype=src.dtype)
            padded[:, :S] = src
            if key == "position_ids":
                padded[:, S:] = src[:, S - 1:S] + np.arange(1, P - S + 1)
            else:
                padded[:, S:] = fill
            out[key] = padded if key == "input_ids" else padded[:, rank * L:(rank + 1) * L]
        return out

    return shard


def numpy_halo(shards, width):
    whole = np.concatenate(shards, axis=1)
    B, L, C = shards[0].shape
    H = width - 1
    padded = np.concatenate([np.zeros((B, H, C), dtype=whole.dtype), whole], axis=1)
    return [padded[:, r * L:r * L + L + H] for r in range(len(shards))]


def numpy_gather(shards):
    whole = np.concatenate(shards, axis=1)
    return [whole for _ in shards]


def torch_functions():
    import torch  # optional

    def halo(shards, width):
        ts = [torch.from_numpy(s.copy()) for s in shards]
        B, L, C = ts[0].shape
        whole = torch.cat([torch.zeros(B, width - 1, C, dtype=ts[0].dtype)] + ts, dim=1)
        return [whole[:, r * L:r * L + L + width - 1] for r in range(len(ts))]

    def gather(shards):
        whole = torch.cat([torch.from_numpy(s.copy()) for s in shards], dim=1)
        return [whole for _ in shards]

    return halo, gather


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    golden = load_golden(argv[1])
    if "--torch" in argv:
        halo, gather = torch_functions()
        check(golden, shard=numpy_shard(golden), halo=halo, gather=gather)
    else:
        check(golden, shard=numpy_shard(golden), halo=numpy_halo, gather=numpy_gather)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except AssertionError as e:
        print("golden_check: FAILED: %s" % e, file=sys.stderr)
        sys.exit(1)
