"""Cases per second of cpsim.torch.check against the same step and comparisons on
torch's own gloo backend across processes (one process per rank), on the same
drawn layouts:

    PYTHONPATH=build/python /usr/bin/python3 examples/torch/bench_harness.py --cases 200

cpsim's figure is the whole harness (drawing, the references' golden folders,
the ranks, the comparisons); torch's is its steady-state loop over the same
golden folders (written beforehand, not counted), and again with the start of
its processes and process groups counted.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_step  # noqa: E402

cp_step.PORTABLE = True  # torch's gloo lacks the tensor forms: both sides run the list forms

import cpsim.torch as ct  # noqa: E402
from cpsim import harness  # noqa: E402
from cpsim.case import Golden  # noqa: E402
from cpsim.rank import run_rank  # noqa: E402


def dump_cases(cases, max_cp, seed, into):
    """The layouts cpsim.torch.check draws for this seed, as golden folders by CP size."""
    work = tempfile.mkdtemp(prefix="cpsim-bench-")
    p = subprocess.Popen([harness._cpsim_binary(), "harness", "--workdir", work, "--cases", str(cases), "--max-cp",
                          str(max_cp), "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         universal_newlines=True, bufsize=1)
    by_cp = {}
    for line in p.stdout:
        if line.strip() == "done":
            break
        folder = line.split(" ", 1)[1].strip()
        g = Golden(folder)
        target = os.path.join(into, "%05d" % sum(len(v) for v in by_cp.values()))
        shutil.copytree(folder, target)
        by_cp.setdefault(g.cp, []).append(target)
        p.stdin.write("ok\n")
        p.stdin.flush()
    p.stdin.close()
    p.wait()
    shutil.rmtree(work, ignore_errors=True)
    return by_cp


def _worker(rank, world, folders, port, times):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    goldens = [Golden(f) for f in folders]
    dist.barrier()
    start = time.perf_counter()
    for g in goldens:
        why = run_rank(g, cp_step.step, rank)
        assert not why, why
    dist.barrier()
    if rank == 0:
        times[world] = time.perf_counter() - start
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--max-cp", type=int, default=8)
    p.add_argument("--seed", type=int, default=5)
    a = p.parse_args()

    start = time.perf_counter()
    n = ct.check(cp_step.step, cases=a.cases, max_cp=a.max_cp, seed=a.seed)
    cpsim_s = time.perf_counter() - start

    folder = tempfile.mkdtemp(prefix="cpsim-bench-cases-")
    try:
        by_cp = dump_cases(a.cases, a.max_cp, a.seed, folder)
        manager = mp.Manager()
        times = manager.dict()
        total_start = time.perf_counter()
        for i, (cp, folders) in enumerate(sorted(by_cp.items())):
            mp.spawn(_worker, args=(cp, folders, 29500 + (os.getpid() % 1000) * 10 + i, times), nprocs=cp)
        torch_total = time.perf_counter() - total_start
        torch_loop = sum(times.values())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("cases: %d (cp 1-%d, seed %d)" % (n, a.max_cp, a.seed))
    print("cpsim.torch.check (threads, whole harness):   %8.1f cases/s" % (n / cpsim_s))
    print("torch gloo processes, loop only:              %8.1f cases/s" % (n / torch_loop))
    print("torch gloo processes, with their start:       %8.1f cases/s" % (n / torch_total))
    print("ratio cpsim / torch loop: %.2f; cpsim / torch with start: %.2f"
          % (torch_loop / cpsim_s, torch_total / cpsim_s))


if __name__ == "__main__":
    main()
