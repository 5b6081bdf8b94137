"""docs/errors.md names every report the Python side raises: each raise of
python/cpsim/ and each throw of python/torch_backend/ whose message is written
there (a literal, or literals around what is filled in) must appear in the page
as its shape, the filled-in parts as any short text (`dp: at least 1, not N`
for "dp: at least 1, not %r"). A report that passes on another's text (raise
CollectiveError(str(error))) is that other report's."""
import ast
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGE = os.path.join(ROOT, "docs", "errors.md")
PLACEHOLDER = r"%[-+ #0]*[\d.]*[sdrgfx]|\{[^}]*\}"


def _literal_parts(e):
    """The string literals of a message expression, in order (None marks what is filled in)."""
    if isinstance(e, ast.Constant) and isinstance(e.value, str):
        return [e.value]
    if isinstance(e, ast.BinOp):
        left = _literal_parts(e.left)
        # "..." % (...): what the right side fills in is marked by the placeholders.
        right = [] if isinstance(e.op, ast.Mod) else _literal_parts(e.right)
        return left + ([None] if not right and not isinstance(e.op, ast.Mod) else right)
    if isinstance(e, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in e.values]
    return [None]


def python_sites():
    folder = os.path.join(ROOT, "python", "cpsim")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                parts = _literal_parts(node.exc.args[0])
                if any(p for p in parts if p):
                    yield "python/cpsim/%s:%d" % (name, node.lineno), parts


def cpp_sites():
    folder = os.path.join(ROOT, "python", "torch_backend")
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".cpp", ".hpp")):
            continue
        text = open(os.path.join(folder, name)).read()
        for m in re.finditer(r"throw\s+\w+\((.*?)\);", text, re.S):
            pieces = re.split(r'("(?:[^"\\]|\\.)*")', m.group(1))
            parts = []
            for piece in pieces:
                if piece.startswith('"'):
                    parts.append(bytes(piece[1:-1], "utf-8").decode("unicode_escape"))
                elif piece.strip(" +\n") and (not parts or parts[-1] is not None):
                    parts.append(None)
            if any(p for p in parts if p):
                yield "python/torch_backend/%s:%d" % (name, text[:m.start()].count("\n") + 1), parts


def shape(parts):
    """The regular expression of a message's shape: its literal text, what is
    filled in as any short text, white space as any."""
    out = []
    for part in parts:
        if part is None:
            out.append(None)
            continue
        for i, piece in enumerate(re.split(PLACEHOLDER, part)):
            if i:
                out.append(None)
            out.append(piece)
    regex, gap = "", False
    for piece in out:
        if piece is None:
            gap = True
            continue
        words = piece.split()
        if not words:
            gap = gap or bool(piece)
            continue
        text = r"\s+".join(re.escape(w) for w in words)
        lead = r"\s*" if piece[:1].isspace() else ""
        regex += (r".{0,80}?" if gap and regex else "") + lead + text + (r"\s*" if piece[-1:].isspace() else "")
        gap = False
    return regex


def page_text():
    return re.sub(r"\s+", " ", open(PAGE).read().replace("`", ""))


def missing(sites, text):
    return ["%s: %s" % (where, "".join(p if p is not None else "..." for p in parts))
            for where, parts in sites if not re.search(shape(parts), text)]


def test_every_python_side_report_is_in_docs_errors():
    text = page_text()
    sites = list(python_sites()) + list(cpp_sites())
    assert len(sites) > 40, sites  # the walk found the raise sites
    gone = missing(sites, text)
    assert not gone, "docs/errors.md does not name:\n  " + "\n  ".join(gone)


def test_a_report_the_page_does_not_name_is_found():
    # The control: a message of a made-up site, and one whose words are all in
    # the page but not in its shape, are both missing.
    text = page_text()
    made_up = [("made_up.py:1", ["cpsim: a report no page names, not ", None])]
    reordered = [("made_up.py:2", ["dp must divide the job's size", None, "check(dp="])]
    assert len(missing(made_up + reordered, text)) == 2


def test_a_spawn_s_report_is_printed_once_when_uncaught():
    # Python prints a chained exception's traceback and message before the
    # report's own: a spawn raises its report from None, its rank's exception
    # kept as RankFailed.error.
    import subprocess
    import sys
    script = ("import sys, torch, torch.distributed as dist, cpsim.torch as ct\n"
              "def ring(rank, world):\n"
              "    dist.send(torch.ones(3), dst=(rank + 1) % world)\n"
              "def own(rank, world):\n"
              "    if rank == 1:\n"
              "        raise ValueError('the step of rank 1 broke')\n"
              "    dist.barrier()\n"
              "try:\n"
              "    ct.spawn(own, 2, timeout=10)\n"
              "except ct.RankFailed as e:\n"
              "    assert isinstance(e.error, ValueError), e.error\n"
              "    assert e.__cause__ is None and e.__suppress_context__\n"
              "ct.spawn(ring if sys.argv[1] == 'ring' else own, 3, timeout=10)\n")
    for mode, words in (("ring", "deadlock: every rank still running waits"), ("own", "the step of rank 1 broke")):
        p = subprocess.run([sys.executable, "-c", script, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
        assert p.returncode != 0, p.stdout
        assert p.stdout.count(words) == 1, p.stdout
        assert "direct cause" not in p.stdout and p.stdout.count("Traceback") == 1, p.stdout
