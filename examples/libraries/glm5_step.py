"""GLM-5.3's contiguous CP (NeMo Automodel 0.7.0's `glm5_next.cp`) and the
GLM-5.3 layers that consume it (`glm5_next.layers`), unmodified, on cpsim's
ranks, property-tested by cpsim.torch.check:

    .venv/bin/python examples/libraries/glm5_step.py cp           # the CP module against cpsim's references
    .venv/bin/python examples/libraries/glm5_step.py kda          # KDA, FLA's kernels (interpreted), sharded vs unsharded
    .venv/bin/python examples/libraries/glm5_step.py kda_torch    # KDA's CPU path as shipped (finding G1: fails)
    .venv/bin/python examples/libraries/glm5_step.py dsa          # KPool-DSA with its indexer
    .venv/bin/python examples/libraries/glm5_step.py decoder      # one decoder layer (DSA, mHC, dense MLP)
    .venv/bin/python examples/libraries/glm5_step.py train --dp 2 # the whole model's step (glm5_train.py)
    .venv/bin/python examples/libraries/glm5_step.py cp --variant rank_from_world

* `cp` and `fla_context`: `shard_batch_for_glm5_next_cp` on the raw batch as the
  collator gives it (a THD collator's [S] rows too: `_normalize_batch_axis`),
  on the CP submesh of a real `init_device_mesh("cpu", (dp, cp))`; its
  `Glm5NextPackedContext` (`doc_ids` from `_global_doc_ids_from_batch`,
  `local_doc_ids`, `local_seq_len`, `seq_start`, `row_cu_seqlens`), every key the sharder
  returns, `segment_cu_seqlens` of each row's local ids (`cp`) or FLA's context
  from `build_fla_cp_context` (`fla_context`: its local boundaries and ranks),
  and `all_gather_sequence` with `all_gather_backward_anchor` added to it.
* `kda`, `kda_torch`, `dsa`, `decoder`: a tiny GLM-5.3 (fp32, hidden 16, heads
  of 16 for KDA, 2 heads of 8 for DSA, mHC of 2 streams, dense MLP; weights
  drawn once from a seed outside the ranks, every rank loads its own copy) run
  sharded, as a training step calls the layer (`packed_context` and
  `padding_mask` from the sharder, the mesh attached by `setup_cp_attention`),
  and unsharded on a group of one: returned as a cpsim.torch.Layer (outputs
  per rank, input gradients, every parameter's gradient summed over ranks).

The layers choose their kernels by `tensor.is_cuda`: on CPU tensors KDA runs a
torch convolution and recurrence, on CUDA tensors FLA's `causal_conv1d`,
`fused_kda_gate` and `chunk_kda` with `cp_context`. `kda_torch` runs the layer
as shipped; `kda` the CUDA branch: `kernel_path(module)` binds, on this
module's instances only, the three methods that test `is_cuda` compiled from
the library's own source with each `X.is_cuda` read as True, and FLA's Triton
kernels run under the interpreter (triton_cpu.py).
"""
import ast
import inspect
import os
import sys
import textwrap
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_cpu  # noqa: E402 - before triton and fla: the interpreter is chosen when kernels are defined

triton_cpu.enable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import library_cli  # noqa: E402
import fla.utils  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.glm5_next import cp as glm5_cp  # noqa: E402
from nemo_automodel.components.models.glm5_next import layers as glm5_layers  # noqa: E402
from nemo_automodel.components.models.glm5_next.config import Glm5NextTextConfig  # noqa: E402

from cpsim.torch import Layer, OutsideContract  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
import cp_step  # noqa: E402 - cpsim's checked example: here only to tell whether a layout is in a contract

# FLA memoises its context on its arguments' identity, one cache a process;
# cpsim's ranks are threads of one process (see fla_step.py).
fla.utils.FLA_DISABLE_TENSOR_CACHE = True

_THD = ("cu_seqlens", "cu_seqlens_padded")


# --- the CP module ---

def _cp_mesh(case):
    """The CP submesh of a (dp, cp) mesh, as a DP x CP job builds it (laid out
    as check(mesh=...) says: consecutive or interleaved ranks)."""
    return case.device_mesh()["cp"]


def _raw(case):
    """The batch as the collator hands it over: a THD collator's rows are [S]
    (the placeholder batch axis `_normalize_batch_axis` restores)."""
    return {k: v.clone() for k, v in case.batch.items()}


def _positions_continued(local_positions, raw, case, seq_start):
    """glm5_next.cp fills the CP padding's position_ids with 0, cpsim continues the
    row's last position (a convention: GLM-5.3's DSA is NoPE, and KDA reads no
    positions, so nothing reads them): the shard's padded slots given back in
    cpsim's convention, from the library's own positions of the row."""
    given = raw.get("position_ids")
    lead = local_positions.shape[:-1]  # [B], or the planes of mRoPE's [3, B, S] ([3] of a THD row's [3, S])
    if local_positions.shape[-1] != case.P // case.cp or (given is not None and given.numel() != lead.numel() * case.S):
        return local_positions  # not this rank's cut of the sequence: compared as the library gives it
    last = (given.reshape(*lead, case.S)[..., -1:] if given is not None
            else torch.full((*lead, 1), case.S - 1, dtype=local_positions.dtype))
    where = torch.arange(seq_start, seq_start + local_positions.shape[-1])
    return torch.where(where >= case.S, last + (where - case.S + 1), local_positions)


def _padded_slots(batch, real="seq_lens"):
    """Whether a document occupies more slots than its real tokens: the lengths
    (`seq_lens`) or the THD boundaries (`cu_seqlens`) against their padded key."""
    return real in batch and real + "_padded" in batch and not torch.equal(batch[real], batch[real + "_padded"])


def _arange_positions_fit(batch):
    if "position_ids" in batch:
        return True
    _, _, positions = cp_step.layout_of(batch)
    return bool((positions == torch.arange(positions.shape[1])).all())


def _contract(batch, findings=True):
    """The layouts whose documents glm5_next.cp reads (findings G2-G5, G7-G9
    outside unless findings=False)."""
    if "token_type_ids" in batch:
        raise OutsideContract("glm5_next.cp shards the keys its model reads (input_ids, labels, position_ids, "
                              "padding_mask, loss_mask); token_type_ids stay global")
    if not findings:
        return
    if library_cli.has_mrope_positions(batch):
        raise OutsideContract("finding G9 (docs/libraries.md): mRoPE's [3, B, S] position_ids are not cut along the "
                              "sequence (read by their axis 1, the rows)")
    if _padded_slots(batch):
        raise OutsideContract("finding G2 (docs/libraries.md, K1): a document's padded slots are real in the "
                              "padding_mask")
    if not _arange_positions_fit(batch):
        raise OutsideContract("finding G3 (docs/libraries.md, K2): without position_ids, arange positions")
    keys = set(batch)
    if not keys & {"seq_lens", "cu_seqlens", "cu_seqlens_padded"} and int(cp_step.layout_of(batch)[0].max()) > 1:
        raise OutsideContract("finding G4 (docs/libraries.md, K3): documents given by position resets are one "
                              "document a row")
    if _padded_slots(batch, "cu_seqlens"):
        raise OutsideContract("finding G8 (docs/libraries.md): THD cu_seqlens (real lengths, cumulated) are read as "
                              "positions in the padded row when cu_seqlens_padded differs")
    if "cu_seqlens" in keys and int((batch["cu_seqlens"] >= 0).sum()) < 2:
        raise OutsideContract("finding G7 (docs/libraries.md): THD boundaries of no document ([0]) are read as one "
                              "document over the whole row")
    if "cu_seqlens_padded" in keys and "cu_seqlens" not in keys:
        raise OutsideContract("finding G5 (docs/libraries.md): THD boundaries given only as cu_seqlens_padded are "
                              "not read: the row is one document")


def make_cp_step(fla_context=False, rank_from_world=False, guarded=True, gradient_in_place=False):
    """fla_context: the rows' boundaries from FLA's context (build_fla_cp_context)
    instead of segment_cu_seqlens of the local ids. guarded=False: the layouts of
    findings G2-G8 are drawn too, and a [S] loss mask handed over as it is (they
    fail)."""
    def step(case):
        batch = _raw(case)
        _contract(batch, findings=guarded)
        mesh = _cp_mesh(case)
        loss_mask = batch.pop("loss_mask", None)
        if guarded and loss_mask is not None and loss_mask.dim() == 1:
            # finding G6: the sharder restores the batch axis of the batch's keys, not
            # of the loss_mask handed beside them
            loss_mask = loss_mask.reshape(1, -1)
        given = set(batch) - set(_THD) - {"seq_lens", "seq_lens_padded"}
        _, local, layout = glm5_cp.shard_batch_for_glm5_next_cp(mesh, None, batch, loss_mask=loss_mask,
                                                                padding_token_id=case.pad_token_id,
                                                                shard_primary=case.shard_primary)
        context = local.pop("glm5_next_packed_context")
        if rank_from_world:  # PLANTED: the context's seq_start from the world rank, not the mesh's
            context.seq_start = dist.get_rank() * context.local_seq_len
        if (layout.original_seq_len, layout.padded_seq_len) != (case.S, case.P):
            raise AssertionError("ShardLayout %s, expected S %d, P %d" % (layout, case.S, case.P))
        if context.local_seq_len != case.P // case.cp:
            raise AssertionError("local_seq_len %d, expected %d" % (context.local_seq_len, case.P // case.cp))
        group = mesh.get_group()
        local["position_ids"] = _positions_continued(local["position_ids"], case.batch, case, context.seq_start)
        shard = {k: v for k, v in local.items() if k in given | {"loss_mask", "padding_mask", "position_ids"}}
        if "attention_mask" in given:  # consumed (documents in doc ids, padding in padding_mask)
            shard["attention_mask"] = (~shard["padding_mask"].bool()).to(torch.int64)
        gathered = glm5_cp.all_gather_sequence(case.x, group, dim=1)
        if not gradient_in_place:  # K4 shows on the gather's own output (an add would hand it a sum)
            gathered = library_cli.FreshGradient.apply(gathered)
            gathered = gathered + glm5_cp.all_gather_backward_anchor(gathered)
        out = {"batch": shard, "doc_ids": context.doc_ids, "local_doc_ids": context.local_doc_ids,
               "gathered": gathered}
        rows = range(context.doc_ids.shape[0])
        if not fla_context:
            out["cu_seqlens"] = [glm5_cp.segment_cu_seqlens(context.local_doc_ids[b]) for b in rows]
        elif case.cp > 1:  # FLA's context exists only under CP (the layers build none at cp 1)
            contexts = [glm5_cp.build_fla_cp_context(context, b, group, case.conv_width) for b in rows]
            out["cu_seqlens"] = [c.cu_seqlens_cpu for c in contexts]
            out["cp_context"] = contexts
        return out
    return step


# --- the layers ---

def tiny_config():
    """A GLM-5.3 text config of a handful of channels: layer 0 KDA, layer 1 DSA,
    both with dense MLPs. KDA's heads are 16 wide (FLA's kernels take 16 and up)."""
    return Glm5NextTextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8,
        index_n_heads=2, index_kpool=2, linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4,
        hc_mult=2, mlp_layer_types=["dense", "dense"], layer_types=["linear_attention", "deepseek_sparse_attention"],
        dtype="float32")


CONFIG = tiny_config()
BACKEND = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch")
MODULES = {
    "kda": lambda: glm5_layers.Glm5NextLinearAttention(CONFIG, 0),
    "dsa": lambda: glm5_layers.Glm5NextSparseAttention(CONFIG, 1, BACKEND),
    "decoder": lambda: glm5_layers.Glm5NextDecoderLayer(CONFIG, 1, None, BACKEND),
    "decoder_kda": lambda: glm5_layers.Glm5NextDecoderLayer(CONFIG, 0, None, BACKEND),
}
INIT_STD = 0.3  # larger than the model's 0.02, so that every path moves the output


def _draw_weights(name):
    """The module's weights, drawn from a fixed seed. Drawn once, at import, on
    no rank's thread: the rank threads share torch's generator, so weights drawn
    inside them would interleave their draws (every rank a different module)."""
    with torch.random.fork_rng():
        torch.manual_seed(20261205)
        module = MODULES[name]()
        module.init_weights(torch.device("cpu"), INIT_STD)
    return {k: v.clone() for k, v in module.state_dict().items()}


WEIGHTS = {name: _draw_weights(name) for name in MODULES}


def _rewritten(function, transformer):
    """function compiled from its own source after an AST transformer (same
    file and line numbers, same globals: the library's module)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    tree = transformer.visit(tree)
    tree.body[0].decorator_list = []
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    namespace = {}
    exec(compile(tree, inspect.getsourcefile(function), "exec"), function.__globals__, namespace)
    return namespace[function.__name__]


class _ReadIsCudaAsTrue(ast.NodeTransformer):
    def visit_Attribute(self, node):
        node = self.generic_visit(node)
        if node.attr == "is_cuda" and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Constant(True), node)
        return node


class _DropAnchor(ast.NodeTransformer):
    """PLANTED (dsa --variant no_anchor): `output + all_gather_backward_anchor(x)`
    becomes `output + 0`: a rank without valid queries has no path back to the
    gather, so it skips the gather's backward all-reduce."""

    def visit_Call(self, node):
        node = self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "all_gather_backward_anchor":
            return ast.copy_location(ast.Constant(0), node)
        return node


def _kernel_source(function):
    """function with every `X.is_cuda` read as True."""
    return _rewritten(function, _ReadIsCudaAsTrue())


_KERNEL_METHODS = {
    glm5_layers._TorchShortConvolution: ("forward", _kernel_source(glm5_layers._TorchShortConvolution.forward)),
    glm5_layers.Glm5NextKDAFp32Params: ("forward", _kernel_source(glm5_layers.Glm5NextKDAFp32Params.forward)),
    glm5_layers.Glm5NextLinearAttention: ("_core", _kernel_source(glm5_layers.Glm5NextLinearAttention._core)),
}


def kernel_path(module):
    """The module with its KDA on the CUDA branch (FLA's kernels), on these
    instances only: the class and every other instance keep the CPU branch."""
    for sub in module.modules():
        for cls, (name, function) in _KERNEL_METHODS.items():
            if isinstance(sub, cls):
                setattr(sub, name, types.MethodType(function, sub))
    return module


_NO_ANCHOR_FORWARD = _rewritten(glm5_layers.Glm5NextSparseAttention.forward, _DropAnchor())
LAYER_TOLERANCE = 1e-5  # relative RMSE, fp32 (sharded against unsharded: 3e-8 to 5e-7 seen, docs/libraries.md)


def make_layer_step(name, kernels=True, no_anchor=False, guarded=False):
    """guarded: findings G2-G9's layouts set aside (else the leak property shows G2, G8)."""
    module_name = "kda" if name == "kda_torch" else name

    def step(case):
        batch = case.replica_batch  # a layer's replica trains on its own rows (case.rows)
        if guarded:
            _contract(batch)
        mesh = _cp_mesh(case)
        _, local, _ = glm5_cp.shard_batch_for_glm5_next_cp(mesh, None, batch, padding_token_id=case.pad_token_id)
        context = local["glm5_next_packed_context"]
        module = MODULES[module_name]()
        module.load_state_dict(WEIGHTS[module_name])
        library_cli.live_kda_gates(module, case)
        if kernels:
            kernel_path(module)
        for sub in module.modules():
            if hasattr(sub, "setup_cp_attention"):
                sub.setup_cp_attention(mesh)
        if no_anchor:
            module.forward = types.MethodType(_NO_ANCHOR_FORWARD, module)
        if name.startswith("decoder"):
            hidden = case.activation("hidden_streams", CONFIG.hc_mult, CONFIG.hidden_size)
        else:
            hidden = case.activation("hidden", CONFIG.hidden_size)
        output = module(hidden, packed_context=context, padding_mask=local["padding_mask"])
        return {"layer": Layer(output, {"hidden": hidden}, module.named_parameters(), LAYER_TOLERANCE)}
    return step


STEPS = {
    "cp": lambda: make_cp_step(),
    "fla_context": lambda: make_cp_step(fla_context=True),
    "kda": lambda: make_layer_step("kda"),
    "kda_torch": lambda: make_layer_step("kda_torch", kernels=False),  # finding G1: fails under CP
    "dsa": lambda: make_layer_step("dsa"),
    "decoder": lambda: make_layer_step("decoder"),
    "decoder_kda": lambda: make_layer_step("decoder_kda"),
    "train": lambda: _train_step(),
}
# Layers: every layout, G2-G9's too, so no leak runs (they show G2, G8); "guarded" variants have them.
# fp32, equal shards (glm5_next.cp cuts padded / cp), the interpreter's KDA at
# CP 1-4; long layouts on --long-every N (65-80 tokens a rank).
SETTINGS = {
    "cp": {"shard_primary": True},
    "fla_context": {"shard_primary": True},
    "kda": {"dtype": "f32", "max_cp": 4, "min_shard": 3, "long_every": 0, "leaks": False, **library_cli.LONG_SHARDS},  # F1: W - 1
    "kda_torch": {"dtype": "f32", "max_cp": 4, "long_every": 0, "leaks": False},
    "dsa": {"dtype": "f32", "long_every": 0, "leaks": False},
    "decoder": {"dtype": "f32", "long_every": 0, "leaks": False},
    "decoder_kda": {"dtype": "f32", "max_cp": 4, "min_shard": 3, "long_every": 0, "leaks": False, **library_cli.LONG_SHARDS},
    "train": {"dtype": "f32", "max_cp": 4, "min_shard": 3, "long_every": 0, **library_cli.LONG_SHARDS,
              "forms": ["seq_lens", "seq_lens_padded", "unpacked", "position_ids"]},
}
def _train_step(bug=None):
    """glm5_train.py's step (imported when run: it imports this module)."""
    return lambda case: __import__("glm5_train").make_train_step(bug)(case)


VARIANTS = {
    "cp": {"rank_from_world": make_cp_step(rank_from_world=True),
           "unguarded": make_cp_step(guarded=False),  # findings G2-G5 drawn: fails
           "gradient_in_place": make_cp_step(gradient_in_place=True)},  # finding K4 unshielded: fails
    "fla_context": {"rank_from_world": make_cp_step(fla_context=True, rank_from_world=True)},
    "kda": {"guarded": make_layer_step("kda", guarded=True)},
    "dsa": {"no_anchor": make_layer_step("dsa", no_anchor=True), "guarded": make_layer_step("dsa", guarded=True)},
    "decoder": {"guarded": make_layer_step("decoder", guarded=True)},
    "train": {"local_label_count": _train_step("local_label_count"), "bias_local": _train_step("bias_local"),
              "fsdp_over_dp": _train_step("fsdp_over_dp"),
              "unused_with_cp_only": _train_step("unused_with_cp_only")},
}


def check(name, step=None, **kwargs):
    """cpsim.torch.check of one step (or a variant of it) at its settings (CP
    sizes up to the step's own largest)."""
    import cpsim.torch
    settings = dict(SETTINGS[name])
    if "max_cp" in settings and kwargs.get("max_cp"):
        kwargs["max_cp"] = min(kwargs["max_cp"], settings["max_cp"])
    if kwargs.get("family"):
        settings.pop("forms", None)
    settings.update({k: v for k, v in kwargs.items() if v is not None})
    return cpsim.torch.check(step or STEPS[name](), **settings)


def main():
    return library_cli.run_steps(__doc__, STEPS, VARIANTS, check, lambda name: "nemo-automodel glm5_next %s" % name)


if __name__ == "__main__":
    sys.exit(main())
