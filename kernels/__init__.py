"""tidal's kernels, two families behind two seams:

    attention/  the `AttentionBackend` seam: reference, torch, numba, cpu (C), Triton
    cpu/        the `CpuOps` seam (`cpu/ops.py`): small-batch GEMMs, RMSNorm, rotary, fused
                decoder layers, chosen once at load; and the build of their C sources

This package is `tidal.kernels`. Run from a checkout's root (`python -m ...`, `python -c`),
the root is on `sys.path` and this folder would also be found as the top-level module
`kernels`, hiding Hugging Face's `kernels` package, which transformers (>= 5.25) imports at
start-up. Imported under that name, this file hands the name over to the next `kernels` on
`sys.path` (the installed one), so `import kernels` means the same thing in a checkout as
anywhere else.
"""

if __name__ == "kernels":
    import importlib.util
    import os
    import sys
    from importlib.machinery import PathFinder

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what is here now
        _spec.loader.exec_module(_module)
