"""Time the release patch_embed and final_layer (ResBlocks, bf16, CUDA) in NCHW and channels_last
memory format, and the MoE un-permute (index_copy_ vs a gather), at the release latent sizes.

    python tools/micro_image_layers.py
"""

import torch
import triton.testing

from ditkv.bench.step_release import random_model_on_device, release_config


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def main():
    dev = torch.device("cuda")
    cfg = release_config(1)
    m = random_model_on_device(cfg, dev, torch.bfloat16)
    print("latent rows | patch_embed NCHW ms | channels_last ms | final_layer NCHW ms | channels_last ms")
    with torch.inference_mode():
        for side in (64, 32):
            for rows in (1, 2):
                x = torch.randn(rows, cfg.latent_channels, side, side, device=dev)
                t = torch.full((rows,), 500.0, device=dev)
                tok = torch.randn(rows, side * side, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
                res = []
                for fmt in (torch.contiguous_format, torch.channels_last):
                    m.patch_embed.to(memory_format=fmt)
                    m.final_layer.to(memory_format=fmt)
                    xin = x.contiguous(memory_format=fmt)
                    res.append((bench(lambda: m.embed_image(xin, t)),
                                bench(lambda: m.final_layer_velocity(tok, t, side, side))))
                print(f"{side:6d} {rows:4d} | {res[0][0]:8.3f} | {res[1][0]:8.3f} | {res[0][1]:8.3f} | {res[1][1]:8.3f}")
        n, k, h = 8194, 8, cfg.hidden_size
        y = torch.randn(n * k, h, device=dev, dtype=torch.bfloat16)
        order = torch.randperm(n * k, device=dev)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(n * k, device=dev)
        out = torch.empty_like(y)
        print(f"un-permute {n * k} slots x {h}: index_copy_ {bench(lambda: out.index_copy_(0, order, y)):.3f} ms, "
              f"index_select {bench(lambda: y.index_select(0, inv)):.3f} ms")
        w = torch.rand(n, k, device=dev)
        print(f"combine fp32 bmm {bench(lambda: torch.bmm(w.unsqueeze(1), y.view(n, k, h).float())):.3f} ms, "
              f"bf16 bmm {bench(lambda: torch.bmm(w.unsqueeze(1).to(y.dtype), y.view(n, k, h))):.3f} ms")


if __name__ == "__main__":
    main()
