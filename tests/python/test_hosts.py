"""One job across three hosts, and the faults of a real network: three network
namespaces, each with its own address and host name, joined by a bridge; a Redis
store on host 0; two ranks a host (RANK/WORLD_SIZE, CPSIM_GLOO_HOST), Gloo over
those addresses. Each fault asserts every rank's exit status, its message and
when it ended: a job that cannot complete ends on every surviving rank within
its timeout + 2 s with exit status 3, naming the ranks it lost; a slow but live
network passes with a sufficient timeout; nothing is left running. The measured
end times are in docs/errors.md ("Across hosts")."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from launchers import EXAMPLES, Hosts, binary, needs, python_env, wait_for

PER_HOST = 2
SLACK = 2.0  # seconds a surviving rank may take past its timeout
JOB_ROUNDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job_rounds.py")
TIMES = {}  # fault -> seconds to the last survivor's end, for docs/errors.md


@pytest.fixture(scope="module")
def hosts():
    needs("redis-server", "redis-cli")
    h = Hosts(3)
    try:
        h.redis = None
        start_redis(h)
        yield h
    finally:
        h.stop()
        if TIMES:
            sys.stderr.write("\nmeasured: %s\n" % ", ".join("%s %.2f s" % kv for kv in sorted(TIMES.items())))
        assert not any(os.path.exists("/run/netns/" + n) for n in h.names), "namespaces left behind"


def start_redis(h):
    if h.redis is not None and h.redis.poll() is None:
        return
    h.redis = h.daemons.start(h.argv(0, ["redis-server", "--port", "6379", "--bind", h.addresses[0], "--save", "", "--protected-mode", "no",
                                         "--appendonly", "no"]), "/dev/null")

    def answers():
        p = subprocess.run(h.argv(0, ["redis-cli", "-h", h.addresses[0], "-p", "6379", "ping"]),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return b"PONG" in p.stdout

    wait_for(answers, 20, "redis-server on host 0")


def store(h):
    return "redis://%s:6379" % h.addresses[0]


class Job:
    """PER_HOST ranks on each host (rank r on host r // PER_HOST), each running
    argv (its own process session), its output in a file. `ends` are the times
    (time.monotonic()) each rank ended."""

    def __init__(self, h, argv, job_id=None, env=None, ranks=None):
        self.world = h.n * PER_HOST
        self.job_id = job_id or "hosts-" + uuid.uuid4().hex[:12]
        self.procs, self.files = {}, {}
        self.started = time.monotonic()
        for r in (ranks if ranks is not None else range(self.world)):
            host = r // PER_HOST
            e = dict(env or os.environ, RANK=str(r), WORLD_SIZE=str(self.world), CPSIM_JOB_ID=self.job_id,
                     CPSIM_GLOO_HOST=h.addresses[host], CPSIM_STORE=store(h))
            f = tempfile.NamedTemporaryFile(prefix="cpsim-hosts-rank%d-" % r, suffix=".out", delete=False)
            self.files[r] = f
            self.procs[r] = subprocess.Popen(h.argv(host, argv), stdout=f, stderr=subprocess.STDOUT, env=e,
                                             start_new_session=True)
        self.ends = {}

    def output(self, r):
        self.files[r].seek(0)
        return self.files[r].read().decode(errors="replace")

    def running(self):
        return [r for r, p in self.procs.items() if p.poll() is None]

    def wait(self, ranks, seconds):
        """Waits up to `seconds` for `ranks` to end; records when each ended."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for r in ranks:
                if r not in self.ends and self.procs[r].poll() is not None:
                    self.ends[r] = time.monotonic()
            if all(r in self.ends for r in ranks):
                return
            time.sleep(0.02)

    def kill(self):
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for f in self.files.values():
            name = f.name
            f.close()
            os.unlink(name)

    def report(self):
        return "\n".join("== rank %d (exit %s)\n%s" % (r, self.procs[r].poll(), self.output(r)[-3000:])
                         for r in sorted(self.procs))


@pytest.fixture
def job(hosts):
    jobs = []

    def make(*args, **kwargs):
        jobs.append(Job(hosts, *args, **kwargs))
        return jobs[-1]

    yield make
    for j in jobs:
        j.kill()
    # Nothing of a job is left on any host (the Redis server stays on host 0).
    for i in range(hosts.n):
        left = [p for p in hosts.pids(i) if not _is_redis(p)]
        assert not left, "host %d: processes left running: %s" % (i, left)


def _is_redis(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().startswith("redis")
    except OSError:
        return False


def fuzz(timeout):
    return [binary(), "fuzz", "--cases", "100000", "--timeout", str(timeout)]


def rounds(timeout, **kw):
    argv = [sys.executable, JOB_ROUNDS, "--timeout", str(timeout)]
    for k, v in kw.items():
        argv += ["--" + k, str(v)]
    return argv


def expect_ended(j, ranks, since, timeout, name, status=3, names=()):
    """Every rank of `ranks` ended by since + timeout + SLACK with `status`,
    its output naming every rank of `names`. Records the slowest end."""
    j.wait(ranks, timeout + SLACK + 10)
    late = [r for r in ranks if r not in j.ends]
    assert not late, "ranks %s still running %.1f s after the fault\n%s" % (late, timeout + SLACK + 10, j.report())
    took = max(j.ends[r] for r in ranks) - since
    TIMES[name] = took
    assert took <= timeout + SLACK, "%s: the last rank ended %.2f s after the fault (timeout %g)\n%s" % (
        name, took, timeout, j.report())
    for r in ranks:
        assert j.procs[r].returncode == status, "rank %d exited %s, expected %d\n%s" % (
            r, j.procs[r].returncode, status, j.report())
        out = j.output(r)
        for q in names:
            assert names_rank(out, q), "rank %d does not name rank %d\n%s" % (r, q, j.report())
    return took


def names_rank(text, q):
    """Whether text names rank q ("rank 4", "ranks 4, 5", "ranks 0, 4")."""
    return re.search(r"\branks? (?:\d+, )*%d\b" % q, text) is not None


def running_rounds(j):
    """Waits until every rank finished its first round: the job is in its loop of
    collectives."""
    wait_for(lambda: all("round 1\n" in j.output(r) for r in range(j.world)), 60, "round 1 on every rank")
    assert len(j.running()) == j.world, "a rank ended before the fault\n" + j.report()


SURVIVORS = [0, 1, 2, 3]  # hosts 0 and 1; host 2 holds ranks 4 and 5


def test_a_check_spread_over_three_hosts_holds(job):
    j = job([binary(), "check", os.path.join(EXAMPLES, "spec_example.json"), "--timeout", "30"])
    j.wait(range(j.world), 120)
    assert all(j.procs[r].returncode == 0 for r in range(j.world)), j.report()
    assert "all properties hold" in j.output(0) and "cp=6" in j.output(0), j.report()


def test_a_torch_step_spread_over_three_hosts_holds(hosts, job):
    j = job(rounds(30, rounds=3), env=python_env())
    j.wait(range(j.world), 120)
    assert all(j.procs[r].returncode == 0 for r in range(j.world)), j.report()
    assert all("rank %d: round 3" % r in j.output(r) for r in range(j.world)), j.report()


@pytest.mark.parametrize("sig,name", [(signal.SIGKILL, "host killed"), (signal.SIGSTOP, "host frozen")])
def test_a_host_killed_or_frozen_mid_run_ends_the_others(hosts, job, sig, name):
    j = job(rounds(5, rounds=100000), env=python_env())
    running_rounds(j)
    since = time.monotonic()
    hosts.signal(2, sig)
    took = expect_ended(j, SURVIVORS, since, 5, name)
    # Each survivor names a rank of host 2 (the one it was waiting for).
    for r in SURVIVORS:
        assert names_rank(j.output(r), 4) or names_rank(j.output(r), 5), j.report()


def test_a_link_cut_before_rendezvous_ends_every_rank(hosts, job):
    hosts.cut(2)
    try:
        j = job(fuzz(5))
        since = j.started
        expect_ended(j, SURVIVORS, since, 5, "link cut before rendezvous", names=[4, 5])
        # Host 2's ranks reach neither the store nor a peer: they end too.
        expect_ended(j, [4, 5], since, 5, "link cut before rendezvous (the cut host)")
    finally:
        hosts.cut(2, down=False)


def test_a_link_cut_while_the_ranks_connect_and_sit_runs_out_ends_every_rank(hosts, job):
    # cpsim fuzz runs groups of 1 to 6 ranks: the ranks outside a run wait for it
    # with a long limit. A cut 0.5 s in meets ranks connecting, running and
    # sitting a run out; none may wait past the timeout.
    j = job(fuzz(5))
    time.sleep(0.5)
    since = time.monotonic()
    hosts.cut(2)
    try:
        expect_ended(j, SURVIVORS, since, 5, "link cut while connecting")
        for r in SURVIVORS:
            assert names_rank(j.output(r), 4) or names_rank(j.output(r), 5), j.report()
        expect_ended(j, [4, 5], since, 5, "link cut while connecting (the cut host)")
    finally:
        hosts.cut(2, down=False)


@pytest.mark.parametrize("pause", [0, 3], ids=["during collectives", "between collectives"])
def test_a_link_cut_mid_run_ends_every_rank(hosts, job, pause):
    # pause 0: the ranks are inside all_reduces back to back; pause 3: they sit 3 s
    # between two, and the next one meets the cut.
    j = job(rounds(4, rounds=100000, pause=pause), env=python_env())
    running_rounds(j)
    since = time.monotonic()
    hosts.cut(2)
    name = "link cut " + ("during" if pause == 0 else "between") + " collectives"
    try:
        expect_ended(j, SURVIVORS, since, pause + 4, name)
        for r in SURVIVORS:
            assert names_rank(j.output(r), 4) or names_rank(j.output(r), 5), j.report()
        expect_ended(j, [4, 5], since, pause + 4, name + " (the cut host)")
    finally:
        hosts.cut(2, down=False)


def test_a_lossy_slow_link_passes_with_a_sufficient_timeout_and_fails_cleanly_with_a_short_one(hosts, job):
    hosts.drop(2, 30)
    hosts.slow(2, "20mbit")
    try:
        # 256 KiB all-reduced 3 times through a 20 Mbit/s link that loses 30% of the
        # packets it sends (TCP retransmits them, backing off): seconds a round.
        j = job(rounds(120, rounds=3, mb=0.25), env=python_env())
        j.wait(range(j.world), 300)
        assert all(j.procs[r].returncode == 0 for r in range(j.world)), j.report()
        TIMES["lossy slow link, 3 rounds of 256 KiB"] = max(j.ends.values()) - j.started
        # The same rounds with a 1 s timeout: every rank ends cleanly (exit 3).
        # The ranks join together (torch's import takes seconds, unevenly), so
        # that the short timeout meets the all-reduce, not the rendezvous.
        j = job(rounds(1, rounds=3, mb=0.25, **{"start-at": time.time() + 8}), env=python_env())
        j.wait(range(j.world), 120)
        assert all(j.procs[r].returncode == 3 for r in range(j.world)), j.report()
    finally:
        subprocess.run(["ip", "netns", "exec", hosts.names[2], "nft", "delete", "table", "inet", "cpsim"])
        for ns, dev in ((hosts.names[2], "eth0"), (hosts.switch, "port2")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])


def test_a_200_ms_delay_passes_with_a_sufficient_timeout_and_fails_cleanly_with_a_short_one(hosts, job):
    reader = hosts.delay(2, 200)
    try:
        # Every packet host 2 sends waits 200 ms: each call's record exchange and
        # each step of an all-reduce that needs host 2's data wait for it.
        j = job(rounds(30, rounds=3, mb=0.25), env=python_env())
        j.wait(range(j.world), 120)
        assert all(j.procs[r].returncode == 0 for r in range(j.world)), j.report()
        TIMES["200 ms delay, 3 rounds of 256 KiB"] = max(j.ends.values()) - j.started
        # A 1 s timeout: the ranks cannot even connect (each store command and
        # each connection of host 2 waits 200 ms, and Gloo connects peer by peer):
        # every rank ends cleanly (exit 3) with a timeout report, within the
        # connection's limit (5 x the timeout) + 2 s of the last rank's joining.
        # The ranks join together (torch's import takes seconds, unevenly) so that
        # this is timed; a rank whose import ran past the joining time (a loaded
        # machine) says when it joined, and the limit counts from the last one.
        join = time.time() + 8
        joined = time.monotonic() + 8
        j = job(rounds(1, rounds=3, mb=0.25, **{"start-at": join}), env=python_env())
        j.wait(range(j.world), 120)
        assert all(j.procs[r].returncode == 3 for r in range(j.world)), j.report()
        assert all("limit 1000 ms" in j.output(r) for r in range(j.world)), j.report()
        at = [float(t) for r in range(j.world) for t in re.findall(r"^joined at ([0-9.]+)$", j.output(r), re.M)]
        assert len(at) == j.world, j.report()
        took = max(j.ends.values()) - (joined + max(0.0, max(at) - join))
        TIMES["200 ms delay, timeout 1 s (from joining)"] = took
        assert took <= 5 + SLACK, "the last rank ended %.2f s after joining\n%s" % (took, j.report())
    finally:
        hosts.undelay(2, reader)


def test_the_store_killed_mid_rendezvous_ends_the_ranks_waiting(hosts, job):
    j = job(fuzz(5), ranks=[0, 1, 2, 3])  # ranks 4 and 5 never come
    time.sleep(2)
    since = time.monotonic()
    hosts.redis.kill()
    hosts.redis.wait()
    try:
        expect_ended(j, SURVIVORS, since, 5, "store killed mid-rendezvous")
    finally:
        start_redis(hosts)


def test_the_store_killed_mid_run_does_not_stop_a_connected_job(hosts, job):
    # The store is for meeting and for failure records: once connected, the ranks
    # run on without it.
    j = job(rounds(5, rounds=4, pause=1), env=python_env())
    wait_for(lambda: all("round 1" in j.output(r) for r in range(j.world)), 60, "round 1 on every rank")
    hosts.redis.kill()
    hosts.redis.wait()
    try:
        j.wait(range(j.world), 60)
        assert all(j.procs[r].returncode == 0 for r in range(j.world)), j.report()
    finally:
        start_redis(hosts)


def test_the_store_killed_while_ranks_sit_short_runs_out_does_not_stop_the_job(hosts, job):
    # cpsim fuzz runs groups of 1 to 6 ranks; a rank outside a run reads the
    # failure records while it waits, and gives up only when the store has been
    # silent for the timeout within one wait. Runs shorter than that go on.
    j = job(fuzz(5))

    def connected():  # every group size has met in the store (groups connect on first use)
        keys = subprocess.run(hosts.argv(0, ["redis-cli", "-h", hosts.addresses[0], "--scan", "--pattern",
                                             j.job_id + "/group*"]), stdout=subprocess.PIPE).stdout.decode()
        return all("/group%d/" % n in keys for n in range(2, j.world))

    wait_for(connected, 60, "every group of the fuzz job connected")
    time.sleep(1)
    hosts.redis.kill()
    hosts.redis.wait()
    try:
        time.sleep(3 * 5)
        assert j.running() == list(range(j.world)), j.report()
    finally:
        start_redis(hosts)


def test_two_jobs_under_one_id_on_one_store_never_mix(hosts, job):
    first = job(rounds(20, rounds=2, pause=3), env=python_env())
    wait_for(lambda: all("round 1" in first.output(r) for r in range(first.world)), 60, "round 1 of the first job")
    second = job([binary(), "check", os.path.join(EXAMPLES, "spec_example.json"), "--timeout", "5"],
                 job_id=first.job_id)
    second.wait(range(second.world), 30)
    assert all(second.procs[r].returncode == 2 for r in range(second.world)), second.report()
    assert all("holds" in second.output(r) or "claimed" in second.output(r) for r in range(second.world)), \
        second.report()
    first.wait(range(first.world), 60)
    assert all(first.procs[r].returncode == 0 for r in range(first.world)), first.report()
