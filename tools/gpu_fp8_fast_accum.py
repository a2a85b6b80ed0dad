"""Does `use_fast_accum` pay on the H200 at the release shapes? Time and error of torch's rowwise FP8
GEMMs (dense 8194 x 4096 -> 6144 projections; grouped 64 experts, 65k slots) with it off and on."""
import time

import torch

from ditkv.models import fp8


def bench(fn, n=30):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


torch.manual_seed(0)
x = torch.randn(8194, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(6144, 4096, device="cuda") * 0.02
q, s = fp8.quantize_rows(x)
w8, ws = fp8.quantize_weight(w)
ref = (q.float() * s) @ (w8.float() * ws[:, None]).t()
for fast in (False, True):
    f = lambda: torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,  # noqa
                                 use_fast_accum=fast)
    print(f"dense fast_accum={fast}: {bench(f):.3f} ms rel {rel(f(), ref):.2e}")
E, H, I, S = 64, 4096, 3072, 65552
ends = torch.linspace(0, S, E + 1, device="cuda")[1:].round().to(torch.int32)
xs = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
qx, sx = fp8.quantize_rows(xs)
w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
q13, s13 = fp8.quantize_weight(w13)
del w13
base = None
for fast in (False, True):
    f = lambda: torch._scaled_grouped_mm(qx, q13.transpose(1, 2), sx.view(-1), s13, offs=ends,  # noqa
                                         out_dtype=torch.bfloat16, use_fast_accum=fast)
    try:
        y = f()
        base = y if base is None else base
        print(f"grouped fast_accum={fast}: {bench(f, 10):.3f} ms rel vs slow {rel(y, base):.2e}")
    except Exception as e:  # noqa: BLE001
        print(f"grouped fast_accum={fast}: ERR {str(e)[:200]}")
