#!/usr/bin/env python3
"""bench/gpu/runtool.py: the data and comparison steps of bench/gpu/run.sh (Python 3 standard library only).

  runtool.py data DIR OUT          Fashion-MNIST from DIR ({train,t10k}-{images-idx3,labels-idx1}-ubyte, each
                                   gzip-compressed (.gz) or not) into OUT, checked (IDX magic, sizes, labels < 10)
                                   and written UNCOMPRESSED under the .gz names examples/mlp.h opens: zlib reads
                                   such files as they are, and so does run.sh's zlib stand-in (bench/gpu/shim).
  runtool.py synth OUT [--train N] [--test N] [--seed S]
                                   a synthetic set of Fashion-MNIST's shape (default 60000 + 10000 images of
                                   28 x 28, labels 0..9) into OUT as above: per class a fixed pattern of bright
                                   4x4 blocks, each image its class's pattern with half of those blocks dimmed
                                   and noise in the low 7 bits of every pixel, so that the MLP has something
                                   to learn. Deterministic for a seed.
  runtool.py compare TEST CPU1 CPU2 [CPU3 ...] [--factor F] [--floor X] [--names T,C1,C2,...] [--label L]
                                   the agreement figure: parameter files of examples/mlp.h's format
                                   (mlp_params_save) after the same steps, TEST (the CUDA trainer's) and two or
                                   more CPU runs that differ only in the BLAS kernel. Per tensor (each layer's W
                                   and b): the relative L2 difference ||x - y|| / ||y||; the SPREAD is the
                                   largest between two CPU runs. TEST agrees when, for the CPU run nearest to it,
                                   every tensor's difference is at most F (default 10) times max(spread, X)
                                   (default 1.19e-7, float's epsilon). Exit 0 agreed, 1 not, 2 a file missing,
                                   unreadable or of another model. (bench/gpu/run.sh's header says why.)
  runtool.py speed LOG1 LOG2 ...   samples/s of the trainer runs with N = 1, 2, ... pipelines (each log's
                                   "trained ... (S samples/s)" line) and whether the best N > 1 beats N = 1.
                                   Exit 0 it does, 1 it does not, 2 a log has no such line.
Every result line starts with "FIGURE <name>:" (what run.sh collects); details go before it."""

import argparse
import array
import gzip
import math
import os
import random
import re
import sys

NAMES = [("train-images-idx3-ubyte", 0x803), ("train-labels-idx1-ubyte", 0x801),
         ("t10k-images-idx3-ubyte", 0x803), ("t10k-labels-idx1-ubyte", 0x801)]


def fail(code, msg):
    print("runtool: " + msg, file=sys.stderr)
    sys.exit(code)


# ---- data ------------------------------------------------------------------------------------------------

def read_maybe_gz(d, name):
    for path in (os.path.join(d, name), os.path.join(d, name + ".gz")):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                raw = f.read()
            if raw[:2] == b"\x1f\x8b":
                try:
                    raw = gzip.decompress(raw)
                except (OSError, EOFError) as e:
                    fail(2, "%s: corrupt gzip data: %s" % (path, e))
            return path, raw
    fail(2, "%s: neither %s nor %s.gz" % (d, name, name))
    return None, None


def check_idx(path, raw, magic):
    if len(raw) < 8 or int.from_bytes(raw[:4], "big") != magic:
        fail(2, "%s: not an IDX file of magic 0x%08x" % (path, magic))
    nd = magic & 0xff
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(nd)]
    want = 4 + 4 * nd + math.prod(dims)
    if len(raw) != want:
        fail(2, "%s: %d bytes, its header announces %d" % (path, len(raw), want))
    if nd == 1 and max(raw[8:], default=0) > 9:
        fail(2, "%s: a label is not below 10" % path)
    return dims


def cmd_data(a):
    os.makedirs(a.out, exist_ok=True)
    dims = {}
    for name, magic in NAMES:
        path, raw = read_maybe_gz(a.dir, name)
        dims[name] = check_idx(path, raw, magic)
        with open(os.path.join(a.out, name + ".gz"), "wb") as f:
            f.write(raw)
    tr, te = dims["train-images-idx3-ubyte"], dims["t10k-images-idx3-ubyte"]
    if dims["train-labels-idx1-ubyte"][0] != tr[0] or dims["t10k-labels-idx1-ubyte"][0] != te[0]:
        fail(2, "%s: images and labels differ in count" % a.dir)
    print("data: Fashion-MNIST from %s: %d training and %d test images of %dx%d" % (a.dir, tr[0], te[0], tr[1], tr[2]))


def write_idx(path, magic, dims, payload):
    with open(path, "wb") as f:
        f.write(magic.to_bytes(4, "big"))
        for d in dims:
            f.write(d.to_bytes(4, "big"))
        f.write(payload)


def cmd_synth(a):
    rng = random.Random(a.seed)
    side, dim = 28, 28 * 28
    # per class: bright 4x4 blocks (values 128..255) on a dark ground (0..15), ~35% of the 49 blocks
    block = []  # per block: the mask of its 16 pixels, as an int of dim bytes (big-endian: pixel 0 first)
    for b in range(49):
        m = bytearray(dim)
        for r in range(4):
            for col in range(4):
                m[(b // 7 * 4 + r) * side + b % 7 * 4 + col] = 0xff
        block.append(int.from_bytes(bytes(m), "big"))
    templates, bright = [], []
    for c in range(10):
        on = [b for b in range(49) if rng.random() < 0.35]
        t = bytearray(rng.randrange(16) for _ in range(dim))
        for b in on:
            for r in range(4):
                for col in range(4):
                    t[(b // 7 * 4 + r) * side + b % 7 * 4 + col] = 0x80 | rng.randrange(128)
        templates.append(int.from_bytes(bytes(t), "big"))
        bright.append(on)
    low7 = int.from_bytes(b"\x7f" * dim, "big")
    os.makedirs(a.out, exist_ok=True)
    for prefix, n in (("train", a.train), ("t10k", a.test)):
        labels = bytes(rng.randrange(10) for _ in range(n))
        pix = bytearray()
        for i in range(n):
            c = labels[i]
            # each image: its class's pattern with a random half of its bright blocks dimmed below 128
            # (classes overlap: something to learn), then noise in the low 7 bits of every pixel
            dim_mask = 0
            for b in bright[c]:
                if rng.random() < 0.5:
                    dim_mask |= block[b]
            img = templates[c] & ~(dim_mask & ~low7) if dim_mask else templates[c]
            img ^= int.from_bytes(rng.randbytes(dim), "big") & low7
            pix += img.to_bytes(dim, "big")
        write_idx(os.path.join(a.out, prefix + "-images-idx3-ubyte.gz"), 0x803, [n, side, side], bytes(pix))
        write_idx(os.path.join(a.out, prefix + "-labels-idx1-ubyte.gz"), 0x801, [n], labels)
    print("data: synthetic, Fashion-MNIST's shape: %d training and %d test images of 28x28, 10 classes (seed %d)"
          % (a.train, a.test, a.seed))


# ---- compare ---------------------------------------------------------------------------------------------

def load_params(path):
    """The tensors of an mlp_params_save file: [(name, floats)], in file order."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        fail(2, "%s: %s" % (path, e.strerror))
    head = array.array("i")
    if len(raw) < 12 or raw[:4] != b"MLPP":
        fail(2, "%s: not a parameter file (mlp_params_save)" % path)
    layers = int.from_bytes(raw[4:8], sys.byteorder, signed=True)
    if not 1 <= layers <= 16 or len(raw) < 4 * (3 + layers):
        fail(2, "%s: bad header" % path)
    head.frombytes(raw[8:8 + 4 * (layers + 1)])
    widths = list(head)
    vals = array.array("f")
    vals.frombytes(raw[4 * (3 + layers):])
    out, at = [], 0
    for l in range(layers):
        i, o = widths[l], widths[l + 1]
        out.append(("W%d %dx%d" % (l + 1, o, i), vals[at:at + o * i]))
        at += o * i
        out.append(("b%d %d" % (l + 1, o), vals[at:at + o]))
        at += o
    if at != len(vals) or len(raw) % 4:
        fail(2, "%s: %d floats, the header announces %d" % (path, len(vals), at))
    return widths, out


def rel_l2(x, ref):
    num = sum((a - b) * (a - b) for a, b in zip(x, ref))
    den = sum(b * b for b in ref)
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def cmd_compare(a):
    files = [a.test] + a.cpu
    names = (a.names or ",".join(["TEST"] + ["CPU%d" % (i + 1) for i in range(len(a.cpu))])).split(",")
    if len(names) != len(files):
        fail(2, "--names takes %d comma-separated names" % len(files))
    if len(a.cpu) < 2:
        fail(2, "compare needs two CPU runs at least (the spread is between them)")
    loaded = [load_params(f) for f in files]
    if any(w != loaded[0][0] for w, _ in loaded):
        fail(2, "the files are of different models: %s" % ", ".join(str(w) for w, _ in loaded))
    test, cpu = loaded[0][1], [t for _, t in loaded[1:]]
    ntens, ncpu = len(test), len(cpu)
    # per tensor: the spread (largest difference between two CPU runs) and TEST's difference to each CPU run
    spread, spread_pair = [], []
    for t in range(ntens):
        best, pair = 0.0, (1, 2)
        for i in range(ncpu):
            for j in range(i + 1, ncpu):
                d = rel_l2(cpu[j][t][1], cpu[i][t][1])
                if not d <= best:
                    best, pair = d, (i + 1, j + 1)
        spread.append(best)
        spread_pair.append(pair)
    diff = [[rel_l2(test[t][1], cpu[i][t][1]) for t in range(ntens)] for i in range(ncpu)]
    ratio = [[diff[i][t] / max(spread[t], a.floor) for t in range(ntens)] for i in range(ncpu)]
    worst = [max(r) if all(math.isfinite(x) for x in r) else math.inf for r in ratio]
    near = min(range(ncpu), key=lambda i: worst[i])
    label = " [%s]" % a.label if a.label else ""
    print("%s%s after the same steps: relative L2 difference per tensor, ||x - y|| / ||y||; spread: the largest between two of"
          " %s; ratio: %s's difference to its nearest CPU run, %s, over max(spread, %g)"
          % (names[0], label, ", ".join(names[1:]), names[0], names[1 + near], a.floor))
    print("  %-12s %8s %12s %12s %12s  %-22s %7s" % ("tensor", "floats", "vs " + names[1], "vs nearest", "spread", "spread between", "ratio"))
    for t in range(ntens):
        i, j = spread_pair[t]
        r = ratio[near][t]
        print("  %-12s %8d %12.3g %12.3g %12.3g  %-22s %7.2f%s" % (test[t][0], len(test[t][1]), diff[0][t], diff[near][t], spread[t],
              (names[i] + "-" + names[j])[:22], r, "  OVER" if not r <= a.factor else ""))
    ok = worst[near] <= a.factor
    print("FIGURE trainer-agreement%s: %s within %g x the CPU spread of its nearest CPU run (%s) in every tensor: worst ratio %.2f"
          " (%s; vs %s: %.2f); largest spread %.3g: %s"
          % (label, names[0], a.factor, names[1 + near], worst[near], test[max(range(ntens), key=lambda t: ratio[near][t])][0],
             names[1], worst[0], max(spread), "met" if ok else "NOT MET"))
    return 0 if ok else 1


# ---- speed -----------------------------------------------------------------------------------------------

def cmd_speed(a):
    rates = []
    for n, path in enumerate(a.logs, 1):
        m = None
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    m = re.search(r"trained .*\(([0-9.]+) samples/s\)", line) or m
        except OSError:
            pass
        if not m:
            print("FIGURE samples-per-s: N = %d: no \"trained ... samples/s\" line in %s: MISSING" % (n, path))
            return 2
        rates.append(float(m.group(1)))
    best = max(range(1, len(rates)), key=lambda i: rates[i]) if len(rates) > 1 else 0
    ok = len(rates) > 1 and rates[best] > rates[0]
    print("FIGURE samples-per-s: %s; best N > 1: N = %d, %.2fx N = 1: %s" % (
        ", ".join("N = %d %.0f" % (i + 1, r) for i, r in enumerate(rates)), best + 1,
        rates[best] / rates[0] if rates[0] > 0 else math.inf, "met (N > 1 beats N = 1)" if ok else "NOT MET (N > 1 does not beat N = 1)"))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("dir")
    d.add_argument("out")
    s = sub.add_parser("synth")
    s.add_argument("out")
    s.add_argument("--train", type=int, default=60000)
    s.add_argument("--test", type=int, default=10000)
    s.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("test")
    c.add_argument("cpu", nargs="+")
    c.add_argument("--factor", type=float, default=10.0)
    c.add_argument("--floor", type=float, default=1.1920929e-07)
    c.add_argument("--names")
    c.add_argument("--label")
    v = sub.add_parser("speed")
    v.add_argument("logs", nargs="+")
    a = p.parse_args()
    if a.cmd == "data":
        return cmd_data(a) or 0
    if a.cmd == "synth":
        return cmd_synth(a) or 0
    if a.cmd == "compare":
        return cmd_compare(a)
    return cmd_speed(a)


if __name__ == "__main__":
    sys.exit(main())
