"""The torch.distributed backend on cpsim's ranks (cpsim.torch.spawn): every
collective torch code calls lands on cpsim's communicators, bitwise, and a
choreography mistake is a named error in under the timeout, never a hang."""
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import cpsim.torch as ct

BACKENDS = ["threads", "gloo"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_agree_with_their_definitions(backend):
    def step(rank, world):
        assert dist.get_rank() == rank and dist.get_world_size() == world
        x = torch.arange(3, dtype=torch.float64) + 10 * rank
        out = torch.empty(3 * world, dtype=torch.float64)
        dist.all_gather_into_tensor(out, x)
        parts = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(parts, x)
        summed = x.clone()
        dist.all_reduce(summed)
        mine = torch.empty(2, dtype=torch.float32)
        dist.reduce_scatter_tensor(mine, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
        b = torch.tensor([rank], dtype=torch.int64)
        dist.broadcast(b, src=world - 1)
        dist.barrier()
        return out, torch.cat(parts), summed, mine, b

    world = 3
    for out, parts, summed, mine, b in ct.spawn(step, world, backend=backend):
        want = torch.cat([torch.arange(3, dtype=torch.float64) + 10 * r for r in range(world)])
        assert torch.equal(out, want) and torch.equal(parts, want)
        assert torch.equal(summed, torch.arange(3, dtype=torch.float64) * world + 10 * sum(range(world)))
        assert b.item() == world - 1
    ranks = ct.spawn(lambda r, w: dist.get_rank(), 4, backend=backend)
    assert ranks == [0, 1, 2, 3]
    scattered = ct.spawn(step, world, backend=backend)
    total = sum(r + 1 for r in range(world))
    for rank, (_, _, _, mine, _) in enumerate(scattered):
        assert torch.equal(mine, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * total)


# Every dtype the backend accepts, through every reduction it accepts (SUM, the
# only one: bool sums as logical or), against a closed form: rank r contributes
# x_r[i] = r + i + 1 (bool: i % world == r), so the all-reduced sum is
# world * (i + 1) + world * (world - 1) / 2, and rank r's reduce-scatter block is
# that sum at positions [r * n, (r + 1) * n). Values stay small integers: exact in
# every dtype, bfloat16 included, so the comparison is bitwise.
ACCEPTED_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", ACCEPTED_DTYPES, ids=str)
def test_every_accepted_dtype_sums_to_its_closed_form(dtype):
    world, n = 3, 4

    def contribution(rank, count):
        i = torch.arange(count)
        return (i % world == rank) if dtype == torch.bool else (i + rank + 1).to(dtype)

    def step(rank, world):
        summed = contribution(rank, world * n)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        mine = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(mine, contribution(rank, world * n), op=dist.ReduceOp.SUM)
        gathered = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(gathered, contribution(rank, n))
        return summed, mine, gathered

    i = torch.arange(world * n)
    want = torch.ones(world * n, dtype=torch.bool) if dtype == torch.bool else \
        (world * (i + 1) + world * (world - 1) // 2).to(dtype)
    for rank, (summed, mine, gathered) in enumerate(ct.spawn(step, world)):
        assert summed.dtype == dtype and torch.equal(summed, want), (dtype, summed, want)
        assert torch.equal(mine, want[rank * n:(rank + 1) * n]), (dtype, rank, mine)
        assert torch.equal(gathered, torch.cat([contribution(r, n) for r in range(world)])), (dtype, gathered)


# Every other reduction is refused by name, never computed as a sum: a MAX, MIN,
# AVG or PRODUCT that summed would pass any test of SUM alone.
@pytest.mark.parametrize("op", ["MAX", "MIN", "AVG", "PRODUCT", "BAND", "BOR", "BXOR"])
def test_every_other_reduction_is_refused_by_name(op):
    if not hasattr(dist.ReduceOp, op):
        pytest.skip("this torch has no ReduceOp.%s" % op)

    def step(rank, world):
        said = []
        for call in (lambda: dist.all_reduce(torch.ones(2), op=getattr(dist.ReduceOp, op)),
                     lambda: dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world),
                                                        op=getattr(dist.ReduceOp, op))):
            try:
                call()
                said.append("computed")
            except (NotImplementedError, RuntimeError, ValueError) as e:
                said.append(str(e))
        return said

    for said in ct.spawn(step, 2, timeout=5):
        assert all("with a reduction other than SUM" in text for text in said), (op, said)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_skips_a_collective_is_named_not_hung(backend):
    def step(rank, world):
        x = torch.ones(4)
        if rank != 1:  # rank 1 returns early: its peers would block forever
            dist.all_reduce(x)

    start = time.monotonic()
    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 3, backend=backend, timeout=5)
    assert time.monotonic() - start < 5
    text = str(e.value)
    assert "rank 1" in text and "all_reduce" in text, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_calls_and_sizes_are_named(backend):
    def sizes(rank, world):
        dist.all_reduce(torch.ones(4 + rank))

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(sizes, 2, backend=backend, timeout=5)
    assert "all_reduce" in str(e.value), str(e.value)

    def calls(rank, world):
        x = torch.ones(2)
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, src=0)

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(calls, 2, backend=backend, timeout=5)
    assert "all_reduce" in str(e.value) and "broadcast" in str(e.value), str(e.value)


def test_a_rank_that_raises_is_the_error_and_its_peers_stop():
    def step(rank, world):
        if rank == 2:
            raise ValueError("a planted failure")
        dist.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(step, 3, timeout=5)
    assert time.monotonic() - start < 5
    assert e.value.rank == 2 and "a planted failure" in str(e.value)


def test_what_cpsim_does_not_support_is_a_typed_error():
    def step(rank, world):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX)

    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(step, 2, timeout=5)
    assert "cpsim does not support all_reduce with a reduction other than SUM" in str(e.value)
    # Outside a spawn, torch.distributed is as it was.
    assert not dist.is_initialized()


def test_send_and_recv_pair_up_around_a_ring():
    def step(rank, world):
        out = torch.full((3,), float(rank))
        got = torch.empty(3)
        if rank % 2 == 0:  # even ranks send first: blocking sends return once buffered
            dist.send(out, dst=(rank + 1) % world)
            dist.recv(got, src=(rank - 1) % world)
        else:
            dist.recv(got, src=(rank - 1) % world)
            dist.send(out, dst=(rank + 1) % world)
        req = dist.isend(out * 2, dst=(rank + 1) % world, tag=7)
        got2 = torch.empty(3)
        dist.irecv(got2, src=(rank - 1) % world, tag=7).wait()
        req.wait()
        return got, got2

    world = 4
    for rank, (got, got2) in enumerate(ct.spawn(step, world)):
        assert torch.equal(got, torch.full((3,), float((rank - 1) % world)))
        assert torch.equal(got2, torch.full((3,), 2.0 * ((rank - 1) % world)))


def test_a_recv_whose_sender_never_sends_is_named_not_hung():
    def step(rank, world):
        if rank == 1:
            dist.recv(torch.empty(4), src=0)

    start = time.monotonic()
    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 2, timeout=5)
    assert time.monotonic() - start < 5
    assert "rank 1 waits in recv from rank 0" in str(e.value) and "returned" in str(e.value), str(e.value)


def test_send_and_recv_of_different_sizes_or_a_send_nobody_takes_are_named():
    def sizes(rank, world):
        if rank == 0:
            dist.send(torch.ones(6, dtype=torch.int64), dst=1)
        else:
            dist.recv(torch.empty(4), src=0)

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(sizes, 2, timeout=5)
    assert "expects 4 float32" in str(e.value) and "holds 6 int64" in str(e.value), str(e.value)

    def unreceived(rank, world):
        if rank == 0:
            dist.send(torch.ones(2), dst=1, tag=3)

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(unreceived, 2, timeout=5)
    assert "a send no recv took" in str(e.value) and "tag 3" in str(e.value), str(e.value)


# Ranks as processes: cpsim launch -n N -- python3 job_script.py MODE, each calling
# cpsim.torch.init_process_group().
def _launch(mode, n=3, timeout=10, grace=30):
    import subprocess
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    script = os.path.join(os.path.dirname(__file__), "job_script.py")
    env = dict(os.environ, JOB_TIMEOUT=str(timeout))
    start = time.monotonic()
    p = subprocess.run([binary, "launch", "-n", str(n), "--grace", str(grace), "--", sys.executable, script, mode],
                       env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    return p.returncode, p.stdout.decode(), time.monotonic() - start


def test_processes_of_a_launch_run_torch_collectives_on_cpsim():
    rc, out, _ = _launch("collectives")
    assert rc == 0, out
    assert all("rank %d: collectives agree" % r in out for r in range(3)), out


@pytest.mark.parametrize("mode,words", [("skip", ["rank 1", "all_reduce"]), ("raise", ["rank 2", "ValueError"]),
                                        ("sizes", ["all_gather"]), ("send", ["does not support send"])])
def test_processes_that_disagree_end_in_a_named_error_not_a_hang(mode, words):
    rc, out, took = _launch(mode, timeout=10)
    assert rc != 0, out
    assert took < 60, (took, out)
    assert all(w in out for w in words), (words, out)


def test_what_cpsim_does_not_have_is_a_typed_error():
    def step(rank, world):
        x = torch.ones(world)
        calls = {
            "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(world), x),
            "reduce": lambda: dist.reduce(x, dst=0),
            "gather": lambda: dist.gather(x, [torch.empty(world) for _ in range(world)] if rank == 0 else None, dst=0),
            "scatter": lambda: dist.scatter(x, [torch.ones(world) for _ in range(world)] if rank == 0 else None, src=0),
        }
        said = {}
        for name, call in calls.items():
            try:
                call()
            except NotImplementedError as e:  # cpsim.torch's Unsupported
                said[name] = str(e)
        return said

    for said in ct.spawn(step, 2):
        assert sorted(said) == ["all_to_all_single", "gather", "reduce", "scatter"], said
        assert all(("cpsim does not support " + name) in text for name, text in said.items()), said


def test_a_process_that_never_arrives_is_named_within_the_timeout():
    rc, out, took = _launch("stall", timeout=5, grace=3)
    assert rc != 0, out
    assert took < 60, (took, out)
    assert "rank 1, which never arrived" in out and "all_reduce" in out, out
