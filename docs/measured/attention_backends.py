"""Which of torch's attention kernels is fastest for each attention the network runs (issue 35, docs/performance.md
"Attention kernels"): records the (q, k, v) shapes of every attention in one training forward of a
backbone (--backbone of conf/backbone, its memory settings chosen for the device; batch, size and precision as
given), then times forward + backward of each shape with every backend of `torch.nn.attention.SDPBackend`, with the
unfused product (matmul, softmax, matmul), with products and sums for the short ones, and with our choice
(`softmax_attention`), in milliseconds (wall clock around a synchronised step, median of --repeats after 2
warm-ups). A backend that refuses a shape or fails is recorded with its error (cuDNN's and the fused kernels'
grids take at most 65535 batch rows).

    python docs/measured/attention_backends.py --batch 8 --size 368 496 --out attention.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowformer.device_settings import device_memory_settings
from flowformer.models import cost_encoder, layers

CONF = Path(__file__).resolve().parents[2] / "conf"


def recorded_shapes(
    backbone_name: str, batch: int, size: tuple[int, int], device: torch.device, dtype: torch.dtype
) -> Counter:
    """(q shape, k shape, v shape) -> calls in one training forward (1 decoder iteration), of every attention: our
    layers' (`softmax_attention`, wherever a module of flowformer.models holds it) and timm's Twins blocks' own
    `scaled_dot_product_attention`."""
    seen: Counter = Counter()
    fused, ours = F.scaled_dot_product_attention, layers.softmax_attention
    holders = [module for module in (layers, cost_encoder) if module.softmax_attention is ours]
    inside_ours = []

    def record(q, k, v) -> None:
        if not inside_ours:
            seen[(tuple(q.shape), tuple(k.shape), tuple(v.shape))] += 1

    def recording_fused(q, k, v, *args, **kwargs):
        record(q, k, v)
        return fused(q, k, v, *args, **kwargs)

    def recording_ours(q, k, v, **kwargs):
        record(q, k, v)
        inside_ours.append(True)
        try:
            return ours(q, k, v, **kwargs)
        finally:
            inside_ours.pop()

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        backbone = compose("config", overrides=[f"backbone={backbone_name}"]).backbone
    backbone = device_memory_settings(backbone, device, training=True)  # as `task=bench` builds it
    net = hydra.utils.instantiate(backbone).to(device).train()
    images = [torch.rand(batch, 3, *size, device=device) * 255 for _ in range(2)]  # [B,3,H,W]
    F.scaled_dot_product_attention = recording_fused
    for module in holders:
        module.softmax_attention = recording_ours
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            net(*images, iters=1)
    finally:
        F.scaled_dot_product_attention = fused
        for module in holders:
            module.softmax_attention = ours
    return seen


def unfused(q, k, v):
    return torch.matmul(torch.matmul(q, k.transpose(-2, -1)).mul(q.shape[-1] ** -0.5).softmax(-1), v)


def elementwise(q, k, v):
    """Products and sums instead of batched matrix products, for short attentions: [N, h, Lq, d] -> [N, h, Lq, dv],
    holding [N, h, Lq, Lk, d] at once."""
    weights = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1).mul(q.shape[-1] ** -0.5).softmax(-1)  # [N, h, Lq, Lk]
    return (weights.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)


def time_ms(run, inputs, repeats: int) -> float:
    """Median milliseconds of forward + backward of `run(*inputs)`."""
    times = []
    for index in range(repeats + 2):
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(*inputs).sum().backward()
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
        if index >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_shape(shapes, device: torch.device, dtype: torch.dtype, repeats: int) -> dict[str, str | float]:
    """{backend: milliseconds, or its error} for one (q, k, v) shape."""
    inputs = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for shape in shapes]
    results: dict[str, str | float] = {}
    for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = SDPBackend.__members__[name]

        def fused(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)

        try:
            results[name] = time_ms(fused, inputs, repeats)
        except RuntimeError as error:
            results[name] = f"fails: {str(error).splitlines()[0][:100]}"
    results["UNFUSED"] = time_ms(unfused, inputs, repeats)
    if shapes[0][-2] * shapes[1][-2] <= layers.UNFUSED_MAX_LOGITS:
        results["ELEMENTWISE"] = time_ms(elementwise, inputs, repeats)
    ours = lambda q, k, v: layers.softmax_attention(q, k, v, scale=q.shape[-1] ** -0.5)
    results["OURS"] = time_ms(ours, inputs, repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="flowformer", help="a backbone of conf/backbone")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, nargs=2, default=[368, 496])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="the table as JSON")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    device = torch.device(args.device)
    shapes = recorded_shapes(args.backbone, args.batch, tuple(args.size), device, dtype)
    rows = []
    for key, calls in shapes.items():
        timed = time_shape(key, device, dtype, args.repeats)
        rows.append({"q": key[0], "k": key[1], "v": key[2], "calls_per_forward": calls, "ms_forward_backward": timed})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"batch": args.batch, "size": args.size, "precision": args.precision, "rows": rows}, file,
                      indent=2)


if __name__ == "__main__":
    main()
