"""cpsim under the launchers people use, each started for real: Open MPI's
mpirun, Slurm's srun (a one-node cluster this suite configures, starts and
stops), and torchrun. Each process takes its rank and size from its launcher's
variables, its job id from the launcher where it gives one, and meets the others
in a file store; the C++ check and a torch step under cpsim.torch.check both run."""
import glob
import os
import re
import sys

import pytest

from launchers import EXAMPLES, JOB_HARNESS, SlurmCluster, binary, free_ports, needs, python_env, run

# Open MPI refuses root unless told (CI runs as root).
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}


@pytest.fixture
def store(tmp_path):
    """A fresh file store (a directory) for one job."""
    path = str(tmp_path / "store")
    os.makedirs(path)
    return path


def claims(store):
    """The job ids under which the processes claimed their ranks in a file store."""
    return sorted({os.path.basename(p).rsplit("_claim_", 1)[0] for p in glob.glob(os.path.join(store, "*_claim_*"))})


def test_mpirun_runs_a_check_on_four_ranks(store):
    needs("mpirun")
    rc, out, seconds = run(["mpirun", "-n", "4", binary(), "check", os.path.join(EXAMPLES, "spec_example.json"),
                            "--store", "file:" + store], env=dict(os.environ, **MPI_ENV))
    assert rc == 0, out
    assert "all properties hold" in out and "cp=4" in out, out
    # Rank, size and the job id came from Open MPI.
    ids = claims(store)
    assert len(ids) == 1 and ids[0].startswith("cpsim-claim-ompi-"), ids
    assert len(glob.glob(os.path.join(store, "*_claim_*"))) == 4


def mpirun_harness(n, variant, cases, store):
    """job_harness.py's `variant` on n processes under mpirun, meeting in `store`."""
    needs("mpirun")
    env = dict(python_env(), CPSIM_STORE="file:" + store, **MPI_ENV)
    return run(["mpirun", "-n", str(n), sys.executable, JOB_HARNESS, variant, str(cases)], env=env)


def test_mpirun_runs_a_torch_step_under_the_harness(store):
    rc, out, _ = mpirun_harness(4, "faithful", 4, store)
    assert rc == 0, out
    assert all("rank %d: [faithful] 4 layouts hold at cp 4" % r in out for r in range(4)), out


def test_mpirun_reports_a_planted_bug_from_every_rank(store):
    rc, out, _ = mpirun_harness(3, "wrong_neighbour", 8, store)
    assert rc != 0, out
    assert all("rank %d: [wrong_neighbour]" % r in out and "halo" in out for r in range(3)), out


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster()
    yield cluster
    cluster.stop()


def test_srun_runs_a_check_on_four_tasks(slurm, store):
    rc, out, _ = run(["srun", "-n", "4", "--overcommit", binary(), "check", os.path.join(EXAMPLES, "spec_example.json"),
                      "--store", "file:" + store], env=slurm.env)
    assert rc == 0, out + slurm.logs()
    assert "all properties hold" in out and "cp=4" in out, out
    # Rank and size from SLURM_PROCID/SLURM_NTASKS, the job id from Slurm's job and step.
    ids = claims(store)
    assert len(ids) == 1 and ids[0].startswith("cpsim-claim-slurm-"), ids


def test_srun_runs_a_torch_step_under_the_harness(slurm, store):
    env = dict(slurm.env, CPSIM_STORE="file:" + store, PYTHONUNBUFFERED="1")
    rc, out, _ = run(["srun", "-n", "3", "--overcommit", sys.executable, JOB_HARNESS, "faithful", "4"], env=env)
    assert rc == 0, out + slurm.logs()
    assert all("rank %d: [faithful] 4 layouts hold at cp 3" % r in out for r in range(3)), out


def srun_tasks(out, what):
    """The tasks srun's lines "task(s) LIST: WHAT" name (LIST as 0-1,3)."""
    tasks = set()
    for m in re.finditer(r"tasks? ([0-9,-]+): " + re.escape(what), out):
        for part in m.group(1).split(","):
            lo, _, hi = part.partition("-")
            tasks.update(range(int(lo), int(hi or lo) + 1))
    return tasks


def test_a_task_killed_under_srun_ends_the_others_naming_it(slurm, store):
    # Rank 2 kills itself with SIGKILL in the middle of a fuzz run; the others end
    # within their timeout (exit 3) naming rank 2.
    script = ('if [ "$SLURM_PROCID" = 2 ]; then (sleep 2; kill -9 $$) & fi; exec %s fuzz --cases 100000 '
              '--timeout 5 --store file:%s' % (binary(), store))
    rc, out, seconds = run(["srun", "-n", "4", "--overcommit", "--kill-on-bad-exit=0", "bash", "-c", script],
                           env=slurm.env, timeout=120)
    assert rc != 0, out
    assert "no failure record from rank 2: its process" in out and "is gone" in out, out
    assert srun_tasks(out, "Exited with exit code 3") == {0, 1, 3}, out
    assert seconds < 2 + 5 + 10, (seconds, out)


def test_torchrun_runs_a_torch_step_under_the_harness(store):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not in the project's environment")
    (port,) = free_ports(1)
    env = dict(python_env(), CPSIM_STORE="file:" + store)
    rc, out, _ = run([torchrun, "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(port),
                      JOB_HARNESS, "faithful", "4"], env=env)
    assert rc == 0, out
    assert all("rank %d: [faithful] 4 layouts hold at cp 4" % r in out for r in range(4)), out
