"""The layouts an upstream gradient comes in. Autograd hands a backward whatever
the output's consumers made: a fresh tensor, a transposed or sliced view of a
larger one, an expanded one (stride 0: a sum's or a mean's gradient), and the
same tensor it also hands another consumer. The harness draws one layout per case
and output (the values are the same in every layout), so a backward that is
right only for a fresh contiguous gradient (one that all-reduces
grad_output.contiguous() and returns grad_output) fails; a backward that writes
into what it was given is reported in every layout (another consumer holds it).
"""
import zlib

import torch

LAYOUTS = ("contiguous", "transposed", "strided", "expanded")


def layout_for(seed, name):
    """The layout of output `name`'s upstream gradient in the case of `seed`."""
    return LAYOUTS[zlib.crc32(("%d/%s" % (int(seed), name)).encode()) % len(LAYOUTS)]


def laid_out(upstream, layout):
    """(tensor, layout): `upstream`'s values in `layout`, or in the nearest one
    its shape and values allow (a transpose needs two dimensions of more than
    one element, a stride-0 expansion equal values)."""
    if layout == "expanded":
        flat = upstream.reshape(-1)
        if upstream.dim() >= 1 and flat.numel() >= 1 and bool((flat == flat[0]).all()):
            out = flat[:1].clone().reshape((1,) * upstream.dim()).expand(upstream.shape)
            return out, "expanded"
        layout = "transposed"
    if layout == "transposed":
        big = [d for d in range(upstream.dim()) if upstream.shape[d] > 1]
        if len(big) >= 2:
            a, b = big[0], big[-1]
            out = upstream.transpose(a, b).contiguous().transpose(a, b)
            return out, "transposed"
        layout = "strided"
    if layout == "strided" and upstream.dim() >= 1 and upstream.numel() > 0:
        wide = torch.zeros(tuple(upstream.shape[:-1]) + (2 * upstream.shape[-1],), dtype=upstream.dtype)
        out = wide[..., ::2]
        out.copy_(upstream)
        return out, "strided"
    return upstream.clone(), "contiguous"
