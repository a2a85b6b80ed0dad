"""Profile the release-geometry denoise step in bf16 and fp8 side by side (CUDA): step times eager and
as a CUDA graph, and the CUDA time per kernel bucket (GEMMs, attention, quantization, MoE routing...).

    python tools/profile_fp8_step.py --layers 4 --image 1024 --prefix 1024
"""

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ditkv.config import EngineConfig
from ditkv.engine.engine import Engine
from ditkv.engine.types import GenerationRequest
from ditkv.models.hunyuan import ByteTokenizer, HunyuanImage3Config, HunyuanImage3Model
from ditkv.models.hunyuan.codec import make_codec
from ditkv.models.hunyuan.quantize import quantize_model
from ditkv.worker.cuda_graph import DenoiseStepGraph
from ditkv.worker.rows import DENOISE, PREFILL

BUCKETS = (("quant", ("_quant_rows_kernel", "_silu_mul_quant_kernel")),
           ("fp8_gemm", ("f8", "fp8", "e4m3", "cutlass3x_sm90_tensorop_gemm_e4m3")),
           ("grouped_bf16_gemm", ("grouped", "Grouped")),
           ("attention", ("_paged", "attn", "flash", "fmha", "cudnn")),
           ("gemm_bf16", ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet")),
           ("sort_gather", ("sort", "Sort", "index", "gather", "scatter", "searchsorted", "radix")),
           ("elementwise_fused", ("triton_",)))


def bucket(name: str) -> str:
    for b, keys in BUCKETS:
        if any(k in name for k in keys):
            return b
    return "other"


def build(layers: int, seed: int = 0):
    base = HunyuanImage3Config.release().to_dict()
    base.update(num_hidden_layers=layers, vocab_size=1024, image_base_size=None)
    base.update({k: v for k, v in HunyuanImage3Config.tiny().to_dict().items() if k.endswith("_token_id")})
    cfg = HunyuanImage3Config.from_dict(base)
    with torch.device("meta"):
        model = HunyuanImage3Model(cfg).to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.float()
    model = model.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.requires_grad_(False).eval(), cfg


def engine(model, cfg, prefix, image, quant):
    tokens = prefix + (image // 16) ** 2 + 16
    ecfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, device="cuda",
                        attention_backend="auto", num_kv_blocks=2 * -(-tokens // 64), max_prompt_tokens=prefix,
                        max_image_height=image, max_image_width=image, profile_memory=False, cuda_graphs="off",
                        quantization=quant)
    e = Engine(ecfg, model_bundle=(model, ByteTokenizer(), make_codec(cfg)))
    rid = e.add_request(GenerationRequest(prompt="a" * (prefix - 4), height=image, width=image, steps=2,
                                          guidance_scale=4.0, seed=0))
    s = e.scheduler.schedule().admitted[0]
    e.worker.install(s.metadata)
    return e, rid, s.payload[0]


def timed(fn, n=10):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--image", type=int, default=1024)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    model, cfg = build(a.layers)
    out = {}
    for quant in (None, "fp8"):
        e, rid, layout = engine(model, cfg, a.prefix, a.image, quant)
        r = e.worker.runner
        x = torch.randn(1, cfg.latent_channels, layout.h, layout.w, device="cuda")
        t = torch.tensor([500.0], device="cuda")
        with torch.inference_mode():
            r.forward_step(rid, layout, x, t, PREFILL, True)
            eager = timed(lambda: r.forward_step(rid, layout, x, t, DENOISE, False))
            g = DenoiseStepGraph(r, rid, layout)
            graph = timed(lambda: g.replay(x, t))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay(x, t)
                torch.cuda.synchronize()
        per = collections.Counter()
        names = collections.Counter()
        for ev in prof.key_averages():
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[bucket(ev.key)] += us
            names[ev.key[:90]] += us
        total = sum(per.values())
        key = quant or "bf16"
        out[key] = {"eager_ms": eager, "graph_ms": graph, "kernel_ms": total / 1e3,
                    "buckets_ms": {k: v / 1e3 for k, v in per.most_common()},
                    "top": [(n, v / 1e3) for n, v in names.most_common(a.top)],
                    "mem_free_gib": torch.cuda.mem_get_info()[0] / 2**30}
        del g
        e.shutdown()
        if quant is None:
            quantize_model(model)  # the same weights, quantized, for the fp8 engine
            torch.cuda.empty_cache()
        print(json.dumps({key: out[key]}, indent=1), flush=True)
    print("fp8/bf16 graph", out["fp8"]["graph_ms"] / out["bf16"]["graph_ms"],
          "eager", out["fp8"]["eager_ms"] / out["bf16"]["eager_ms"])


if __name__ == "__main__":
    main()
