"""DTensor, functional collectives, FSDP2 and tensor parallelism on cpsim's ranks
(cpsim.torch.spawn, threads and gloo; processes through job_script.py): each
transition against values worked out by hand, and a tiny model's step under
FSDP2 and a TP plan against the same step on one rank."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import cpsim.torch as ct
from test_torch_backend import _expect_every_rank_says, _launch

BACKENDS = ["threads", "gloo"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_partial_dtensor_s_full_tensor_is_the_sum_of_every_rank_s_part(backend):
    # The routing-bias update's load sum (NeMo Automodel's MoE): correct code.
    def rank(r, world):
        mesh = init_device_mesh("cpu", (world,))
        load = torch.tensor([float(r), 1.0, 2.0, 3.0])
        return DTensor.from_local(load, device_mesh=mesh, placements=[Partial()]).full_tensor().tolist()

    assert ct.spawn(rank, 2, backend=backend) == [[1.0, 2.0, 4.0, 6.0], [1.0, 2.0, 4.0, 6.0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_collectives_agree_with_their_definitions(backend):
    def rank(r, world):
        group = dist.group.WORLD
        x = torch.arange(4, dtype=torch.float64) + 10 * r
        summed = funcol.all_reduce(x, "sum", group)
        gathered = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)(x, 0, group)
        scattered = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)(torch.arange(2.0 * world) * (r + 1), "sum", 0, group)
        swapped = funcol.all_to_all_single(torch.arange(world, dtype=torch.int64) + 100 * r, None, None, group)
        sent = funcol.broadcast(torch.full((3,), float(r)), world - 1, group)
        waited = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "max", group))
        # Each is read as it is used: reading an AsyncCollectiveTensor waits.
        return (summed.tolist(), gathered.tolist(), scattered.tolist(), swapped.tolist(), sent.tolist(),
                waited.tolist(), (summed * 2).tolist())

    world = 3
    total = sum(r + 1 for r in range(world))
    for r, out in enumerate(ct.spawn(rank, world, backend=backend)):
        summed, gathered, scattered, swapped, sent, waited, doubled = out
        assert summed == [30.0 + 3 * i for i in range(4)]
        assert gathered == [float(i + 10 * q) for q in range(world) for i in range(4)]
        assert scattered == [float(2 * r * total), float((2 * r + 1) * total)]
        assert swapped == [r + 100 * q for q in range(world)]
        assert sent == [float(world - 1)] * 3
        assert waited == [1.0, 1.0]
        assert doubled == [2 * v for v in summed]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_functional_output_never_waited_and_never_read_is_named(backend):
    def rank(r, world):
        funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD)  # dropped: neither waited nor read

    with pytest.raises(ct.CollectiveError) as e:
        ct.spawn(rank, 2, backend=backend)
    text = str(e.value)
    assert "never waited" in text and "all_reduce" in text, text


@pytest.mark.parametrize("backend", BACKENDS)
def test_reading_a_plain_async_output_before_wait_is_still_named(backend):
    # The race the check is for (async_op=True, then a read): functional
    # collectives are exempt only because their reads wait.
    def rank(r, world):
        x = torch.ones(3)
        work = dist.all_reduce(x, async_op=True)
        y = x * 2
        work.wait()
        return y

    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(rank, 2, backend=backend)
    assert "UsedBeforeWait" in str(e.value), str(e.value)


def _chunks(full, world, dim=0):
    return list(torch.chunk(full, world, dim=dim))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtensor_transitions_on_a_one_dimensional_mesh(backend):
    world = 4

    def rank(r, world):
        mesh = init_device_mesh("cpu", (world,))
        mine = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * r
        out = {}
        # Partial -> Replicate: the sum of the parts.
        out["partial"] = DTensor.from_local(mine, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        # Shard(0) -> Replicate: the parts stacked in rank order.
        out["gather"] = DTensor.from_local(mine, mesh, [Shard(0)]).full_tensor()
        # Replicate -> Shard(1): this rank's slice of a whole tensor (no data moves).
        whole = torch.arange(2 * world, dtype=torch.float64).reshape(2, world)
        out["slice"] = DTensor.from_local(whole, mesh, [Replicate()]).redistribute(mesh, [Shard(1)]).to_local()
        # Partial -> Shard(0): a reduce-scatter.
        tall = torch.arange(world * 2, dtype=torch.float64).reshape(world, 2) * (r + 1)
        out["reduce_scatter"] = DTensor.from_local(tall, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()
        # Shard(0) -> Shard(1): an all-to-all.
        block = torch.arange(world * 1.0).reshape(1, world) + 10 * r
        out["all_to_all"] = DTensor.from_local(block, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).to_local()
        # With autograd: the gradient of a gathered tensor's weighted sum comes back
        # to each shard; through Replicate -> Shard the backward gathers.
        leaf = mine.clone().requires_grad_()
        weight = torch.arange(2.0 * world * 3, dtype=torch.float64).reshape(2 * world, 3)
        (DTensor.from_local(leaf, mesh, [Shard(0)]).full_tensor() * weight).sum().backward()
        out["gather_grad"] = leaf.grad
        rep = whole.clone().requires_grad_()
        piece = DTensor.from_local(rep, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
        (piece.to_local() * (r + 1)).sum().backward()
        out["slice_grad"] = rep.grad
        return out

    outs = ct.spawn(rank, world, backend=backend)
    mine = [torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * r for r in range(world)]
    whole = torch.arange(2 * world, dtype=torch.float64).reshape(2, world)
    weight = torch.arange(2.0 * world * 3, dtype=torch.float64).reshape(2 * world, 3)
    total = sum(r + 1 for r in range(world))
    for r, out in enumerate(outs):
        assert torch.equal(out["partial"], sum(mine)), (r, out["partial"])
        assert torch.equal(out["gather"], torch.cat(mine)), (r, out["gather"])
        assert torch.equal(out["slice"], whole[:, r:r + 1]), (r, out["slice"])
        assert torch.equal(out["reduce_scatter"], (torch.arange(2.0, dtype=torch.float64) + 2 * r)[None] * total)
        assert torch.equal(out["all_to_all"], torch.tensor([[float(r + 10 * q)] for q in range(world)]))
        assert torch.equal(out["gather_grad"], weight[2 * r:2 * r + 2]), (r, out["gather_grad"])
        # The replicated input's gradient: the whole gradient, every rank's slice
        # gathered (rank q's slice scaled by q + 1).
        want = torch.cat([torch.full((2, 1), float(q + 1), dtype=torch.float64) for q in range(world)], dim=1)
        assert torch.equal(out["slice_grad"], want), (r, out["slice_grad"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("names", [("dp", "cp"), ("cp", "dp")])
def test_dtensor_transitions_on_a_dp_by_cp_mesh(backend, names):
    # 2 x 2: placements per mesh dimension, reduced along one dimension only.
    def rank(r, world):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        dp, cp = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
        x = torch.tensor([[float(r), 1.0]])
        d = names.index("dp")
        # Partial over dp, Shard(0) over cp -> replicated: the sum over dp, the cp shards stacked.
        placements = [Partial(), Shard(0)] if d == 0 else [Shard(0), Partial()]
        full = DTensor.from_local(x, mesh, placements).full_tensor()
        # Sum over cp alone (the other dimension left as it is).
        sub = mesh["cp"]
        over_cp = DTensor.from_local(x, sub, [Partial()]).full_tensor()
        return dp, cp, full, over_cp

    outs = ct.spawn(rank, 4, backend=backend)
    rank_at = {(dp, cp): r for r, (dp, cp, _, _) in enumerate(outs)}
    for r, (dp, cp, full, over_cp) in enumerate(outs):
        rows = [[float(sum(rank_at[(d, c)] for d in range(2))), 2.0] for c in range(2)]
        assert full.tolist() == rows, (names, r, full)
        assert over_cp.tolist() == [[float(sum(rank_at[(dp, c)] for c in range(2))), 2.0]], (names, r, over_cp)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 4)
        # The same weights on every rank: from a generator of its own (rank
        # threads share the process's default generator, so torch.manual_seed on
        # each would interleave their draws).
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _one_rank_step(rows):
    """The unsharded step: every rank's rows on one rank (mean loss, SGD)."""
    model = _Tiny().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(rows).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item(), {n: p.detach().clone() for n, p in model.named_parameters()}


def _expect_the_one_rank_step(results, world):
    """Every rank's (loss, parameters after the step) equal the one-rank step's."""
    want_loss, want = _one_rank_step(_rows(world))
    for r, (loss, params) in enumerate(results):
        assert loss == pytest.approx(want_loss, rel=1e-12), r
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=1e-12, atol=1e-14, msg=lambda m: "%s: %s" % (name, m))


def _rows(world):
    return torch.arange(world * 2 * 4, dtype=torch.float64).reshape(world * 2, 4) / 10


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_fsdp2_step_equals_the_one_rank_step(backend, shape):
    # A 1-D mesh shards over every rank; a dp x cp mesh is HSDP: replicated over
    # dp, sharded over cp. Every rank holds rows of its own, and the gradients
    # are averaged over all of them.
    from torch.distributed.fsdp import fully_shard

    world = 1
    for n in shape:
        world *= n

    def rank(r, world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp")[:len(shape)] if len(shape) > 1 else None)
        model = _Tiny().double()
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mine = _rows(world)[2 * r:2 * r + 2]
        loss = model(mine).pow(2).mean()  # FSDP2 averages gradients over the mesh
        loss.backward()
        opt.step()
        logged = funcol.all_reduce(loss.detach(), "avg", dist.group.WORLD)
        return logged.item(), {n: p.full_tensor().detach() for n, p in model.named_parameters()}

    _expect_the_one_rank_step(ct.spawn(rank, world, backend=backend), world)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_step_equals_the_one_rank_step(backend):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = 2

    def rank(r, world):
        mesh = init_device_mesh("cpu", (world,))
        model = parallelize_module(_Tiny().double(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(_rows(world)).pow(2).mean()  # every TP rank holds every row
        loss.backward()
        opt.step()
        return loss.item(), {n: p.full_tensor().detach() for n, p in model.named_parameters()}

    _expect_the_one_rank_step(ct.spawn(rank, world, backend=backend), world)


def test_processes_reduce_through_dtensor_functional_collectives_and_fsdp2():
    _expect_every_rank_says("dtensor", 2, "dtensor agrees")


def test_processes_name_a_functional_output_never_waited():
    rc, out, _ = _launch("funcol_unwaited", n=2)
    assert rc != 0, out
    assert "never waited" in out and "all_reduce" in out, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_routing_bias_update_sums_the_expert_load_over_every_rank(backend):
    # NeMo Automodel's MoE Gate.update_bias (unmodified): with the correction
    # bias a replicated DTensor, each rank's expert load becomes a Partial
    # DTensor whose full_tensor() is the load over every rank; every rank then
    # moves the bias by the same signs.
    from nemo_automodel.components.moe.layers import Gate

    experts, world = 4, 2
    loads = [torch.tensor([5.0, 0.0, 1.0, 2.0]), torch.tensor([0.0, 1.0, 1.0, 0.0])]

    class GateState(torch.nn.Module):  # the attributes update_bias reads
        def __init__(self, mesh, load):
            super().__init__()
            self.train_gate, self.bias_update_factor, self.training = True, 0.5, True
            self._cumulative_expert_load = load
            self.e_score_correction_bias = DTensor.from_local(torch.zeros(experts), mesh, [Replicate()])
            self.e_score_correction_bias_master = None

    def rank(r, world):
        gate = GateState(init_device_mesh("cpu", (world,)), loads[r])
        Gate.update_bias(gate)
        return gate.e_score_correction_bias.to_local().tolist()

    total = loads[0] + loads[1]
    want = (torch.sign(total.mean() - total) * 0.5).tolist()
    assert want == [-0.5, 0.5, 0.5, 0.5]  # neither rank's own load gives these signs
    assert ct.spawn(rank, world, backend=backend) == [want, want]


def test_a_compiled_function_runs_on_cpsim_ranks():
    # torch.compile traces the rank's torch-function modes too: the use-before-wait
    # check steps aside inside a compiled region (it raised dynamo's Unsupported:
    # "Dynamo does not know how to trace method `size` of class `Ledger`").
    @torch.compile(backend="eager", fullgraph=True)
    def swiglu(x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def fn(rank, world):
        x = torch.arange(8.0).reshape(2, 4) + rank
        y = swiglu(x)
        dist.all_reduce(y)
        return y

    got = ct.spawn(fn, 2)
    want = sum(swiglu.__wrapped__(torch.arange(8.0).reshape(2, 4) + r) for r in range(2))
    assert all(torch.equal(g, want) for g in got)
    # and an op on an output not waited on is still named, outside the compiled region
    def unwaited(rank, world):
        t = torch.ones(2)
        work = dist.all_reduce(t, async_op=True)
        try:
            swiglu(t.reshape(1, 2))
            return t + 1
        finally:
            work.wait()
    with pytest.raises(ct.RankFailed) as e:
        ct.spawn(unwaited, 2)
    assert "before wait()" in str(e.value)
