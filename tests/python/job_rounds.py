"""One rank of a job that all-reduces `--mb` MiB `--rounds` times, pausing
`--pause` seconds after each round (joining the job at `--start-at`): a step that sits between collectives, for
the host-fault suite. Prints "rank R: round K" after each round."""
import argparse
import os
import time

import torch
import torch.distributed as dist

import cpsim.torch as ct

ap = argparse.ArgumentParser()
ap.add_argument("--mb", type=float, default=0.001)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--pause", type=float, default=0.0)
ap.add_argument("--timeout", type=float, default=10.0)
ap.add_argument("--start-at", type=float, default=0.0,
                help="time.time() at which to join the job: ranks that start apart join together")
args = ap.parse_args()

time.sleep(max(0.0, args.start_at - time.time()))
# When this rank really joined: a loaded machine imports torch past `--start-at`.
os.write(1, b"joined at %.3f\n" % time.time())

ct.init_process_group(timeout=args.timeout)
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(max(1, int(args.mb * (1 << 20) / 4)))
for k in range(args.rounds):
    x.fill_(1.0)
    dist.all_reduce(x)
    assert float(x[0]) == world, float(x[0])
    os.write(1, b"rank %d: round %d\n" % (rank, k + 1))
    time.sleep(args.pause)
