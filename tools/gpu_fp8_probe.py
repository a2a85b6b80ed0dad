"""One-off probe of torch's FP8 ops on the device (API, constraints, speed): prints findings."""
import time
import torch

dev = "cuda"
F8 = torch.float8_e4m3fn
print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())


def q_rows(x):
    s = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x.float() / s).clamp(-448, 448).to(F8), s


def bench(fn, n=20):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


# _scaled_mm rowwise, odd M
for m in (1, 7, 100, 8194):
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device=dev, dtype=torch.bfloat16)
    xq, xs = q_rows(x)
    wq, ws = q_rows(w)
    try:
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
        ref = (xq.float() * xs) @ (wq.float() * ws).t()
        print("scaled_mm", m, "ok rel", ((y.float() - ref).norm() / ref.norm()).item())
    except Exception as e:
        print("scaled_mm", m, "ERR", str(e)[:300])

# grouped: 2D x 3D
E, H, I = 64, 4096, 3072
for tot in (37, 1000, 65536):
    ends = torch.sort(torch.randint(0, tot + 1, (E,), device=dev))[0].to(torch.int32)
    ends[-1] = tot
    x = torch.randn(tot, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    xq, xs = q_rows(x)
    wq, ws = q_rows(w)  # ws [E, 2I, 1]
    for label, sa, sb in (("sa[M] sb[E,N]", xs.view(-1), ws.view(E, -1)),):
        try:
            y = torch._scaled_grouped_mm(xq, wq.transpose(1, 2), sa, sb, offs=ends, out_dtype=torch.bfloat16)
            # reference
            ref = torch.empty(tot, 2 * I, device=dev)
            st = 0
            for e in range(E):
                en = int(ends[e])
                if en > st:
                    ref[st:en] = (xq[st:en].float() * xs[st:en]) @ (wq[e].float() * ws[e]).t()
                st = en
            print("grouped", tot, label, "ok rel", ((y.float() - ref).norm() / ref.norm()).item())
        except Exception as e:
            print("grouped", tot, label, "ERR", str(e)[:400])
    if tot == 65536:
        wb = w
        tb = bench(lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=ends))
        tf = bench(lambda: torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs.view(-1), ws.view(E, -1), offs=ends,
                                                     out_dtype=torch.bfloat16))
        print(f"grouped 65k bf16 {tb:.3f} ms fp8 {tf:.3f} ms")
        # graph capture of grouped fp8
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            out = torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs.view(-1), ws.view(E, -1), offs=ends,
                                           out_dtype=torch.bfloat16)
            with torch.cuda.graph(g):
                out2 = torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs.view(-1), ws.view(E, -1), offs=ends,
                                                out_dtype=torch.bfloat16)
        g.replay(); torch.cuda.synchronize()
        print("graph replay equal", torch.equal(out, out2))
        qc = torch.compile(q_rows, dynamic=True)
        print("quant eager ms", bench(lambda: q_rows(x)), "compiled ms", bench(lambda: qc(x)))
# 3D weight scale shape alternative: per-tensor broadcast
print("mem", torch.cuda.mem_get_info())
