"""Time the decode GEMV pass's tiles (`models/fp8_gemv.py`) and the decode router's
(`models/hunyuan/router_kernel.py`) at the release's decode shapes, against what they replace
(`torch._scaled_mm`, the grouped path, `Router.forward` in torch), on one GPU:

    python tools/gpu_gemv_tune.py [--rows 1]

Prints microseconds per call (CUDA events over 200 calls in a CUDA graph, so launch gaps count as in
decode) and the weight bytes read per second; the best tile per shape last.
"""

import argparse
import itertools

import torch

from ditkv.models import fp8
from ditkv.models.fp8_gemv import gemv
from ditkv.models.hunyuan import router_kernel

H, I, E, TOPK, QKV = 4096, 3072, 64, 8, 6144


def timed(fn, reps=200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def weights(e, n, k):
    w8 = (torch.randn(e, n, k, device="cuda") * 100).clamp(-448, 448).to(fp8.FP8)
    return w8, torch.rand(e, n, device="cuda") / 448


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1)
    a = p.parse_args(argv)
    r = a.rows
    x = torch.randn(r, H, device="cuda", dtype=torch.bfloat16)
    q, s = fp8.quantize_rows(x)
    hq, hs = fp8.quantize_rows(torch.randn(r * TOPK, I, device="cuda", dtype=torch.bfloat16))
    ids = torch.stack([torch.randperm(E, device="cuda")[:TOPK] for _ in range(r)]).reshape(-1)
    w13, s13 = weights(E, 2 * I, H)
    w2, s2 = weights(E, H, I)
    wd, sd = weights(1, QKV, H)
    cases = {  # name: (call with a tile, weight bytes read, baseline)
        "routed gate_up": (lambda t: gemv(q, s, w13, s13, torch.bfloat16, ids, TOPK, t), r * TOPK * 2 * I * H, None),
        "routed down": (lambda t: gemv(hq, hs, w2, s2, torch.bfloat16, ids, 1, t), r * TOPK * H * I, None),
        "qkv (dense)": (lambda t: gemv(q, s, wd[0], sd[0], torch.bfloat16, tile=t), QKV * H,
                        lambda: torch._scaled_mm(q, wd[0].t(), scale_a=s, scale_b=sd[0].view(1, -1),
                                                 out_dtype=torch.bfloat16, use_fast_accum=True)),
    }
    tiles = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
             for bn, bk, nw, ns in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8), (3,))
             if bn * bk <= 32768]
    best = {}
    for name, (call, nbytes, base) in cases.items():
        if base is not None:
            us = timed(base)
            print(f"{name:16s} baseline: {us:8.2f} us  {nbytes / us / 1e6:6.2f} TB/s")
        for t in tiles:
            try:
                us = timed(lambda: call(t))
            except Exception as e:  # a tile that does not compile (registers, shared memory)
                print(f"{name:16s} {t}: {type(e).__name__}")
                continue
            print(f"{name:16s} {t}: {us:8.2f} us  {nbytes / us / 1e6:6.2f} TB/s")
            if name not in best or us < best[name][0]:
                best[name] = (us, t)
    # the grouped path of the routed experts (sort by expert, two grouped GEMMs), at this row count
    from ditkv.models.hunyuan.layers import grouped_sorted_outputs

    us = timed(lambda: grouped_sorted_outputs(x, ids, w13, w2, TOPK, (s13, s2), (q, s)))
    print(f"routed grouped path (both projections, sort, gate): {us:8.2f} us")
    wg = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)

    def torch_router():
        probs = (x.float() @ wg.float().t()).softmax(-1)
        w, i = probs.topk(TOPK, -1)
        return w / w.sum(-1, keepdim=True).clamp_min(1e-20), i

    print(f"router torch: {timed(torch_router):8.2f} us")
    for be, bk, nw in itertools.product((2, 4, 8), (512, 1024), (4,)):
        t = dict(block_e=be, block_k=bk, num_warps=nw)
        us = timed(lambda: router_kernel.route(x, wg, TOPK, t))
        print(f"router {t}: {us:8.2f} us")
        if "router" not in best or us < best["router"][0]:
            best["router"] = (us, t)
    print("==== best")
    for name, (us, t) in best.items():
        print(f"{name:16s} {us:8.2f} us  {t}")


if __name__ == "__main__":
    main()
