"""Run PyTorch CP code on cpsim's ranks (torch 2.x).

    import cpsim.torch
    def step(rank, world_size):
        x = torch.full((2,), float(rank))
        out = torch.empty(2 * world_size)
        torch.distributed.all_gather_into_tensor(out, x)   # checked by cpsim
    cpsim.torch.spawn(step, world_size=4)

spawn() runs fn(rank, world_size) on `world_size` threads of this process. Each
thread is a rank with a torch.distributed world of its own: its default group
(backend "cpsim"), and every group it makes (dist.new_group, DeviceMesh), so
torch.distributed code runs unchanged. Every call passes cpsim's call check first:
a rank that skips a collective its peers enter, a different collective, size,
dtype, reduction or root, a rank that raises, or one that never arrives ends
every rank within the timeout with cpsim's report naming each rank's call and
where the program made it. Sends and receives match in any order (a ring that
posts its irecv first is fine, as on NCCL and Gloo); a receive nothing comes for,
a size or dtype that differs, a send nobody receives, a request never waited on,
and an output used before its request was waited on are named errors.
"""
import atexit
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from cpsim import _C
from cpsim import where
from cpsim.waits import UseBeforeWait as _UseBeforeWait, UsedBeforeWait, unwaited as _unwaited  # noqa: F401

# Modules whose functions take `group=group.WORLD` as a default argument read the
# default group when they are imported: imported here, on no rank's thread, so
# that no rank's group becomes every later program's default.
import torch.distributed.nn.functional  # noqa: E402,F401
import torch.distributed.device_mesh  # noqa: E402,F401

# A call's site, and where an exception came from, is the innermost frame outside
# where.INTERNAL (cpsim's own files, the thread module where a spawned rank's
# stack begins, and torch's files): one list for both.
where.INTERNAL.append(os.path.dirname(torch.__file__) + os.sep)
_C.set_internal_paths(where.INTERNAL)
_C.set_own_path(os.path.dirname(__file__) + os.sep)

CollectiveError = _C.CollectiveError
Unsupported = _C.Unsupported

_local = threading.local()  # this thread's rank: .world (its torch world), .source (its Backends)
_patch_lock = threading.Lock()
_patched = 0
_saved = {}


class _RankWorld(c10d._World):
    """One rank's torch.distributed state (torch keeps it in module globals: one
    per process). Everything _World holds, held here."""

    def __init__(self):
        super().__init__()
        self._maps = {name: {} for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config",
                                            "tags_to_pg", "pg_to_tag")}
        self._count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self):
        return self._count

    @group_count.setter
    def group_count(self, value):
        self._count = value


class _Worlds:
    """torch.distributed's world while cpsim ranks run: the calling thread's own
    (a rank's), or the process's (any other thread)."""

    def __init__(self, shared):
        object.__setattr__(self, "_shared", shared)

    def _current(self):
        world = getattr(_local, "world", None)
        return world if world is not None else object.__getattribute__(self, "_shared")

    def __getattr__(self, name):
        return getattr(self._current(), name)

    def __setattr__(self, name, value):
        setattr(self._current(), name, value)


def _install():
    """Per-thread worlds (and per-thread group registries in torch's C++ side)."""
    global _patched
    with _patch_lock:
        if _patched == 0:
            _saved["world"] = c10d._world
            c10d._world = _Worlds(c10d._world)
            torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _patched += 1


def _uninstall():
    global _patched
    with _patch_lock:
        _patched -= 1
        if _patched == 0:
            c10d._world = _saved.pop("world")
            torch._C._distributed_c10d._set_thread_isolation_mode(False)


def _create(opts, backend_options=None):
    """torch's call for each group made with backend "cpsim": this thread's rank
    makes its Backend."""
    source = getattr(_local, "source", None)
    if source is None:
        raise RuntimeError("backend 'cpsim' runs inside cpsim.torch.spawn() or after cpsim.torch.init_process_group()")
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    return source(str(opts.group_id), ranks)


dist.Backend.register_backend("cpsim", _create, extended_api=True, devices=["cpu"])
# cpsim records every call itself (the call check); torch's flight recorder is one
# per process and would take thread ranks for one rank changing its number.
if isinstance(getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None), set):
    c10d._FR_SELF_RECORDING_BACKENDS.add("cpsim")


class RankFailed(RuntimeError):
    """A rank of a spawn raised: `rank` says which, `ranks` every one that did,
    `error` what `rank` raised (not chained: the report says it once)."""

    def __init__(self, rank, report, error=None, ranks=None):
        super().__init__("rank %d: %s" % (rank, report))
        self.rank, self.error = rank, error
        self.ranks = list(ranks) if ranks is not None else [rank]


class RankStuck(RuntimeError):
    """A rank of a spawn still ran `timeout` seconds after a peer ended, in no
    cpsim call (a loop or a wait of the program's own): `ranks` says which,
    the message where each one was."""

    def __init__(self, message, ranks):
        super().__init__(message)
        self.ranks = ranks


class _Abandoned(BaseException):
    """Raised inside a stuck rank's thread to stop it (pure Python code stops at
    its next bytecode; a call blocked in C code stops when it returns)."""


def _stop_thread(thread):
    import ctypes
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))


def spawn(fn, world_size, backend="threads", timeout=20.0, args=(), sends="rendezvous"):
    """Runs fn(rank, world_size, *args) on world_size ranks of a cpsim group of
    `backend` (threads or gloo), as threads of this process; returns every rank's
    result in rank order. The first failure is raised on the caller's thread once
    every rank has stopped: a rank's own exception (its peers' CollectiveErrors
    are its consequence), or a CollectiveError naming every rank's call. A rank
    still running `timeout` seconds after a peer ended (and so in no cpsim call,
    whose own wait would have ended) is RankStuck, with where it was; its thread
    is stopped at its next Python bytecode. `sends`: "rendezvous" (a blocking
    send returns when a receive took its message, as on Gloo and NCCL: a ring
    that sends before it receives is a deadlock, named at once) or "eager" (at
    once, as MPI's small sends)."""
    group = _C.SpawnedGroup(backend, world_size, float(timeout), sends)
    store = dist.HashStore()
    results, errors, backends = [None] * world_size, [None] * world_size, [[] for _ in range(world_size)]
    ended = [None] * world_size  # when each rank's thread ended (time.monotonic)
    ending = threading.Condition()

    def run(rank):
        ledger = group.ledger(rank)

        def source(name, ranks):
            b = group.backend(name, ranks, rank)
            backends[rank].append(b)
            return b

        _local.world, _local.source = _RankWorld(), source
        try:
            dist.init_process_group("cpsim", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
            with _UseBeforeWait(ledger, rank):
                results[rank] = fn(rank, world_size, *args)
            _unwaited(ledger, rank)
            group.finish(rank)
        except _Abandoned:
            pass  # reported by spawn as RankStuck
        except BaseException as e:  # noqa: B902 - every failure ends the rank and tells its peers
            errors[rank] = e
            group.fail(rank, "%s: %s" % (type(e).__name__, e))
        finally:
            _local.world = _local.source = None
            with ending:
                ended[rank] = time.monotonic()
                ending.notify_all()

    _install()
    hook = sys.excepthook  # each rank's init_process_group wraps it (a "[rank N]:" prefix)
    stuck = []
    try:
        threads = [threading.Thread(target=run, args=(r,), name="cpsim rank %d" % r, daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t.start()
        stuck = _stuck_ranks(ended, ending, timeout)
        if stuck:
            first = min(e for e in ended if e is not None)
            first_rank = ended.index(first)
            lines = ["rank %d is still running %.3g s after rank %d ended, in no cpsim call: at %s"
                     % (r, time.monotonic() - first, first_rank, where.running(threads[r])) for r in stuck]
            for r in stuck:
                group.fail(r, "stuck")
                _stop_thread(threads[r])
        for r, t in enumerate(threads):
            t.join(1.0 if r in stuck else None)
        if not stuck:
            group.done()
    finally:
        sys.excepthook = hook
        _uninstall()
    if stuck:
        raise RankStuck("\n".join(lines), stuck)
    _raise_first_failure(group, errors, backends)
    return results


def _stuck_ranks(ended, ending, timeout):
    """Waits until every rank's thread ended (`ended[r]`, told on `ending`); the
    ranks still running `timeout` and a little after a peer ended, or []. Every
    rank's wait in a cpsim call ends within the timeout: such a rank is in none."""
    grace = max(1.0, 0.1 * timeout)
    with ending:
        while any(e is None for e in ended):
            first = min((e for e in ended if e is not None), default=None)
            left = None if first is None else first + timeout + grace - time.monotonic()
            if left is not None and left <= 0:
                return [r for r in range(len(ended)) if ended[r] is None]
            ending.wait(left)
    return []


def _raise_first_failure(group, errors, backends):
    """The root cause first: an exception of a rank's own (RankFailed), then
    cpsim's report (CollectiveError), then a send nobody received. A rank whose
    own call ended in cpsim's report raised the report (it crosses torch's
    bindings as a RuntimeError with cpsim's text); any other exception is the
    rank's own."""
    def reported_by_cpsim(rank, error):
        return isinstance(error, (CollectiveError, _C.Aborted)) or (
            isinstance(error, RuntimeError) and any(b.collective_failed() for b in backends[rank]))

    own = [(r, e) for r, e in enumerate(errors) if e is not None and not reported_by_cpsim(r, e)]
    reported = [(r, e) for r, e in enumerate(errors) if e is not None]
    # From None: a chained exception would print the report (or a traceback) twice.
    if own:
        rank, error = own[0]
        raise RankFailed(rank, where.failure(error), error, [r for r, _ in own]) from None
    if reported:
        rank, error = reported[0]
        raise CollectiveError(str(error)) from None
    unreceived = group.unreceived()
    if unreceived:
        raise CollectiveError(unreceived)


_job = None      # this process's rank of its job (init_process_group)
_session = None  # the program's session of it: the default group


def _job_source(default_session, sessions):
    """The Backends of a process of a job: the default group on `default_session`,
    any other group (of every process, or of some: new_group, DeviceMesh) on a
    fresh session of its own, which its processes alone open (kept in
    `sessions`: each is finished, or failed, with the program)."""

    def source(name, ranks):
        if default_session[0] is not None:
            session, default_session[0] = default_session[0], None
            return session.backend()
        ranks = sorted(int(r) for r in ranks)
        # torch names a group alike on every process (its own counter, which
        # every process advances); a name used again (a world made anew) gets a
        # fresh connection: the members count its uses alike.
        key = (name, tuple(ranks))
        _job_session_uses[key] = _job_session_uses.get(key, 0) + 1
        session = _job.session("group-%s-%s-%d" % (name, ".".join(map(str, ranks)), _job_session_uses[key]), ranks)
        sessions.append(session)
        return session.backend()

    return source


_job_session_uses = {}
_job_sessions = []
_program_mode = []


def _end_sessions(sessions):
    """The program returned: every session finished in turn (a peer still in a
    call of any of them learns it). Returns the messages that came and no
    receive took, as one report ('' when none)."""
    for session in sessions:
        session.finish()
    return "\n".join(u for u in (session.unreceived() for session in sessions) if u)


def _fail_sessions(sessions, error):
    """The program raised `error`: every session's peers learn it."""
    for session in sessions:
        session.fail("%s: %s" % (type(error).__name__, error))


def init_process_group(timeout=20.0, sends="rendezvous"):
    """Makes this process one rank of the job `cpsim launch -n N -- python3 SCRIPT`
    started (or torchrun, Slurm, Open MPI, with CPSIM_STORE naming the store) and
    the default torch.distributed group a cpsim group over the job's Gloo
    transport: every call is checked across the processes, so a rank that skips a
    collective, calls another one or another size, raises, or never arrives ends
    every rank within `timeout` with cpsim's one-line error. Sends and receives
    between the processes match in any order, with spawn()'s `sends`; a
    receive from a rank that returned or raised ends at once. Returns the group."""
    global _job, _session
    if _job is not None:
        raise RuntimeError("cpsim.torch.init_process_group: this process already joined its job")
    # The exit status, as cpsim's own commands give it: 3 when the job could not
    # complete (a peer lost, a timeout, the store gone: _C.Aborted uncaught), so
    # a launcher tells "no verdict" from a failed check (1). Registered first, so
    # that it runs after every other exit handler, joining the job included.
    atexit.register(_exit_with_status)
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if isinstance(value, _C.Aborted):
            _exit_status[0] = 3
        # The program raised: every peer learns it (a rank that only relays
        # cpsim's report of what the ranks did prints that one line).
        if _session is not None:
            sessions = _job_sessions + [_session]
            reported = isinstance(value, (CollectiveError, _C.Aborted)) or (
                isinstance(value, RuntimeError) and any(s.collective_failed() for s in sessions))
            _fail_sessions(sessions, value)
            if reported:
                sys.stderr.write("rank %d: %s\n" % (_job.rank(), value))
                return
        previous(kind, value, traceback)

    sys.excepthook = excepthook
    _job = _C.JobGroup(float(timeout), sends)
    _session = _job.session("")
    _local.source = _job_source([_session], _job_sessions)
    # torch's own store stays in this process: the processes met in cpsim's store
    # when the job was joined.
    dist.init_process_group("cpsim", store=dist.HashStore(), rank=_job.rank(), world_size=_job.size(),
                            timeout=timedelta(seconds=timeout))
    # Outputs of open requests are watched on this thread from now on.
    _program_mode.append(_UseBeforeWait(_job.ledger(), _job.rank()))
    _program_mode[0].__enter__()
    atexit.register(_finish_job)
    return dist.group.WORLD


_exit_status = [None]


def _exit_with_status():
    if _exit_status[0] is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def _finish_job():
    global _job, _session
    job, session, _job, _session = _job, _session, None, None
    if job is None:
        return
    try:
        _unwaited(job.ledger(), job.rank())
        unreceived = _end_sessions(_job_sessions + [session])
        job.leave()
        if unreceived:
            raise CollectiveError(unreceived)
    except Exception as e:  # noqa: BLE001 - atexit cannot raise: say it and fail the exit status
        sys.stderr.write("rank %d: %s\n" % (job.rank(), e))
        sys.stderr.flush()
        # A job that could not complete (a peer lost at its end, a timeout) is 3
        # here too, after this rank's own collectives all returned.
        os._exit(3 if isinstance(e, _C.Aborted) else (_exit_status[0] or 1))


# The property harness (cpsim/harness.py), as cpsim.torch.check(step, ...): the
# harness builds on this module, so it is imported when first asked for, and
# this module never imports it.
_HARNESS_NAMES = ("CheckFailed", "Checked", "Inputs", "Layer", "Layouts", "Loss", "OutsideContract", "RankCase",
                  "Ranks", "TrainStep", "check")


def __getattr__(name):
    if name in _HARNESS_NAMES:
        from cpsim import harness
        return getattr(harness, name)
    raise AttributeError("module 'cpsim.torch' has no attribute %r" % name)


def __dir__():
    return sorted(list(globals()) + list(_HARNESS_NAMES))
