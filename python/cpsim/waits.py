"""Requests on cpsim's ranks: every request is waited on before its rank ends,
and its outputs are not used before that (on NCCL a read before wait() sees
whatever is there). cpsim.torch checks both on every rank; the ledger of open
requests is the backend's (python/torch_backend/work.hpp)."""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from cpsim import _C


class UsedBeforeWait(RuntimeError):
    """A rank used the output of a request before waiting on it."""


# What reads nothing of a tensor's values: its shape, type and place.
_METADATA = frozenset((
    "size", "dim", "numel", "nelement", "shape", "dtype", "device", "ndim", "is_contiguous", "stride",
    "storage_offset", "data_ptr", "untyped_storage", "element_size", "requires_grad", "is_floating_point",
    "layout", "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "grad_fn", "_version", "__len__",
    "names", "is_leaf", "output_nr", "_base", "itemsize", "nbytes", "__repr__", "__format__"))


def _op_name(func):
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: its own name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


# Functional collectives (torch.distributed._functional_collectives, DTensor,
# FSDP2): their output is wrapped in an AsyncCollectiveTensor, whose first read
# waits (wait_tensor) before the value is used. Wrapping it and waiting on it are
# not uses; an op on the wrapper waits first. An output never waited on and never
# read is still an open request at the rank's end (unwaited names it).
_WAITS = frozenset(("_wrap_tensor_autograd", "wait_tensor", "wait_tensors"))


def _async_collective_tensor():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return AsyncCollectiveTensor


def _storages(a, acts):
    """The storages an op on `a` reads: a plain tensor's own; a tensor subclass's
    inner tensors' (a DTensor's local tensor); none for an AsyncCollectiveTensor
    (reading it waits first)."""
    if isinstance(a, acts):
        return
    if type(a) not in (torch.Tensor, torch.nn.Parameter) and hasattr(a, "__tensor_flatten__"):
        names, _ = a.__tensor_flatten__()
        for n in names:
            yield from _storages(getattr(a, n), acts)
        return
    if a.numel() > 0:
        yield a.untyped_storage().data_ptr()


class UseBeforeWait(TorchFunctionMode):
    """Inside a rank: any torch operation on a tensor that an open request (one
    not waited on) will write is the race real code has (on NCCL it reads what
    is there before the data comes): a named error."""

    def __init__(self, ledger, rank):
        super().__init__()
        self.ledger, self.rank = ledger, rank

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Under torch.compile dynamo traces this mode too, and cannot trace the
        # ledger (a C++ object): a compiled region's ops go unchecked (its
        # inputs were checked where they were made, eagerly).
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if self.ledger.size():
            name = _op_name(func).split(".")[0]
            if name not in _METADATA and name not in _WAITS:
                self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs):
        pending = [(out.untyped_storage().data_ptr(), what) for out, what in self.ledger.outstanding()
                   if out.numel() > 0]
        if not pending:
            return
        acts = _async_collective_tensor()
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                for where in _storages(a, acts):
                    for ptr, what in pending:
                        if ptr == where:
                            raise UsedBeforeWait("rank %d used the output of its %s (in %s) before wait() on its "
                                                 "request" % (self.rank, what, _op_name(func) or func))


def unwaited(ledger, rank):
    """Raises CollectiveError naming every request of `rank` never waited on."""
    text = ledger.unwaited(rank)
    if text:
        raise _C.CollectiveError("a request never waited on:\n  " + text)
