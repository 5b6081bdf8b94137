"""cpsim.torch.check's options, in three groups: which layouts are drawn
(Layouts), what the step's inputs are (Inputs) and how its ranks run (Ranks).

check(step, cases, layouts=Layouts(...), inputs=Inputs(...), ranks=Ranks(...))
or, the same, check(step, cases, plan="random", dtype="f32", dp=2, ...): each
keyword is a field of one group. Every field's text is here once: the groups'
help and docs/harness.md are written from it (`python3 -m cpsim.docs`).
No torch here.
"""
import dataclasses
from dataclasses import dataclass, field

from cpsim.mesh import MESHES

PLANS = ("equal", "balanced", "random")
DTYPES = ("f64", "f32", "bf16")
FORMS = ("seq_lens_padded", "seq_lens", "cu_seqlens", "cu_seqlens_only", "cu_seqlens_padded_only", "unpacked",
         "position_ids")


def _option(default, doc):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Layouts:
    """Which layouts are drawn, or the one replayed."""
    cps: tuple = _option(None, "the CP sizes drawn, each as often as any other (default 1..max_cp)")
    max_cp: int = _option(8, "the largest CP size drawn when cps is not given")
    family: str = _option(None, "a family file: its members are drawn (a packer's layouts)")
    forms: tuple = _option(None, "the batch forms a random layout is drawn in (a library's: " + ", ".join(FORMS)
                           + ")")
    plan: str = _option("equal", "how the ranks cut the padded rows: equal (what an equal-interval implementation "
                        "expects), balanced, or random (drawn cuts, empty intervals included: the step follows "
                        "case.cuts); a replay takes equal, balanced or a plan file")
    seed: int = _option(None, "the seed of the drawing (and of a replay's inputs)")
    min_shard: int = _option(1, "only layouts whose equal shards hold at least this many positions (a library's "
                             "contract, as FLA's CP convolution's W - 1)")
    pad_multiple: int = _option(1, "every sequence padded to a multiple of cp * M (case.P), as a library that pads "
                                "to 2 * cp does (equal or balanced plan)")
    long_every: int = _option(10, "1 in N random layouts is long, its length drawn from long_lengths (0: none): "
                              "long documents, shards that span several kernel chunks")
    long_lengths: tuple = _option((64, 512), "the long layouts' lengths in tokens, (at least, at most)")
    long_per_rank: bool = _option(False, "long_lengths are each rank's shard (a long layout cp times as long): shards "
                                  "that span a kernel's chunks (64 tokens in FLA's) at every CP size, a state carried "
                                  "from chunk to chunk inside a rank")
    probes: int = _option(2, "once every drawn layout held, this many layouts just outside each contract "
                          "(min_shard, forms) go to the step: it must refuse each (OutsideContract or an exception) "
                          "or handle it right; a wrong result fails the check (Checked.probes says what it did)")
    batch: str = _option(None, "a BATCH file to replay instead of drawing (a CheckFailed's path), at CP size cp")
    cp: int = _option(None, "the CP size of the replayed batch")

    def __post_init__(self):
        if self.batch is not None:
            if self.cp is None:
                raise ValueError("check(step, batch=FILE, cp=N): the CP size to replay the batch at")
            if self.plan == "random":
                raise ValueError("plan: a replay takes equal, balanced or a plan file, not random")
        elif self.plan not in PLANS:
            raise ValueError("plan: equal, balanced or random, not %r" % (self.plan,))
        elif self.cp is not None:
            raise ValueError("cp= goes with batch=FILE (a replay); cps=[...] chooses the CP sizes drawn")
        if not self.sizes() or self.sizes()[0] < 1:
            raise ValueError("cps: CP sizes of at least 1, not %r" % (self.cps,))

    def sizes(self):
        """The CP sizes drawn, ascending."""
        return sorted(set(int(c) for c in (self.cps if self.cps is not None else range(1, int(self.max_cp) + 1))))


@dataclass(frozen=True)
class Inputs:
    """What the step's inputs are."""
    dtype: str = _option("f64", "the dtype of every floating input and expected value (f64, f32 or bf16), "
                         "compared within the manifest's tolerance of that dtype")
    conv_width: int = _option(4, "the convolution's width W (case.conv_width)")
    live_gates_every: int = _option(4, "1 in N cases (0: none) draws case.recurrence's gates live: each head's "
                                    "log-decay scaled by its own factor, 1, 0.01, 0.1 or 0 (heads differ, a state "
                                    "outlives a chunk); else every head's in [-1, 0]. case.live_gates says which "
                                    "(a layer that makes its own gates can follow it)")
    shard_primary: bool = _option(False, "input_ids is sharded like the other keys (else kept global)")
    tolerance: float = _option(None, "the relative RMSE every floating output is compared within, instead of "
                               "the manifest's for the dtype (outputs compared bit for bit stay so)")
    leaks: bool = _option(True, "the leak property: a case whose step returns layer, user_loss or train is run "
                          "again with one document's inputs drawn again, then the padding's; every other "
                          "document's per-position results (with the padding, every result) must stay as they "
                          "were (no reference needed: a bug in the step and its unsharded run alike shows)")

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError("dtype: f64, f32 or bf16, not %r" % (self.dtype,))
        if int(self.live_gates_every) < 0:
            raise ValueError("live_gates_every: 0 (none) or more, not %r" % (self.live_gates_every,))
        if self.tolerance is not None and not float(self.tolerance) >= 0:
            raise ValueError("tolerance: a relative RMSE of at least 0, not %r" % (self.tolerance,))


@dataclass(frozen=True)
class Ranks:
    """How the step's ranks run."""
    backend: str = _option("threads", "the simulated group's backend: threads or gloo (a job's own in a job)")
    timeout: float = _option(20.0, "seconds a rank may wait for its peers, or run on after one ended")
    dp: int = _option(1, "data-parallel replicas: dp * cp ranks, laid out as `mesh` says (case.dp_rank, "
                      "case.world_rank); each replica trains on its own rows of the case (case.rows)")
    microbatches: int = _option(1, "each replica's rows in this many microbatches (case.microbatches: gradient "
                                "accumulation); the unsharded run holds every row in one")

    mesh: str = _option("dp,cp", "how the dp * cp ranks are laid out: \"dp,cp\" as init_device_mesh(\"cpu\", "
                        "(dp, cp)) (a CP group is consecutive ranks) or \"cp,dp\" (interleaved: every dp-th rank); "
                        "case.device_mesh() builds it")

    def __post_init__(self):
        if int(self.dp) < 1:
            raise ValueError("dp: at least 1, not %r" % (self.dp,))
        if int(self.microbatches) < 1:
            raise ValueError("microbatches: at least 1, not %r" % (self.microbatches,))
        if self.mesh not in MESHES:
            raise ValueError("mesh: %s, not %r" % (" or ".join(MESHES), self.mesh))


GROUPS = (Layouts, Inputs, Ranks)


def grouped(layouts=None, inputs=None, ranks=None, **keywords):
    """(Layouts, Inputs, Ranks) from the groups given and the keywords, each a
    field of one group (not of a group also given whole)."""
    given = {Layouts: layouts, Inputs: inputs, Ranks: ranks}
    fields = {f.name: g for g in GROUPS for f in dataclasses.fields(g)}
    unknown = sorted(set(keywords) - set(fields))
    if unknown:
        raise TypeError("check() has no option %s (options: %s)" % (", ".join(unknown), ", ".join(fields)))
    out = []
    for g in GROUPS:
        mine = {k: v for k, v in keywords.items() if fields[k] is g}
        if given[g] is not None and mine:
            raise TypeError("check(): %s given both in %s= and as keywords" % (", ".join(sorted(mine)),
                                                                                g.__name__.lower()))
        out.append(given[g] if given[g] is not None else g(**mine))
    return tuple(out)


def markdown():
    """The options as docs/harness.md shows them: a table per group."""
    rows = []
    for g in GROUPS:
        rows += ["", "**%s** (`%s=`): %s" % (g.__name__, g.__name__.lower(), g.__doc__.strip()), "",
                 "| option | default | what |", "| --- | --- | --- |"]
        rows += ["| `%s` | `%r` | %s |" % (f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(g)]
    return "\n".join(rows[1:]) + "\n"
