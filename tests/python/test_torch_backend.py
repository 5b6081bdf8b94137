"""The torch.distributed backend on cpsim's ranks (cpsim.torch.spawn): every
collective torch code calls lands on cpsim's communicators, bitwise, and a
choreography mistake is a named error in under the timeout, never a hang."""
import os
import re
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import cpsim.torch as ct

BACKENDS = ["threads", "gloo"]
# Older torch (2.10) runs monitored_barrier on its gloo backend only.
_MONITORED_BARRIER_GLOO_ONLY = "only implemented for GLOO" in open(dist.distributed_c10d.__file__).read()


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


# Every dtype torch can send, through every reduction defined for it, against
# closed forms in Python integers: rank r contributes x_r[i] = (i + r) % 3 + 1
# (bool: (i + r) % 2 == 0), small integers exact in every dtype, so the
# comparison is bitwise (AVG: the exact sum divided in the dtype, as torch does).
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _defined(op, dtype):
    if op == "AVG":
        return dtype.is_floating_point
    if op in ("BAND", "BOR", "BXOR"):
        return not dtype.is_floating_point
    return not (dtype == torch.bool and op in ("SUM", "PRODUCT"))


def _contribution(rank, count, dtype):
    i = torch.arange(count)
    return ((i + rank) % 2 == 0) if dtype == torch.bool else ((i + rank) % 3 + 1).to(dtype)


def _closed_form(op, values):
    from functools import reduce
    import operator
    f = {"SUM": operator.add, "AVG": operator.add, "PRODUCT": operator.mul, "MIN": min, "MAX": max,
         "BAND": operator.and_, "BOR": operator.or_, "BXOR": operator.xor}[op]
    return reduce(f, values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_through_every_reduction_matches_its_closed_form(dtype):
    world, n = 3, 4

    def step(rank, world):
        out = {}
        for op in OPS:
            if not _defined(op, dtype):
                continue
            summed = _contribution(rank, world * n, dtype)
            dist.all_reduce(summed, op=getattr(dist.ReduceOp, op))
            mine = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(mine, _contribution(rank, world * n, dtype), op=getattr(dist.ReduceOp, op))
            rooted = _contribution(rank, world * n, dtype)
            dist.reduce(rooted, dst=1, op=getattr(dist.ReduceOp, op))
            out[op] = summed, mine, rooted
        gathered = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(gathered, _contribution(rank, n, dtype))
        return out, gathered

    for rank, (out, gathered) in enumerate(ct.spawn(step, world)):
        assert torch.equal(gathered, torch.cat([_contribution(r, n, dtype) for r in range(world)])), (dtype, gathered)
        for op, (summed, mine, rooted) in out.items():
            parts = [_contribution(r, world * n, dtype).tolist() for r in range(world)]
            exact = [_closed_form(op, [p[i] for p in parts]) for i in range(world * n)]
            want = torch.tensor(exact).to(dtype)
            if op == "AVG":
                want = want / world
            assert summed.dtype == dtype and torch.equal(summed, want), (op, dtype, summed, want)
            assert torch.equal(mine, want[rank * n:(rank + 1) * n]), (op, dtype, rank, mine)
            if rank == 1:
                assert torch.equal(rooted, want), (op, dtype, rooted)
            else:
                assert torch.equal(rooted, _contribution(rank, world * n, dtype)), (op, dtype, rank, rooted)


@pytest.mark.parametrize("op,dtype", [("AVG", torch.int32), ("BAND", torch.float32), ("BXOR", torch.bfloat16)])
def test_a_reduction_torch_does_not_define_for_a_dtype_is_named(op, dtype):
    def step(rank, world):
        dist.all_reduce(torch.ones(2, dtype=dtype), op=getattr(dist.ReduceOp, op))

    for world in (1, 2):  # refused before any byte moves, in a group of one too
        with pytest.raises(ct.RankFailed) as e:
            ct.spawn(step, world, timeout=5)
        assert ("all_reduce with %s of %s" % (op, str(dtype).split(".")[1])) in str(e.value), str(e.value)


def test_fp8_moves_bit_for_bit():
    kinds = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]

    def step(rank, world):
        out = []
        for kind in kinds:
            x = (torch.arange(4, dtype=torch.float32) + rank).to(kind)
            got = torch.empty(4 * world, dtype=kind)
            dist.all_gather_into_tensor(got, x)
            b = x.clone()
            dist.broadcast(b, src=1)
            out.append((got.view(torch.uint8), b.view(torch.uint8)))
        return out

    results = ct.spawn(step, 2)
    for k, kind in enumerate(kinds):
        want = torch.cat([(torch.arange(4, dtype=torch.float32) + r).to(kind).view(torch.uint8) for r in range(2)])
        for out in results:
            assert torch.equal(out[k][0], want) and torch.equal(out[k][1], want[4:]), kind


def test_rooted_and_all_to_all_collectives_agree_with_their_definitions():
    def step(rank, world):
        x = torch.arange(2, dtype=torch.float64) + 10 * rank
        got = [torch.empty(2, dtype=torch.float64) for _ in range(world)] if rank == 0 else None
        dist.gather(x, got, dst=0)
        piece = torch.empty(2, dtype=torch.float64)
        dist.scatter(piece, [torch.full((2,), float(q)) .double() for q in range(world)] if rank == 1 else None, src=1)
        # Uneven all_to_all_single: rank r sends q + 1 rows to rank q.
        send = torch.cat([torch.full((q + 1, 2), float(10 * rank + q)) for q in range(world)])
        recv = torch.empty(world * (rank + 1), 2)
        dist.all_to_all_single(recv, send, output_split_sizes=[rank + 1] * world,
                               input_split_sizes=[q + 1 for q in range(world)])
        outs = [torch.empty(3, dtype=torch.int32) for _ in range(world)]
        dist.all_to_all(outs, [torch.full((3,), 100 * rank + q, dtype=torch.int32) for q in range(world)])
        coalesced = [torch.ones(2) * (rank + 1), torch.ones(3) * (rank + 2)]
        dist.all_reduce_coalesced(coalesced)
        objects = [None] * world
        dist.all_gather_object(objects, {"rank": rank, "text": "r%d" % rank})
        sent = [{"from": "root"}] if rank == 2 else [None]
        dist.broadcast_object_list(sent, src=2)
        if _MONITORED_BARRIER_GLOO_ONLY:  # torch's own refusal, before any backend is asked
            with pytest.raises(ValueError, match="only implemented for GLOO"):
                dist.monitored_barrier(timeout=timedelta(seconds=5))
        else:
            dist.monitored_barrier(timeout=timedelta(seconds=5))
        return got, piece, recv, outs, coalesced, objects, sent

    world = 3
    for rank, (got, piece, recv, outs, coalesced, objects, sent) in enumerate(ct.spawn(step, world)):
        if rank == 0:
            assert torch.equal(torch.stack(got), torch.stack([torch.arange(2).double() + 10 * r for r in range(world)]))
        assert torch.equal(piece, torch.full((2,), float(rank)).double())
        assert torch.equal(recv, torch.cat([torch.full((rank + 1, 2), float(10 * q + rank)) for q in range(world)]))
        assert [int(o[0]) for o in outs] == [100 * q + rank for q in range(world)]
        assert torch.equal(coalesced[0], torch.ones(2) * 6) and torch.equal(coalesced[1], torch.ones(3) * 9)
        assert objects == [{"rank": r, "text": "r%d" % r} for r in range(world)]
        assert sent == [{"from": "root"}]


def test_dp_by_cp_groups_from_new_group_and_a_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    def step(rank, world):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        cp = mesh["cp"].get_group()
        dp = mesh["dp"].get_group()
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=cp)
        y = torch.tensor([float(rank)])
        dist.all_reduce(y, group=dp, op=dist.ReduceOp.MAX)
        pair = dist.new_group([0, 3])
        z = torch.tensor([float(rank)])
        if rank in (0, 3):
            dist.all_reduce(z, group=pair)
        return (x.item(), y.item(), z.item(), dist.get_process_group_ranks(cp), dist.get_rank(cp),
                dist.get_backend(cp), dist.get_process_group_ranks(dist.group.WORLD))

    for rank, (x, y, z, cp_ranks, cp_rank, backend, world_ranks) in enumerate(ct.spawn(step, 4)):
        dp_row = rank // 2  # mesh [[0, 1], [2, 3]]: cp groups are rows, dp groups columns
        assert cp_ranks == [2 * dp_row, 2 * dp_row + 1] and cp_rank == rank % 2, (rank, cp_ranks, cp_rank)
        assert x == float(sum(cp_ranks)) and y == float(2 + rank % 2), (rank, x, y)
        assert z == (3.0 if rank in (0, 3) else float(rank))
        assert backend == "cpsim" and world_ranks == [0, 1, 2, 3]


def test_the_autograd_all_gather_runs_forward_and_backward():
    import torch.distributed.nn.functional as dnn

    def step(rank, world):
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        parts = dnn.all_gather(x)
        loss = sum((q + 1) * p.sum() for q, p in enumerate(parts))
        loss.backward()
        return x.grad

    for rank, grad in enumerate(ct.spawn(step, 3)):
        # Every rank's loss weighs rank q's part by q + 1; x_r's gradient sums over ranks.
        assert torch.equal(grad, torch.full((2,), 3.0 * (rank + 1))), (rank, grad)


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


def test_a_rank_stuck_in_python_is_named_with_where_it_is_within_the_timeout():
    def step(rank, world):
        if rank == 2:
            spin = 0
            while True:  # stuck: in no cpsim call, so no call of its own times out
                spin += 1
        dist.all_reduce(torch.ones(4))

    start = time.monotonic()
    with pytest.raises(ct.RankStuck) as e:
        ct.spawn(step, 3, timeout=2)
    assert time.monotonic() - start < 2 + 2 + 3  # the peers' timeout, then as long again and a second
    assert e.value.ranks == [2]
    text = str(e.value)
    assert "rank 2 is still running" in text and "test_torch_backend.py" in text and "in step" in text, text
    # The stuck thread was stopped: the next spawn runs as usual.
    assert ct.spawn(lambda rank, world: rank, 2) == [0, 1]


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


def _shard_index(ranks, rank):
    return ranks[rank]  # the slip: a global rank used as an index into the CP group's ranks


def test_an_exception_in_the_step_names_the_users_file_line_and_source(monkeypatch):
    def step(rank, world):
        dist.all_reduce(torch.ones(1))
        return _shard_index([0, 1], rank)

    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(step, 3, timeout=5)
    text = str(e.value)
    line = _shard_index.__code__.co_firstlineno + 1
    assert e.value.rank == 2 and "IndexError: list index out of range" in text, text
    assert "at test_torch_backend.py:%d in _shard_index: return ranks[rank]" % line in text, text
    assert "Traceback" not in text and "CPSIM_TRACEBACK=1" in text, text
    # A flag away: the whole traceback, the step's frame in it.
    monkeypatch.setenv("CPSIM_TRACEBACK", "1")
    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(step, 3, timeout=5)
    text = str(e.value)
    assert "Traceback (most recent call last)" in text and "in step" in text and "in _shard_index" in text, text


def test_what_cpsim_does_not_support_is_a_typed_error():
    def step(rank, world):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))

    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(step, 2, timeout=5)
    assert "cpsim does not support all_reduce with PREMUL_SUM" in str(e.value), str(e.value)
    # Outside a spawn, torch.distributed is as it was.
    assert not dist.is_initialized()


def test_different_reductions_are_a_mismatch_named_with_the_call_sites():
    def step(rank, world):
        x = torch.ones(2)
        if rank == 0:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)  # the call site of rank 0
        else:
            dist.all_reduce(x)

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 2, timeout=5)
    text = str(e.value)
    assert "all_reduce #1 with different arguments" in text, text
    assert "MAX" in text and "SUM" in text and "test_torch_backend.py:" in text, text


def test_send_and_recv_pair_up_around_a_ring():
    def step(rank, world):
        out = torch.full((3,), float(rank))
        got = torch.empty(3)
        if rank % 2 == 0:  # even ranks send first: each send returns when its receiver takes it
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
    text = str(e.value)
    assert "rank 1 waits for its recv from rank 0 (tag 0, float32 x 4) at test_torch_backend.py:" in text, text
    assert "rank 0 returned without sending it" in text, text


def test_send_and_recv_of_different_sizes_or_a_send_nobody_takes_are_named():
    def sizes(rank, world):
        if rank == 0:
            dist.send(torch.ones(6, dtype=torch.int64), dst=1)
        else:
            dist.recv(torch.empty(4), src=0)

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(sizes, 2, timeout=5)
    assert "float32 x 4" in str(e.value) and "holds int64 x 6" in str(e.value), str(e.value)

    def unreceived(rank, world):
        if rank == 0:
            dist.send(torch.ones(2), dst=1, tag=3)

    with pytest.raises(ct.CollectiveError) as e:  # a blocking send waits for its receive: rank 1 returned
        ct.spawn(unreceived, 2, timeout=5)
    assert ("rank 0 waits for its send to rank 1 (tag 3, float32 x 2) at test_torch_backend.py:" in str(e.value)
            and "but rank 1 returned without receiving it" in str(e.value)), str(e.value)
    with pytest.raises(ct.CollectiveError) as e:  # eager sends return at once: the message is left over
        ct.spawn(unreceived, 2, timeout=5, sends="eager")
    assert "a send no recv took" in str(e.value) and "tag 3" in str(e.value), str(e.value)


def test_a_ring_that_sends_before_it_receives_is_a_deadlock_named_at_once():
    # On Gloo and NCCL every rank's blocking send waits for a receive that is
    # never posted (even of 3 floats); with eager sends (MPI's small messages) it runs.
    def step(rank, world):
        dist.send(torch.full((3,), float(rank)), dst=(rank + 1) % world)
        got = torch.empty(3)
        dist.recv(got, src=(rank - 1) % world)
        return got

    start = time.monotonic()
    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 3, timeout=20)
    assert time.monotonic() - start < 10, time.monotonic() - start
    text = str(e.value)
    assert "deadlock: every rank still running waits in point to point" in text, text
    for r in range(3):
        assert "rank %d: waits for its send to rank %d (tag 0, float32 x 3) at test_torch_backend.py:" % (
            r, (r + 1) % 3) in text, text
    assert [g[0].item() for g in ct.spawn(step, 3, timeout=20, sends="eager")] == [2.0, 0.0, 1.0]


# Sends and receives match in any order within a rank's outstanding requests, as
# on NCCL and Gloo: a ring whose every rank posts its irecv first, and a batch
# with the irecv first, are valid programs (they hung when a receive blocked).
def test_a_ring_that_posts_its_irecv_first_completes():
    def step(rank, world):
        got = torch.empty(3)
        r = dist.irecv(got, src=(rank - 1) % world)
        s = dist.isend(torch.full((3,), float(rank)), dst=(rank + 1) % world)
        r.wait()
        s.wait()
        halo = torch.empty(2)
        ops = [dist.P2POp(dist.irecv, halo, (rank - 1) % world, tag=5),
               dist.P2POp(dist.isend, torch.full((2,), 10.0 + rank), (rank + 1) % world, tag=5)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        blocking = torch.empty(1)
        dist.recv(blocking, src=(rank + 1) % world) if rank % 2 else None
        dist.send(torch.tensor([float(rank)]), dst=(rank - 1) % world)
        dist.recv(blocking, src=(rank + 1) % world) if rank % 2 == 0 else None
        return got, halo, blocking

    world = 4
    for rank, (got, halo, blocking) in enumerate(ct.spawn(step, world, timeout=5)):
        assert torch.equal(got, torch.full((3,), float((rank - 1) % world)))
        assert torch.equal(halo, torch.full((2,), 10.0 + (rank - 1) % world))
        assert blocking.item() == float((rank + 1) % world)


def test_a_recv_from_any_source_takes_the_message_that_came_first():
    def step(rank, world):
        sent = None
        if rank == 2:
            sent = dist.isend(torch.full((2,), 2.0), dst=0)
        dist.barrier()  # rank 2's message is in before rank 1 sends
        if rank == 1:
            sent = dist.isend(torch.full((2,), 1.0), dst=0)
        dist.barrier()
        if rank == 0:
            first, second = torch.empty(2), torch.empty(2)
            return dist.recv(first), first[0].item(), dist.recv(second), second[0].item()
        sent.wait()

    assert ct.spawn(step, 3)[0] == (2, 2.0, 1, 1.0)


def test_a_wait_with_a_timeout_ends_by_it():
    def step(rank, world):
        if rank == 0:
            request = dist.irecv(torch.empty(2), src=1)
            start = time.monotonic()
            try:
                request.wait(timeout=timedelta(seconds=1))
            finally:
                assert time.monotonic() - start < 5
        else:
            time.sleep(3)  # busy, not returned: rank 0's wait ends by its own timeout

    with pytest.raises((ct.CollectiveError, ct.RankFailed)) as e:
        ct.spawn(step, 2, timeout=20)
    assert "limit 1000 ms" in str(e.value) and "recv from rank 1" in str(e.value), str(e.value)


def test_a_request_never_waited_on_is_named():
    def step(rank, world):
        got = torch.empty(2)
        if rank == 0:
            dist.isend(torch.ones(2), dst=1)  # the request is dropped
        else:
            dist.recv(got, src=0)
        return got

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 2, timeout=5)
    text = str(e.value)
    assert "rank 0: its send to rank 1 (tag 0, float32 x 2) at test_torch_backend.py:" in text, text
    assert "was never waited on" in text, text


def test_an_output_used_before_its_wait_is_named():
    def step(rank, world):
        got = torch.empty(2)
        out = torch.empty(2 * world)
        gather = dist.all_gather_into_tensor(out, torch.ones(2) * rank, async_op=True)
        r = dist.irecv(got, src=(rank - 1) % world)
        dist.send(torch.ones(2), dst=(rank + 1) % world)
        total = got.sum() if rank == 1 else out.sum()  # read before wait()
        r.wait()
        gather.wait()
        return total

    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(step, 2, timeout=5)
    text = str(e.value)
    assert "used the output of its" in text and "before wait()" in text, text
    assert "recv from rank 0" in text or "all_gather_into_tensor" in text, text


def test_a_recv_against_an_all_reduce_names_both_calls_and_where_they_are():
    def step(rank, world):
        if rank == 0:
            dist.all_reduce(torch.ones(2))  # the all_reduce
        else:
            dist.recv(torch.empty(2), src=0)  # the recv

    start = time.monotonic()
    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 2, timeout=3)
    assert time.monotonic() - start < 5
    text = str(e.value)
    assert "all_reduce" in text and "recv from rank 0 (tag 0, float32 x 2) at test_torch_backend.py:" in text, text
    assert text.count("test_torch_backend.py:") >= 2, text


# Ranks as processes: cpsim launch -n N -- python3 job_script.py MODE, each calling
# cpsim.torch.init_process_group().
def _launch(mode, n=3, timeout=10, grace=30, sends="rendezvous"):
    import subprocess
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    script = os.path.join(os.path.dirname(__file__), "job_script.py")
    env = dict(os.environ, JOB_TIMEOUT=str(timeout), JOB_SENDS=sends)
    start = time.monotonic()
    p = subprocess.run([binary, "launch", "-n", str(n), "--grace", str(grace), "--", sys.executable, script, mode],
                       env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    return p.returncode, p.stdout.decode(), time.monotonic() - start


def _launch_that_fails(mode, **launch):
    """A launch of job_script.py MODE that must fail, and within a minute (an
    error named, not a hang); its output."""
    rc, out, took = _launch(mode, **launch)
    assert rc != 0, out
    assert took < 60, (took, out)
    return out


def _expect_every_rank_says(mode, n, what):
    """A launch of job_script.py MODE as n processes that ends well, every rank
    printing "rank R: WHAT"."""
    rc, out, _ = _launch(mode, n=n)
    assert rc == 0, out
    assert all("rank %d: %s" % (r, what) in out for r in range(n)), out


def test_processes_of_a_launch_run_torch_collectives_on_cpsim():
    _expect_every_rank_says("collectives", 3, "collectives agree")


def test_processes_send_and_receive_in_any_order():
    _expect_every_rank_says("ring", 3, "point to point agrees")


def test_processes_make_groups_of_some_of_them_and_a_device_mesh():
    _expect_every_rank_says("subgroups", 4, "subgroups agree")


def test_a_rank_that_skips_its_subgroup_s_collective_is_named():
    out = _launch_that_fails("subgroup_skip", n=4, timeout=5)
    # In the job's ranks, with the group: group rank 1 is job rank 2.
    assert "rank 2 returned without joining all_reduce #1 on the group of ranks 0, 2 that rank 0 waits in" in out, out


def test_a_receive_nothing_comes_for_is_said_once():
    # Its first line names the receive; the pending list and the other ranks'
    # lines do not repeat it.
    def step(rank, world):
        if rank == 0:
            dist.recv(torch.zeros(4), src=1)

    for _ in range(2):
        with pytest.raises(ct.CollectiveError) as e:
            ct.spawn(step, 2, timeout=1)
        text = str(e.value)
        assert "rank 1 returned without sending it" in text, text
        assert text.count("recv from rank 1 (tag 0, float32 x 4)") == 1, text


def test_a_subgroup_s_report_names_global_ranks_and_the_group():
    # A (dp, cp) mesh of 4: dp groups [0, 2] and [1, 3]. Global rank 3 skips its
    # dp group's AVG all_reduce; in that group it is rank 1, and rank 1 is rank 0.
    def step(rank, world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        dist.all_reduce(torch.ones(4), group=mesh.get_group("cp"))
        if rank != 3:
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 4, timeout=5)
    lines = str(e.value).splitlines()
    assert lines[0] == "rank 3 returned without joining all_reduce #1 on the group of ranks 1, 3 that rank 1 waits in"
    assert lines[1].startswith("  rank 1: in all_reduce #1 (float32 x 1, AVG) at test_torch_backend.py:"), lines
    assert lines[2] == "  rank 3: returned (last completed on this group: nothing)", lines


def test_a_rank_in_another_group_s_collective_is_named_there():
    # Rank 1 waits in its dp group's all_reduce for rank 3, which went on to the
    # world's barrier: whichever wait ends first, its report says where the
    # other rank is, in global ranks, and no phrase twice.
    def step(rank, world):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        if rank != 3:
            dist.all_reduce(torch.ones(1), group=mesh.get_group("dp"))
        dist.barrier()

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(step, 4, timeout=2)
    text = str(e.value)
    dp_first = "in all_reduce #1 (float32 x 1, SUM) at test_torch_backend.py:" in text.splitlines()[0]
    if dp_first:  # rank 1's wait ended first: rank 3 is in the world's barrier
        assert "for rank 3, which never arrived" in text and "on the group of ranks 1, 3" in text, text
        assert "  rank 3: in barrier at test_torch_backend.py:" in text, text
    else:  # the barrier's: rank 1 is in its dp group's all_reduce (or failed in it, an instant before)
        assert "for rank 1, which never arrived" in text, text
        assert re.search(r"  rank 1: (failed )?in all_reduce at test_torch_backend.py:\d+ on the group of ranks 1, 3 "
                         r"\(last completed on the world group: ", text), text
    assert text.count("(last completed") == len([l for l in text.splitlines() if "(last completed" in l]), text


@pytest.mark.parametrize("mode,words", [("skip", ["rank 1", "all_reduce"]), ("raise", ["rank 2", "ValueError"]),
                                        ("sizes", ["all_gather"]),
                                        ("recv_nothing", ["rank 0", "recv from rank 1", "returned without sending it"]),
                                        ("send_size", ["recv from rank 1", "float32 x 3"]),
                                        ("unreceived", ["send no recv took", "rank 1's send #1 to rank 0"])])
def test_processes_that_disagree_end_in_a_named_error_not_a_hang(mode, words):
    out = _launch_that_fails(mode, timeout=10, sends="eager" if mode == "unreceived" else "rendezvous")
    assert all(w in out for w in words), (words, out)


def test_a_ring_of_processes_that_send_first_is_a_deadlock_named_at_once():
    # A ring whose every process sends before it receives hangs on Gloo and NCCL
    # (3 floats included): each blocking send waits for its receipt. The
    # processes' published states name it at once, not at the timeout (60 s).
    rc, out, took = _launch("send_first", timeout=60)
    assert rc != 0, out
    assert "deadlock: every rank still running waits in point to point" in out and "timeout" not in out, out
    for r in range(3):
        assert ("rank %d: waits for its send to rank %d (tag 0, float64 x 3) at job_script.py:" % (r, (r + 1) % 3)
                in out), out
    rc, out, _ = _launch("send_first", sends="eager")
    assert rc == 0, out
    assert all("rank %d: the ring ran" % r in out for r in range(3)), out


def test_a_process_s_receive_ends_when_its_peer_returned_or_raised():
    # The peer's end comes over the wire after its last message: the receive is
    # told then, not at its timeout (whose report says "nothing came").
    rc, out, took = _launch("recv_nothing", timeout=60)
    assert rc != 0, out
    assert "rank 0 waits for its recv from rank 1 (tag 0, float32 x 2) at job_script.py:" in out, out
    assert "but rank 1 returned without sending it" in out and "nothing came" not in out, out
    rc, out, took = _launch("recv_from_raiser", timeout=60)
    assert rc != 0, out
    assert "rank 1 threw: ValueError: the step of rank 1 broke" in out and "nothing came" not in out, out


def test_a_rank_lost_after_every_collective_returned_ends_the_others_with_exit_3():
    # The survivors' own work is done; the job still could not complete (its end
    # needs every rank): no verdict, exit 3, not a failed check's 1.
    import re
    rc, out, took = _launch("lost_at_end", timeout=5, grace=10)
    assert took < 60, (took, out)
    assert "rank 1 (pid" in out and "killed by signal 9" in out, out
    for r in (0, 2):
        assert re.search(r"rank %d \(pid \d+\) exited with status 3" % r, out), out


def test_a_process_that_never_arrives_is_named_within_the_timeout():
    out = _launch_that_fails("stall", timeout=5, grace=3)
    assert "rank 1, which never arrived" in out and "all_reduce" in out, out


# torch's tag semantics: a receive takes only a message of its own tag, and of one
# tag in the order sent. Receives posted before their sends, in every order of
# posting and sending, with every mix of tags.
_TAG_ORDERS = [((1, 2), (2, 1)), ((2, 1), (1, 2)), ((1, 1, 2), (2, 1, 1)), ((3, 1, 3), (1, 3, 3)),
               ((0, 5, 0, 5), (5, 5, 0, 0))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("posted,sent", _TAG_ORDERS)
def test_receives_posted_first_take_their_own_tag_in_send_order(backend, posted, sent):
    def step(rank, world):
        if rank == 0:
            bufs = [torch.zeros(1) for _ in posted]
            reqs = [dist.irecv(b, src=1, tag=t) for b, t in zip(bufs, posted)]
            dist.barrier()  # every receive is posted before any message leaves
            for r in reqs:
                r.wait()
            return [b.item() for b in bufs]
        dist.barrier()
        reqs = [dist.isend(torch.tensor([10.0 * t + i]), dst=0, tag=t) for i, t in enumerate(sent)]
        for r in reqs:
            r.wait()
        return None

    got = ct.spawn(step, 2, backend=backend, sends="eager")[0]
    # The k-th receive of tag t takes the k-th message of tag t.
    want, seen = [], {}
    for t in posted:
        k = seen.get(t, 0)
        seen[t] = k + 1
        i = [j for j, s in enumerate(sent) if s == t][k]
        want.append(10.0 * t + i)
    assert got == want, (posted, sent, got)


def test_processes_match_receives_posted_first_by_their_tags():
    _expect_every_rank_says("tags_posted_first", 3, "tags agree")


@pytest.mark.parametrize("mode,waiting", [("subgroup_raise", 1), ("subgroup_raise_offset", 2)])
def test_a_subgroup_failure_is_named_by_its_global_rank_not_its_group_rank(mode, waiting):
    # A group of ranks 1 and 3 (an interleaved mesh's), or 2 and 3 (an offset
    # one): group rank 1 is job rank 3, group rank 0 the other. Rank 3's failure
    # is recorded and reported under 3; a record kept under its group rank would
    # name rank 1 (a rank of another group, or the waiting one's own record).
    out = _launch_that_fails(mode, n=4, timeout=5)
    assert "the step of rank 3 broke" in out, out
    assert re.search(r"rank 3\b[^\n]*threw|rank 3 raised|rank 3: .*ValueError", out), out
    for other in (0, 1, 2):
        assert "rank %d threw" % other not in out and "rank %d raised" % other not in out, out
