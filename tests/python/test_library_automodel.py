"""NeMo Automodel's CP batch code (nemo-automodel 0.7.0, unmodified) on cpsim's
ranks: Kimi-Linear's CP helpers, the contiguous sharder and the THD input
utility against cpsim's references (examples/libraries/automodel_step.py), and
the findings of docs/libraries.md reproduced."""
import json

import pytest
import torch
import torch.distributed as dist

from libraries_common import FAMILY, SEED, expect_reported

import automodel_step
import cpsim.torch

PACK_DATASET = FAMILY["nemo_automodel_pack_dataset"]


@pytest.mark.parametrize("name", ["kimi", "contiguous", "thd"])
def test_random_layouts_hold_at_every_cp_size(name):
    ran = automodel_step.check(name, cases=200, max_cp=8, seed=SEED)
    assert ran >= 200


@pytest.mark.parametrize("mesh", ["dp,cp", "cp,dp"])
def test_kimi_holds_in_data_parallel_replicas(mesh):
    # A (dp, cp) mesh: Kimi's seq_start and gathers follow the CP submesh, whose
    # ranks are consecutive or (cp, dp) interleaved.
    assert automodel_step.check("kimi", cases=40, max_cp=4, seed=SEED, dp=2, mesh=mesh) >= 40


def test_thd_holds_on_automodels_own_packer():
    assert automodel_step.check("thd", cases=100, seed=SEED, family=PACK_DATASET) >= 100


def test_the_contiguous_sharder_cuts_mrope_planes_along_the_sequence(tmp_path):
    # shard_batch_contiguous reads [3, B, S] position_ids' sequence as dim 2
    # (docs/libraries.md): two HF rows, one left-padded with a 1 x 2 image grid.
    batch = tmp_path / "mrope.json"
    batch.write_text('{"input_ids": [[0, 5, 9, 9, 6, 7], [7, 8, 4, 3, 2, 1]], '
                     '"labels": [[-100, 5, 9, 9, 6, 7], [7, 8, 4, 3, 2, 1]], '
                     '"padding_mask": [[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], '
                     '"position_ids": [[[0, 0, 1, 1, 3, 4], [0, 1, 2, 3, 4, 5]], '
                     '[[0, 0, 1, 1, 3, 4], [0, 1, 2, 3, 4, 5]], [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]]}')
    for cp in (1, 2, 3):
        assert automodel_step.check("contiguous", batch=str(batch), cp=cp) == 1


def test_thd_keeps_mrope_planes_and_kimis_sharder_cuts_their_rows():
    # process_input_for_thd flattens each plane on its own ([3, 1, B * S]);
    # Kimi-Linear's sharder pads and cuts [3, B, S] along axis 1 (finding K5).
    rows = FAMILY["vision_language_mrope_rows"]
    assert automodel_step.check("thd", cases=10, seed=SEED, family=rows) >= 10
    expect_reported(lambda: automodel_step.check("kimi", automodel_step.VARIANTS["kimi"]["unguarded"], cases=10,
                                                 seed=SEED, family=rows),
                    "batch position_ids: shape [3, ")


def test_the_contiguous_sharder_holds_on_hf_families():
    for name in ("unpacked_left_padding", "flattening_collator", "vision_language_mrope_unpacked"):
        automodel_step.check("contiguous", cases=25, seed=SEED, family=FAMILY[name])


def test_a_seq_start_from_the_world_rank_is_reported_in_data_parallel_replicas():
    expect_reported(lambda: automodel_step.check("kimi", automodel_step.VARIANTS["kimi"]["rank_from_world"],
                                                 cases=40, max_cp=4, seed=SEED, dp=2),
                    "(dp 1, cp 0) local_doc_ids")


def test_undeclared_sequence_keys_are_reported():
    expect_reported(lambda: automodel_step.check("contiguous",
                                                 automodel_step.VARIANTS["contiguous"]["extra_keys_undeclared"],
                                                 cases=200, seed=SEED),
                    "batch token_type_ids")


def test_a_thd_stream_unflattened_sequence_major_is_reported():
    expect_reported(lambda: automodel_step.check("thd", automodel_step.VARIANTS["thd"]["rows_transposed"],
                                                 cases=100, seed=SEED, family=PACK_DATASET),
                    "padding")


def test_finding_k1_padded_slots_are_real_in_kimis_padding_mask():
    # Automodel's own packer pads every document to 2 * cp: Kimi marks those slots real.
    failure = expect_reported(lambda: automodel_step.check("kimi", automodel_step.VARIANTS["kimi"]["unguarded"],
                                                           cases=50, seed=SEED, family=PACK_DATASET),
                              "batch padding_mask", "expected True")
    assert '"seq_lens_padded"' in failure.batch


def _replay(tmp_path, name, batch):
    """The library's step on one layout of docs/libraries.md, its guards off."""
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(dict(batch, pad_token_id=0)))
    settings = automodel_step.SETTINGS[name]
    return lambda: cpsim.torch.check(automodel_step.VARIANTS[name]["unguarded"], batch=str(path), cp=1,
                                     pad_multiple=settings.get("pad_multiple", 1),
                                     shard_primary=settings.get("shard_primary", False))


def test_the_minimal_layouts_of_docs_libraries_show_their_findings(tmp_path):
    expect_reported(_replay(tmp_path, "kimi", {"input_ids": [[1, 0]], "labels": [[5, -100]], "seq_lens": [[1]],
                                               "seq_lens_padded": [[2]]}),
                    "batch padding_mask: 1 wrong elements, first at [0, 1]: False, expected True")  # K1
    expect_reported(_replay(tmp_path, "kimi", {"input_ids": [[1, 1]], "labels": [[0, 4]], "seq_lens": [[1, 1]],
                                               "seq_lens_padded": [[1, 1]]}),
                    "batch position_ids: 1 wrong elements, first at [0, 1]: 1, expected 0")  # K2
    expect_reported(_replay(tmp_path, "kimi", {"input_ids": [[1, 1]], "labels": [[4, 0]], "position_ids": [[0, 0]],
                                               "padding_mask": [[False, False]]}),
                    "doc_ids: 1 wrong elements, first at [0, 1]: 1, expected 2")  # K3
    expect_reported(_replay(tmp_path, "contiguous", {"input_ids": [[1]], "labels": [[0]]}),
                    "batch: no padding_mask")  # A1


def test_finding_k4_the_gather_backward_reduces_its_grad_output_in_place():
    expect_reported(lambda: automodel_step.check("kimi", automodel_step.VARIANTS["kimi"]["gradient_in_place"],
                                                 cases=50, seed=SEED),
                    "gathered: the backward wrote into the upstream gradient")


def test_finding_k4_changes_a_sibling_gradient():
    # What K4 does in a model: the gathered tensor added to another input (made
    # before the gather, so autograd runs the gather's backward first); that
    # input's gradient comes out summed over the ranks.
    from nemo_automodel.components.models.kimi_linear.cp import all_gather_sequence

    def rank(r, world):
        x = torch.ones(1, 2, 1, requires_grad=True)
        b = torch.zeros(1, 4, 1, requires_grad=True)
        c = b * 2.0
        out = all_gather_sequence(x, dist.group.WORLD, dim=1) + c
        out.backward(torch.full((1, 4, 1), float(r + 1)))
        return b.grad.flatten().tolist()

    grads = cpsim.torch.spawn(rank, 2)
    assert grads == [[6.0] * 4, [6.0] * 4]  # the right ones: [2.0] * 4 and [4.0] * 4
