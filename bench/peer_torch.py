#!/usr/bin/python3
"""peer_torch.py -- the main job's model trained by PyTorch, the peer bench/bench_peer.sh compares with.

The same MLP as examples/fashion_mnist.c (784-512-256-128-10 by default: Linear + ReLU, softmax
cross-entropy), the same data (Debian's Fashion-MNIST, pixels standardised with the training set's
mean and deviation), the same batch (128), Adam (lr 1e-3, PyTorch's defaults), one pass over a shuffled
training set per epoch, in `--threads` threads (torch.set_num_threads; run it with OPENBLAS_NUM_THREADS
and OMP_NUM_THREADS set to the same, as bench_peer.sh does, so that OpenBLAS's own pool matches).

PyTorch at its best on a CPU for this model, as far as its API offers: the whole data set as one tensor
indexed per batch (no DataLoader), Adam's multi-tensor path (foreach=True), gradients set to None rather
than zeroed, a few warm-up batches before the clock starts. Debian's PyTorch 1.13 calls the system BLAS,
which is OpenBLAS here: the first line names its kernel (openblas_get_corename), as the C programs do.

Prints "BLAS: ..." first, then "trained E epochs in T s (R samples/s)" like fashion_mnist.
Usage: /usr/bin/python3 bench/peer_torch.py [--hidden 512,256,128] [--batch 128] [--threads 1]
           [--epochs 1] [--limit-train N] [--data /usr/share/datasets/fashion-mnist] [--seed 1]
"""
import argparse
import ctypes
import gzip
import os
import struct
import sys
import time

import numpy as np
import torch


def load_idx(path):
    """An IDX file (gzip-compressed or not) as a numpy array of uint8."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndims = magic & 0xFF
    if magic >> 8 != 0x08 or ndims < 1 or ndims > 3:
        sys.exit("peer_torch: %s: not an IDX file of unsigned bytes" % path)
    dims = struct.unpack(">" + "I" * ndims, data[4:4 + 4 * ndims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndims).reshape(dims)


def blas_kernel():
    """The OpenBLAS kernel this process runs (torch links libblas.so.3, OpenBLAS here)."""
    for name in ("libopenblas.so.0", "libblas.so.3"):
        try:
            lib = ctypes.CDLL(name)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            lib.openblas_get_config.restype = ctypes.c_char_p
            config = lib.openblas_get_config().decode().split()
            return "%s, kernel %s" % (" ".join(config[:2]), lib.openblas_get_corename().decode())
        except (OSError, AttributeError):
            continue
    return "not OpenBLAS (kernel unknown)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", default="512,256,128")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--limit-train", type=int, default=0)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    print("BLAS: %s, %d thread%s (PyTorch %s)" % (blas_kernel(), a.threads, "s" if a.threads > 1 else "", torch.__version__),
          flush=True)

    x = load_idx(os.path.join(a.data, "train-images-idx3-ubyte.gz")).reshape(-1, 784).astype(np.float32) / 255.0
    y = load_idx(os.path.join(a.data, "train-labels-idx1-ubyte.gz")).astype(np.int64)
    x = (x - x.mean()) / x.std()
    if a.limit_train:
        x, y = x[:a.limit_train], y[:a.limit_train]
    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)

    widths = [784] + [int(w) for w in a.hidden.split(",") if w] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = x.shape[0] // a.batch

    def batch(idx):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        return loss

    g = torch.Generator().manual_seed(a.seed)
    perm = torch.randperm(x.shape[0], generator=g)
    for s in range(5):  # warm-up: first touches, thread pools
        batch(perm[s * a.batch:(s + 1) * a.batch])
    t0 = time.perf_counter()
    for e in range(a.epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        for s in range(steps):
            loss = batch(perm[s * a.batch:(s + 1) * a.batch])
    secs = time.perf_counter() - t0
    samples = a.epochs * steps * a.batch
    print("trained %d epochs in %.1f s (%.0f samples/s); last loss %.4f" % (a.epochs, secs, samples / secs, float(loss)))


if __name__ == "__main__":
    main()
