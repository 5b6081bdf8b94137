"""What the launcher and host suites share: the cpsim binary, free ports, daemons
this suite starts and always stops (never the machine's own services), and a
one-node Slurm cluster of its own (munge, slurmctld, slurmd on free ports, in a
temporary folder)."""
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples")
JOB_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job_harness.py")
DELAY_LINK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay_link.py")


def binary():
    path = os.environ.get("CPSIM_BINARY")
    if not path:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    return os.path.abspath(path)


def needs(*commands):
    """Skips with one line naming what is missing (CI installs them all and must
    not skip: scripts/install-deps.sh)."""
    missing = [c for c in commands if not shutil.which(c)]
    if missing:
        pytest.skip("not installed: %s (scripts/install-deps.sh installs them)" % ", ".join(missing))


def free_ports(n):
    """n TCP ports nothing listens on now (bound, read, released together)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def python_env():
    """The environment a Python rank needs: the build's cpsim module on the path."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Daemons:
    """Processes started in the foreground, each in a session of its own, stopped
    (SIGTERM, then SIGKILL after 5 s) in reverse order."""

    def __init__(self):
        self.procs = []

    def start(self, argv, log, env=None):
        out = open(log, "ab")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()
        self.procs.append((argv[0], p))
        return p

    def stop(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("%s: not within %d s" % (what, seconds))


class SlurmCluster:
    """A one-node Slurm cluster: munged with a fresh key, slurmctld and slurmd on
    free ports, 8 task slots on this host (config_overrides: more than its cores),
    every file in a temporary folder removed when it stops. `env` is what srun needs (SLURM_CONF)."""

    def __init__(self):
        needs("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo")
        # munged wants every folder above its socket open to all (a test's own
        # temporary folder is not): a folder of its own under the temporary one.
        self.folder = folder = tempfile.mkdtemp(prefix="cpsim-slurm-")
        os.chmod(folder, 0o755)
        self.daemons = Daemons()
        for d in ("state", "spool", "log", "run"):
            os.makedirs(os.path.join(folder, d), mode=0o755, exist_ok=True)
        key = os.path.join(folder, "munge.key")
        subprocess.run(["mungekey", "-c", "-k", key, "-b", "1024"], check=True, stderr=subprocess.DEVNULL)
        os.chmod(key, 0o600)
        sock = os.path.join(folder, "run", "munge.sock")
        self.daemons.start(["munged", "-F", "--key-file=" + key, "--socket=" + sock,
                            "--pid-file=" + os.path.join(folder, "run", "munged.pid"),
                            "--log-file=" + os.path.join(folder, "log", "munged.log"),
                            "--seed-file=" + os.path.join(folder, "run", "munged.seed")],
                           os.path.join(folder, "log", "munged.out"))
        wait_for(lambda: os.path.exists(sock), 10, "munged's socket")
        host = socket.gethostname()
        ctld, slurmd = free_ports(2)
        conf = os.path.join(folder, "slurm.conf")
        with open(conf, "w") as f:
            f.write("\n".join([
                "ClusterName=cpsimtest",
                "SlurmctldHost=%s(127.0.0.1)" % host,
                "SlurmctldPort=%d" % ctld, "SlurmdPort=%d" % slurmd,
                "SlurmUser=root", "SlurmdUser=root",
                "AuthType=auth/munge", "CredType=cred/munge", "AuthInfo=socket=" + sock,
                "StateSaveLocation=" + os.path.join(folder, "state"),
                "SlurmdSpoolDir=" + os.path.join(folder, "spool"),
                "SlurmctldPidFile=" + os.path.join(folder, "run", "slurmctld.pid"),
                "SlurmdPidFile=" + os.path.join(folder, "run", "slurmd.pid"),
                "SlurmctldLogFile=" + os.path.join(folder, "log", "slurmctld.log"),
                "SlurmdLogFile=" + os.path.join(folder, "log", "slurmd.log"),
                "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
                "SwitchType=switch/none", "MpiDefault=none", "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
                "SlurmdParameters=config_overrides",
                "NodeName=%s NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN" % host,
                "PartitionName=cpsim Nodes=%s Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE" % host,
                ""]))
        self.env = dict(os.environ, SLURM_CONF=conf)
        self.daemons.start(["slurmctld", "-D", "-c"], os.path.join(folder, "log", "slurmctld.out"), self.env)
        self.daemons.start(["slurmd", "-D"], os.path.join(folder, "log", "slurmd.out"), self.env)

        def idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL).stdout.decode()
            return out.strip() == "idle"

        try:
            wait_for(idle, 30, "the Slurm node idle")
        except AssertionError:
            self.stop()
            raise

    def logs(self):
        text = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.folder, "log", name)
            if os.path.exists(path):
                with open(path) as f:
                    text.append("== %s\n%s" % (name, "".join(f.readlines()[-20:])))
        return "\n".join(text)

    def stop(self):
        self.daemons.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def run(argv, env=None, timeout=300):
    """argv's exit status, its output (stdout and stderr together) and its seconds."""
    start = time.monotonic()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace"), time.monotonic() - start



def _ip(*args, check=True):
    p = subprocess.run(["ip"] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if check and p.returncode:
        raise RuntimeError("ip %s: %s" % (" ".join(args), p.stdout.decode().strip()))
    return p.stdout.decode()


class Hosts:
    """n network namespaces as hosts: host i is namespace cpsim<pid>h<i> with its
    own host name (host<i>, a UTS namespace a process) and the address 10.0.0.<i+1>
    on eth0, a veth whose other end is a port of a bridge in a switch namespace of
    its own, so the machine's own network is never touched. Faults: a host's link
    cut at the switch, its packets dropped at random (nftables), its link slowed
    (a token bucket), its processes killed or frozen. stop() kills every process
    left in the namespaces and removes them."""

    def __init__(self, n=3):
        needs("ip", "nft", "tc", "unshare")
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root (CI runs as root)")
        self.n = n
        self.prefix = "cpsim%d" % os.getpid()
        self.switch = self.prefix + "sw"
        self.names = ["%sh%d" % (self.prefix, i) for i in range(n)]
        self.addresses = ["10.0.0.%d" % (i + 1) for i in range(n)]
        self.daemons = Daemons()
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", "port%d" % i,
                    "netns", self.switch)
                _ip("-n", self.switch, "link", "set", "port%d" % i, "master", "br0", "up")
                _ip("-n", name, "addr", "add", self.addresses[i] + "/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except Exception:
            self.stop()
            raise

    def argv(self, i, argv):
        """argv run on host i: in its network namespace, under its own host name."""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', "host%d" % i] + list(argv)

    def pids(self, i):
        return [int(p) for p in _ip("netns", "pids", self.names[i], check=False).split()]

    def signal(self, i, sig):
        for pid in self.pids(i):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def cut(self, i, down=True):
        """Host i's cable: its switch port down (nothing arrives, nothing is refused)."""
        _ip("-n", self.switch, "link", "set", "port%d" % i, "down" if down else "up")

    def drop(self, i, percent):
        """Host i loses `percent` of the packets it sends, at random (as netem's loss
        on its interface: this machine's kernel has no netem; nftables does it)."""
        rules = ("add table inet cpsim\n"
                 "add chain inet cpsim out { type filter hook output priority 0; }\n"
                 "add rule inet cpsim out numgen random mod 100 < %d drop\n" % percent)
        subprocess.run(["ip", "netns", "exec", self.names[i], "nft", "-f", "-"], input=rules.encode(), check=True)

    def slow(self, i, rate):
        """Host i's link at `rate` (tc's units, say 2mbit) both ways: a token bucket on
        its eth0 and on its switch port."""
        for ns, dev in ((self.names[i], "eth0"), (self.switch, "port%d" % i)):
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kb",
                            "latency", "10s"], check=True)

    def delay(self, i, ms):
        """Host i's packets held `ms` ms before they leave (as netem's delay on its
        interface): what it sends to the subnet goes through a TUN device whose
        reader (delay_link.py) writes each packet back `ms` later, and the kernel
        forwards it out of eth0. Returns the reader; undelay(i, reader) ends it."""
        ns = self.names[i]
        reader = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, DELAY_LINK, "delay0", str(ms)],
                                  stdout=subprocess.PIPE, start_new_session=True)
        ready, _, _ = select.select([reader.stdout], [], [], 10)  # the TUN device within 10 s, or fail
        if not ready or reader.stdout.readline().strip() != b"ready":
            os.killpg(reader.pid, signal.SIGKILL)
            reader.wait()
            raise AssertionError("delay_link.py did not make its device within 10 s")
        for key, value in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                           ("net.ipv4.conf.delay0.rp_filter", "0"), ("net.ipv4.conf.delay0.accept_local", "1")):
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "%s=%s" % (key, value)], check=True)
        _ip("-n", ns, "link", "set", "delay0", "up")
        # What comes back out of the device leaves by eth0; what the host sends enters it.
        _ip("-n", ns, "route", "add", "10.0.0.0/24", "dev", "eth0", "table", "100")
        _ip("-n", ns, "rule", "add", "iif", "delay0", "lookup", "100")
        _ip("-n", ns, "route", "replace", "10.0.0.0/24", "dev", "delay0", "src", self.addresses[i])
        return reader

    def undelay(self, i, reader):
        ns = self.names[i]
        _ip("-n", ns, "route", "replace", "10.0.0.0/24", "dev", "eth0", "src", self.addresses[i], check=False)
        _ip("-n", ns, "rule", "del", "iif", "delay0", "lookup", "100", check=False)
        _ip("-n", ns, "route", "flush", "table", "100", check=False)
        if reader.poll() is None:
            os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()

    def stop(self):
        self.daemons.stop()
        for i, name in enumerate(self.names):
            if name in _ip("netns", "list", check=False):
                self.signal(i, signal.SIGCONT)
                self.signal(i, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(self.pids(i) for i in range(self.n) if self.names[i] in _ip("netns", "list", check=False)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for name in self.names + [self.switch]:
            _ip("netns", "del", name, check=False)
