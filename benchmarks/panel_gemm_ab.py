"""The panel GEMM (`kernels/cpu/small_m_gemm.c`) of the working tree against the one of a git
revision, on a model's own projections, interleaved in one process.

    python benchmarks/panel_gemm_ab.py MODEL_FOLDER [--base main] [--rows 1 2 3 5 8]
        [--layers 30] [--rounds 15] [--threads 1] [--march haswell] [--storage bfloat16]

Builds both sources (`native.build_and_load`, `--march` for another CPU's paths: haswell, the
AVX2 build on an AVX-512 machine), packs each layer's q/o/gate/up/down weight the way
`PanelGemm` stores it here (4/8-bit blocks where the weight is made of them, else panels in
`--storage` or `exact_storage_dtype`), checks that both builds give the same products bit for
bit, then times one pass over all the projections at each row count, base then new, for
`--rounds` rounds, and prints the least and median ms of each and their ratios. With
`--onednn`, oneDNN's kernel on the same weights (`cpu_gemm.SmallBatchGemm`'s copy) is timed
too (ONEDNN_MAX_CPU_ISA=AVX2 in the environment gives its AVX2 code).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--base", default="main")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--march", default=None)
    parser.add_argument("--storage", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--onednn", action="store_true")
    args = parser.parse_args()
    import safetensors.torch
    import torch

    from tidal.kernels.cpu import native, small_m_gemm
    from tidal.kernels.cpu.cpu_gemm import REORDER_ROWS

    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as folder:
        base_source = Path(folder) / "small_m_gemm_base.c"
        base_source.write_text(subprocess.run(
            ["git", "show", f"{args.base}:kernels/cpu/small_m_gemm.c"], cwd=root, check=True,
            capture_output=True, text=True).stdout)
        libraries = {}
        for name, source in (("base", base_source), ("new", source_of(root))):
            built = native.build_and_load(source, "tidal_panel_gemm_available", args.march)
            if built.library is None:
                raise SystemExit(f"{name}: {built.why_not}")
            small_m_gemm._declare(built.library)
            libraries[name] = built.library
    vector = libraries["new"].tidal_panel_gemm_vector_floats()
    tensors = {}
    for path in glob.glob(os.path.join(args.model, "*.safetensors")):
        tensors.update(safetensors.torch.load_file(path))
    storage = getattr(torch, args.storage) if args.storage else None
    weights = []  # (packed, kernel type, n, k, float32 weight)
    for layer in range(args.layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                     "mlp.down_proj"):
            w = tensors[f"model.layers.{layer}.{name}.weight"].to(torch.float32).contiguous()
            packed, kind = None, 0
            if storage is None:
                for find, k in ((small_m_gemm.q4_blocks, 3), (small_m_gemm.q8_blocks, 4)):
                    packed = find(w)
                    if packed is not None:
                        kind = k
                        break
            if packed is None:
                dtype = storage or small_m_gemm.exact_storage_dtype(w)
                packed = small_m_gemm.pack_panels(w, dtype)
                kind = small_m_gemm._WEIGHT_TYPES[dtype]
            weights.append((packed, kind, *w.shape, w))
    kinds = sorted({kind for _, kind, *_ in weights})
    print(f"{len(weights)} projections, kernel weight types {kinds}, {vector}-float vectors, "
          f"{args.threads} thread(s), base {args.base}; load {os.getloadavg()[0]:.1f}")
    xs = {m: [torch.randn(m, k) for _, _, n, k, _ in weights] for m in args.rows}
    ys = {m: [torch.empty(m, n) for _, _, n, k, _ in weights] for m in args.rows}

    def kernel(library):
        def run(m):
            for (packed, kind, n, k, _), x, y in zip(weights, xs[m], ys[m]):
                library.tidal_panel_gemm(x.data_ptr(), m, k, packed.data_ptr(), kind, n,
                                         y.data_ptr(), None, 0)
        return run

    runs = {name: kernel(library) for name, library in libraries.items()}
    if args.onednn:
        reordered = [torch.ops.mkldnn._reorder_linear_weight(w, REORDER_ROWS)
                     for *_, w in weights]

        def onednn(m):
            for r, x in zip(reordered, xs[m]):
                torch.ops.mkldnn._linear_pointwise(x, r, None, "none", [], "")
        runs["onednn"] = onednn
    for m in args.rows:
        runs["new"](m)
        new = [y.clone() for y in ys[m]]
        runs["base"](m)
        assert all(torch.equal(a, b) for a, b in zip(new, ys[m])), f"{m} rows differ"
    print("base and new equal bit for bit at rows", args.rows)
    times = {(m, name): [] for m in args.rows for name in runs}
    for _ in range(args.rounds):
        for m in args.rows:
            for name, run in runs.items():
                start = time.perf_counter()
                run(m)
                times[(m, name)].append(time.perf_counter() - start)
    print("rows " + "".join(f"{name + ' least (median) ms':>28}" for name in runs)
          + "   new/base least, median")
    for m in args.rows:
        cells = "".join(f"{min(times[(m, n)]) * 1e3:15.2f} ({statistics.median(times[(m, n)]) * 1e3:8.2f})"
                        for n in runs)
        b, n = times[(m, "base")], times[(m, "new")]
        print(f"{m:4d} {cells}   {min(n) / min(b):.2f}, "
              f"{statistics.median(n) / statistics.median(b):.2f}")
    print(f"load {os.getloadavg()[0]:.1f}")


def source_of(root: Path) -> Path:
    return root / "kernels" / "cpu" / "small_m_gemm.c"


if __name__ == "__main__":
    main()
