"""cpsim.torch.check: property-test a user's per-rank PyTorch CP step.

    def step(case):                      # runs on every rank, as that rank
        local = my_shard_batch(case.batch, case.rank, case.cp, case.pad_token_id)
        return {"batch": local, "gathered": my_gather_sequence(case.x)}
    cpsim.torch.check(step, cases=200, max_cp=8)

cpsim's generators draw the layouts (random ones, or the members of a family
file); for each, cpsim's references (never the code under test) give every
rank's expected values, the ranks run `step` on a simulated group (torch
collectives land on cpsim's communicators, call-checked), and what the step
returned is compared with the expected values, forward and backward. A failure
is shrunk to the smallest layout and raised as CheckFailed (an AssertionError,
so a plain pytest test reports it), with the layout as a BATCH file that
`cpsim check` replays.


What the step may return (any subset; each is compared when present; the
table is cpsim.outputs', also docs/harness.md's):

%s

A step whose library does not take a drawn layout (FLA: every rank at least W-1
tokens) raises OutsideContract(why) on every rank, before any collective: the
case is set aside, not counted, and another drawn in its place (check() says
how many were set aside, and why).

Gradients are taken in that order on every rank, one autograd.grad per output,
as a training step's backward would: a rank whose output has no path to a
collective (no anchor) skips that collective's backward, and its peers' wait is
reported by name, never a hang.
"""
import json
import os
import shutil
import subprocess
import tempfile

import torch

from cpsim import torch as ct  # spawn and the job: the harness builds on cpsim.torch
from cpsim import outputs as _outputs
from cpsim import program
from cpsim import verdict as _verdict
from cpsim.case import RankCase
from cpsim.layer import Layer
from cpsim.train import TrainStep
from cpsim.user_loss import Loss
from cpsim.options import Inputs, Layouts, Ranks, grouped
from cpsim.outputs import OUTPUTS
from cpsim.verdict import OutsideContract

__doc__ = __doc__ % _outputs.text()
__all__ = ("check", "CheckFailed", "Checked", "Inputs", "Layer", "Layouts", "Loss", "OUTPUTS", "OutsideContract",
           "RankCase", "Ranks", "TrainStep")


class CheckFailed(AssertionError):
    """The step disagreed with cpsim's references. `batch` is the smallest failing
    layout as BATCH JSON text, `path` where it was saved, `cp` the CP size,
    `plan` and `seed` what replays it (check(step, batch=path, cp=cp, plan=plan,
    seed=seed)), `failure` what went wrong: each output's first difference on every
    rank, a line each."""

    def __init__(self, message, failure, batch, path, cp, plan, seed=None):
        super().__init__(message)
        self.failure, self.batch, self.path, self.cp, self.plan, self.seed = failure, batch, path, cp, plan, seed


class Checked(int):
    """What check() returns: the number of cases run (an int), and `outside`, how
    many drawn cases were set aside as outside the step's contract, with
    `outside_why`, each reason given and how often ({why: count}); `probes`,
    the layouts just outside the contract it was handed afterwards and what it
    did with each ({"contract", "outcome": "refused" | "refused on some ranks"
    | "accepted", "why"})."""

    def __new__(cls, ran, outside=0, outside_why=None, probes=()):
        value = super().__new__(cls, ran)
        value.outside, value.outside_why = outside, dict(outside_why or {})
        value.probes = [dict(p) for p in probes]
        return value

    def probe_report(self):
        """What the step did outside its contract, a line a probe ('' when none ran)."""
        return "\n".join("%s: %s%s" % (p["contract"], p["outcome"], " (%s)" % p["why"] if p["why"] else "")
                         for p in self.probes)



def _precision_note(inputs, dp=1):
    """What a tolerance failure at CP size 1 is: the step's own arithmetic (or,
    with replicas, the DP reduction: an exchange too)."""
    if dp > 1:
        return ("\nat cp 1 with dp %d nothing is sharded, but the replicas' reduction over DP is an exchange: the "
                "difference may be the step's arithmetic in %s or its DP reduction (the shrink keeps dp)"
                % (dp, inputs.dtype))
    return ("\nat cp 1 nothing is sharded or exchanged: the difference is the step's own (its arithmetic in %s "
            "against cpsim's reference, or what it computes), not CP's; %s" %
            (inputs.dtype, "the tolerance given is %g" % inputs.tolerance if inputs.tolerance is not None else
             "the tolerance is the manifest's for %s" % inputs.dtype) +
            " (check(..., tolerance=...) sets the relative RMSE every floating output is compared within)")


def _generator(workdir, cases, layouts, inputs, sizes, seed, in_job, rows_multiple=1):
    """The command line of `cpsim harness` that draws (or replays) the cases."""
    command = [program.binary(), "harness", "--workdir", workdir, "--cases", str(int(cases)), "--plan", layouts.plan,
               "--conv-width", str(int(inputs.conv_width)), "--dtype", inputs.dtype,
               "--pad-multiple", str(int(layouts.pad_multiple)), "--min-shard", str(int(layouts.min_shard)),
               "--probes", str(int(layouts.probes)), "--long-every", str(int(layouts.long_every)),
               "--long-lengths", ",".join(str(int(n)) for n in layouts.long_lengths),
               "--live-gates-every", str(int(inputs.live_gates_every))]
    if layouts.long_per_rank:
        command += ["--long-per-rank"]
    if layouts.batch is not None:
        command += ["--batch", os.fspath(layouts.batch), "--cp", str(int(layouts.cp))]
    else:
        command += ["--cps", ",".join(str(c) for c in sizes)]
        if in_job:
            command += ["--cp", str(sizes[0])]
    if layouts.family:
        command += ["--family", layouts.family]
    if layouts.forms:
        command += ["--forms", ",".join(layouts.forms)]
    if seed is not None:
        command += ["--seed", str(int(seed))]
    if inputs.shard_primary:
        command += ["--shard-primary"]
    if rows_multiple > 1:  # one global batch, each replica's microbatch its own rows of it (case.rows)
        command += ["--rows-multiple", str(int(rows_multiple))]
    return command


def check(step, cases=100, layouts=None, inputs=None, ranks=None, out=None, **options):
    """Property-tests `step(case) -> dict` (see the module's text) on `cases`
    layouts drawn by cpsim (or one replayed), each on a simulated group.

    The options come in three groups (cpsim.options; docs/harness.md has each
    option, its default and what it does): `layouts=Layouts(...)` (which
    layouts: cps, max_cp, family, forms, plan, seed, min_shard, pad_multiple;
    batch and cp for a replay), `inputs=Inputs(...)` (dtype, conv_width,
    shard_primary) and `ranks=Ranks(...)` (backend, timeout, dp); any option
    may be given as a keyword instead (check(step, 200, plan="random", dp=2)).

    Returns the number of cases run (a Checked: an int with `outside`, the
    number of drawn cases the step set aside as outside its contract, and
    `outside_why`). Raises CheckFailed with the smallest failing layout, saved
    as a BATCH file to `out` (default: a file in the temporary folder), and
    each output's first difference on every rank (values before gradients).

    In a process of a job (after cpsim.torch.init_process_group(), under
    `cpsim launch -n N`), every case runs at CP size N / dp, this process being
    its rank, on a fresh group of the processes (`backend` and `timeout` are the
    job's); every process must call check() with the same arguments.

    The layouts come from `cpsim harness` (the cpsim executable: CPSIM_BINARY,
    else the build's, else cpsim on the PATH), which draws and shrinks them
    with RapidCheck and writes each case's expected values."""
    layouts, inputs, ranks = grouped(layouts, inputs, ranks, **options)
    dp = int(ranks.dp)
    sizes, seed = layouts.sizes(), layouts.seed
    in_job = ct._job is not None
    if in_job:
        seed, sizes = _job_draw(seed, dp, layouts)
    workdir = tempfile.mkdtemp(prefix="cpsim-check-")
    command = _generator(workdir, cases, layouts, inputs, sizes, seed, in_job, dp * int(ranks.microbatches))
    try:
        generator = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     universal_newlines=True, bufsize=1)
        last_failure = None  # the last failing verdict is the smallest failure's, whole
        number = 0
        try:
            for line in generator.stdout:
                line = line.rstrip("\n")
                if line == "done":
                    break
                probe = line.startswith("probe ")
                if not (line.startswith("case ") or probe):
                    raise RuntimeError("cpsim harness said %r" % line)
                number += 1
                folder = line.split(" ", 1)[1]
                why = (_verdict.job_verdict(folder, step, number, dp, inputs.tolerance, ranks.mesh,
                                            ranks.microbatches) if in_job
                       else _verdict.verdict(folder, step, ranks.backend, ranks.timeout, dp, inputs.tolerance,
                                             ranks.mesh, inputs.leaks, ranks.microbatches))
                answer, failure = _answer(why, probe)
                last_failure = failure if failure is not None else last_failure
                generator.stdin.write(answer + "\n")
                generator.stdin.flush()
        except BaseException:
            generator.kill()
            generator.wait()
            raise
        generator.stdin.close()
        errors = generator.stderr.read()
        code = generator.wait()
        if code not in (0, 1):
            raise RuntimeError("cpsim harness exited %d: %s" % (code, errors.strip()))
        with open(os.path.join(workdir, "result.json")) as f:
            result = json.load(f)
        if result["ok"]:
            return Checked(result["ran"], result.get("outside", 0), result.get("outside_why"), result.get("probes", ()))
        raise _failed(result, last_failure, layouts, inputs, ranks, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _job_draw(seed, dp, layouts):
    """In a process of a job (init_process_group): every case at the job's size,
    each process its rank; every process draws the same cases (rank 0's seed).
    Returns (seed, [CP size])."""
    import torch.distributed as dist
    chosen = torch.tensor([int.from_bytes(os.urandom(6), "little") if seed is None else int(seed)])
    dist.broadcast(chosen, src=0, group=dist.group.WORLD)
    if ct._job.size() % dp:
        raise ValueError("check(dp=%d) in a job of %d processes: dp must divide the job's size" % (dp, ct._job.size()))
    size = ct._job.size() // dp
    _verdict.job_checks[0] += 1
    if layouts.batch is not None and int(layouts.cp) != size:
        raise ValueError("check(batch=..., cp=%d) in a job of %d processes at dp=%d: the CP size is %d"
                         % (int(layouts.cp), ct._job.size(), dp, size))
    return int(chosen), [size]


def _answer(why, probe):
    """A verdict as the line the harness reads (ok, outside, refused, partial,
    fail), and the failure to keep (None: keep the last one): a probe's as
    (its joined text, the verdict), after what cpsim says of the contract."""
    if probe and isinstance(why, _verdict.Raised) and 0 < len(why.ranks) < why.world:
        # Outside its contract, refused by some ranks only: the others wait for them.
        return ("partial ranks %s of %d raised, the others waited in a collective (on NCCL, a hang): %s" % (
            ", ".join(map(str, why.ranks)), why.world, " | ".join(why.splitlines())), None)
    if probe and isinstance(why, (_verdict.Outside, _verdict.Raised)):
        return "refused " + " | ".join(why.splitlines()), None  # outside its contract: loudly, as it must
    if isinstance(why, _verdict.Outside):
        return "outside " + " | ".join(why.splitlines()), None
    if why:
        joined = " | ".join(why.splitlines())  # its first line leads, the rest joined
        return "fail " + joined, ((joined, why) if probe else why)
    return "ok", None


def _failed(result, last_failure, layouts, inputs, ranks, out):
    """The CheckFailed of a failing check: the smallest (or replayed, or probed)
    layout saved to `out`, its verdict whole, the lines that replay it."""
    dp, replay = int(ranks.dp), layouts.batch is not None
    if isinstance(last_failure, tuple):  # outside its contract: the verdict after what cpsim says of it
        joined, whole = last_failure
        if result["failure"].endswith(joined):
            result["failure"] = result["failure"][:len(result["failure"]) - len(joined)] + whole
    elif last_failure is not None:
        result["failure"] = last_failure
    first = result["failure"].split("\n", 1)[0]
    if result.get("cp") == 1 and "relative RMSE" in first and "the step's loss is " not in result["failure"]:
        result["failure"] += _precision_note(inputs, dp)
    if "batch" not in result:
        return CheckFailed("cpsim.torch.check: %s" % result["report"], result["failure"], None, None, None,
                           layouts.plan)
    path = out or os.path.join(tempfile.gettempdir(), "cpsim-counterexample-%d.json" % os.getpid())
    with open(path, "w") as f:
        f.write(result["batch"])
    references = "cpsim check %s --cp %d" % (path, result["cp"])
    plan_arg = "equal"
    if result["cuts"] is not None:
        plan_arg = path + ".plan.json"
        with open(plan_arg, "w") as f:
            json.dump({"cuts": result["cuts"]}, f)
        references += " --plan " + plan_arg
    elif result["plan"] != "equal":
        plan_arg = result["plan"].split(":")[0]
        references += " --plan " + plan_arg
    replicas = "" if dp == 1 else ", dp=%d, mesh=%r" % (dp, ranks.mesh)  # a DP failure replays with its replicas
    if int(ranks.microbatches) > 1:
        replicas += ", microbatches=%d" % int(ranks.microbatches)
    again = "cpsim.torch.check(step, batch=%r, cp=%d, plan=%r, seed=%d%s)" % (path, result["cp"], plan_arg,
                                                                             result["seed"], replicas)
    message = ("cpsim.torch.check: %s\n%s failing layout (cp=%d, plan %s), saved to %s:\n%s"
               "\nreplay the step with: %s\nreplay the references with: %s"
               % (result["failure"], "the replayed" if replay else "the probed" if isinstance(last_failure, tuple)
                  else "smallest", result["cp"], result["plan"],
                  path, json.dumps(json.loads(result["batch"])), again, references))
    return CheckFailed(message, result["failure"], result["batch"], path, result["cp"], plan_arg, result["seed"])
