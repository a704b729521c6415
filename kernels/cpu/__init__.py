"""CPU kernels other than attention: the GEMMs of small batches (`small_m_gemm`, `amx_gemm`,
`cpu_gemm`), RMSNorm and the rotary rotation (`cpu_fused`), the decoder layers in one C call
(`fused_layers`), and the machinery that builds their C sources on first use (`native`).
"""
