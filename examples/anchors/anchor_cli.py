"""The command line every adapter of examples/anchors/ shares."""
import argparse


def arguments(doc, variants, steps=None):
    """--variant (a planted bug or a finding's unguarded step), --cases, --max-cp,
    --family, --seed; and the step's name when an adapter has several."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if steps:
        parser.add_argument("step", choices=sorted(steps))
    parser.add_argument("--variant", choices=sorted(variants), help="a planted bug in the adapter's glue")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--max-cp", type=int, default=8)
    parser.add_argument("--family", help="draw this layout family's members")
    parser.add_argument("--seed", type=int)
    return parser.parse_args()


def run(check, what):
    """Runs check() (cpsim.torch.check of the step); prints what held (`what`, or
    what() once it ran), or the failure; returns the exit status."""
    import cpsim.torch
    try:
        ran = check()
    except cpsim.torch.CheckFailed as failure:
        print(failure)
        return 1
    what = what() if callable(what) else what
    aside = "; ".join("%s: %d" % why for why in ran.outside_why.items())
    print("%s: %d cases held (%d set aside%s)" % (what, ran, ran.outside, ": " + aside if aside else ""))
    return 0
