"""The CPU op family beside attention, behind one seam: `ops.CpuOps`, chosen once when a worker
loads (`ops.select_cpu_ops`, from the machine and the `cpu_kernels` setting) and logged in one
line. Behind it: the GEMMs of small batches (`small_m_gemm`, `amx_gemm`, `cpu_gemm`), RMSNorm
and the rotary rotation (`cpu_fused`), the decoder layers in one C call (`fused_layers`), and
the machinery that builds their C sources on first use (`native`).
"""
