"""Run PyTorch CP code on cpsim's ranks.

    import cpsim.torch
    def step(rank, world_size):
        x = torch.full((2,), float(rank))
        out = torch.empty(2 * world_size)
        torch.distributed.all_gather_into_tensor(out, x)   # checked by cpsim
    cpsim.torch.spawn(step, world_size=4)

spawn() runs fn(rank, world_size) on `world_size` threads of this process. Each
thread sees its own default process group (backend "cpsim"), so torch.distributed
calls without a group go to that rank. Every call passes cpsim's call check first:
a rank that skips a collective its peers enter, a different collective, size or
dtype, a rank that raises, or one that never arrives ends every rank within the
timeout with cpsim's one-line error naming each rank's call. send and recv are
paired: a recv whose sender stopped or never sends, a size or dtype that
differs, or a send no recv takes is a named error too.
"""
import atexit
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from cpsim import _C

CollectiveError = _C.CollectiveError

_local = threading.local()
_patch_lock = threading.Lock()
_patched = 0
_saved = {}


def _default_group():
    pg = getattr(_local, "pg", None)
    if pg is not None:
        return pg
    return _saved["_get_default_group"]()


def _is_initialized():
    return getattr(_local, "pg", None) is not None or _saved["is_initialized"]()


def _install():
    """Per-thread default groups: torch.distributed's default-group lookups read
    this thread's cpsim rank while a spawn runs (and the real ones otherwise)."""
    global _patched
    with _patch_lock:
        if _patched == 0:
            _saved["_get_default_group"] = c10d._get_default_group
            _saved["is_initialized"] = c10d.is_initialized
            c10d._get_default_group = _default_group
            c10d.is_initialized = _is_initialized
            dist.is_initialized = _is_initialized
        _patched += 1


def _uninstall():
    global _patched
    with _patch_lock:
        _patched -= 1
        if _patched == 0:
            c10d._get_default_group = _saved["_get_default_group"]
            c10d.is_initialized = _saved["is_initialized"]
            dist.is_initialized = _saved["is_initialized"]


class RankFailed(RuntimeError):
    """A rank of a spawn raised; `rank` says which, `__cause__` what it raised."""

    def __init__(self, rank, error):
        super().__init__("rank %d: %s" % (rank, error))
        self.rank = rank


def spawn(fn, world_size, backend="threads", timeout=20.0, args=()):
    """Runs fn(rank, world_size, *args) on world_size ranks of a cpsim group of
    `backend` (threads or gloo), as threads of this process; returns every rank's
    result in rank order. The first failure is raised on the caller's thread once
    every rank has stopped: a rank's own exception (its peers' CollectiveErrors
    are its consequence), or a CollectiveError naming every rank's call."""
    group = _C.SpawnedGroup(backend, world_size, float(timeout))
    results, errors, groups = [None] * world_size, [None] * world_size, [None] * world_size

    def run(rank):
        try:
            _local.pg = groups[rank] = group.process_group(rank)
            # Group ranks are global ranks (irecv and friends translate through this map).
            c10d._pg_group_ranks[_local.pg] = {r: r for r in range(world_size)}
            results[rank] = fn(rank, world_size, *args)
            group.finish(rank)
        except BaseException as e:  # noqa: B902 - every failure ends the rank and tells its peers
            errors[rank] = e
            group.fail(rank, "%s: %s" % (type(e).__name__, e))
        finally:
            c10d._pg_group_ranks.pop(groups[rank], None)
            _local.pg = None

    _install()
    try:
        threads = [threading.Thread(target=run, args=(r,), name="cpsim rank %d" % r) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        group.done()
    finally:
        _uninstall()
    # The root cause first: an exception of the rank's own, then cpsim's report.
    # A rank whose own call ended in cpsim's report raised the report (it crosses
    # torch's bindings as a RuntimeError with cpsim's text); any other exception
    # is the rank's own.
    def reported_by_cpsim(rank, error):
        return isinstance(error, CollectiveError) or (
            isinstance(error, RuntimeError) and groups[rank] is not None and groups[rank].collective_failed())

    own = [(r, e) for r, e in enumerate(errors) if e is not None and not reported_by_cpsim(r, e)]
    reported = [(r, e) for r, e in enumerate(errors) if e is not None]
    if own:
        rank, error = own[0]
        raise RankFailed(rank, "%s: %s" % (type(error).__name__, error)) from error
    if reported:
        rank, error = reported[0]
        raise CollectiveError(str(error)) from error
    unreceived = group.unreceived()
    if unreceived:
        raise CollectiveError(unreceived)
    return results


_job = None      # this process's rank of its job (init_process_group)
_session = None  # the program's session of it: the default group


def init_process_group(timeout=20.0):
    """Makes this process one rank of the job `cpsim launch -n N -- python3 SCRIPT`
    started (or torchrun, Slurm, Open MPI, with CPSIM_STORE naming the store) and
    the default torch.distributed group a cpsim group over the job's Gloo
    transport: every call is checked across the processes, so a rank that skips a
    collective, calls another one or another size, raises, or never arrives ends
    every rank within `timeout` with cpsim's one-line error. Returns the group.
    (send and recv between processes are not supported: spawn() has them.)"""
    global _job, _session
    if _job is not None:
        raise RuntimeError("cpsim.torch.init_process_group: this process already joined its job")
    _job = _C.JobGroup(float(timeout))
    _session = _job.session("")
    pg = _session.process_group()
    # torch's own store stays in this process: the processes met in cpsim's store
    # when the job was joined, so torch's store-based barrier after init (which
    # counts the ranks in its store) is told that every rank is there.
    local = dist.HashStore()

    def create(store, rank, size, timeout):
        local.add("store_based_barrier_key:%d" % c10d._group_count, size - 1)
        return pg

    if hasattr(dist.Backend, "CPSIM"):
        dist.Backend.CPSIM = create
    else:
        dist.Backend.register_backend("cpsim", create)
    dist.init_process_group("cpsim", store=local, rank=_job.rank(), world_size=_job.size())
    atexit.register(_finish_job)
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        # The program raised: every peer learns it (a rank that only relays
        # cpsim's report of what the ranks did prints that one line).
        session = _session
        if session is not None:
            reported = isinstance(value, (CollectiveError, _C.Aborted)) or (
                isinstance(value, RuntimeError) and session.collective_failed())
            session.fail("%s: %s" % (kind.__name__, value))
            if reported:
                sys.stderr.write("rank %d: %s\n" % (_job.rank(), value))
                return
        previous(kind, value, traceback)

    sys.excepthook = excepthook
    return pg


def _finish_job():
    global _job, _session
    job, session, _job, _session = _job, _session, None, None
    if job is None:
        return
    try:
        session.finish()  # a peer still in a call learns that this rank returned
        job.leave()
    except Exception as e:  # noqa: BLE001 - atexit cannot raise: say it and fail the exit status
        sys.stderr.write("rank %d: %s\n" % (job.rank(), e))
        sys.stderr.flush()
        import os
        os._exit(1)


# The property harness (cpsim/harness.py): cpsim.torch.check(step, ...).
from cpsim.harness import CheckFailed, RankCase, check  # noqa: E402,F401
