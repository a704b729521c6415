"""The C row decode kernel (kernels/attention/decode_attention.c) of this tree against the same
file at another git revision, float32 (and, with --int8, this tree's int8 kernel over the
same positions), calls alternating, in one process.

    OMP_NUM_THREADS=1 python benchmarks/decode_attention_ab.py [--base main] [--march native]
        [--batch 8] [--context 4096] [--heads 9] [--kv-heads 3] [--head-dim 64]
        [--layers 4] [--rounds 9] [--int8]

Caches as the cpu backend stores them (float32 head-major, int8 position-major with a scale
per position and KV head), random contents, --layers layers' caches read in turn (more than
the L3 cache holds, so from memory; --batch 1 --context 1000 --layers 1: from cache), every
page resident in 2 MB pages where the kernel has them (as a worker's cache once it has been
idle: workers/host_memory.py; --small-pages: 4 KB pages, as a worker never idle faults its
cache in). Each library is built here with the project's flags for --march (`haswell`:
the AVX2 build on an AVX-512 machine). Prints, per kernel, the median and lowest wall and
process CPU time a layer (CPU time: on a shared machine the wall clock also counts the time
other processes held the cores), the bytes of K and V read per CPU second, and the largest
difference from the base's output (0: bit for bit).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tidal.kernels.attention import cpu_attention
from tidal.kernels.cpu import native
from tidal.workers.host_memory import commit_pages

SOURCE = "kernels/attention/decode_attention.c"


def build(source_text: str, folder: Path, name: str, march: str) -> ctypes.CDLL:
    source = folder / f"{name}.c"
    source.write_text(source_text)
    library = folder / f"{name}.so"
    subprocess.run([native.compiler_name(), *native.flags(march), "-o", str(library), str(source),
                    "-lm"], check=True)
    return ctypes.CDLL(str(library))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="git revision of the other kernel")
    ap.add_argument("--march", default="native")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--int8", action="store_true", help="also this tree's int8 kernel")
    ap.add_argument("--small-pages", action="store_true",
                    help="caches in 4 KB pages (faulted in by use, as in a worker never idle)")
    a = ap.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    base_text = subprocess.run(["git", "-C", str(root), "show", f"{a.base}:{SOURCE}"],
                               check=True, capture_output=True, text=True).stdout
    bs, d, kvh = 16, a.head_dim, a.kv_heads
    per = -(-a.context // bs)
    blocks = a.batch * per
    g = torch.Generator().manual_seed(0)
    f32 = [[torch.empty(blocks, kvh, bs, d).transpose(1, 2) for _ in range(2)]
           for _ in range(a.layers)]
    i8 = [[torch.empty(blocks, bs, kvh, d, dtype=torch.int8) for _ in range(2)]
          + [torch.empty(blocks, bs, kvh) for _ in range(2)]
          for _ in range(a.layers if a.int8 else 0)]
    if not a.small_pages:  # before the first touch: a page already there stays 4 KB
        resident = commit_pages([t for layer in f32 + i8 for t in layer], "benchmark caches")
        if resident is not None:
            resident.join()
    for layer in f32:
        for t in layer:
            t.normal_(generator=g)
    for layer in i8:
        for t in layer[:2]:
            t.random_(-127, 128, generator=g)
        for t in layer[2:]:
            t.uniform_(0, 0.02, generator=g)
    tables = torch.randperm(blocks, generator=g).to(torch.int32).reshape(a.batch, per)
    lens = torch.full((a.batch,), a.context, dtype=torch.int32)
    rows = torch.arange(a.batch, dtype=torch.int64)
    q = torch.randn(a.batch, a.heads, d, generator=g)
    scale = d ** -0.5
    with tempfile.TemporaryDirectory() as folder:
        libraries = {f"{a.base} float32": build(base_text, Path(folder), "base", a.march),
                     "tree float32": build((root / SOURCE).read_text(), Path(folder), "tree",
                                           a.march)}
    cpu_attention._declare(libraries["tree float32"])
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    libraries[f"{a.base} float32"].tidal_decode_attention.argtypes = [  # as _declare's
        p, p, p, p, n, p, p, p, n, i, i, i, i, n, n, n, ctypes.c_float, p]
    kernels = dict(libraries)
    if a.int8:
        kernels["tree int8"] = libraries["tree float32"]
    outs = {name: torch.zeros_like(q) for name in kernels}
    common = (tables.data_ptr(), per, lens.data_ptr(), rows.data_ptr(), rows.data_ptr(),
              a.batch, a.heads, kvh, d, bs)

    def call(name: str, layer: int) -> None:
        out = outs[name].data_ptr()
        if name.endswith("int8"):
            k, v, ks, vs = i8[layer]
            status = kernels[name].tidal_decode_attention_int8(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), ks.data_ptr(), vs.data_ptr(),
                *common, *k.stride()[:3], *ks.stride(), scale, 0, 0.0, out)
        else:
            k, v = f32[layer]
            status = kernels[name].tidal_decode_attention(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), *common, *k.stride()[:3], scale, out)
        assert status == 0, status

    wall = {name: [] for name in kernels}
    cpu = {name: [] for name in kernels}
    for r in range(a.rounds + 1):  # round 0 warms up
        for name in kernels:
            w0, c0 = time.perf_counter(), time.process_time()
            for layer in range(a.layers):
                call(name, layer)
            if r:
                wall[name].append((time.perf_counter() - w0) / a.layers * 1e3)
                cpu[name].append((time.process_time() - c0) / a.layers * 1e3)
    huge = [line.split()[1] for line in open("/proc/self/smaps_rollup")
            if line.startswith("AnonHugePages")] if os.path.exists("/proc/self/smaps_rollup") else []
    print(f"{a.batch} x {a.context} positions, {a.heads} heads over {kvh} KV heads of {d}, "
          f"{a.layers} layers' caches in turn, {'4 KB' if a.small_pages else '2 MB'} pages, "
          f"-march={a.march}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"{'process in 2 MB pages: ' + huge[0] + ' kB; ' if huge else ''}"
          f"load average {os.getloadavg()[0]:.2f}")
    print("| kernel | wall ms a layer (median, min) | CPU ms a layer (median, min) "
          "| GB/s per CPU second | max diff from base |")
    print("| --- | --- | --- | --- | --- |")
    base = outs[f"{a.base} float32"]
    for name in kernels:
        bytes_read = a.batch * a.context * kvh * d * 2 * (1 if name.endswith("int8") else 4)
        median_cpu = statistics.median(cpu[name])
        print(f"| {name} | {statistics.median(wall[name]):.3f}, {min(wall[name]):.3f} | "
              f"{median_cpu:.3f}, {min(cpu[name]):.3f} | {bytes_read / median_cpu / 1e6:.1f} | "
              f"{(outs[name] - base).abs().max().item():.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
