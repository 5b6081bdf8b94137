"""The ranks of check(dp=D): which global rank is which replica's CP rank."""

# How the dp * cp ranks of check(dp=D) are laid out: "dp,cp" as
# init_device_mesh("cpu", (dp, cp)) (each CP group consecutive global ranks),
# "cp,dp" as init_device_mesh("cpu", (cp, dp)) (each CP group every dp-th rank:
# interleaved). Either way no CP group but the first is global ranks 0..cp-1.
MESHES = ("dp,cp", "cp,dp")


def world_rank(cp_rank, dp_rank, cp, dp, mesh="dp,cp"):
    """The global rank of CP rank `cp_rank` of replica `dp_rank`."""
    return dp_rank * cp + cp_rank if mesh == "dp,cp" else cp_rank * dp + dp_rank


def placed(rank, cp, dp, mesh="dp,cp"):
    """(cp_rank, dp_rank) of global rank `rank`."""
    return (rank % cp, rank // cp) if mesh == "dp,cp" else (rank // dp, rank % dp)


def who(cp_rank, dp_rank, cp, dp, mesh="dp,cp"):
    """How reports name a rank: "rank 2", or with replicas "rank 3 (dp 1, cp 1)"."""
    if dp == 1:
        return "rank %d" % cp_rank
    return "rank %d (dp %d, cp %d)" % (world_rank(cp_rank, dp_rank, cp, dp, mesh), dp_rank, cp_rank)


def ranks_with(runs, output, cp, dp, mesh, found):
    """(run, who, world rank) of each rank, replica by replica, whose run of
    `output` is in `runs` (keyed (dp_rank, cp_rank)); a rank without one is put
    in `found` as its first difference (0: a value), once."""
    for dp_rank in range(dp):
        for rank in range(cp):
            run = runs.get((dp_rank, rank))
            name, at = who(rank, dp_rank, cp, dp, mesh), world_rank(rank, dp_rank, cp, dp, mesh)
            if run is None:
                found.setdefault(at, (0, "%s returned no %s (the unsharded run did)" % (name, output)))
            else:
                yield run, name, at
