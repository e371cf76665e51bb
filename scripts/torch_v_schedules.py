#!/usr/bin/env python3
"""Write small V-placed pipeline schedules in PyTorch's CSV layout (torch.distributed.pipelining's
_dump_csv: one line per rank, comma-separated actions, an empty field for an idle slot,
"(a;b)OVERLAP_F_B" for an overlapped pair), for avgpipe's import/validate/export tests.

The schedules follow the published algorithm descriptions, written here independently of avgpipe's
C generators (so the tests compare two implementations):
  ZB-V:      Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), the V schedule, as PyTorch's
             ScheduleZBVZeroBubble lays it out (warm-up, steady F-I-W pairs, cool-down; short streams
             padded to 2S-1 micro-batches whose padding is dropped, leaving idle slots).
  DualPipeV: DeepSeek's DualPipe folded into a V (PyTorch's ScheduleDualPipeV): eight steps, the
             steady ones overlapping the forward of one micro-batch with the backward of another.
Rank r holds stages r and 2S-1-r (the V placement).

usage: scripts/torch_v_schedules.py OUTDIR   (writes the files tests/data holds)
"""
import os
import sys


def act(stage, kind, micro):
    return f"{stage}{kind}{micro}"


def zbv(ranks, n_micro):
    stages = 2 * ranks
    out = []
    for rank in range(ranks):
        padded = max(2 * ranks - 1, n_micro)
        ops = [None] * rank  # PyTorch starts rank r with r idle slots
        c0, c1 = rank, stages - 1 - rank
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (ranks - rank) - 1):
            ops.append((c0, "F", f0)); f0 += 1
        for _ in range(rank):
            ops.append((c1, "F", f1)); f1 += 1
            ops.append((c0, "F", f0)); f0 += 1
        for _ in range(ranks - rank):
            ops.append((c1, "F", f1)); f1 += 1
            ops.append((c1, "I", b1)); ops.append((c1, "W", b1)); b1 += 1
        while f1 < f0 or f0 < padded:
            if f0 < padded:
                ops.append((c0, "F", f0)); f0 += 1
            ops.append((c0, "I", b0)); ops.append((c0, "W", b0)); b0 += 1
            ops.append((c1, "F", f1)); f1 += 1
            ops.append((c1, "I", b1)); ops.append((c1, "W", b1)); b1 += 1
        w0, w1 = b0, b1
        for _ in range(rank):
            ops.append((c0, "I", b0)); b0 += 1
            ops.append((c1, "I", b1)); b1 += 1
        for _ in range(ranks - rank):
            ops.append((c0, "I", b0)); b0 += 1
            ops.append((c0, "W", w0)); w0 += 1
        while w1 < b1:
            ops.append((c1, "W", w1)); w1 += 1
        while w0 < b0:
            ops.append((c0, "W", w0)); w0 += 1
        assert f0 == b0 == w0 == padded and f1 == b1 == w1 == padded
        out.append(["" if o is None or o[2] >= n_micro else act(*o) for o in ops])
    return out


def dualpipev(ranks, n_micro):
    assert n_micro >= 2 * ranks, "DualPipeV needs at least 2 x ranks micro-batches"
    stages = 2 * ranks
    out = []
    for rank in range(ranks):
        c = (rank, stages - 1 - rank)
        fwd = [0, 0]
        bwd = [0, 0]
        held = []  # weight gradients an I left for a later W, oldest first
        ops = []

        def f(ch):
            a = act(c[ch], "F", fwd[ch]); fwd[ch] += 1
            return a

        def b(ch, split):
            a = act(c[ch], "I" if split else "B", bwd[ch])
            if split:
                held.append((c[ch], bwd[ch]))
            bwd[ch] += 1
            return a

        def w():
            s, m = held.pop(0)
            return act(s, "W", m)

        def pair(fa, ba):
            return f"({fa};{ba})OVERLAP_F_B"

        for _ in range((ranks - rank - 1) * 2):          # 1: F0
            ops.append(f(0))
        for _ in range(rank + 1):                        # 2: F0 F1
            ops.append(f(0)); ops.append(f(1))
        for _ in range(ranks - rank - 1):                # 3: I1 W1 F1
            ops.append(b(1, True)); ops.append(w()); ops.append(f(1))
        for i in range(n_micro - 2 * ranks + rank + 1):  # 4: (F0;B1) (F1;B0)
            if i == 0 and rank == ranks - 1:             # the last rank keeps its first pair apart
                ops.append(f(0)); ops.append(b(1, False))
            else:
                fa = f(0); ops.append(pair(fa, b(1, False)))
            fa = f(1); ops.append(pair(fa, b(0, False)))
        for _ in range(ranks - rank - 1):                # 5: B1 (F1;B0)
            ops.append(b(1, False))
            fa = f(1); ops.append(pair(fa, b(0, False)))
        zb = False
        for i in range(rank + 1):                        # 6: B1 B0, I from half-way on
            if i == (rank + 1) // 2 and rank % 2 == 1:
                zb = True
            ops.append(b(1, zb))
            if i == (rank + 1) // 2 and rank % 2 == 0:
                zb = True
            ops.append(b(0, zb))
        for _ in range(ranks - rank - 1):                # 7: W I0
            ops.append(w()); ops.append(b(0, True))
        while held:                                      # 8: W
            ops.append(w())
        assert fwd == [n_micro, n_micro] and bwd == [n_micro, n_micro]
        out.append(ops)
    return out


FILES = {
    "torch_zbv_2rank_4stage_6micro.csv": lambda: zbv(2, 6),
    "torch_zbv_4rank_8stage_4micro.csv": lambda: zbv(4, 4),
    "torch_dualpipev_2rank_4stage_4micro.csv": lambda: dualpipev(2, 4),
    "torch_dualpipev_4rank_8stage_10micro.csv": lambda: dualpipev(4, 10),
}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    for name, make in FILES.items():
        with open(os.path.join(sys.argv[1], name), "w", newline="") as fh:
            for row in make():
                fh.write(",".join(row) + "\n")


if __name__ == "__main__":
    main()
