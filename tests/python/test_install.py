"""The README's install, as a new user runs it: a fresh virtual environment with
only torch, `pip install .` on a fresh copy of the project (the program, the
harness and the torch backend, built by the project's CMake build through
scikit-build-core against that torch), then a user's step through
cpsim.torch.check on threads and through `cpsim launch` as processes. The commands
are the README's `sh install` block, run as written from the copy's root; nothing
of the build tree (PYTHONPATH, CPSIM_BINARY) is visible to them.

Wheels come from the project's wheel folder (python-env.sh fills it: torch,
scikit-build-core), as pip's find-links with no index: the same packages a user
gets from PyPI, without downloading them again. Several minutes: a whole build.
Where ccache is installed the copy's build goes through it, with the project's
root as ccache's base folder and the build in the copy's `build/`: its C++
objects are then the ones make test's build (build/, also through ccache) has
made, compiled once; the torch module's are its own (another torch folder).
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def readme_install_commands():
    """The commands of the README's ```sh install block, in order."""
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"^```sh install\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) == 1, "the README has one ```sh install block"
    return [line.strip() for line in blocks[0].splitlines() if line.strip() and not line.strip().startswith("#")]


def fresh_copy(dest):
    """The project's files as a fresh clone has them (tracked ones, and new ones
    git does not ignore), without any build output."""
    listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", "-z"], check=True,
                            stdout=subprocess.PIPE).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))


def user_environment(wheels):
    """The environment of a user's shell: no build tree, packages from the wheel folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CPSIM_BINARY", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=wheels, PIP_DISABLE_PIP_VERSION_CHECK="1",
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    if shutil.which("ccache"):  # the objects make test's build compiled (Makefile: its ccache)
        # ccache hashes the compiler's name: c++ as there (CMake's Ninja build would take g++).
        env.update(CMAKE_CXX_COMPILER_LAUNCHER="ccache", CCACHE_BASEDIR=ROOT, SKBUILD_BUILD_DIR="build",
                   CXX=env.get("CXX", "c++"))
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The copy after the README's commands: [(command, exit status, output)]."""
    wheels = os.environ.get("CPSIM_WHEELS", os.path.expanduser("~/.cache/cpsim/wheels"))
    assert os.path.isdir(wheels), f"no wheel folder {wheels}: run scripts/python-env.sh (make test does)"
    # Under the project's root (in its ignored build/), so that ccache's base folder holds it.
    copy = os.path.join(ROOT, "build", "install-clone", "cpsim")
    shutil.rmtree(os.path.dirname(copy), ignore_errors=True)
    fresh_copy(copy)
    env = user_environment(wheels)
    results = []
    for command in readme_install_commands():
        p = subprocess.run(["bash", "-c", command], cwd=copy, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=1500)
        results.append((command, p.returncode, p.stdout.decode(errors="replace")))
        if p.returncode != 0:
            break
    return copy, env, results


def test_every_install_command_of_the_readme_runs_as_written(installed):
    _, _, results = installed
    assert len(results) == len(readme_install_commands())
    for command, rc, out in results:
        assert rc == 0, f"{command}: exit status {rc}\n{out[-6000:]}"
        if "pip install" not in command:  # a run of cpsim prints no third-party warning
            assert "Warning:" not in out, f"{command}:\n{out[-6000:]}"


def test_the_venv_holds_torch_and_cpsim_only_and_its_cpsim_is_the_packages_program(installed):
    copy, env, results = installed
    python = os.path.join(copy, "cp-env", "bin", "python")
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], env=env, stdout=subprocess.PIPE,
                            text=True).stdout.split()
    names = {line.split("==")[0].lower() for line in listed}
    # numpy too: without it torch warns at every import, a line on every run.
    assert {"cpsim", "torch", "numpy"} <= names, listed
    assert not names & {"pytest", "scikit-build-core"}, listed
    where = subprocess.run([python, "-c", "import cpsim.program, cpsim._C; print(cpsim.program.binary())"],
                           cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert where.returncode == 0, where.stdout
    assert where.stdout.strip().endswith(os.path.join("site-packages", "cpsim", "bin", "cpsim")), where.stdout


def test_the_step_holds_on_threads_and_as_processes(installed):
    _, _, results = installed
    outputs = {command: out for command, _, out in results}
    on_threads = next(out for command, out in outputs.items() if "cp_step.py" in command and "launch" not in command)
    assert re.search(r"cp_step: \d+ layouts hold at cp 1-8 \(threads\)", on_threads), on_threads
    as_processes = next(out for command, out in outputs.items() if "launch" in command)
    for rank in range(2):
        assert re.search(r"cp_step: rank %d: \d+ layouts hold at cp 2 \(processes\)" % rank, as_processes), as_processes
    assert "cpsim launch: exit status 0" in as_processes, as_processes


def test_a_planted_bug_is_caught_by_the_installed_package(installed):
    copy, env, _ = installed
    python = os.path.join(copy, "cp-env", "bin", "python")
    p = subprocess.run([python, "examples/torch/cp_step.py", "--variant", "wrong_neighbour", "--cases", "30"],
                       cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 1, p.stdout
    assert "halo" in p.stdout and "smallest failing layout" in p.stdout, p.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
