"""NeMo Automodel's context-parallel batch code (nemo-automodel 0.7.0), unmodified,
on cpsim's ranks, property-tested by cpsim.torch.check:

    .venv/bin/python examples/libraries/automodel_step.py kimi        # Kimi-Linear's CP
    .venv/bin/python examples/libraries/automodel_step.py contiguous  # the contiguous sharder
    .venv/bin/python examples/libraries/automodel_step.py thd         # the THD input utility
    .venv/bin/python examples/libraries/automodel_step.py kimi --variant rank_from_world

Each step calls Automodel's own functions on the raw batch cpsim draws and
returns what they give, in cpsim's terms:

* `kimi`: `components.models.kimi_linear.cp`: `shard_batch_for_kimi_cp` (the
  padded, contiguously sliced batch and the KimiPackedContext: global doc ids,
  local doc ids), `build_fla_cp_context` (FLA's context of every row, from the
  context's `row_cu_seqlens`, i.e. `segment_cu_seqlens`), `all_gather_sequence`
  (the sequence gather with its all-reduce backward). The CP mesh is a real
  `init_device_mesh("cpu", (cp,))`.
* `contiguous`: `components.distributed.context_parallel.sharder.
  shard_batch_contiguous` (pads to a multiple of 2 * cp, slices every sequence
  key), checked at pad_multiple 2.
* `thd`: `components.distributed.thd_utils.process_input_for_thd` (the rows
  flattened into one THD stream, its padding mask from the pack lengths),
  unflattened to [B, S] and compared with cpsim's padding and positions.

What each takes (its contract, drawn within; see docs/libraries.md for why):
`kimi` takes the layouts whose documents it can read (seq_lens forms, an
unpacked row with a mask); `contiguous` takes HF-style rows (unpacked, with
labels); `thd` takes Automodel's packed rows (seq_lens with seq_lens_padded
whose lengths fill the row). A drawn layout outside a step's contract is set
aside (OutsideContract) and counted.
"""
import os
import sys

import torch
import torch.distributed as dist

from nemo_automodel.components.distributed.context_parallel.sharder import shard_batch_contiguous
from nemo_automodel.components.distributed.thd_utils import process_input_for_thd
from nemo_automodel.components.models.kimi_linear.cp import (
    all_gather_sequence,
    build_fla_cp_context,
    shard_batch_for_kimi_cp,
)

import fla.utils
from cpsim.torch import OutsideContract

# FLA memoises its context on its arguments' identity, one cache a process;
# cpsim's ranks are threads of one process (see fla_step.py).
fla.utils.FLA_DISABLE_TENSOR_CACHE = True

_PACKED = ("seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
import cp_step  # noqa: E402 - cpsim's checked example: here only to tell whether a layout is in a contract
import library_cli  # noqa: E402


def _arange_positions_fit(batch):
    """Both Automodel sharders take arange(S) as the positions when none are
    given: right for a row whose one document starts at 0 (and for its tail)."""
    if "position_ids" in batch:
        return True
    _, _, positions = cp_step.layout_of(batch)
    return bool((positions == torch.arange(positions.shape[1])).all())


def _rows(t):
    return t.reshape(1, -1) if t.dim() == 1 else t


def _raw(case):
    """The batch as a collator hands it over: [B, S] tensors (a THD collator's
    [S] row made [1, S], as every one of these libraries expects; mRoPE's [3, S]
    position_ids [3, 1, S])."""
    planes = library_cli.has_mrope_positions(case.batch)
    return {k: (v if k in ("cu_seqlens", "cu_seqlens_padded")
                else v.reshape(3, -1, v.shape[-1]) if planes and k == "position_ids" else _rows(v))
            for k, v in case.batch.items()}


def _mask_back(local, given):
    """Both sharders consume an attention_mask (padding travels in padding_mask,
    documents in doc ids): the shard's HF mask is 1 where not padding."""
    if "attention_mask" in given:
        local["attention_mask"] = (~local["padding_mask"].bool()).to(torch.int64)
    return local


def _cp_mesh(case):
    """The CP submesh of a (dp, cp) mesh, as a DP x CP job builds it (laid out
    as check(mesh=...) says: consecutive or interleaved ranks)."""
    return case.device_mesh()["cp"]


# --- Kimi-Linear's CP (the closest relative of cpsim's model) ---

def _padded_slots(batch):
    """Whether a document occupies more slots than its real tokens."""
    if "seq_lens_padded" not in batch:
        return False
    real, occupied = batch["seq_lens"], batch["seq_lens_padded"]
    return bool(((occupied != real) & (real >= 0)).any())


def make_kimi_step(rank_from_world=False, guarded=True, gradient_in_place=False):
    """guarded=False: the layouts of findings K1-K3 are drawn too (they fail)."""
    def step(case):
        batch = _raw(case)
        keys = set(batch)
        if guarded and _padded_slots(batch):
            raise OutsideContract("finding K1 (docs/libraries.md): a document's padded slots are marked real in the "
                                  "padding_mask Kimi-Linear's sharder derives")
        if "token_type_ids" in keys:
            raise OutsideContract("Kimi-Linear shards only the keys its model reads (input_ids, labels, "
                                  "position_ids, padding_mask, loss_mask); token_type_ids stay global")
        if keys & {"cu_seqlens", "cu_seqlens_padded"}:
            raise OutsideContract("Kimi-Linear reads documents from seq_lens, _packed_seq_ids or an attention mask, "
                                  "not from THD cu_seqlens (it drops them)")
        if guarded and not _arange_positions_fit(batch):
            raise OutsideContract("finding K2 (docs/libraries.md): without position_ids, arange positions, wrong "
                                  "for packed rows and left padding")
        if guarded and "seq_lens" not in keys and int(cp_step.layout_of(batch)[0].max()) > 1:
            raise OutsideContract("finding K3 (docs/libraries.md): documents given by position resets (a flattening "
                                  "collator's) are read as one document a row")
        if guarded and library_cli.has_mrope_positions(batch):
            raise OutsideContract("finding K5 (docs/libraries.md): mRoPE's [3, B, S] position_ids are padded and cut "
                                  "along their axis 1, the rows")
        mesh = _cp_mesh(case)
        loss_mask = batch.pop("loss_mask", None)
        given = set(batch)
        _, local, _ = shard_batch_for_kimi_cp(mesh, None, batch, loss_mask=loss_mask,
                                              padding_token_id=case.pad_token_id)
        context = local.pop("kimi_packed_context")
        group = mesh.get_group()
        if rank_from_world:  # PLANTED: the context's seq_start from the world rank, not the mesh's
            context.seq_start = dist.get_rank() * (context.doc_ids.shape[1] // case.cp)
        local = _mask_back({k: v for k, v in local.items() if k in given | {"loss_mask", "padding_mask",
                                                                             "position_ids"}}, given)
        out = {"batch": local,
               "doc_ids": context.doc_ids,
               "local_doc_ids": context.local_doc_ids,
               "gathered": all_gather_sequence(case.x, group, dim=1)}
        if not gradient_in_place:
            out["gathered"] = library_cli.FreshGradient.apply(out["gathered"])
        if case.cp > 1:  # FLA's context exists only under CP (Kimi builds none at cp 1)
            contexts = [build_fla_cp_context(context, b, group, case.conv_width)
                        for b in range(context.doc_ids.shape[0])]
            out["cu_seqlens"] = [c.cu_seqlens_cpu for c in contexts]
            out["cp_context"] = contexts
        return out
    return step


# --- the contiguous sharder ---

def make_contiguous_step(extra_keys_undeclared=False, guarded=True):
    """guarded=False: the layouts of findings A1 and K2 are drawn too (they fail)."""
    def step(case):
        batch = _raw(case)
        if set(batch) & set(_PACKED):
            raise OutsideContract("shard_batch_contiguous takes HF-style rows: packed lengths are the THD path's")
        if guarded and not set(batch) & {"attention_mask", "padding_mask"}:
            raise OutsideContract("finding A1 (docs/libraries.md): without a mask, the positions it pads are not "
                                  "marked as padding")
        if guarded and not _arange_positions_fit(batch):
            raise OutsideContract("finding K2 (docs/libraries.md): without position_ids, arange positions, wrong "
                                  "for packed rows and left padding")
        mesh = _cp_mesh(case)
        loss_mask = batch.pop("loss_mask", None)
        given = set(batch)
        # A model declares its other per-token keys (extra_seq_keys: key -> sequence dim).
        extra = {k: 1 for k in batch if k not in ("input_ids", "labels", "position_ids", "padding_mask",
                                                  "attention_mask")}
        if extra_keys_undeclared:  # PLANTED: the model's other per-token keys not declared
            extra = {}
        _, local, _ = shard_batch_contiguous(mesh, None, batch, loss_mask=loss_mask,
                                             padding_token_id=case.pad_token_id, shard_primary=case.shard_primary,
                                             extra_seq_keys=extra)
        return {"batch": _mask_back(local, given)}
    return step


# --- the THD input utility ---

def make_thd_step(rows_transposed=False):
    def step(case):
        batch = _raw(case)
        if "seq_lens" not in batch:
            raise OutsideContract("process_input_for_thd takes Automodel's packed rows (seq_lens)")
        B, S = batch["input_ids"].shape
        padded = batch.get("seq_lens_padded", batch["seq_lens"])
        if any(int(n[n >= 0].sum()) != S for n in padded):
            raise OutsideContract("Automodel's THD collator gives rows whose padded lengths fill the row")
        if "position_ids" not in batch:
            raise OutsideContract("process_input_for_thd requires position_ids")
        thd = process_input_for_thd(batch, padding_token_id=case.pad_token_id)
        positions = thd["position_ids"]
        planes = positions.shape[:1] if positions.dim() == 3 else ()  # mRoPE's: [3, 1, B * S]
        if rows_transposed:  # PLANTED: the THD stream unflattened sequence-major
            return {"padding": thd["padding_mask"].reshape(S, B).t(),
                    "position_ids": positions.reshape(*planes, S, B).transpose(-1, -2)}
        return {"padding": thd["padding_mask"].reshape(B, S), "position_ids": positions.reshape(*planes, B, S)}
    return step


STEPS = {"kimi": make_kimi_step, "contiguous": make_contiguous_step, "thd": make_thd_step}
# What each step is checked at: the forms of the batches it takes (the rest of
# its contract is checked by the step, OutsideContract), and the harness's settings.
SETTINGS = {
    "kimi": {"forms": ["seq_lens_padded", "seq_lens", "unpacked"], "shard_primary": True},
    "contiguous": {"forms": ["unpacked", "position_ids"], "pad_multiple": 2, "shard_primary": True},
    "thd": {"forms": ["seq_lens_padded"]},  # the collator gives both lengths
}
VARIANTS = {
    "kimi": {"rank_from_world": make_kimi_step(rank_from_world=True),
             "unguarded": make_kimi_step(guarded=False),  # findings K1-K3 drawn: fails
             "gradient_in_place": make_kimi_step(gradient_in_place=True)},  # finding K4 unshielded: fails
    "contiguous": {"extra_keys_undeclared": make_contiguous_step(extra_keys_undeclared=True),
                   "unguarded": make_contiguous_step(guarded=False)},  # findings A1, K2 drawn: fails
    "thd": {"rows_transposed": make_thd_step(rows_transposed=True)},
}


def check(name, step=None, family=None, **kwargs):
    """cpsim.torch.check of one step (or a variant of it) at its settings; with a
    family, its members (the family's form, not the step's forms)."""
    import cpsim.torch
    settings = dict(SETTINGS[name])
    if family:
        settings.pop("forms", None)
    settings.update(kwargs)
    return cpsim.torch.check(step or STEPS[name](), family=family, **settings)


def main():
    variants = {name for steps in VARIANTS.values() for name in steps}
    args = library_cli.arguments(__doc__, variants, STEPS)
    if args.variant and args.variant not in VARIANTS[args.step]:
        raise SystemExit("%s has the variants %s" % (args.step, sorted(VARIANTS[args.step])))
    step = VARIANTS[args.step][args.variant] if args.variant else None
    return library_cli.run(lambda: check(args.step, step, cases=args.cases, max_cp=args.max_cp, family=args.family,
                                        seed=args.seed),
                          "nemo-automodel %s" % args.step)


if __name__ == "__main__":
    sys.exit(main())
