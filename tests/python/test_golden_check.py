"""examples/golden_check.py (the independent numpy check of a golden folder)
checked from outside: a folder with one value wrong, in each comparison branch
it has (bit for bit, within a tolerance, a NaN on one side only) and in every
kind of key it checks (a rank's exchanged data, its layout, its layer output,
its targets), is rejected naming the key; the folder as written passes."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHECK = os.path.join(ROOT, "examples", "golden_check.py")


def _run_check(folder):
    p = subprocess.run([sys.executable, CHECK, folder], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=120)
    return p.returncode, p.stdout


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    folder = str(tmp_path_factory.mktemp("golden") / "spec_cp3")
    subprocess.run([binary, "golden", os.path.join(ROOT, "examples", "spec_example.json"), "--cp", "3", "--out",
                    folder], check=True, stdout=subprocess.DEVNULL)
    return folder


def test_the_folder_as_written_passes(golden):
    rc, out = _run_check(golden)
    assert rc == 0 and "comparisons hold" in out, out


def _last(change):
    def apply(a):
        flat = a.reshape(-1)
        flat[-1] = change(flat[-1])
    return apply


TAMPERS = [
    ("gathered", _last(lambda v: v + 1), "1 wrong elements"),             # bitwise, floating
    ("halo", _last(lambda v: v + 1), "1 wrong elements"),                 # bitwise, floating
    ("local_doc_ids", _last(lambda v: v + 1), "1 wrong elements"),        # bitwise, integer
    ("targets", _last(lambda v: v + 1), "1 wrong elements"),              # the targets its loss reads
    ("o", _last(lambda v: v * (1 + 1e-3) + 1e-3), "relative RMSE"),       # within a tolerance
    ("conv_y", _last(lambda v: np.nan), "a NaN or an inf on one side only"),
    ("attention_dv", _last(lambda v: np.inf), "a NaN or an inf on one side only"),
]


@pytest.mark.parametrize("key,change,words", TAMPERS, ids=[t[0] for t in TAMPERS])
def test_one_value_wrong_is_rejected_naming_its_key(golden, tmp_path, key, change, words):
    folder = str(tmp_path / "tampered")
    shutil.copytree(golden, folder)
    path = os.path.join(folder, "rank_1.safetensors")
    tensors = load_file(path)
    value = tensors[key].copy()
    change(value)
    tensors[key] = value
    save_file(tensors, path)
    rc, out = _run_check(folder)
    assert rc != 0, out
    assert ("rank 1 %s:" % key) in out and words in out, out


# The writer's tolerances: a folder whose manifest loosens one is rejected by
# golden_check's own bounds, naming the key (a looser tolerance would let a
# wrong implementation pass every comparison that reads it).
LOOSENED = [
    ("attention_o", 0.01, "looser than float64 arithmetic needs (at most 1e-09)"),  # computed
    ("conv_dx", float("nan"), "looser than float64 arithmetic needs"),               # NaN: not <= any bound
    ("gathered", 1e-12, "compared bit for bit"),                                     # exchanged
    ("targets", 0.5, "compared bit for bit"),                                        # integers
]


@pytest.mark.parametrize("key,tolerance,words", LOOSENED, ids=[t[0] for t in LOOSENED])
def test_a_loosened_tolerance_in_the_manifest_is_rejected_naming_its_key(golden, tmp_path, key, tolerance, words):
    import json
    folder = str(tmp_path / "loosened")
    shutil.copytree(golden, folder)
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"]["rank_1.safetensors"][key]["tolerance"] = tolerance
    with open(path, "w") as f:
        json.dump(manifest, f)
    rc, out = _run_check(folder)
    assert rc != 0, out
    assert ("rank_1.safetensors %s: tolerance" % key) in out and words in out, out


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_writers_tolerances_of_every_dtype_are_within_golden_checks_bounds(tmp_path, dtype):
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    folder = str(tmp_path / dtype)
    subprocess.run([binary, "golden", os.path.join(ROOT, "examples", "spec_example.json"), "--cp", "3", "--dtype",
                    dtype, "--out", folder], check=True, stdout=subprocess.DEVNULL)
    sys.path.insert(0, os.path.dirname(CHECK))
    import golden_check
    assert golden_check.check_tolerances(golden_check.load_golden(folder)) > 100


def test_an_mrope_folder_holds_and_rope_by_one_plane_is_rejected(tmp_path):
    # examples/mrope_example.json: [3, S] position_ids (a 2 x 3 image grid in the
    # first document). The numpy check turns each pair by its plane; turned by
    # the temporal plane alone, the rope and attention keys are rejected.
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    folder = str(tmp_path / "mrope")
    subprocess.run([binary, "golden", os.path.join(ROOT, "examples", "mrope_example.json"), "--cp", "3", "--out",
                    folder], check=True, stdout=subprocess.DEVNULL)
    code, out = _run_check(folder)
    assert code == 0, out
    sys.path.insert(0, os.path.dirname(CHECK))
    import golden_check
    golden = golden_check.load_golden(folder)
    assert golden.ranks[1]["batch.position_ids"].shape[0] == 3
    one_plane = lambda x, positions: golden_check.numpy_rope(x, [p[0] for p in positions])
    with pytest.raises(AssertionError, match="rope"):
        golden_check.check(golden, rope=one_plane, log=lambda *a: None)
