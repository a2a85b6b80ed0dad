"""Batch invariance on one GPU: torch's kernels (cuBLAS, _grouped_mm, aten/compiled norms) vs the
batch-invariant mode's Triton kernels (ditkv/models/hunyuan/invariant*.py).

    python tools/batch_invariance_gpu.py --out bi.json        # < 3 minutes on one H200

Sections, in this order (each catches its own errors; the JSON is rewritten after each, and a
watchdog writes it and exits when --budget seconds have passed):
- e2e: the trained tiny model, 3 requests (bf16, Triton attention, CUDA graphs), images solo vs
  max_num_seqs=3, with the mode off and on: max / mean level differences per request;
- dense, grouped, norms: per op at release and tiny widths, a request's rows computed alone vs
  inside a batch (at its start and at its end) for M in {257, 514, 1028, 1542}: bitwise equal or
  not, max |diff|; error vs fp64; time at M = 1542 and 8194 (the release 1024x1024 CFG step's tokens);
- step: one batched denoise step of the release geometry (random weights, --layers layers, --requests
  CFG requests at --image px), eager and as a CUDA graph, mode off vs on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

T0 = time.perf_counter()
RESULT: dict = {"sections": {}}
MS = (257, 514, 1028, 1542)
BIG = 8194  # tokens of the release 1024x1024 CFG denoise step (2 rows x 4097)
DEV = "cuda"
SMOKE = False  # --smoke: the same code at toy widths on the CPU (TRITON_INTERPRET=1), to test this script


def d(n: int) -> int:
    """A width: as given, or 1/64 of it (>= 8) under --smoke."""
    return max(8, n // 64) if SMOKE else n
LOCK = threading.Lock()


def elapsed() -> float:
    return time.perf_counter() - T0


def save(path: str) -> None:
    with LOCK:
        RESULT["elapsed_s"] = round(elapsed(), 1)
        for _ in range(5):  # the watchdog may serialise while the main thread adds a key: retry
            try:
                text = json.dumps(RESULT, indent=1, default=str)
                break
            except RuntimeError:
                time.sleep(0.05)
        else:
            text = json.dumps({"error": "could not serialise the results"})
    with open(path, "w") as f:
        f.write(text + "\n")


def watchdog(path: str, budget: float) -> None:
    time.sleep(budget)
    RESULT["timed_out"] = f"budget of {budget:.0f} s reached; sections not finished are incomplete"
    save(path)
    with open(path) as f:
        print(f.read(), flush=True)
    os._exit(0)


def section(name: str, fn, path: str, *args):
    print(f"[{elapsed():6.1f}s] {name} ...", file=sys.stderr, flush=True)
    RESULT["sections"][name] = out = {"status": "running"}
    t0 = elapsed()
    try:
        fn(out, *args)
        out["status"] = "ok"
    except Exception as e:  # report and go on with the next section
        out["status"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    out["seconds"] = round(elapsed() - t0, 1)
    save(path)
    if DEV == "cuda":
        torch.cuda.empty_cache()


def cuda_ms(fn, repeats: int = 10) -> float:
    if DEV == "cpu":  # --smoke
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


# ---------------------------------------------------------------------------------------- ops
def invariance(op, x: torch.Tensor) -> dict:
    """op over rows: the first / last m rows of a batch of M rows vs those rows alone, m < M in MS."""
    full = {m: op(x[:m]) for m in MS}
    worst, bitwise, pairs = 0.0, True, 0
    for i, m in enumerate(MS):
        for big in MS[i + 1:]:
            for alone, inside in ((full[m], full[big][:m]), (op(x[big - m:big]), full[big][big - m:])):
                d = (alone.float() - inside.float()).abs().max().item()
                worst, bitwise, pairs = max(worst, d), bitwise and torch.equal(alone, inside), pairs + 1
    return {"bitwise": bitwise, "max_abs_diff": worst, "comparisons": pairs}


def dense_ops(out: dict, budget_end: float) -> None:
    from ditkv.models.hunyuan import invariant_kernels as K

    shapes = {  # name: (K, N, dtype)
        "release.qkv 4096->6144": (d(4096), d(6144), torch.bfloat16),
        "release.o_proj 4096->4096": (d(4096), d(4096), torch.bfloat16),
        "release.kv 4096->1024": (d(4096), d(1024), torch.bfloat16),
        "release.shared_up 4096->6144": (d(4096), d(6144), torch.bfloat16),
        "release.shared_down 3072->4096": (d(3072), d(4096), torch.bfloat16),
        "release.router fp32 4096->64": (d(4096), 64, torch.float32),
        "tiny.qkv 128->256": (128, 256, torch.bfloat16),
        "tiny.o_proj 128->128": (128, 128, torch.bfloat16),
        "tiny.router fp32 128->8": (128, 8, torch.float32),
        "timestep_mlp 256->4096 (+bias)": (256, d(4096), torch.bfloat16),
    }
    res = out["ops"] = {}
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, (k, n, dt) in shapes.items():
        if elapsed() > budget_end:
            res[name] = "skipped: section budget"
            continue
        try:
            x = torch.randn(BIG, k, device=DEV, generator=g).to(dt)
            w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dt)
            b = torch.randn(n, device=DEV, generator=g).to(dt) if "bias" in name else None
            ref = torch.nn.functional.linear(x[:MS[-1]].double(), w.double(), None if b is None else b.double())
            r = res[name] = {}
            for impl, op in (("torch", lambda t: torch.nn.functional.linear(t, w, b)),
                             ("invariant", lambda t: K.matmul(t, w, b))):
                r[impl] = invariance(op, x[:MS[-1]])
                r[impl]["max_abs_err_vs_fp64"] = (op(x[:MS[-1]]).double() - ref).abs().max().item()
                for m in (MS[-1], BIG):
                    ms = cuda_ms(lambda: op(x[:m]))
                    r[impl][f"ms_M{m}"] = round(ms, 4)
                    r[impl][f"tflops_M{m}"] = round(2 * m * k * n / ms / 1e9, 1)
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"}


def grouped_ops(out: dict, budget_end: float) -> None:
    """Expert GEMMs over the slots of a request's tokens (sorted by expert), alone vs with other
    requests' tokens in the same grouped call: the request's slot outputs compared."""
    from ditkv.models.hunyuan import invariant_kernels as K
    from ditkv.models.hunyuan.layers import sort_slots_by_expert

    cases = {"release.w13 64x(4096->6144) top8": (64, 8, d(4096), d(6144)),
             "release.w2 64x(3072->4096) top8": (64, 8, d(3072), d(4096)),
             "tiny.w13 8x(128->256) top2": (8, 2, 128, 256)}
    res = out["ops"] = {}
    g = torch.Generator(device=DEV).manual_seed(1)
    for name, (e, topk, k, n) in cases.items():
        if elapsed() > budget_end:
            res[name] = "skipped: section budget"
            continue
        try:
            x = torch.randn(BIG, k, device=DEV, generator=g).to(torch.bfloat16)
            w = (torch.randn(e, n, k, device=DEV, generator=g) / k ** 0.5).to(torch.bfloat16)
            ids = torch.rand(BIG, e, device=DEV, generator=g).topk(topk, dim=-1).indices  # [T, k] distinct

            def slots_op(kernel):
                def op(tokens: torch.Tensor, lo: int = 0, hi: int | None = None):
                    hi = tokens.shape[0] + lo if hi is None else hi
                    flat = ids[lo:hi].reshape(-1)
                    order, ends = sort_slots_by_expert(flat, e)
                    xs = tokens.index_select(0, order // topk)
                    y = kernel(xs, ends)
                    inv = torch.empty_like(order)
                    inv[order] = torch.arange(order.shape[0], device=DEV)
                    return y.index_select(0, inv).view(hi - lo, topk, n)
                return op

            impls = {"torch._grouped_mm": lambda xs, ends: torch._grouped_mm(xs, w.transpose(1, 2), offs=ends),
                     "invariant": lambda xs, ends: K.grouped_matmul(xs, ends, w)}
            r = res[name] = {}
            for impl, kern in impls.items():
                op = slots_op(kern)
                full = {m: op(x[:m]) for m in MS}
                worst, bitwise = 0.0, True
                for i, m in enumerate(MS):
                    for big in MS[i + 1:]:
                        for alone, inside in ((full[m], full[big][:m]),
                                              (op(x[big - m:big], big - m, big), full[big][big - m:])):
                            worst = max(worst, (alone.float() - inside.float()).abs().max().item())
                            bitwise = bitwise and torch.equal(alone, inside)
                r[impl] = {"bitwise": bitwise, "max_abs_diff": worst}
                flat = ids.reshape(-1)
                order, ends = sort_slots_by_expert(flat, e)
                xs = x.index_select(0, order // topk)
                ms = cuda_ms(lambda: kern(xs, ends))
                r[impl][f"ms_M{BIG}_slots"] = round(ms, 4)
                r[impl]["tflops"] = round(2 * xs.shape[0] * k * n / ms / 1e9, 1)
        except Exception as ex:
            res[name] = {"error": f"{type(ex).__name__}: {ex}"}


def norm_ops(out: dict, budget_end: float) -> None:
    from ditkv.models.hunyuan import invariant_kernels as K
    from ditkv.models.hunyuan.fused import fused
    from ditkv.models.hunyuan.layers import _rms_norm, _rope_rms_norm, rope_cos_sin

    res = out["ops"] = {}
    g = torch.Generator(device=DEV).manual_seed(2)
    compiled_rms, compiled_rope = fused(_rms_norm), fused(_rope_rms_norm)
    m, hidden, heads, hd = MS[-1], d(4096), 32 if not SMOKE else 4, 128 if not SMOKE else 8
    h = torch.randn(m, hidden, device=DEV, generator=g).to(torch.bfloat16)
    wh = torch.rand(hidden, device=DEV, generator=g).to(torch.bfloat16) + 0.5
    qkv = torch.randn(m, (heads + 16) * hd, device=DEV, generator=g).to(torch.bfloat16)  # q, then 8 K + 8 V heads
    wq = torch.rand(hd, device=DEV, generator=g).to(torch.bfloat16) + 0.5
    pos = torch.arange(m, device=DEV)
    cos, sin = rope_cos_sin(pos // 40, pos % 40, hd, 10000.0)

    def q_of(t):  # the q heads view of the fused projection, as the model passes it
        return t[:, :heads * hd].view(t.shape[0], heads, hd)

    def rope_op(fn):
        # rows of `t` are taken from the same positions of qkv (cos/sin follow the rows)
        return lambda t: fn(q_of(t), cos[_rows(t, qkv)], sin[_rows(t, qkv)], wq, 1e-6)

    ops = {
        "rms 4096 eager": (lambda t: _rms_norm(t, wh, 1e-6), h),
        "rms 4096 compiled": (lambda t: compiled_rms(t, wh, 1e-6), h),
        "rms 4096 invariant": (lambda t: K.rms_norm(t, wh, 1e-6), h),
        "rope+rms 32x128 eager": (rope_op(_rope_rms_norm), qkv),
        "rope+rms 32x128 compiled": (rope_op(compiled_rope), qkv),
        "rope+rms 32x128 invariant": (rope_op(lambda x, c, s, w, e: K.rms_norm(x, w, e, c, s)), qkv),
    }
    for name, (op, x) in ops.items():
        if elapsed() > budget_end:
            res[name] = "skipped: section budget"
            continue
        try:
            res[name] = invariance(op, x)
            res[name][f"ms_M{MS[-1]}"] = round(cuda_ms(lambda: op(x)), 4)
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"}


def _rows(t: torch.Tensor, base: torch.Tensor) -> slice:
    """Which rows of `base` the view `t` starts at (the invariance slices are views of base)."""
    start = (t.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())
    return slice(start, start + t.shape[0])


# ---------------------------------------------------------------------------------------- e2e
def e2e(out: dict) -> None:
    import numpy as np

    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest
    from ditkv.models.loader import load_model

    dtype = torch.float32 if SMOKE else torch.bfloat16
    bundle = load_model("tiny", torch.device(DEV), dtype)
    size, steps = (32, 2) if SMOKE else (64, 4)
    reqs = [GenerationRequest(prompt=p, height=size, width=size, steps=steps, guidance_scale=4.0, seed=i,
                              request_id=f"r{i}")
            for i, p in enumerate(["a large blue square", "a small red circle", "a green triangle in the top left"])]
    images = {}
    for on in (False, True):
        mode = "on" if on else "off"
        r = out[f"mode_{mode}"] = {}
        try:
            for seqs in (1, 3):
                t0 = time.perf_counter()
                cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2,
                                   block_size=64, num_kv_blocks=64, attention_backend="torch" if SMOKE else "triton",
                                   device=DEV, dtype=str(dtype).replace("torch.", ""), profile_memory=False,
                                   max_num_seqs=seqs, batch_invariant=on)
                e = Engine(cfg, model_bundle=bundle)
                for q in reqs:
                    e.add_request(q)
                outs = {o.request_id: o for o in e.run_until_complete()}
                bad = [o.error for o in outs.values() if not o.ok]
                if bad:
                    raise RuntimeError(f"requests failed (max_num_seqs={seqs}): {bad}")
                images[(on, seqs)] = [outs[q.request_id].image.astype(int) for q in reqs]
                sg = e.worker.runner.step_graphs
                r[f"seqs{seqs}"] = {"wall_s": round(time.perf_counter() - t0, 2), "batch_sizes": dict(e.batch_sizes),
                                    "graphs": [str(k) for k in sg.graphs] if sg is not None else None}
                e.shutdown()
            diffs = [np.abs(a - b) for a, b in zip(images[(on, 1)], images[(on, 3)])]
            r["solo_vs_batched_max_levels"] = [int(d.max()) for d in diffs]
            r["solo_vs_batched_mean_levels"] = [round(float(d.mean()), 4) for d in diffs]
            r["within_1_level"] = max(int(d.max()) for d in diffs) <= 1
            r["bit_identical"] = all(int(d.max()) == 0 for d in diffs)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc()[-2000:]
    if (False, 1) in images and (True, 1) in images:  # how far the mode moves a solo image
        d = [np.abs(a - b) for a, b in zip(images[(False, 1)], images[(True, 1)])]
        out["solo_off_vs_on"] = {"max_levels": [int(x.max()) for x in d], "mean_levels": [round(float(x.mean()), 4)
                                                                                          for x in d]}


# --------------------------------------------------------------------------------------- step
def step(out: dict, args) -> None:
    from ditkv.bench.step_release import random_model_on_device, release_config
    from ditkv.config import EngineConfig
    from ditkv.engine.engine import Engine
    from ditkv.engine.types import GenerationRequest
    from ditkv.models.hunyuan import ByteTokenizer
    from ditkv.models.hunyuan.codec import make_codec
    from ditkv.models.hunyuan.invariant import set_batch_invariant
    from ditkv.worker.cuda_graph import DenoiseStepGraph
    from ditkv.worker.dit_runner import StepItem
    from ditkv.worker.rows import DENOISE, PREFILL

    cfg = release_config(args.layers, shrink=SMOKE)
    model = random_model_on_device(cfg, torch.device(DEV), torch.float32 if SMOKE else torch.bfloat16)
    tokens = args.prefix + (args.image // cfg.image_token_downsample) ** 2 + 16
    ecfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2, block_size=64,
                        device=DEV, attention_backend="torch" if SMOKE else "triton",
                        num_kv_blocks=(args.requests + 1) * 2 * -(-tokens // 64),
                        max_prompt_tokens=args.prefix, max_image_height=args.image, max_image_width=args.image,
                        profile_memory=False, cuda_graphs="off", max_num_seqs=args.requests)
    e = Engine(ecfg, model_bundle=(model, ByteTokenizer(), make_codec(cfg)))
    runner = e.worker.runner
    try:
        for i in range(args.requests):
            e.add_request(GenerationRequest(prompt="a" * (args.prefix - 8), height=args.image, width=args.image,
                                            steps=2, guidance_scale=5.0, seed=i, request_id=f"s{i}"))
        admitted = e.scheduler.schedule().admitted
        for s in admitted:
            e.worker.install(s.metadata)
        rids, layouts = [s.request_id for s in admitted], [s.payload[0] for s in admitted]
        g = torch.Generator(device=DEV).manual_seed(0)
        xs = [torch.randn(1, cfg.latent_channels, lay.h, lay.w, device=DEV, generator=g) for lay in layouts]
        t = torch.tensor([500.0], device=DEV)
        out.update(layers=args.layers, requests=len(rids), image=args.image, prefix=args.prefix,
                   denoise_tokens=sum(r.target_len for lay in layouts for r in lay.rows))
        with torch.inference_mode():
            runner.forward_batch([StepItem(r, lay, x, t, PREFILL, True) for r, lay, x in zip(rids, layouts, xs)])
            items = [StepItem(r, lay, x, t, DENOISE, False) for r, lay, x in zip(rids, layouts, xs)]
            vel = {}
            for on in (False, True):
                mode = "on" if on else "off"
                set_batch_invariant(on)
                r = out[f"mode_{mode}"] = {}
                vel[on] = runner.forward_batch(items)[0]  # warm-up (compiles), and the output kept
                r["eager_ms"] = round(cuda_ms(lambda: runner.forward_batch(items), 5), 3)
                if DEV == "cuda" and elapsed() < args.budget - 25:
                    graph = DenoiseStepGraph(runner, rids, layouts, guidance=[None] * len(rids))
                    r["graph_ms"] = round(cuda_ms(lambda: graph.replay(xs, [t] * len(rids)), 10), 3)
                    del graph
                    torch.cuda.empty_cache()
            if "graph_ms" in out["mode_on"] and "graph_ms" in out["mode_off"]:
                out["graph_slowdown_on_vs_off"] = round(out["mode_on"]["graph_ms"] / out["mode_off"]["graph_ms"], 3)
            out["eager_slowdown_on_vs_off"] = round(out["mode_on"]["eager_ms"] / out["mode_off"]["eager_ms"], 3)
            rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(vel[True], vel[False]))
            out["velocity_max_rel_diff_on_vs_off"] = rel
    finally:
        set_batch_invariant(False)
        e.shutdown()


def main():
    global DEV, SMOKE, MS, BIG
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget", type=float, default=165.0, help="seconds before the watchdog writes and exits")
    p.add_argument("--layers", type=int, default=2, help="release-geometry layers of the step timing")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--image", type=int, default=512)
    p.add_argument("--prefix", type=int, default=64)
    p.add_argument("--skip", default="", help="comma list of sections to skip: dense,grouped,norms,e2e,step")
    p.add_argument("--smoke", action="store_true",
                   help="test this script on a CPU: toy widths, TRITON_INTERPRET=1, no graphs (numbers mean nothing)")
    args = p.parse_args()
    if args.smoke:
        DEV, SMOKE, MS, BIG = "cpu", True, (5, 9, 17, 26), 40
        args.image, args.prefix = 32, 16
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
    skip = set(filter(None, args.skip.split(",")))
    RESULT["machine"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                         "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                         "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton

        RESULT["machine"]["triton"] = triton.__version__
    except ImportError as e:
        RESULT["machine"]["triton"] = f"missing: {e}"
    if DEV == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        RESULT["error"] = "TRITON_INTERPRET is set: unset it to compile the kernels for the GPU"
        save(args.out)
        print(json.dumps(RESULT, indent=1))
        return
    if DEV == "cuda" and not torch.cuda.is_available():
        RESULT["error"] = "no CUDA device"
        save(args.out)
        print(json.dumps(RESULT, indent=1))
        return
    threading.Thread(target=watchdog, args=(args.out, args.budget), daemon=True).start()
    if "e2e" not in skip:  # the goal's measure first
        section("e2e", e2e, args.out)
    for name, fn, seconds in (("dense", dense_ops, 30), ("grouped", grouped_ops, 15), ("norms", norm_ops, 12)):
        if name not in skip:  # each op section stops starting new ops after its share
            section(name, fn, args.out, elapsed() + seconds * args.budget / 165)
    if "step" not in skip:
        section("step", step, args.out, args)
    RESULT["done"] = True
    save(args.out)
    print(json.dumps(RESULT, indent=1, default=str), flush=True)


if __name__ == "__main__":
    main()
