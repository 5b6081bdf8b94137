"""One rank of a job that `cpsim launch -n N -- python3 job_script.py MODE` starts
(tests/python/test_torch_backend.py): torch.distributed calls on the cpsim
backend across processes."""
import os
import sys

import torch
import torch.distributed as dist

import cpsim.torch as ct

mode = sys.argv[1]
ct.init_process_group(timeout=float(os.environ.get("JOB_TIMEOUT", "10")), sends=os.environ.get("JOB_SENDS", "rendezvous"))
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "cpsim", dist.get_backend()
x = torch.arange(3, dtype=torch.float64) + 10 * rank
if mode == "collectives":
    out = torch.empty(3 * world, dtype=torch.float64)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, torch.cat([torch.arange(3, dtype=torch.float64) + 10 * r for r in range(world)])), out
    summed = x.clone()
    dist.all_reduce(summed)
    assert torch.equal(summed, torch.arange(3, dtype=torch.float64) * world + 10 * sum(range(world))), summed
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    total = sum(r + 1 for r in range(world))
    assert torch.equal(mine, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * total), mine
    b = torch.tensor([rank])
    dist.broadcast(b, src=world - 1)
    assert b.item() == world - 1
    dist.barrier()
    print("rank %d: collectives agree" % rank)
elif mode == "skip":
    if rank != 1:  # rank 1 returns without the all_reduce its peers enter
        dist.all_reduce(x)
elif mode == "raise":
    if rank == world - 1:
        raise ValueError("the step of rank %d broke" % rank)
    dist.all_reduce(x)
elif mode == "lost_at_end":  # every all_reduce returns, then rank 1 is killed before the job ends
    dist.all_reduce(x)
    if rank == 1:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
elif mode == "sizes":
    dist.all_gather_into_tensor(torch.empty(world * (2 + rank)), torch.ones(2 + rank))
elif mode == "stall":
    if rank == 1:  # never arrives at the all_reduce its peers wait in
        import time
        time.sleep(1000)
    dist.all_reduce(x)
elif mode == "ring":  # every rank posts its irecv first, then sends; then a batch, then a subgroup's pair
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(3, dtype=torch.float64)
    req = dist.irecv(got, src=prev)
    dist.send(x, dst=nxt)
    req.wait()
    assert torch.equal(got, torch.arange(3, dtype=torch.float64) + 10 * prev), got
    back = torch.empty(2, dtype=torch.float16)
    ops = [dist.P2POp(dist.irecv, back, nxt), dist.P2POp(dist.isend, torch.full((2,), float(rank), dtype=torch.float16), prev)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    assert torch.equal(back, torch.full((2,), float(nxt), dtype=torch.float16)), back
    pair = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        peer = world - 1 if rank == 0 else 0
        big = torch.full((1 << 16,), float(rank))
        req = dist.isend(big, dst=peer, group=pair)
        into = torch.empty(1 << 16)
        dist.recv(into, src=peer, group=pair)
        req.wait()
        assert torch.equal(into, torch.full((1 << 16,), float(peer))), into[:4]
    dist.barrier()
    print("rank %d: point to point agrees" % rank)
elif mode == "recv_nothing":  # rank 0 waits for a message rank 1 never sends
    if rank == 0:
        dist.recv(torch.empty(2), src=1)
elif mode == "send_size":  # rank 1 sends 3 elements where rank 0 receives 2
    if rank == 1:
        dist.send(torch.ones(3), dst=0)
    elif rank == 0:
        dist.recv(torch.empty(2), src=1)
elif mode == "send_first":  # every rank's blocking send before its recv: a deadlock unless sends are eager
    dist.send(x, dst=(rank + 1) % world)
    got = torch.empty(3, dtype=torch.float64)
    dist.recv(got, src=(rank - 1) % world)
    assert torch.equal(got, torch.arange(3, dtype=torch.float64) + 10 * ((rank - 1) % world)), got
    print("rank %d: the ring ran" % rank)
elif mode == "recv_from_raiser":  # rank 0 waits for a message; rank 1 raises instead of sending it
    if rank == 0:
        dist.recv(torch.empty(2), src=1)
    elif rank == 1:
        raise ValueError("the step of rank 1 broke")
elif mode == "unreceived":  # rank 1 sends what rank 0 never receives (eager sends: it returns)
    if rank == 1:
        dist.send(torch.ones(3), dst=0)
    dist.barrier()
elif mode == "subgroups":  # 4 processes: a group of some, a (dp, cp) mesh, a group made twice
    from torch.distributed.device_mesh import init_device_mesh
    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=mine)
    assert y.item() == (0 + 2 if rank % 2 == 0 else 1 + 3), y
    assert dist.get_process_group_ranks(mine) == ([0, 2] if rank % 2 == 0 else [1, 3])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp, dp = mesh["cp"].get_group(), mesh["dp"].get_group()
    z = torch.tensor([float(rank)])
    dist.all_reduce(z, op=dist.ReduceOp.MAX, group=cp)  # cp groups: {0, 1}, {2, 3}
    assert z.item() == (1 if rank < 2 else 3), z
    w = torch.tensor([float(rank)])
    dist.all_reduce(w, op=dist.ReduceOp.AVG, group=dp)  # dp groups: {0, 2}, {1, 3}
    assert w.item() == (1 if rank % 2 == 0 else 2), w
    first = dist.new_group([0, 1, 2])
    if rank < 3:
        t = torch.ones(2)
        dist.all_reduce(t, group=first)
        assert torch.equal(t, torch.full((2,), 3.0)), t
    dist.barrier()
    print("rank %d: subgroups agree" % rank)
elif mode == "subgroup_skip":  # 4 processes: rank 2 skips its group's collective
    pair = dist.new_group([0, 2])
    if rank == 0:
        dist.all_reduce(x, group=pair)
elif mode == "dtensor":  # a Partial DTensor's full_tensor, functional collectives, an FSDP2 step
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Shard
    mesh = init_device_mesh("cpu", (world,))
    load = torch.tensor([float(rank), 1.0, 2.0, 3.0])
    full = DTensor.from_local(load, device_mesh=mesh, placements=[Partial()]).full_tensor()
    assert full.tolist() == [float(sum(range(world))), 1.0 * world, 2.0 * world, 3.0 * world], full
    stacked = DTensor.from_local(torch.tensor([[float(rank)]]), mesh, [Shard(0)]).full_tensor()
    assert stacked.flatten().tolist() == [float(r) for r in range(world)], stacked
    summed = funcol.all_reduce(x, "sum", dist.group.WORLD)
    assert summed.tolist() == (torch.arange(3, dtype=torch.float64) * world + 10 * sum(range(world))).tolist()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).double()
    fully_shard(model, mesh=mesh)
    rows = torch.arange(world * 8, dtype=torch.float64).reshape(world * 2, 4) / 10
    model(rows[2 * rank:2 * rank + 2]).pow(2).mean().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).double()
    ref(rows).pow(2).mean().backward()
    for g, p in zip(grads, ref.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-12, atol=1e-14), (g, p.grad)
    print("rank %d: dtensor agrees" % rank)
elif mode == "funcol_unwaited":  # a functional all_reduce whose output is neither waited nor read
    import torch.distributed._functional_collectives as funcol
    funcol.all_reduce(x, "sum", dist.group.WORLD)
elif mode == "tags_posted_first":  # receives of two tags posted before the sends, sent the other way round
    if rank == 0:
        a, b = torch.zeros(1), torch.zeros(1)
        ra, rb = dist.irecv(a, src=1, tag=1), dist.irecv(b, src=1, tag=2)
        dist.barrier()
        ra.wait()
        rb.wait()
        assert (a.item(), b.item()) == (11.0, 20.0), (a, b)
    elif rank == 1:
        dist.barrier()
        for r in [dist.isend(torch.tensor([20.0]), dst=0, tag=2), dist.isend(torch.tensor([11.0]), dst=0, tag=1)]:
            r.wait()
    else:
        dist.barrier()
    print("rank %d: tags agree" % rank)
elif mode.startswith("subgroup_raise"):
    # 4 processes: in a group of two (ranks 1 and 3, interleaved; subgroup_raise_offset:
    # ranks 2 and 3), rank 3 raises; the group's other rank waits in it
    members = [2, 3] if mode.endswith("_offset") else [1, 3]
    pair = dist.new_group(members)
    if rank == 3:
        raise ValueError("the step of rank 3 broke")
    if rank == members[0]:
        dist.all_reduce(x, group=pair)
