"""GLM-5.3's contiguous CP (nemo-automodel 0.7.0's glm5_next.cp, the module of
seed 003, unmodified) and the GLM-5.3 layers that consume it, on cpsim's ranks
(examples/libraries/glm5_step.py): the CP module against cpsim's references, the
layers sharded against themselves unsharded (KDA with FLA's Triton kernels under
the interpreter), and the findings of docs/libraries.md reproduced.

A long run: `glm5_step.py cp --cases 2000`, `glm5_step.py kda --cases 100`."""
import importlib.util
import os

import pytest
import torch

from libraries_common import FAMILIES, FAMILY, ROOT, SEED, expect_reported

import glm5_step  # noqa: E402 - imports triton_cpu first: FLA's kernels interpreted
from nemo_automodel.components.models.glm5_next import cp as glm5_cp

import cpsim.torch


# --- the CP module against cpsim's references ---

def test_the_cp_module_holds_on_random_layouts_at_every_cp_size():
    ran = glm5_step.check("cp", cases=150, max_cp=8, seed=SEED)
    assert ran >= 150


@pytest.mark.parametrize("mesh", ["dp,cp", "cp,dp"])
def test_the_cp_module_holds_on_a_dp_cp_mesh(mesh):
    # The CP submesh's ranks consecutive, or interleaved (every dp-th rank).
    assert glm5_step.check("cp", cases=30, max_cp=4, dp=2, mesh=mesh, seed=SEED) >= 30


def test_flas_context_built_by_the_cp_module_holds():
    assert glm5_step.check("fla_context", cases=60, max_cp=8, seed=SEED) >= 60


# The shipped families whose members lie outside glm5_next.cp's contract, by the
# finding that puts them there (docs/libraries.md); every other family holds.
OUTSIDE = {"interior_padding": "G2", "nemo_automodel_pack_dataset": "G2", "nemo_automodel_seq_lens": "G2, G3",
           "unpacked_left_padding": "G3", "te_thd_2cp": "G8", "vision_language_mrope": "G9",
           "vision_language_mrope_rows": "G2, G9", "vision_language_mrope_unpacked": "G3, G9"}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.rsplit("/", 1)[-1][:-5])
def test_every_shipped_family_holds_or_shows_its_finding(family):
    name = family.rsplit("/", 1)[-1][:-5]
    if name in OUTSIDE:
        failure = expect_reported(lambda: glm5_step.check("cp", glm5_step.VARIANTS["cp"]["unguarded"], cases=10,
                                                          seed=SEED, family=family),
                                  "smallest failing layout")
        symptoms = {"G2": ["padding_mask"], "G3": ["position_ids"], "G8": ["doc_ids", "padding_mask"],
                    "G9": ["position_ids"]}
        assert any(s in failure.failure for g in OUTSIDE[name].split(", ") for s in symptoms[g]), failure.failure
    else:
        assert glm5_step.check("cp", cases=10, seed=SEED, family=family) >= 10


def test_the_thd_vlm_collators_placeholder_batch_axis_is_restored():
    # vision_language gives [S] rows (one_dimensional, image spans): the step hands them over as
    # they are, and _normalize_batch_axis gives them their batch axis.
    # (members of several documents without position_ids are finding G3's: set aside)
    ran = glm5_step.check("cp", cases=10, seed=SEED, family=FAMILY["vision_language"])
    assert ran >= 10


def test_a_seq_start_from_the_world_rank_is_reported_on_a_dp_cp_mesh():
    expect_reported(lambda: glm5_step.check("cp", glm5_step.VARIANTS["cp"]["rank_from_world"], cases=40, max_cp=4,
                                            dp=2, seed=SEED),
                    "(dp 1, cp 0)", "smallest failing layout")


def test_finding_k4_the_gathers_backward_all_reduces_grad_output_in_place():
    expect_reported(lambda: glm5_step.check("cp", glm5_step.VARIANTS["cp"]["gradient_in_place"], cases=60,
                                            seed=SEED),
                    "gathered: the backward wrote into the upstream gradient it was given")


def test_the_layouts_of_findings_g2_to_g8_fail_when_drawn():
    expect_reported(lambda: glm5_step.check("cp", glm5_step.VARIANTS["cp"]["unguarded"], cases=100, seed=SEED),
                    "smallest failing layout")


def _shard(batch, loss_mask=None):
    _, local, _ = glm5_cp.shard_batch_for_glm5_next_cp(None, None, {k: torch.tensor(v) for k, v in batch.items()},
                                                       loss_mask=loss_mask)
    return local


def test_the_minimal_layouts_of_docs_libraries_show_glm5s_findings():
    # G2 (as K1): a document's padded slots are real in the padding_mask
    local = _shard({"input_ids": [[1, 0]], "labels": [[5, -100]], "seq_lens": [[1]], "seq_lens_padded": [[2]]})
    assert local["padding_mask"].tolist() == [[False, False]]  # expected [[False, True]]
    # G3 (as K2): without position_ids, arange positions across documents
    local = _shard({"input_ids": [[1, 1]], "labels": [[0, 4]], "seq_lens": [[1, 1]]})
    assert local["position_ids"].tolist() == [[0, 1]]  # expected [[0, 0]]
    # G4 (as K3): documents given by position resets are one document
    local = _shard({"input_ids": [[1, 1]], "labels": [[4, 0]], "position_ids": [[0, 0]]})
    assert local["glm5_next_packed_context"].doc_ids.tolist() == [[1, 1]]  # expected [[1, 2]]
    # G5: THD boundaries given only as cu_seqlens_padded are not read
    local = _shard({"input_ids": [1, 1], "cu_seqlens_padded": [0, 1, 2]})
    assert local["glm5_next_packed_context"].doc_ids.tolist() == [[1, 1]]  # expected [[1, 2]]
    # G7: THD boundaries of no document are one document over the row
    local = _shard({"input_ids": [1], "cu_seqlens": [0]})
    assert local["glm5_next_packed_context"].doc_ids.tolist() == [[1]]  # expected [[0]]
    assert local["padding_mask"].tolist() == [[False]]  # expected [[True]]
    # G8: a padded THD batch's cu_seqlens read as positions in the padded row
    local = _shard({"input_ids": [1, 0, 1], "cu_seqlens": [0, 1, 2], "cu_seqlens_padded": [0, 2, 3]})
    assert local["glm5_next_packed_context"].doc_ids.tolist() == [[1, 2, 0]]  # expected [[1, 1, 2]]
    assert local["padding_mask"].tolist() == [[False, False, True]]  # expected [[False, True, False]]
    # G6: a [S] loss_mask beside a THD collator's [S] batch is not given its batch axis
    with pytest.raises(IndexError):
        _shard({"input_ids": [1], "labels": [-100], "seq_lens": [1]}, loss_mask=torch.tensor([0]))


# --- the layers, sharded against themselves unsharded ---

# Few interpreted KDA cases in CI (each ~13 s); `glm5_step.py kda --cases N` or
# CPSIM_GLM5_KDA_CASES=N for long runs.
KDA_CASES = int(os.environ.get("CPSIM_GLM5_KDA_CASES", "3"))


def test_kda_with_flas_kernels_under_cp_matches_kda_unsharded():
    ran = glm5_step.check("kda", cases=KDA_CASES, seed=SEED)
    assert ran >= KDA_CASES and ran.outside == 0


def test_kda_carries_a_live_state_over_chunks_and_ranks(tmp_path):
    # One document over two ranks of 72 tokens (two of FLA's chunks each), the
    # layer's heads made live (library_cli.live_kda_gates: the library's A_log init
    # wipes a state within a few tokens). FLA's fix #1115 reverted fails here.
    batch = tmp_path / "one_long_document.json"
    batch.write_text('{"input_ids": [[%s]]}' % ", ".join(str(1 + i % 5) for i in range(144)))
    assert glm5_step.check("kda", batch=str(batch), cp=2, seed=SEED, live_gates_every=1) == 1


def test_kpool_dsa_with_its_indexer_matches_itself_unsharded():
    assert glm5_step.check("dsa", cases=30, seed=SEED) >= 30


def test_a_decoder_layer_matches_itself_unsharded():
    assert glm5_step.check("decoder", cases=20, seed=SEED) >= 20


def test_finding_g1_kdas_cpu_path_takes_no_halo_no_state_and_no_resets_under_cp(tmp_path):
    # Rank 0 holds a one-token document and the first token of a second one: that
    # token is not reset (no document boundary reaches the CPU path under CP); rank 1
    # holds the rest of the second document and starts from a zero state, no halo.
    batch = tmp_path / "g1.json"
    batch.write_text('{"input_ids": [[1, 1, 1, 1]], "labels": [[0, 4, 4, -100]], "seq_lens": [[1, 3]]}')
    failure = expect_reported(lambda: glm5_step.check("kda_torch", batch=str(batch), cp=2, seed=SEED),
                              "rank 0 layer output", "rank 1 layer output")
    assert failure.cp == 2
    # unsharded the CPU path agrees with itself, and at cp 1 the check holds
    assert glm5_step.check("kda_torch", batch=str(batch), cp=1, seed=SEED) == 1


def test_the_dsa_without_its_anchor_leaves_a_rank_out_of_the_gathers_backward():
    expect_reported(lambda: glm5_step.check("dsa", glm5_step.VARIANTS["dsa"]["no_anchor"], cases=40, seed=SEED),
                    "returned without joining all_reduce")


# --- every name of seed 003, and Inkling2 ---

SEED_003 = ("Glm5NextPackedContext", "doc_ids_from_seq_lens", "doc_ids_from_cu_seqlens", "segment_cu_seqlens",
            "build_fla_cp_context", "_AllGatherSequence", "_AllGatherBackwardAnchor", "all_gather_sequence",
            "all_gather_backward_anchor", "_pad_sequence_dim", "_normalize_batch_axis", "_global_doc_ids_from_batch",
            "shard_batch_for_glm5_next_cp", "_PAD_DOC_ID")


def test_every_name_of_seed_003_is_in_the_module_and_in_docs_libraries_table():
    with open(os.path.join(ROOT, "docs", "libraries.md")) as f:
        docs = f.read()
    table = docs[docs.index("## Seed 003"):]
    for name in SEED_003:
        assert hasattr(glm5_cp, name), name
        assert "`%s`" % name in table, name


def test_inkling2_context_parallel_is_run_when_a_pin_ships_it():
    # nemo-automodel 0.7.0 ships models/inkling without a CP module (docs/libraries.md);
    # a later pin that ships it makes this test run its adapter.
    name = "nemo_automodel.components.models.inkling2.context_parallel"
    try:  # Automodel's model registry raises ModuleNotFoundError for a model it lacks
        present = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        from importlib import metadata
        assert metadata.version("nemo-automodel") == "0.7.0", "a new pin: see whether it ships %s" % name
        return
    import inkling2_step
    assert cpsim.torch.check(inkling2_step.step, cases=100, seed=SEED, forms=["seq_lens_padded"]) >= 100


def test_finding_g8_shows_in_the_dsa_layer_as_padding_read_by_the_next_document(tmp_path):
    # cu_seqlens [0, 1, 4] with cu_seqlens_padded [0, 2, 5]: document 1 is position 0
    # and its padded slot 1; glm5_next.cp reads the real boundaries as positions (G8),
    # so position 1 opens document 2 for the layer. Sharded and unsharded agree; the
    # leak property (the padding drawn again) shows the layer reading it.
    batch = tmp_path / "g8.json"
    batch.write_text('{"cu_seqlens": [0, 1, 4], "cu_seqlens_padded": [0, 2, 5], "input_ids": [[1, 1, 4, 0, 2, 2]],'
                     ' "labels": [[0, -100, 1, 5, 5, -100]], "position_ids": [[0, 1, 0, 1, 2, 3]],'
                     ' "pad_token_id": 0}')
    assert glm5_step.check("dsa", batch=str(batch), cp=1, seed=SEED) == 1  # no leak runs
    expect_reported(lambda: glm5_step.check("dsa", batch=str(batch), cp=1, seed=SEED, leaks=True),
                    "layer output changed at row 0 position 2 (document 2)", "padding must never count")
    # the guarded step sets the layout aside as G8's
    ran = glm5_step.check("dsa", glm5_step.VARIANTS["dsa"]["guarded"], batch=str(batch), cp=1, seed=SEED,
                          leaks=True)
    assert ran == 0 and any("G8" in why for why in ran.outside_why), ran.outside_why


@pytest.mark.parametrize("name,cases", [("kda", 1), ("dsa", 8), ("decoder", 6)])
def test_within_the_librarys_contract_the_layers_keep_documents_apart_and_padding_out(name, cases):
    # The leak property on the layers, within glm5_next.cp's contract (G2-G9 set aside).
    assert glm5_step.check(name, glm5_step.VARIANTS[name]["guarded"], cases=cases, seed=SEED, leaks=True) >= cases


# --- the whole model's training step (glm5_train.py) ---

# Few drawn cases in CI (each is the whole model on dp x cp ranks, its unsharded
# run and the two leak runs: ~30 s at dp 2 x cp 2); `glm5_step.py train --dp 2
# --cases N` for long runs. The planted bugs replay one batch of two rows (one
# each replica) at dp 2 x cp 2: drawing shrinks through dozens of whole steps.
TRAIN_CASES = int(os.environ.get("CPSIM_GLM5_TRAIN_CASES", "1"))
TRAIN_BATCH = ('{"input_ids": [[3, 5, 7, 2, 9, 4, 6, 0], [8, 3, 3, 5, 1, 7, 0, 0]], '
               '"labels": [[5, 7, -100, 9, 4, 6, -100, -100], [3, 3, 5, -100, 7, -100, -100, -100]], '
               '"position_ids": [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 2, 3]], '
               '"seq_lens": [[3, 4], [4, 2]], "pad_token_id": 0}')


def test_the_glm5_train_step_at_dp_2_cp_2_matches_the_step_on_one_rank(tmp_path):
    batch = tmp_path / "train.json"
    batch.write_text(TRAIN_BATCH)
    assert glm5_step.check("train", batch=str(batch), cp=2, dp=2, seed=SEED) == 1  # with the leak runs
    assert glm5_step.check("train", cases=TRAIN_CASES, cps=[2], dp=2, seed=SEED, leaks=False) >= TRAIN_CASES


def test_the_glm5_train_step_at_cp_1_to_4_matches_the_step_on_one_rank():
    assert glm5_step.check("train", cases=TRAIN_CASES, cps=[1, 3, 4], seed=SEED, leaks=False) >= TRAIN_CASES


# Finding G10: a replica whose rows are padding only runs no DSA query, so the
# DSA layer's parameters have no gradient there; without FSDP2's zeros for
# unused parameters (the library configures them only with CP) the replicas'
# reduce-scatters differ in size.
G10_BATCH = ('{"input_ids": [[1, 0, 1], [2, 2, 3]], "labels": [[-100, -100, -100], [2, 3, -100]], '
             '"seq_lens": [[-1000], [3]], "pad_token_id": 0}')


def test_finding_g10_a_replica_of_padding_only_mismatches_fsdps_reduce_scatter_at_cp_1(tmp_path):
    batch = tmp_path / "g10.json"
    batch.write_text(G10_BATCH)
    expect_reported(lambda: glm5_step.check("train", glm5_step.VARIANTS["train"]["unused_with_cp_only"],
                                            batch=str(batch), cp=1, dp=2, seed=SEED, leaks=False),
                    "collective mismatch: reduce_scatter_tensor", "with different arguments")
    assert glm5_step.check("train", batch=str(batch), cp=1, dp=2, seed=SEED, leaks=False) == 1


@pytest.mark.parametrize("variant,says", [
    # the label count of the rank's own shard: every rank's loss over too few labels
    ("local_label_count", ["train:", "the loss reported"]),
    # the routing bias a plain tensor: each rank's own expert load moves it
    ("bias_local", ["train:", "buffer model.language_model.layers.1.mlp.gate.e_score_correction_bias after the step"]),
    # FSDP2 over the DP mesh alone: the CP ranks' gradients never reduced
    ("fsdp_over_dp", ["train:", "gradient of", "the reduction left out CP"]),
])
def test_a_planted_bug_of_the_glm5_train_step_is_reported(variant, says, tmp_path):
    batch = tmp_path / "train.json"
    batch.write_text(TRAIN_BATCH)
    expect_reported(lambda: glm5_step.check("train", glm5_step.VARIANTS["train"][variant], batch=str(batch), cp=2,
                                            dp=2, seed=SEED, leaks=False), *says)
