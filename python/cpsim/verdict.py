"""A case's verdict: every rank of the step run on a simulated group (threads,
or this process's rank of a job), its differences agreed and reported."""
import sys

import torch

from cpsim import torch as ct  # spawn and the job: the harness builds on cpsim.torch
from cpsim import where
from cpsim.case import Golden
from cpsim.compared import combined
from cpsim.leak import leak_differences, redraws
from cpsim.mesh import placed
from cpsim.rank import UNSHARDED_OUTPUTS, first_differences, run_rank


class OutsideContract(Exception):
    """Raised by a step, on every rank and before any collective, for a drawn
    layout its library does not take (the library's documented contract): the
    case is set aside and another drawn."""


class Outside(str):
    """A case's verdict: set aside (the text says why)."""


class Raised(str):
    """A case's verdict: a rank's step raised an exception of its own (the text
    says which and where): a failure, and for a layout outside the step's
    contract a loud refusal; `ranks` raised, of `world` (the others failed in
    a collective their peer never joined: on NCCL, a hang)."""

    def __new__(cls, text, ranks=(), world=0):
        value = super().__new__(cls, text)
        value.ranks, value.world = list(ranks), world
        return value


def verdict(folder, step, backend, timeout, dp=1, tolerance=None, mesh="dp,cp", leaks=True, microbatches=1):
    golden = Golden(folder, tolerance, microbatches)
    cp = golden.cp
    runs = {}  # "layer", "user_loss": {(dp_rank, rank) or None (unsharded): run}
    try:
        found = ct.spawn(_each_rank(golden, step, dp, mesh, runs), dp * cp, backend=backend, timeout=timeout)
    except ct.RankFailed as e:
        if isinstance(e.error, OutsideContract):
            return Outside(str(e.error))
        return Raised("rank %d raised %s" % (e.rank, str(e).split(": ", 1)[1]), e.ranks, dp * cp)
    except ct.RankStuck as e:
        return str(e)
    except ct.CollectiveError as e:
        return "the ranks' calls did not match: %s" % e
    if runs:  # the step itself, unsharded on a group of one: the reference of "layer" and "user_loss"
        if backend != "threads":
            return "a \"%s\" output is compared on thread ranks (backend='threads'), not on %s" % (
                sorted(runs)[0], backend)
        try:
            ct.spawn(_unsharded_rank(golden, step, runs), 1, backend=backend, timeout=timeout)
        except ct.RankFailed as e:
            return "the unsharded run (cp 1) raised %s" % str(e).split(": ", 1)[1]
        except (ct.RankStuck, ct.CollectiveError) as e:
            return "the unsharded run (cp 1): %s" % e
        for name, kind in UNSHARDED_OUTPUTS.items():  # the unsharded run gave each in runs (else it raised)
            if name not in runs:
                continue
            for r, why in kind.differences(runs[name], cp, dp, golden.manifest["S"], mesh).items():
                found[r] = combined(found[r], why)
        if leaks and not any(found):
            why = _leaks(golden, step, runs, backend, timeout, dp, mesh, found)
            if why:
                return why
    return first_differences(found)


def _each_rank(golden, step, dp, mesh, runs, redraw=None):
    """A spawned rank's body: its place in the mesh, then run_rank."""
    def one(rank, world):
        cp_rank, dp_rank = placed(rank, golden.cp, dp, mesh)
        return run_rank(golden, step, cp_rank, dp, dp_rank, runs, mesh=mesh, redraw=redraw)
    return one


def _unsharded_rank(golden, step, runs, redraw=None):
    """The unsharded run's body (a group of one): run_rank with unsharded=True."""
    return lambda rank, world: run_rank(golden, step, 0, runs=runs, unsharded=True, redraw=redraw)


def _leaks(golden, step, runs, backend, timeout, dp, mesh, found):
    """The leak property (cpsim.leak): the step run again on every rank with
    one document's inputs drawn again, then the padding's; what moved goes to
    found. Returns why the run itself failed, or ''."""
    cp = golden.cp
    for redraw in redraws(golden):
        again = {name: {} for name in runs}
        try:
            ct.spawn(_each_rank(golden, step, dp, mesh, again, redraw), dp * cp, backend=backend, timeout=timeout)
        except ct.RankFailed as e:
            return "the step run again with %s drawn again: rank %d raised %s" % (
                redraw.what, e.rank, str(e).split(": ", 1)[1])
        except (ct.RankStuck, ct.CollectiveError) as e:
            return "the step run again with %s drawn again: %s" % (redraw.what, e)
        for name in runs:
            for r, why in leak_differences(name, runs[name], again[name], redraw, golden, cp, dp, mesh).items():
                found[r] = found[r] or why
        if any(found):
            at = min((r for r, f in enumerate(found) if f), key=lambda r: (found[r][0], r))
            found[at] = (found[at][0], found[at][1] + _whose_leak(golden, step, runs, redraw, backend, timeout, mesh))
            return ""
    return ""


def _whose_leak(golden, step, runs, redraw, backend, timeout, mesh):
    """Once the sharded run leaked: the unsharded run redrawn the same way,
    which says whether the step's own code lets them meet or its CP code."""
    whole = {name: {} for name in runs}
    try:
        ct.spawn(_unsharded_rank(golden, step, whole, redraw), 1, backend=backend, timeout=timeout)
    except (ct.RankFailed, ct.RankStuck, ct.CollectiveError) as e:
        return "\n  (the unsharded run with them drawn again failed: %s)" % str(e).split("\n")[0]
    leaked = any(leak_differences(name, {(0, 0): runs[name][None]}, {(0, 0): whole[name].get(None)}, redraw,
                                  golden, 1, 1, mesh) for name in runs)
    return ("\n  the unsharded run (cp 1) moves too: the step's own code, with or without CP" if leaked else
            "\n  the unsharded run (cp 1) keeps them apart: the step's CP code")


def exchange(text, group):
    """Every process's text, over the job's own group (a length, then the bytes as int64)."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    data = torch.tensor(list(text.encode()), dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([data.numel()]), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.int64)
    padded[:data.numel()] = data
    parts = [torch.zeros(longest, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[:int(n)].tolist()).decode() for p, n in zip(parts, lengths)]


job_checks = [0, 0]  # check() calls and cases of this process of a job so far


def job_verdict(folder, step, case_number, dp=1, tolerance=None, mesh="dp,cp", microbatches=1):
    """One case in a job: this process runs its rank of the step on a fresh group
    of every process (the default group of a torch world of the case's own); the
    verdicts of all processes are agreed over the job's own group, so every
    process's generator takes the same branch."""
    import torch.distributed as dist
    job, main = ct._job, dist.group.WORLD
    rank = job.rank()
    golden = Golden(folder, tolerance, microbatches)
    # Named apart from every earlier check() of this job (each counts its cases from 1).
    session = job.session("check%d-case%d" % (job_checks[0], case_number))
    hook = sys.excepthook  # init_process_group wraps it (a "[rank N]:" prefix): once per case, undone
    saved = (getattr(ct._local, "world", None), getattr(ct._local, "source", None))
    ct._install()
    # The case's groups are named after the case (the program's own, on this
    # thread too, keep their names).
    world = ct._RankWorld()
    job_checks[1] += 1  # torch registers group names process-wide: every case of every check apart
    world.group_count = 1000 * job_checks[1]
    groups = []  # the case's other groups (a DeviceMesh's)
    ct._local.world, ct._local.source = world, ct._job_source([session], groups)
    own, outside, why = False, False, ""
    try:
        dist.init_process_group("cpsim", store=dist.HashStore(), rank=rank, world_size=job.size())
        cp_rank, dp_rank = placed(rank, golden.cp, dp, mesh)
        mine = run_rank(golden, step, cp_rank, dp, dp_rank, mesh=mesh)
        why = "%d%s" % mine if mine else ""
        ct._unwaited(job.ledger(), rank)
        unreceived = ct._end_sessions(groups + [session])
        if unreceived:
            why = "the ranks' calls did not match: " + unreceived
    except BaseException as e:  # noqa: B902 - every failure is this case's verdict
        if isinstance(e, OutsideContract):
            outside, why = True, str(e)
        elif any(s.collective_failed() for s in groups + [session]) or isinstance(e, ct.CollectiveError):
            why = "the ranks' calls did not match: %s" % e
        else:
            own, why = True, "rank %d raised %s" % (rank, where.failure(e))
        ct._fail_sessions(groups + [session], e)
    finally:
        ct._local.world, ct._local.source = saved
        ct._uninstall()
        sys.excepthook = hook
    # Each process's verdict: "1" and its own exception, "2" and why the case is
    # outside the step's contract, or "0" and a report of cpsim's, or "0", the
    # phase of its first difference (0 value, 1 gradient) and it.
    verdicts = exchange(("1" if own else "2" if outside else "0") + why, main)
    del session, groups
    # A rank's own exception first (its peers' reports are its consequence).
    raised = [q for q, v in enumerate(verdicts) if v[:1] == "1"]
    for v in verdicts:
        if v[:1] == "1":
            return Raised(v[1:], raised, len(verdicts))
    for v in verdicts:
        if v[:1] == "2":
            return Outside(v[1:])
    for v in verdicts:
        if v[1:] and v[1] not in "01":
            return v[1:]
    return first_differences([(int(v[1]), v[2:]) if v[1:] else None for v in verdicts])

