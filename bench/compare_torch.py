#!/usr/bin/env python3
"""What users run today, side by side with cpsim: torch.distributed's Gloo backend
(one process per rank, loopback) against cpsim's backends on the same all_gather
sizes, and a plain torch loop doing the gather + halo property work against cpsim's
property throughput. Needs torch (the project's .venv: make bench-compare) and a built cpsim:

    .venv/bin/python bench/compare_torch.py build/cpsim [--ranks 2,4,8] [--sizes 64K,1M,16M] [--seconds 5]

Every figure is measured in this run; ratios are cpsim time / torch time (below 1:
cpsim is faster) and cpsim cases/s / torch cases/s.
"""
import argparse
import json
import os
import subprocess
import sys
import time

try:
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn
    import torch.multiprocessing as mp
except ImportError:
    sys.exit("compare_torch.py needs PyTorch: make bench-compare (it makes the project's .venv), or run it with .venv/bin/python")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def iterations(n, size):
    return max(5, min(2000, int(256 * 2 ** 20 / (size * n * n + 4096 * n))))


def all_gather_worker(rank, n, sizes, port, queue):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for size in sizes:
        x = torch.full((max(1, size // 4),), float(rank))
        out = [torch.empty_like(x) for _ in range(n)]
        it = iterations(n, size)
        dist.all_gather(out, x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(it):
            dist.all_gather(out, x)
        dist.barrier()
        if rank == 0:
            queue.put((size, (time.perf_counter() - t0) / it * 1e6))
    dist.destroy_process_group()


def random_case(seed, n):
    """One random packed layout: S <= 256 tokens, documents of random lengths, C = 8."""
    g = torch.Generator().manual_seed(seed)
    S = int(torch.randint(1, 257, (1,), generator=g))
    P = (S + n - 1) // n * n
    x = torch.randn(1, P, 8, generator=g, dtype=torch.float64)
    x[:, S:] = 0
    ups = [torch.randn(1, P, 8, generator=g, dtype=torch.float64) for _ in range(n)]
    return P, x, ups


def property_worker(rank, n, seconds, port, queue):
    """gather forward/backward and halo forward/backward, checked, per random case."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    W = 4
    cases, failures = 0, 0
    t0 = time.perf_counter()
    while True:
        stop = torch.tensor([1 if (cases >= 3 and time.perf_counter() - t0 >= seconds) else 0])
        dist.broadcast(stop, 0)
        if int(stop):
            break
        P, x, ups = random_case(1000 + cases, n)
        L = P // n
        ok = True
        # gather_sequence forward and backward
        local = x[:, rank * L:(rank + 1) * L].clone().requires_grad_()
        gathered = torch.cat(dnn.all_gather(local), dim=1)
        ok &= torch.equal(gathered.detach(), x)
        (gathered * ups[rank]).sum().backward()
        want = sum(u[:, rank * L:(rank + 1) * L] for u in ups)
        ok &= torch.allclose(local.grad, want, rtol=0, atol=1e-12)
        # convolution_history forward and backward (all-gather of tails)
        local = x[:, rank * L:(rank + 1) * L].clone().requires_grad_()
        T = min(L, W - 1)
        tails = torch.cat(dnn.all_gather(local[:, L - T:]), dim=1)  # [1, n*T, 8]
        hist = []
        for s in range(W - 1):
            p = rank * L - (W - 1) + s
            if p < 0:
                hist.append(torch.zeros(1, 1, 8, dtype=x.dtype))
            else:
                q, k = p // L, p - (p // L * L + L - T)
                hist.append(tails[:, q * T + k:q * T + k + 1])
        window = torch.cat(hist + [local], dim=1)
        ref = torch.cat([torch.zeros(1, W - 1, 8, dtype=x.dtype), x], dim=1)[:, rank * L:rank * L + L + W - 1]
        ok &= torch.equal(window.detach(), ref)
        up = ups[rank][:, :1].expand(1, L + W - 1, 8).contiguous()
        # The anchor: every rank's loss must depend on the gathered tails, or a rank
        # whose window lies before position 0 skips the all_gather's backward (a hang).
        ((window * up).sum() + tails.sum() * 0).backward()
        ok &= local.grad is not None
        cases += 1
        failures += 0 if ok else 1
    if rank == 0:
        queue.put((cases, time.perf_counter() - t0, failures))
    dist.destroy_process_group()


def spawn(target, n, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + (os.getpid() % 1000) + n
    procs = [ctx.Process(target=target, args=(r, n, *args, port, queue)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out


def cpsim_json(cmd):
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cpsim")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--sizes", default="64K,1M,16M")
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--only", choices=["all_gather", "properties"], help="run one of the two comparisons")
    a = ap.parse_args()
    ranks = [int(r) for r in a.ranks.split(",")]
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.only != "properties":
        compare_all_gather(a, ranks, sizes)
    if a.only != "all_gather":
        compare_properties(a, ranks)


def compare_all_gather(a, ranks, sizes):
    print("# all_gather, float32, bytes per rank; time of one call (us); ratio = cpsim / torch gloo")
    print(f"{'ranks':>5} {'bytes':>10} {'torch gloo':>11} {'threads':>9} {'gloo':>9} {'gloo mp':>9}"
          f" {'threads/torch':>14} {'gloo/torch':>11} {'gloo mp/torch':>14}")
    for n in ranks:
        torch_us = dict(spawn(all_gather_worker, n, sizes))
        common = ["--ops", "all_gather", "--sizes", a.sizes, "--json"]
        ours = {}
        for label, cmd in [("threads", [a.cpsim, "bench", "--backend", "threads", "--ranks", str(n)] + common),
                           ("gloo", [a.cpsim, "bench", "--backend", "gloo", "--ranks", str(n)] + common),
                           ("gloo mp", [a.cpsim, "launch", "-n", str(n), "--", a.cpsim, "bench", "--backend", "gloo"] + common)]:
            ours[label] = {p["bytes"]: p["time_us"] for p in cpsim_json(cmd)}
        for size in sizes:
            t = torch_us[size]
            row = [ours[k][size] for k in ("threads", "gloo", "gloo mp")]
            print(f"{n:>5} {size:>10} {t:>11.1f} {row[0]:>9.1f} {row[1]:>9.1f} {row[2]:>9.1f}"
                  f" {row[0] / t:>14.3f} {row[1] / t:>11.3f} {row[2] / t:>14.3f}")


def compare_properties(a, ranks):
    print("\n# property throughput, cases/s: random layouts (S <= 256, C = 8), checked forward and backward")
    print(f"{'ranks':>5} {'torch loop':>11} {'cpsim g+h':>10} {'cpsim all':>10} {'g+h / torch':>12} {'all / torch':>12}")
    for n in ranks:
        cases, secs, failures = spawn(property_worker, n, a.seconds)[0]
        torch_rate = cases / secs
        out = subprocess.run([a.cpsim, "bench", "--backend", "threads", "--ranks", str(n), "--ops", "all_gather",
                              "--sizes", "8", "--properties", str(a.seconds)], check=True, capture_output=True,
                             text=True).stdout
        rates = {}
        for line in out.splitlines():
            f = line.split()
            if len(f) == 6 and f[0] == "threads" and f[1] == str(n):
                rates[f[2]] = float(f[4])
        print(f"{n:>5} {torch_rate:>11.1f} {rates['gather+halo']:>10.1f} {rates['all']:>10.1f}"
              f" {rates['gather+halo'] / torch_rate:>12.2f} {rates['all'] / torch_rate:>12.2f}"
              + (f"  (torch loop failures: {failures})" if failures else ""))


if __name__ == "__main__":
    main()
