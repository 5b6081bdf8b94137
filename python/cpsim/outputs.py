"""What cpsim.torch.check compares: the one table of a step's outputs.

The harness's text (help(cpsim.harness)) and the docs page docs/harness.md are
both written from OUTPUT_TABLE (`python3 -m cpsim.docs docs/harness.md`
rewrites the page's tables; a test fails while they differ). No torch here.
"""
import collections
import textwrap

Output = collections.namedtuple("Output", "name form text")

OUTPUT_TABLE = (
    Output("batch", "dict",
           "the local batch after sharding (every key cpsim's shard_batch gives: the batch's keys padded to P and "
           "cut, input_ids global unless shard_primary, padding_mask and position_ids)"),
    Output("padding", "[B, S] bool",
           "the raw batch's padding (true where padding), decided from the lengths (or the mask of an unpacked "
           "row)"),
    Output("position_ids", "[B, S]",
           "the position of every token in its document (given, or derived: tail padding continues the last "
           "position; mRoPE's as given, [3, B, S])"),
    Output("doc_ids", "[B, P]", "global document ids (i + 1 on document i's span, 0 on padding beyond the "
           "documents)"),
    Output("local_doc_ids", "[B, L]", "this rank's slice of them"),
    Output("cu_seqlens", "a 1-D tensor per row",
           "the boundaries of the runs of equal local doc ids, [0, ..., L]"),
    Output("cp_context", "an entry per row",
           "this rank's flash-linear-attention CP context of the row (FLA's FLACPContext, or a dict), its "
           "pre_num_conv_tokens, pre_num_ranks, post_num_ranks, is_first_rank and is_last_rank compared"),
    Output("gathered", "[B, P, C]",
           "gather_sequence(case.x); its gradient to case.x is checked for the upstream gradient of this rank"),
    Output("halo", "[B, L + W - 1, C]",
           "convolution_history(case.x, W); its gradient to case.x is checked for the conv's gradient of the "
           "window"),
    Output("conv", "[B, L, C]",
           "the packed causal depthwise convolution of case.x (weights case.conv_weight [C, W], w[:, W-1] on the "
           "token itself; bias case.conv_bias; a tap before the token's segment dropped; no activation); "
           "gradients to case.x (halo returns included), case.conv_weight and case.conv_bias (this rank's part, "
           "before any sum over ranks) checked"),
    Output("attention_o", "[B, L, H, D]",
           "document-masked causal attention of case.q over the gathered case.k, case.v after RoPE by position "
           "(scale case.softmax_scale, base case.rope_base; 0 for a query that sees no key); gradients to "
           "case.q, case.k, case.v checked"),
    Output("recurrence_o", "[B, L, H, V]",
           "the gated delta rule / KDA recurrence of case.recurrence's q, k, v, beta, g (this rank's slices; "
           "S_t = (I - beta k k^T) Diag(exp g) S_(t-1) + beta k v^T, o_t = S_t^T q_t, no q scaling, S = 0 at "
           "every segment start, state carried over the ranks before this one); gradients to the five checked"),
    Output("layer", "a cpsim.torch.Layer",
           "the step's own module on this rank (its output [B, L, ...] from inputs drawn with case.activation, "
           "and its parameters), compared with the same step run unsharded on a group of one (case.cp == 1; the "
           "upstream gradient is drawn, 0 on the CP padding): each rank's output and input gradients against the "
           "unsharded run's at its positions (and its replica's rows, case.rows), every parameter's gradient "
           "summed over every rank against the unsharded one, within the Layer's tolerance"),
    Output("user_loss", "a cpsim.torch.Loss",
           "the step's own loss on this rank: its value, the logits it came from (case.activation), and "
           "optionally its labels and loss mask [B, L], compared with the same step run unsharded on a group of "
           "one, whatever its convention (token mean, per-document mean, sum): labels and mask exactly at the "
           "rank's positions (CP padding left out), the value on every rank (value_is='global') or summed over "
           "the ranks ('share'), and each rank's gradient to its logits as the unsharded one at its positions "
           "(gradient='sum'; 'mean': dp x cp times it), within the Loss's tolerance; a value or gradient off by a "
           "known factor is named; with replicas, each on its own rows (case.rows), the unsharded run on all. "
           "On a failure, where one side is cpsim's own token-mean cross entropy of the unsharded run's logits and "
           "labels, the report says which side is off (a bug in the step's path without CP is the unsharded "
           "run's)"),
    Output("train", "a cpsim.torch.TrainStep",
           "the step's whole training step on this rank (forward, loss, backward, the gradients' reduction, "
           "clipping, the optimizer step, buffer updates; each replica on its own rows, case.rows), compared with "
           "the same step run unsharded on a group of one holding every replica's rows, from the same weights "
           "(case.generator): the loss it reports, every parameter's gradient as its reduction left it, every "
           "parameter, buffer and optimizer state after the step, its other tensors, within the TrainStep's "
           "tolerance, every differing one listed (values, gradients, then the update, each worst first; a "
           "factor of dp, cp or dp x cp named, and the group a gradient reduction left out, CP or DP); then every "
           "rank's parameters, buffers and optimizer state bit for bit against world rank 0's (replicas "
           "identical after a step)"),
    Output("targets", "[B, L]",
           "this rank's next-token targets, aligned on whole rows before sharding from case.tokens: tokens[t + 1] "
           "when t and t + 1 are real tokens of one document, else -100"),
    Output("loss", "a scalar",
           "the token-mean cross entropy of case.logits [B, L, V] against the targets over every rank: the sum "
           "of per-token losses and the count of targets all-reduced, sum / count (0 when no target); the same "
           "value on every rank. Its gradient to case.logits (upstream 1) is checked: d(local sum) / count"),
)

OUTPUTS = tuple(o.name for o in OUTPUT_TABLE)
# The recurrence's inputs (case.recurrence) and the fields of a CP context compared.
RECURRENCE_INPUTS = ("q", "k", "v", "beta", "g")
CP_CONTEXT_FIELDS = ("pre_num_conv_tokens", "pre_num_ranks", "post_num_ranks", "is_first_rank", "is_last_rank")


def text():
    """The table as the harness's help shows it: a name, its form, what it is."""
    lines = []
    for o in OUTPUT_TABLE:
        body = textwrap.wrap("%s: %s" % (o.form, o.text), 60)
        lines.append("  %-15s  %s" % ('"%s"' % o.name, body[0]))
        lines += ["  %-15s  %s" % ("", b) for b in body[1:]]
    return "\n".join(lines)


def markdown():
    """The table as docs/harness.md shows it."""
    rows = ["| output | form | what cpsim compares |", "| --- | --- | --- |"]
    rows += ["| `%s` | %s | %s |" % (o.name, o.form, o.text.replace("|", "\\|")) for o in OUTPUT_TABLE]
    return "\n".join(rows) + "\n"
