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
import math
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
        # Rank r holds [cuts[r], cuts[r+1]) of the padded row (the shard plan).
        m = self.manifest
        self.cuts = m.get("cuts") or [r * m["L"] for r in range(self.cp + 1)]
        self.ranks = [load_safetensors(os.path.join(folder, "rank_%d.safetensors" % r)) for r in range(self.cp)]
        # The batch as the file gave it (inputs.<key>), with cpsim's stand-ins for keys it did not give.
        self.batch = {k.split(".", 1)[1]: v for k, v in self.inputs.items()
                      if k.startswith("inputs.") or k.startswith("stand_in.")}


def load_golden(folder):
    return Golden(folder)


def _numpy(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


MEASURED = None  # a dict: compare() records each key's error there instead of failing on a tolerance


def _isnan(a):
    return np.isnan(a) if np.issubdtype(a.dtype, np.floating) else np.zeros(a.shape, dtype=bool)


def _nonfinite_mismatch(got, want):
    """The first position (index per axis) where one side holds a NaN or an inf that
    the other does not (the same non-finite value on both sides agrees), or None."""
    if not (np.issubdtype(got.dtype, np.floating) or np.issubdtype(want.dtype, np.floating)):
        return None
    g, w = got.astype(np.float64), want.astype(np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    off = np.argwhere(~(np.isfinite(g) & np.isfinite(w)) & ~same)
    return tuple(int(i) for i in off[0]) if len(off) else None


def relative_rmse(got, want, scale=None):
    """rms(want - got) / rms(scale) in float64 (scale: want itself unless given, e.g.
    the sums of a sum's absolute terms); 0 when they agree; inf when one side holds
    a NaN or an inf the other does not. Test it with `not err <= tolerance`: a NaN
    measure never passes."""
    if _nonfinite_mismatch(got, want) is not None:
        return float("inf")
    w, g = want.astype(np.float64), got.astype(np.float64)
    s = w if scale is None else np.asarray(scale).astype(np.float64)
    keep = np.isfinite(w) & np.isfinite(g)  # the same non-finite value on both sides agrees
    with np.errstate(over="ignore", invalid="ignore"):
        d = np.where(keep, w - g, 0.0)
        num = np.sqrt(np.mean(np.square(d))) if want.size else 0.0
        den = np.sqrt(np.mean(np.square(np.where(keep & np.isfinite(s), s, 0.0)))) if want.size else 0.0
    if num == 0:
        return 0.0
    return float("inf") if not den > 0 else float(num / den)


def compare(name, got, want, tolerance=None, scale=None):
    """Bitwise, or within a relative RMSE (rms(want - got) / rms(want), or / rms(scale)
    for a sum held to the sums of its absolute terms) when a tolerance is given. A
    failure names the key and the first position (index per axis) that differs; a
    NaN or an inf on one side only always fails."""
    got = _numpy(got)
    if got.shape != want.shape:
        raise AssertionError("%s: shape %s, expected %s" % (name, got.shape, want.shape))
    bad = _nonfinite_mismatch(got, want)
    if bad is not None and MEASURED is None:
        raise AssertionError("%s: %r at %s, expected %r (a NaN or an inf on one side only)"
                             % (name, got[bad], list(bad), want[bad]))
    if tolerance is None:
        wrong = np.argwhere((got != want) & ~(_isnan(got) & _isnan(want)))  # a NaN on both sides agrees
        if len(wrong):
            at = tuple(int(i) for i in wrong[0])
            raise AssertionError("%s: %d wrong elements, first at %s: %r, expected %r"
                                 % (name, len(wrong), list(at), got[at], want[at]))
        return 0.0
    err = relative_rmse(got, want, scale)
    if MEASURED is not None:
        key = name.split(" ", 2)[-1] if name.startswith("rank ") else name
        old = MEASURED.get(key, 0.0)
        if not (math.isnan(old) or old >= err):  # the worst, and a NaN stays
            MEASURED[key] = err
        return err
    if not err <= tolerance:
        w, g = want.astype(np.float64), got.astype(np.float64)
        s = w if scale is None else np.asarray(scale).astype(np.float64)
        den = np.sqrt(np.mean(np.square(s))) if want.size else 0.0
        off = np.argwhere(~(np.abs(w - g) <= tolerance * max(den, 1e-300)))
        at = tuple(int(i) for i in off[0]) if len(off) else ()
        measure = "relative RMSE" if scale is None else "RMSE relative to the summed terms"
        raise AssertionError("%s: %s %.3g > %.3g; first differs at %s: %r, expected %r"
                             % (name, measure, err, tolerance, list(at), got[at], want[at]))
    return err


# The loosest relative RMSE this check accepts from a folder, by the folder's
# dtype: its own bound, not the writer's (verify/golden.cpp's golden_tolerances
# are measured, about 4x the worst rounding; these sit above them). A folder
# whose tolerance were looser would let a wrong implementation pass.
CEILINGS = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}
# Keys that are copied or exchanged, never computed: bit for bit in every dtype.
BITWISE = ("gathered", "halo")
BITWISE_PREFIXES = ("batch.", "padded.")


def check_tolerances(golden):
    """Every compared key's tolerance in the manifest is one this check accepts:
    0 for integers, booleans and what is exchanged or copied; at most the
    folder dtype's ceiling for what is computed. Returns how many it read."""
    m = golden.manifest
    ceiling = CEILINGS.get(m["dtype"])
    if ceiling is None:
        raise AssertionError("manifest: dtype %r, not one of %s" % (m["dtype"], sorted(CEILINGS)))
    read = 0
    for file, keys in m["files"].items():
        if file == "inputs.safetensors":
            continue
        for key, entry in keys.items():
            tolerance = entry.get("tolerance")
            name = "%s %s" % (file, key)
            if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool):
                raise AssertionError("%s: no tolerance in the manifest" % name)
            exact = "float" not in entry["dtype"] or key in BITWISE or key.startswith(BITWISE_PREFIXES)
            if exact and tolerance != 0:
                raise AssertionError("%s: tolerance %g in the manifest, but it is compared bit for bit"
                                     % (name, tolerance))
            if not tolerance <= ceiling:
                raise AssertionError("%s: tolerance %g in the manifest is looser than %s arithmetic needs (at most %g)"
                                     % (name, tolerance, m["dtype"], ceiling))
            read += 1
    return read


def check(golden, layout=None, shard=None, cp_context=None, halo=None, gather=None, gather_backward=None, conv=None,
          recurrence=None, rope=None, attention=None, targets=None, loss=None, log=print):
    """Compares the given functions with every rank's expected values.

    layout(batch) -> (doc_ids, padding, position_ids), each [B, S] (mRoPE's
        position_ids [3, B, S]): the layout of the raw batch (docs/layout.md)
    shard(batch, rank, cp, pad_token_id) -> dict: the local batch after shard_batch
    cp_context(doc_ids, cuts) -> list: for every rank a dict with "local_doc_ids"
        [B, L], "row_cu_seqlens" (one list per row) and the recurrent CP context
        fields "pre_num_conv_tokens", "pre_num_ranks", "post_num_ranks",
        "is_first_rank", "is_last_rank" (one value per row); doc_ids: the global
        padded doc ids [B, P]; cuts: the shard plan, rank r holding
        [cuts[r], cuts[r+1]) (manifest["cuts"]; equal intervals unless --plan)
    gather_backward(upstream, cuts) -> list: every rank's gradient [B, L, C] of
        its x shard through gather_sequence, upstream[q] being rank q's [B, P] gradient
    conv(x, doc_ids, weight, bias, grad_y) -> list of dicts with "y", "dx" (the
        x shard's gradient, halo returns included), "dw_partial", "dbias_partial"
        (before the sum over ranks) and "halo_grad" [B, L+W-1, C]: the packed
        causal depthwise conv (manifest["conventions"]["conv_taps"]) and its
        backward for grad_y; doc_ids: each rank's local doc ids
    recurrence(q, k, v, beta, g, doc_ids, grad_o) -> list of dicts with "o",
        "dq", "dk", "dv", "dbeta", "dg": the gated delta rule (no q scaling,
        manifest["conventions"]["recurrence"]) and its gradients; optionally the
        intermediates "initial_state" (the folded state the rank's first token
        starts from), "final_state", and the transition of its last local
        segment "transition_m" [B, H, K, K], "transition_s_ext" [B, H, K, V]
    halo(shards, width) -> list: every rank's convolution history [B, L+W-1, C]
    gather(shards) -> list: every rank's gathered tensor [B, P, C]
    (shards: the list of every rank's [B, L, C] shard of the activation x; L is
    each rank's own length, and may be 0, under a shard plan of unequal intervals)

    The layers that consume the layout (docs/operators.md, "The layers"); each
    takes lists with one entry per rank, that rank's shard, and returns one
    result per rank:
    rope(x, positions) -> list: each rank's x [B, L, H, D] turned by its
        position_ids [B, L] or mRoPE's [3, B, L] (interleaved pairs, base
        manifest["rope_base"])
    attention(q, k, v, positions, doc_ids, padding, grad_o, topk=None,
              index_q=None, index_k=None) -> list of dicts with "o", "dq", "dk",
        "dv" (and "kept" [B, L, topk] when topk is given): RoPE on q and k by
        position, then document-masked causal attention over the gathered K/V
        (scale manifest["softmax_scale"]), and the gradients of the unrotated
        q, k, v for the upstream grad_o; with topk, the top-k sparse form
        whose indexer scores index_q . index_k
    targets(tokens, doc_ids, padding) -> [B, P]: next-token targets on whole rows
    loss(logits, targets) -> list of (loss, grad_logits): every rank's
        token-mean cross entropy across ranks and its logits' gradient
    """
    check_tolerances(golden)  # the folder's own tolerances first: every comparison below reads them
    m = golden.manifest
    cuts, width = golden.cuts, m["conv_width"]
    x = golden.inputs["x"]
    shards = [x[:, cuts[r]:cuts[r + 1]] for r in range(golden.cp)]
    checked = 0

    def per_rank(key):
        return [golden.ranks[r][key] for r in range(golden.cp)]

    def split(key):
        t = golden.inputs[key]
        return [t[:, cuts[r]:cuts[r + 1]] for r in range(golden.cp)]

    positions, doc_ids, padding = per_rank("batch.position_ids"), per_rank("local_doc_ids"), per_rank("batch.padding_mask")
    ref = golden.reference
    S, cp = m["S"], golden.cp

    def tolerance(r, key):
        return golden.manifest["files"]["rank_%d.safetensors" % r][key]["tolerance"] or None

    def against(r, key, got):
        entry = golden.manifest["files"]["rank_%d.safetensors" % r][key]
        # A sum over ranks names the key of its terms' magnitudes, the scale it is held to.
        scale = golden.ranks[r][entry["scale"]] if entry.get("scale") else None
        try:
            compare("rank %d %s" % (r, key), got, golden.ranks[r][key], tolerance(r, key), scale)
        except AssertionError as e:
            see = golden.manifest["files"]["rank_%d.safetensors" % r][key]["see"]
            raise AssertionError("%s (%s)" % (e, see)) from None

    def against_reference(name, got, key, view=lambda t: t):
        entry = golden.manifest["files"]["reference.safetensors"][key]
        try:
            compare(name, got, view(ref[key]), entry["tolerance"] or None)
        except AssertionError as e:
            raise AssertionError("%s (%s)" % (e, entry["see"])) from None

    if layout is not None:
        ids, pad, pos = layout(golden.batch)
        against_reference("layout doc_ids", ids, "doc_ids", lambda t: t[:, :S])
        against_reference("layout padding", pad, "padding")
        against_reference("layout position_ids", pos, "position_ids")
        checked += 3
    if cp_context is not None:
        for r, got in enumerate(cp_context(ref["doc_ids"], cuts)):
            against(r, "local_doc_ids", got["local_doc_ids"])
            for b, cu in enumerate(got["row_cu_seqlens"]):
                against(r, "row_cu_seqlens.%d" % b, np.asarray(cu, dtype=np.int64))
            for field in ("pre_num_conv_tokens", "pre_num_ranks", "post_num_ranks", "is_first_rank", "is_last_rank"):
                want = golden.ranks[r]["cp_context." + field]
                against(r, "cp_context." + field, np.asarray(got[field], dtype=want.dtype))
            checked += 7
    if gather_backward is not None:
        upstream = [golden.inputs["gather_grad.%d" % q] for q in range(cp)]
        for r, got in enumerate(gather_backward(upstream, cuts)):
            against(r, "gather_grad_x", got)
            checked += 1
    if conv is not None:
        parts = conv(shards, doc_ids, golden.inputs["conv_weight"], golden.inputs["conv_bias"], split("conv_grad_y"))
        for r, got in enumerate(parts):
            for name, key in (("y", "conv_y"), ("dx", "conv_dx"), ("dw_partial", "conv_dw_partial"),
                              ("dbias_partial", "conv_dbias_partial"), ("halo_grad", "halo_grad")):
                against(r, key, got[name])
                checked += 1
        against_reference("conv_dw (the partials summed)", sum(_numpy(p["dw_partial"]) for p in parts), "conv_dw")
        checked += 1
    if recurrence is not None:
        got = recurrence(split("q"), split("k"), split("v"), split("beta"), split("g"), doc_ids,
                         split("recurrence_grad_o"))
        for r, out in enumerate(got):
            for key in ("o", "dq", "dk", "dv", "dbeta", "dg"):
                against(r, key, out[key])
                checked += 1
            for key in ("initial_state", "final_state", "transition_m", "transition_s_ext"):
                if key in out:  # the intermediates, when the hook gives them
                    against(r, "recurrence_" + key, out[key])
                    checked += 1
    if shard is not None:
        for r in range(golden.cp):
            local = shard(golden.batch, r, golden.cp, m["pad_token_id"])
            for key, want in golden.ranks[r].items():
                if key.startswith("batch."):
                    against(r, key, local[key[len("batch."):]])
                    checked += 1
    if halo is not None:
        for r, got in enumerate(halo(shards, width)):
            against(r, "halo", got)
            checked += 1
    if gather is not None:
        for r, got in enumerate(gather(shards)):
            against(r, "gathered", got)
            checked += 1
    if rope is not None:
        for key in ("q", "k"):
            for r, got in enumerate(rope(split("attention_" + key), positions)):
                against(r, "rope_" + key, got)
                checked += 1
    if attention is not None:
        for prefix, topk in (("attention_", None), ("sparse_attention_", m["topk"])):
            extra = {} if topk is None else {"topk": topk, "index_q": split("index_q"), "index_k": split("index_k")}
            got = attention(split("attention_q"), split("attention_k"), split("attention_v"), positions, doc_ids,
                            padding, split("attention_grad_o"), **extra)
            for r, out in enumerate(got):
                if topk is not None:
                    against(r, prefix + "kept", out["kept"])
                for name in ("o", "dq", "dk", "dv"):
                    against(r, prefix + name, out[name])
                checked += 5 if topk is not None else 4
    if targets is not None:
        whole_ids = np.concatenate(doc_ids, axis=1)
        whole_padding = np.concatenate(padding, axis=1)
        whole_targets = targets(golden.inputs["loss_tokens"], whole_ids, whole_padding)
        against_reference("targets", whole_targets, "targets")
        # Every rank's own targets are its interval of the whole rows' (what its loss reads).
        for r in range(cp):
            against(r, "targets", whole_targets[:, cuts[r]:cuts[r + 1]])
        checked += 1 + cp
    if loss is not None:
        for r, (value, grad) in enumerate(loss(split("logits"), per_rank("targets"))):
            against(r, "loss", np.reshape(_numpy(value), (1,)))
            against(r, "loss_grad_logits", grad)
            checked += 2
    log("golden_check: %d comparisons hold (cp=%d, batch %s)" % (checked, golden.cp, m["batch"]))
    return checked


# ---------------------------------------------------------------------------
# A reference implementation in numpy: how a training step's CP code behaves.

_FILL = {"input_ids": None, "labels": -100, "padding_mask": True, "loss_mask": 0, "attention_mask": 0}
_LENGTH_KEYS = ("seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded")


def _rows(t):
    return t.reshape(1, -1) if t.ndim == 1 else t


def numpy_layout(batch):
    """docs/layout.md from the raw batch: doc ids (i + 1 over document i's
    occupied span, 0 beyond), padding (decided from lengths, never token ids) and
    positions (given, or the offset inside the occupied span; tail padding
    continues the last position)."""
    tokens = _rows(batch["input_ids"] if "input_ids" in batch
                   else next(v for k, v in sorted(batch.items()) if k not in _LENGTH_KEYS))
    B, S = tokens.shape
    ids, pad = np.zeros((B, S), np.int64), np.ones((B, S), bool)

    def cu_lengths(key):
        cu = batch[key].reshape(-1).astype(np.int64)
        return list(np.diff(cu[cu >= 0]))

    # Given positions as planes [K, B, S]: K = 1, or mRoPE's 3 (temporal, height, width).
    planes = batch["position_ids"].astype(np.int64).reshape(-1, B, S) if "position_ids" in batch else None
    given_pos = None if planes is None else planes[0] if len(planes) == 1 else planes
    for b in range(B):
        if "seq_lens" in batch:
            real = [int(n) for n in _rows(batch["seq_lens"])[b] if n >= 0]
            occupied = [int(n) for n in _rows(batch["seq_lens_padded"])[b] if n >= 0] \
                if "seq_lens_padded" in batch else real
        elif "cu_seqlens" in batch or "cu_seqlens_padded" in batch:
            real = cu_lengths("cu_seqlens" if "cu_seqlens" in batch else "cu_seqlens_padded")
            occupied = cu_lengths("cu_seqlens_padded" if "cu_seqlens_padded" in batch else "cu_seqlens")
        else:
            real = None
        if real is not None:
            start = 0
            for i, (n, span) in enumerate(zip(real, occupied)):
                end = min(start + span, S)
                ids[b, start:end] = i + 1
                pad[b, start:end] = np.arange(end - start) >= n
                start += span
        else:  # unpacked: a document per row, or one per reset of the given positions to 0
            if "padding_mask" in batch:
                pad[b] = _rows(batch["padding_mask"])[b] != 0
            elif "attention_mask" in batch:
                pad[b] = _rows(batch["attention_mask"])[b] == 0
            else:
                pad[b] = False
            documents = 0
            for s in np.flatnonzero(~pad[b]):
                if documents == 0 or (planes is not None and not planes[:, b, s].any()):
                    documents += 1
                ids[b, s] = documents if given_pos is not None else 1
    if given_pos is not None:
        return ids, pad, given_pos
    pos = np.zeros((B, S), np.int64)
    for b in range(B):
        real_end = (np.flatnonzero(ids[b]) + 1).max(initial=0)
        for s in range(1, S):
            pos[b, s] = pos[b, s - 1] + 1 if (ids[b, s] == ids[b, s - 1] or s >= real_end) else 0
    return ids, pad, pos


def numpy_shard(golden):
    """shard_batch (docs/sharding.md): the layout derived from the raw batch, every
    key padded to P with its fill value, this rank's slice (input_ids stay global)."""
    m = golden.manifest
    S, P, cuts = m["S"], m["P"], golden.cuts

    def shard(batch, rank, cp, pad_token_id):
        ids, padding, positions = numpy_layout(batch)
        rows = ids.shape[0]
        out = {}
        keys = [k for k in batch if k not in _LENGTH_KEYS] + ["padding_mask", "position_ids"]
        for key in set(keys):
            src = {"padding_mask": padding, "position_ids": positions}.get(key)
            if src is None:
                src = batch[key].reshape(rows, S).astype(np.int64)
            fill = pad_token_id if key == "input_ids" else _FILL.get(key, 0)
            padded = np.empty(src.shape[:-1] + (P,), dtype=src.dtype)  # mRoPE's positions: [3, B, P]
            padded[..., :S] = src
            if key == "position_ids":
                padded[..., S:] = src[..., S - 1:S] + np.arange(1, P - S + 1)
            else:
                padded[..., S:] = fill
            keep_global = key == "input_ids" and not m.get("shard_primary", False)
            out[key] = padded if keep_global else padded[..., cuts[rank]:cuts[rank + 1]]
        return out

    return shard


def _runs(row):
    """Boundaries of the runs of equal ids of a row: [0, ..., len(row)]."""
    change = np.flatnonzero(row[1:] != row[:-1]) + 1
    return [0] + [int(c) for c in change] + [len(row)]


def numpy_cp_context(doc_ids, cuts):
    """Every rank's local doc ids, local segments and recurrent CP context (the
    segments are the runs of equal ids, padding runs included). A rank with an
    empty interval has no segments and reaches nobody; no rank counts it."""
    B, P = doc_ids.shape
    cp = len(cuts) - 1
    out = []
    for r in range(cp):
        lo, hi = cuts[r], cuts[r + 1]
        ctx = {"local_doc_ids": doc_ids[:, lo:hi], "row_cu_seqlens": [], "pre_num_conv_tokens": [],
               "pre_num_ranks": [], "post_num_ranks": []}
        for b in range(B):
            if hi == lo:
                for field, value in (("row_cu_seqlens", [0]), ("pre_num_conv_tokens", 0), ("pre_num_ranks", 0),
                                     ("post_num_ranks", 0)):
                    ctx[field].append(value)
                continue
            ctx["row_cu_seqlens"].append(_runs(doc_ids[b, lo:hi]))
            runs = _runs(doc_ids[b])
            first_start = max(c for c in runs if c <= lo)           # the segment holding position lo
            last_end = min(c for c in runs if c >= hi)              # the segment holding position hi - 1
            ctx["pre_num_conv_tokens"].append(lo - first_start)
            # Ranks holding positions of those segments (an empty interval holds none).
            ctx["pre_num_ranks"].append(sum(1 for q in range(r) if cuts[q] < cuts[q + 1] and cuts[q + 1] > first_start))
            ctx["post_num_ranks"].append(sum(1 for q in range(r + 1, cp) if cuts[q] < cuts[q + 1] and cuts[q] < last_end))
        ctx["is_first_rank"] = [n == 0 for n in ctx["pre_num_ranks"]]
        ctx["is_last_rank"] = [n == 0 for n in ctx["post_num_ranks"]]
        out.append(ctx)
    return out


def numpy_gather_backward(upstream, cuts):
    cp = len(upstream)
    out = []
    for r in range(cp):
        grad = upstream[0][:, cuts[r]:cuts[r + 1]].copy()
        for q in range(1, cp):  # in rank order
            grad = grad + upstream[q][:, cuts[r]:cuts[r + 1]]
        out.append(grad)
    return out


def _cuts(parts):
    """The shard plan of every rank's part along the sequence: [0, ..., P]."""
    return [0] + [int(c) for c in np.cumsum([p.shape[1] for p in parts])]


def _segment_starts(ids):
    """For every position of every row, where its run of equal ids starts."""
    B, P = ids.shape
    start = np.zeros((B, P), np.int64)
    for b in range(B):
        for t in range(1, P):
            start[b, t] = start[b, t - 1] if ids[b, t] == ids[b, t - 1] else t
    return start


def numpy_conv(x, doc_ids, weight, bias, grad_y):
    """The packed causal depthwise conv over the joined shards; each rank's part of
    the backward is that of its own outputs."""
    cp, cuts = len(x), _cuts(x)
    X, ids, GY = np.concatenate(x, axis=1), np.concatenate(doc_ids, axis=1), np.concatenate(grad_y, axis=1)
    B, P, C = X.shape
    W = weight.shape[1]
    start = _segment_starts(ids)
    Y = np.broadcast_to(bias, X.shape).copy()
    for t in range(P):
        for j in range(W):
            p = t - (W - 1) + j
            if p < 0:
                continue
            live = (p >= start[:, t])[:, None]
            Y[:, t] += np.where(live, weight[:, j] * X[:, p], 0.0)
    out = []
    for r in range(cp):
        lo_r, hi_r = cuts[r], cuts[r + 1]
        dX, dw, db = np.zeros_like(X), np.zeros_like(weight), GY[:, lo_r:hi_r].sum(axis=(0, 1))
        for t in range(lo_r, hi_r):
            for j in range(W):
                p = t - (W - 1) + j
                if p < 0:
                    continue
                live = (p >= start[:, t])[:, None]
                dX[:, p] += np.where(live, weight[:, j] * GY[:, t], 0.0)
                dw[:, j] += np.where(live, X[:, p] * GY[:, t], 0.0).sum(axis=0)
        lo = lo_r - (W - 1)
        halo = np.zeros((B, hi_r - lo_r + W - 1, C), dtype=X.dtype)
        halo[:, max(0, -lo):] = dX[:, max(lo, 0):hi_r]
        out.append({"y": Y[:, lo_r:hi_r], "dw_partial": dw, "dbias_partial": db, "halo_grad": halo,
                    "dX": dX})
    total = sum(o.pop("dX") for o in out)
    for r, o in enumerate(out):
        o["dx"] = total[:, cuts[r]:cuts[r + 1]]
    return out


def numpy_recurrence(q, k, v, beta, g, doc_ids, grad_o):
    """The gated delta rule token by token over the joined shards (S = 0 at every
    segment start), and its backward by hand."""
    cp, cuts = len(q), _cuts(q)
    join = lambda parts: np.concatenate(parts, axis=1)
    Q, K, V, Bt, G, ids, DO = join(q), join(k), join(v), join(beta), join(g), join(doc_ids), join(grad_o)
    B, P, H, Kd = Q.shape
    grads = {name: np.zeros_like(t) for name, t in (("dq", Q), ("dk", K), ("dv", V), ("dbeta", Bt), ("dg", G))}
    O = np.zeros_like(V)
    eye = np.eye(Kd, dtype=Q.dtype)
    Vd = V.shape[-1]
    inter = {name: np.zeros((cp, B, H, Kd, n)) for name, n in (("initial_state", Vd), ("final_state", Vd),
                                                                  ("transition_m", Kd), ("transition_s_ext", Vd))}
    for b in range(B):
        for h in range(H):
            states, prevs, mats = [], [], []
            S = None
            for t in range(P):
                if t == 0 or ids[b, t] != ids[b, t - 1]:
                    S = np.zeros((Kd, V.shape[-1]), dtype=Q.dtype)
                kk, e, bt = K[b, t, h], np.exp(G[b, t, h]), Bt[b, t, h]
                A = (eye - bt * np.outer(kk, kk)) * e[None, :]
                prevs.append(S)
                mats.append(A)
                S = A @ S + bt * np.outer(kk, V[b, t, h])
                states.append(S)
                O[b, t, h] = S.T @ Q[b, t, h]
            for r in range(cp):
                lo, hi = cuts[r], cuts[r + 1]
                if hi == lo:  # an empty interval: no tokens, no segment (zeros, as cpsim writes)
                    continue
                starts_here = lo == 0 or ids[b, lo] != ids[b, lo - 1]
                inter["initial_state"][r, b, h] = 0 if starts_here else states[lo - 1]
                inter["final_state"][r, b, h] = states[hi - 1]
                first = max([t for t in range(lo, hi) if t == 0 or ids[b, t] != ids[b, t - 1]], default=lo)
                M, ext = eye.copy(), np.zeros((Kd, Vd), dtype=Q.dtype)
                for t in range(first, hi):
                    M = mats[t] @ M
                    ext = mats[t] @ ext + Bt[b, t, h] * np.outer(K[b, t, h], V[b, t, h])
                inter["transition_m"][r, b, h], inter["transition_s_ext"][r, b, h] = M, ext
            dS = np.zeros_like(S)
            for t in reversed(range(P)):
                if t == P - 1 or ids[b, t + 1] != ids[b, t]:
                    dS = np.zeros_like(dS)  # nothing flows back from the next segment
                kk, vv, e, bt, A, prev = K[b, t, h], V[b, t, h], np.exp(G[b, t, h]), Bt[b, t, h], mats[t], prevs[t]
                dS = dS + np.outer(Q[b, t, h], DO[b, t, h])
                grads["dq"][b, t, h] = states[t] @ DO[b, t, h]
                dA = dS @ prev.T
                ke = kk * e
                grads["dbeta"][b, t, h] = np.sum(dS * np.outer(kk, vv)) - kk @ dA @ ke
                grads["dk"][b, t, h] = bt * (dS @ vv) - bt * (dA @ ke + e * (dA.T @ kk))
                grads["dv"][b, t, h] = bt * (dS.T @ kk)
                grads["dg"][b, t, h] = (np.diag(dA) - bt * kk * (dA.T @ kk)) * e
                dS = A.T @ dS
    out = []
    for r in range(cp):
        cut = slice(cuts[r], cuts[r + 1])
        one = {"o": O[:, cut]}
        one.update({name: t[:, cut] for name, t in grads.items()})
        one.update({name: t[r] for name, t in inter.items()})
        out.append(one)
    return out


def numpy_halo(shards, width):
    whole = np.concatenate(shards, axis=1)
    cuts = _cuts(shards)
    B, _, C = shards[0].shape
    H = width - 1
    padded = np.concatenate([np.zeros((B, H, C), dtype=whole.dtype), whole], axis=1)
    return [padded[:, cuts[r]:cuts[r + 1] + H] for r in range(len(shards))]


def numpy_gather(shards):
    whole = np.concatenate(shards, axis=1)
    return [whole for _ in shards]


def numpy_rope(x, positions, base=10000.0):
    """Each rank's x turned by its positions: [B, L], or mRoPE's [3, B, L], where
    pair m reads the plane of its run (temporal, height, width; height and width
    3/8 of the pairs each, at least one: Qwen2-VL's [16, 24, 24] of 64)."""
    out = []
    for xs, pos in zip(x, positions):
        D = xs.shape[-1]
        pairs = np.arange(D // 2)
        if pos.ndim == 3:
            side = max(1, (D // 2) * 3 // 8)
            plane = np.where(pairs >= D // 2 - side, 2, np.where(pairs >= D // 2 - 2 * side, 1, 0))
            pos = np.moveaxis(pos[plane], 0, -1)  # [B, L, D/2]: each pair's position
        else:
            pos = pos[..., None]
        theta = pos.astype(np.float64) * base ** (-2.0 * pairs / D)  # [B, L, D/2]
        cos, sin = np.cos(theta)[:, :, None, :], np.sin(theta)[:, :, None, :]
        even, odd = xs[..., 0::2], xs[..., 1::2]
        y = np.empty_like(xs)
        y[..., 0::2] = even * cos - odd * sin
        y[..., 1::2] = even * sin + odd * cos
        out.append(y)
    return out


def numpy_attention(q, k, v, positions, doc_ids, padding, grad_o, topk=None, index_q=None, index_k=None):
    """Every rank's queries over the gathered keys: the ranks' shards are joined
    (what gather_sequence gives every rank), and each rank keeps its slice."""
    cp, cuts = len(q), _cuts(q)
    join = lambda parts: np.concatenate(parts, axis=1)
    pos, ids, pad = np.concatenate(positions, axis=-1), join(doc_ids), join(padding)  # mRoPE's: [3, B, P]
    Q, K, V, G = numpy_rope([join(q)], [pos])[0], numpy_rope([join(k)], [pos])[0], join(v), join(grad_o)
    B, S, H, D = Q.shape
    scale = 1.0 / np.sqrt(D)
    O, dQ, dK, dV = np.zeros_like(V), np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    kept = np.full((B, S, topk if topk is not None else 0), -1, dtype=np.int64)
    for b in range(B):
        for i in range(S):
            if pad[b, i] or ids[b, i] == 0:
                continue
            seen = [j for j in range(i + 1) if not pad[b, j] and ids[b, j] == ids[b, i]]
            if topk is not None:
                iq, ik = join(index_q), join(index_k)
                seen = sorted(sorted(seen, key=lambda j: (-float(iq[b, i] @ ik[b, j]), j))[:topk])
                kept[b, i, :len(seen)] = seen
            if not seen:
                continue
            s = scale * np.einsum("hd,jhd->hj", Q[b, i], K[b, seen])
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            O[b, i] = np.einsum("hj,jhd->hd", p, V[b, seen])
            dp = np.einsum("hd,jhd->hj", G[b, i], V[b, seen])
            ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
            dQ[b, i] = scale * np.einsum("hj,jhd->hd", ds, K[b, seen])
            dK[b, seen] += scale * np.einsum("hj,hd->jhd", ds, Q[b, i])
            dV[b, seen] += np.einsum("hj,hd->jhd", p, G[b, i])
    # Back through RoPE: the inverse rotation.
    dQ, dK = numpy_rope([dQ], [-pos])[0], numpy_rope([dK], [-pos])[0]
    out = []
    for r in range(cp):
        cut = slice(cuts[r], cuts[r + 1])
        one = {"o": O[:, cut], "dq": dQ[:, cut], "dk": dK[:, cut], "dv": dV[:, cut]}
        if topk is not None:
            one["kept"] = kept[:, cut]
        out.append(one)
    return out


def numpy_targets(tokens, doc_ids, padding):
    targets = np.full(tokens.shape, -100, dtype=np.int64)
    same = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] != 0) & ~padding[:, :-1] & ~padding[:, 1:]
    targets[:, :-1] = np.where(same, tokens[:, 1:], -100)
    return targets


def numpy_loss(logits, targets):
    """Each rank sums its per-token losses and counts its targets; both summed
    over ranks (the all-reduce); loss = sum / count."""
    sums, counts, grads = [], [], []
    for z, t in zip(logits, targets):
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        real = t >= 0
        picked = np.take_along_axis(p, np.where(real, t, 0)[..., None], axis=-1)[..., 0]
        sums.append(-np.log(picked[real]).sum())
        counts.append(real.sum())
        onehot = np.zeros_like(p)
        np.put_along_axis(onehot, np.where(real, t, 0)[..., None], 1.0, axis=-1)
        grads.append((p - onehot) * real[..., None])
    total, count = sum(sums), sum(counts)
    return [(np.array([total / count if count else 0.0]), g / count if count else g) for g in grads]


def numpy_functions(golden):
    """Every hook of check(), from the numpy implementation above."""
    return {"layout": numpy_layout, "shard": numpy_shard(golden), "cp_context": numpy_cp_context,
            "halo": numpy_halo, "gather": numpy_gather, "gather_backward": numpy_gather_backward,
            "conv": numpy_conv, "recurrence": numpy_recurrence, "rope": numpy_rope,
            "attention": numpy_attention, "targets": numpy_targets, "loss": numpy_loss}


def torch_functions():
    import torch  # optional

    def halo(shards, width):
        ts = [torch.from_numpy(s.copy()) for s in shards]
        cuts = _cuts(shards)
        B, _, C = ts[0].shape
        whole = torch.cat([torch.zeros(B, width - 1, C, dtype=ts[0].dtype)] + ts, dim=1)
        return [whole[:, cuts[r]:cuts[r + 1] + width - 1] for r in range(len(ts))]

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
        check(golden, **numpy_functions(golden))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except AssertionError as e:
        print("golden_check: FAILED: %s" % e, file=sys.stderr)
        sys.exit(1)
