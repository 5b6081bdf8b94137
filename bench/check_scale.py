#!/usr/bin/python3
"""cpsim check on one long packed row, against a same-run memcpy.

    bench/check_scale.py [--cpsim build/cpsim] [--tokens 1048576] [--cp 8] [--max-doc 512] [--repeat 1]
    bench/check_scale.py --doc-lengths 1,256000,523776,1,128000     # long documents, the rest padding

Writes a lengths-only batch of one row of TOKENS tokens (documents of 1..MAX_DOC (default 512)
tokens, seeded), runs `cpsim check BATCH --cp CP` on it and reports its CPU time
(user + system, every thread) and peak RSS, each as a ratio against a same-run
anchor: the CPU time of copying 6.4 GB with one thread (numpy's copyto of a 64 MiB
buffer, 100 times), and bytes per token. The issue's reach: within 12x the anchor's
CPU, under 1.2 GB at 1M tokens and CP 8.
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time


def cpu_of(usage):
    return usage.ru_utime + usage.ru_stime


def memcpy_anchor_seconds():
    import numpy as np

    a = np.ones(64 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)  # pages of both touched before timing
    before = cpu_of(resource.getrusage(resource.RUSAGE_SELF))
    for _ in range(100):
        np.copyto(b, a)
    return cpu_of(resource.getrusage(resource.RUSAGE_SELF)) - before


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpsim", default=os.path.join(here, "..", "build", "cpsim"))
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--cp", default="8")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--max-doc", dest="max_doc", type=int, default=512)
    p.add_argument("--doc-lengths", dest="doc_lengths", default=None,
                   help="the row's documents, comma-separated (instead of random ones up to --max-doc); "
                        "the rest of the row is padding")
    p.add_argument("extra", nargs="*", help="more cpsim check options (after --)")
    a = p.parse_args()

    rng = random.Random(1)
    lens, left = [], a.tokens
    if a.doc_lengths:
        lens = [int(n) for n in a.doc_lengths.split(",")]
        if sum(lens) > a.tokens:
            p.error("--doc-lengths sum to %d, more than --tokens %d" % (sum(lens), a.tokens))
        left = 0
    while left > 0:
        n = min(left, rng.randint(1, a.max_doc))
        lens.append(n)
        left -= n
    with tempfile.TemporaryDirectory() as d:
        batch = os.path.join(d, "long_row.json")
        with open(batch, "w") as f:
            json.dump({"seq_len": a.tokens, "seq_lens": [lens]}, f)
        anchor = memcpy_anchor_seconds()
        for _ in range(a.repeat):
            before = cpu_of(resource.getrusage(resource.RUSAGE_CHILDREN))
            t0 = time.monotonic()
            r = subprocess.run([a.cpsim, "check", batch, "--cp", a.cp] + a.extra, capture_output=True, text=True)
            wall = time.monotonic() - t0
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = cpu_of(usage) - before
            rss = usage.ru_maxrss * 1024  # the largest child so far (KiB on Linux)
            ok = r.returncode == 0 and "all properties hold" in r.stdout
            print(f"check {a.tokens} tokens at cp {a.cp}: {'ok' if ok else 'FAILED (exit %d)' % r.returncode}; "
                  f"cpu {cpu:.2f} s ({cpu / anchor:.1f}x the same-run 6.4 GB memcpy of {anchor:.2f} s), "
                  f"wall {wall:.2f} s, peak RSS {rss / 1e9:.2f} GB ({rss / a.tokens:.0f} bytes/token)")
            if not ok:
                sys.stdout.write(r.stdout[-2000:] + r.stderr[-2000:])
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
