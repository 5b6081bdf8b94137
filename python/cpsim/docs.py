"""docs/harness.md's tables, written from the code's: the outputs
(cpsim.outputs) and the options (cpsim.options).

    PYTHONPATH=python python3 -m cpsim.docs docs/harness.md

Each table sits between two markers of the page. No torch here.
"""
import sys

from cpsim import options, outputs

SECTIONS = (("outputs", outputs.markdown), ("options", options.markdown))


def markers(name):
    return "<!-- %s: written by python3 -m cpsim.docs -->\n" % name, "<!-- end of %s -->\n" % name


def rendered(text):
    """The page with every table the code's."""
    for name, table in SECTIONS:
        begin, end = markers(name)
        if begin not in text or end not in text:
            raise ValueError("the page has no %r markers for its %s table" % (begin.strip(), name))
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + begin + "\n" + table() + "\n" + end + tail
    return text


def rewrite(path):
    """Writes the code's tables into the page; True when it changed."""
    with open(path) as f:
        old = f.read()
    new = rendered(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
    return new != old


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print("%s: %s" % (path, "rewritten" if rewrite(path) else "already the code's tables"))
