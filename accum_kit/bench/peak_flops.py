"""The device's peak FLOP/s, the denominator of model FLOPs utilisation: a datasheet table or a measured matmul.

Model FLOPs utilisation (MFU) is the FLOP/s a training step needs by the standard count, 6 x parameters x tokens
per second (2 per parameter and token forward, 4 backward: Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1; the PaLM paper, Chowdhery et al. 2022, appendix B, names the ratio MFU), over the peak.

The peak, in the dtype the step multiplies in (``bf16`` / ``fp16`` under mixed precision, else ``fp32``):

- a GPU of :data:`DEVICE_PEAKS`: the dense tensor-core figure of the vendor's datasheet (the datasheets quote
  16-bit tensor-core figures "with sparsity", 2:4 structured; dense is half of that), and the plain FP32 figure
  for float32 (PyTorch multiplies float32 without TF32 unless ``torch.set_float32_matmul_precision`` says
  otherwise; then the peak is measured instead);
- any other device (the CPU, an unlisted GPU): the best rate of a square matmul measured here
  (:func:`measured_matmul_flops`), a practical peak rather than the hardware's.

:func:`peak_flops` says which, in its ``source``; :func:`accum_kit.bench.report_single.mfu` divides.
"""

from __future__ import annotations

import time

_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"

#: ``(words all in the device name, label, {dtype: dense peak FLOP/s}, datasheet)``, the first match wins
#: (so the NVL and PCIe variants come before their SXM names). TFLOP/s: H100 / H200 SXM BF16 and FP16 1,979 with
#: sparsity (989 dense), FP32 67; H100 PCIe 1,513 (756 dense), FP32 51; H100 NVL and H200 NVL 1,671 (835 dense),
#: FP32 60; A100 (SXM and PCIe) 624 with sparsity (312 dense), FP32 19.5.
DEVICE_PEAKS = (
    (("H200", "NVL"), "NVIDIA H200 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}, _H200),
    (("H200",), "NVIDIA H200 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, _H200),
    (("H100", "NVL"), "NVIDIA H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}, _H100),
    (("H100", "PCIE"), "NVIDIA H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}, _H100),
    (("H100",), "NVIDIA H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, _H100),
    (("A100",), "NVIDIA A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, _A100),
)


def compute_dtype_name(mixed_precision: str) -> str:
    """``bf16``, ``fp16`` or ``fp32``: what the step's matrix products run in under Accelerate's ``mixed_precision``."""
    return mixed_precision if mixed_precision in ("bf16", "fp16") else "fp32"


def table_peak(device_name: str, dtype: str) -> dict | None:
    """``{"flops_per_s", "source"}`` from :data:`DEVICE_PEAKS` for a GPU named ``device_name``
    (``torch.cuda.get_device_name``) in ``dtype`` (``bf16``, ``fp16``, ``fp32``); None for a device not listed."""
    upper = device_name.upper()
    for words, label, peaks, url in DEVICE_PEAKS:
        if all(w in upper for w in words) and dtype in peaks:
            return {"flops_per_s": peaks[dtype], "source": f"table: {label} {dtype} dense peak "
                                                          f"{peaks[dtype] / 1e12:g} TFLOP/s (datasheet {url})"}
    return None


def measured_matmul_flops(device, dtype: str, n: int | None = None, repeats: int = 10) -> dict:
    """The best rate of an ``n x n`` by ``n x n`` product, ``torch.nn.functional.linear`` (``2 n^3`` FLOP), over
    ``repeats`` timed calls after one untimed call: ``{"flops_per_s", "source"}``.

    Args:
        device: a ``torch.device``.
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        n: the size (default 8192 on CUDA, 1024 elsewhere: about a second in all on 2 CPU cores).
        repeats: timed calls.
    """
    import torch
    import torch.nn.functional as F

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    n = n or (8192 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(torch_dtype)
    b = torch.randn(n, n, generator=g, device=device).to(torch_dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    F.linear(a, b)  # the product nn.Linear runs (on CPU, float16's plain matmul takes a path ~50x slower)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        F.linear(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    flops = 2 * n**3 / best
    return {"flops_per_s": flops, "source": f"measured: best of {repeats} {n} x {n} {dtype} matmuls (F.linear) on {device} "
                                            f"({torch.get_num_threads()} threads), {flops / 1e9:.1f} GFLOP/s"}


def peak_flops(device, mixed_precision: str) -> dict:
    """The peak FLOP/s for MFU on ``device`` (a ``torch.device``) under ``mixed_precision`` (``no``, ``bf16``,
    ``fp16``): ``{"flops_per_s", "source", "dtype"}``, from :data:`DEVICE_PEAKS` for a listed GPU (float32 only
    at PyTorch's default ``highest`` matmul precision), else :func:`measured_matmul_flops`."""
    import torch

    dtype = compute_dtype_name(mixed_precision)
    found = None
    if device.type == "cuda" and (dtype != "fp32" or torch.get_float32_matmul_precision() == "highest"):
        found = table_peak(torch.cuda.get_device_name(device), dtype)
    return {**(found or measured_matmul_flops(device, dtype)), "dtype": dtype}

