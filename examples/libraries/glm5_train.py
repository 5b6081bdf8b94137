"""GLM-5.3's whole training step (NeMo Automodel 0.7.0), unmodified, on cpsim's
ranks: `glm5_step.py train` (this module is its `train` step).

The tiny `Glm5NextForConditionalGeneration` (hidden 16, a KDA layer on FLA's
kernels under the interpreter, a KPool-DSA layer with its indexer, an MoE of 4
routed experts (top 2) and one shared expert on the torch experts backend, mHC
of 2 streams, the lm head; a vision tower of depth 1 that text batches leave
idle), one step as `train_ft._run_train_optim_step` does it:

* the label count over the replica's whole rows (labels before sharding, as
  the recipe's batches hold them), all-reduced over DP only (`_dp_allreduce`,
  include_cp=False);
* the batch sharded by the model's own CP entry (`prepare_model_inputs_for_cp`:
  `shard_batch_for_glm5_next_cp`, shard_primary=False), the CP mesh attached
  to every layer that takes one (`setup_cp_attention`);
* `calculate_loss(MaskedCrossEntropy(), ..., num_label_tokens=N)`, backward of
  `loss * dp_group_size(include_cp=True)`;
* torch's FSDP2 (`fully_shard`) over the (dp, cp) mesh flattened, in the
  units the library's MoE parallelizer makes (each block, the embedding, the
  lm head, the vision tower, the root): its reduce-scatter averages the
  gradients over every DP x CP rank (the parallelizer itself first patches
  FSDP in a way torch 2.15.0 breaks, docs/libraries.md), with the library's
  `configure_fsdp_unused_param_reduction` at every CP size (finding G10: the
  parallelizer calls it with CP only);
* `scale_grads_and_clip_grad_norm` (the library's, torch's norm on CPU), a
  step of torch's SGD with momentum on the sharded parameters, then `update_moe_gate_bias()` with the routing bias replicated
  over the whole (dp, cp) mesh as the MoE parallelizer does (a DTensor:
  every rank's expert load summed).

The library's `torch.compile` of its expert activation (`swiglu_clamped_deepep`,
inductor with max_autotune) costs 40-120 s at a process's first forward on two
cores, the same arithmetic as eager: the experts are built here with the
function's own Python body (`__wrapped__`), so no case pays it.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

import glm5_step
import library_cli
from glm5_step import OutsideContract, glm5_cp, kernel_path

from nemo_automodel.components.distributed.parallelizer_utils import configure_fsdp_unused_param_reduction
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
from nemo_automodel.components.loss.utils import calculate_loss
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.glm5_next.config import (Glm5NextConfig, Glm5NextTextConfig,
                                                              Glm5NextVisionConfig)
from nemo_automodel.components.models.glm5_next.model import Glm5NextForConditionalGeneration
from nemo_automodel.components.moe.layers import Gate
from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

import cpsim.torch


def _eager_expert_activations():
    """The experts' activations as their own Python functions, not torch.compile's
    wrappers (fullgraph=True: disabling dynamo makes them raise instead): the
    experts module looks them up by name when a model is built."""
    from nemo_automodel.components.moe import experts
    for name in ("quick_geglu_deepep", "swiglu_oai_deepep", "relu2_deepep", "swiglu_clamped_deepep"):
        compiled = getattr(experts, name)
        setattr(experts, name, getattr(compiled, "__wrapped__", compiled))


_eager_expert_activations()

VOCAB = 32
LR = 0.1
MAX_NORM = 1.0
TOLERANCE = 1e-4  # relative RMSE, fp32 through the whole model (KDA's gate gradients: 1e-5 to 3e-5 seen at cp 2)


def tiny_config():
    """GLM-5.3 of a handful of channels: layer 0 KDA with a dense MLP, layer 1
    DSA with the MoE (4 routed experts, top 2, one shared)."""
    text = Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8,
        v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, index_kpool=2, linear_head_dim=16,
        linear_num_heads=2, linear_conv_kernel_dim=4, hc_mult=2, mlp_layer_types=["dense", "sparse"],
        layer_types=["linear_attention", "deepseek_sparse_attention"], n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, pad_token_id=0, dtype="float32")
    vision = Glm5NextVisionConfig(depth=1, hidden_size=16, num_heads=2, out_hidden_size=16, intermediate_size=16,
                                  projection_intermediate_size=16, patch_size=2, image_size=8)
    return Glm5NextConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 1)


CONFIG = tiny_config()
BACKEND = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch", dispatcher="torch")


def _build():
    return Glm5NextForConditionalGeneration(CONFIG, backend=BACKEND)


def _draw_weights():
    """Drawn once, at import, on no rank's thread (the rank threads share torch's
    generator), larger than the model's 0.02 so that every path moves the loss."""
    with torch.random.fork_rng():
        torch.manual_seed(20261206)
        model = _build()
        model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(10.0)
    return {k: v.clone() for k, v in model.state_dict().items()}


WEIGHTS = _draw_weights()


def _gates(model):
    return [m for m in model.modules() if isinstance(m, Gate) and m.e_score_correction_bias is not None]


def _fully_shard(model, mesh):
    """torch's FSDP2 over the mesh, in the units the library's MoE parallelizer
    (`apply_fsdp`) makes: each decoder block, the embedding, the lm head, the
    vision tower (its own unit: bf16 parameters), then the root. Its
    reduce-scatter averages every gradient over the mesh's ranks."""
    text = model.model.language_model
    for block in text.layers.values():
        fully_shard(block, mesh=mesh)
    for unit in (text.embed_tokens, model.lm_head, model.model.visual):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_train_step(bug=None):
    """bug (PLANTED): "local_label_count" (the label count of this rank's shard,
    not the replica's rows over DP), "bias_local" (the routing bias left a plain
    tensor: each rank's own expert load), "fsdp_over_dp" (FSDP2 over the DP
    mesh alone: the CP ranks' gradients never reduced); "unused_with_cp_only"
    (FSDP2's zeros for unused parameters only with CP, as the library's MoE
    parallelizer has it: finding G10)."""
    def step(case):
        batch = case.replica_batch
        glm5_step._contract(batch)
        if "labels" not in batch:
            raise OutsideContract("a training batch carries labels")
        mesh = case.device_mesh()
        cp_mesh = mesh["cp"]
        model = _build()
        model.load_state_dict(WEIGHTS)
        library_cli.live_kda_gates(model, case)
        kernel_path(model)
        model.train()
        for sub in model.modules():
            if hasattr(sub, "setup_cp_attention"):
                sub.setup_cp_attention(cp_mesh)
        flat = mesh._flatten("dp_cp")  # the FSDP mesh: DP and CP flattened into one
        _fully_shard(model, mesh["dp"] if bug == "fsdp_over_dp" else flat)
        if bug != "unused_with_cp_only" or cp_mesh.size() > 1:
            # Zeros reduced for a parameter this rank's tokens left unused. The
            # MoE parallelizer does it only with CP (`if cp_enabled`): finding
            # G10, a replica of padding only leaves the DSA layer idle at any dp.
            configure_fsdp_unused_param_reduction(model)
        if bug != "bias_local":
            # As the MoE parallelizer does: replicated over the FSDP mesh (FSDP2 leaves buffers alone).
            for gate in _gates(model):
                gate.e_score_correction_bias = distribute_tensor(gate.e_score_correction_bias, flat, [Replicate()])
        loss_mask = batch.pop("loss_mask", None)
        labels = batch["labels"].reshape(batch["input_ids"].shape[0] if batch["input_ids"].dim() > 1 else 1, -1)
        num_label_tokens = (labels != -100).sum()
        _, local, _ = glm5_cp.shard_batch_for_glm5_next_cp(cp_mesh, None, batch, loss_mask=loss_mask,
                                                           padding_token_id=case.pad_token_id, shard_primary=False)
        if bug == "local_label_count":
            num_label_tokens = (local["labels"] != -100).sum()
        dist.all_reduce(num_label_tokens, group=mesh["dp"].get_group())  # _dp_allreduce(include_cp=False)
        out = model(input_ids=local["input_ids"], padding_mask=local["padding_mask"],
                    glm5_next_packed_context=local["glm5_next_packed_context"])
        loss = calculate_loss(MaskedCrossEntropy(), logits=out.logits, labels=local["labels"], model=model,
                              hidden_states=None, num_label_tokens=int(num_label_tokens))
        world = mesh.size()
        (loss * world).backward()  # the recipe's loss * dp_group_size(include_cp=True)
        norm = scale_grads_and_clip_grad_norm(MAX_NORM, [model], device_mesh=None, num_label_tokens=None,
                                              dp_group_size=world, use_torch_clip_grad_norm=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # on FSDP's sharded parameters
        optimizer.step()
        model.update_moe_gate_bias()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # every rank's share: the window's loss
        return {"train": cpsim.torch.TrainStep(model, logged, optimizer, tensors={"grad_norm": torch.as_tensor(norm)},
                                               positions={"logits": out.logits}, tolerance=TOLERANCE)}
    return step
