"""`ditkv bench loading`: what sliced per-rank checkpoint loading saves over load-all-then-shard.

A synthetic checkpoint (several safetensors files) is written once to a temp folder. For every
(tp, ep) layout and every rank, two FRESH subprocesses load it (so `ru_maxrss` is one load's peak):
  full:   `load_checkpoint` (the whole checkpoint) then `shard_model` to the rank's shard;
  sliced: `load_checkpoint_shard` (reads only the rank's slices).
Measured per load: wall time, peak RSS, bytes read (file bytes for full, `ShardReadStats.bytes_read`
for sliced) and the kept parameter bytes. The full child of rank 0 of each layout also loads the
sliced shard after its measurement and checks the two are equal tensor for tensor.

Default preset `moe`: the release structure (64 experts top-8 + shared, 32/8-style GQA with
head_dim 128) at hidden 1024 so that, as in the 80B release, experts are most of the bytes
(~1.7 GB bf16). `wide` uses the release widths (hidden 4096) with few layers and experts: its
replicated image modules (~0.7 GB) are a much larger share than in the release.
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from types import SimpleNamespace

from ..argtypes import positive_float, positive_int, positive_int_list
from .common import emit, machine

PRESETS = {  # name -> (default layers, default experts)
    "tiny": (2, 8),
    "moe": (4, 64),
    "wide": (1, 16),
}


def add_arguments(p):
    p.add_argument("--preset", choices=sorted(PRESETS), default="moe",
                   help="model shape: " + ", ".join(f"{k} ({l} layers, {e} experts)" for k, (l, e) in PRESETS.items()))
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default per preset)")
    p.add_argument("--experts", type=positive_int, default=None, help="routed experts per layer (default per preset)")
    p.add_argument("--tp", type=positive_int_list, default=[1, 2, 4], help="comma-separated tensor-parallel sizes")
    p.add_argument("--no-ep", action="store_true", help="skip the expert-parallel layouts (ep = tp)")
    p.add_argument("--shard-mib", type=positive_float, default=None,
                   help="max safetensors file size (default: checkpoint / 6, so several files)")
    p.add_argument("--jobs", type=positive_int, default=1, help="child loads run at once (>1 skews the times)")
    p.add_argument("--workdir", default=None, help="where the temp checkpoint goes (default: system temp)")
    p.add_argument("--json", action="store_true", help="print one JSON object only (else a table, then the JSON)")


def make_config(preset: str, layers: int | None = None, experts: int | None = None):
    from ..models.hunyuan import HunyuanImage3Config

    d_layers, d_experts = PRESETS[preset]
    layers, experts = layers or d_layers, experts or d_experts
    if preset == "tiny":
        return HunyuanImage3Config.tiny().replace(num_hidden_layers=layers, num_experts=experts)
    specials = {k: v for k, v in HunyuanImage3Config.tiny().to_dict().items() if k.endswith("_token_id")}
    base = HunyuanImage3Config.release().to_dict()
    base.update(num_hidden_layers=layers, num_experts=experts, vocab_size=1024, **specials)
    if preset == "moe":
        base.update(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, attention_head_dim=128,
                    intermediate_size=1024, moe_intermediate_size=1024, moe_topk=min(8, experts))
    else:
        base.update(moe_topk=min(2, experts))
    return HunyuanImage3Config.from_dict(base)


def spec(rank: int, tp: int, ep: int):
    return SimpleNamespace(tp_rank=rank % tp, tp_size=tp, tp_group=None,
                           ep_rank=rank if ep > 1 else 0, ep_size=ep, ep_group=None)


def layouts(cfg, tps: list[int], with_ep: bool) -> list[tuple[int, int]]:
    """(tp, ep) pairs to measure; EP is over the whole replica (ep = tp) as in the engine and is
    left out where the config cannot split its experts. A requested tp the model cannot split is
    a `ConfigError` (nothing is written before it)."""
    from ..errors import ConfigError
    from ..models.hunyuan.sharded_load import _check_spec

    out = []
    for tp in tps:
        _check_spec(cfg, spec(0, tp, 1))  # raises, naming the field: pick another --tp
        out.append((tp, 1))
        if with_ep and tp > 1:
            try:
                _check_spec(cfg, spec(0, tp, tp))
            except ConfigError:
                continue
            out.append((tp, tp))
    return out


# ------------------------------------------------------------------ child process
def _nbytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _reset_peak() -> None:
    """Reset this process's peak RSS to its current RSS (Linux clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass  # the peak then also counts what the process held before the load


def _rss() -> tuple[int, int]:
    """(RssAnon, RssFile) bytes: private memory, and file pages mapped (here: checkpoint pages touched)."""
    got = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("RssAnon:", "RssFile:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got.get("RssAnon", 0), got.get("RssFile", 0)


class _Sampler:
    """Peak RssAnon / RssFile growth over a block, sampled every 2 ms (approximate)."""

    def __enter__(self):
        import threading

        self.base = _rss()
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(0.002):
            self._take()

    def _take(self):
        self.peak = [max(p, v) for p, v in zip(self.peak, _rss())]

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take()


def _touch(model) -> None:
    """Read one element per 4 KiB page of every kept tensor: `load_file` returns tensors backed by
    the file's mmap, so without this the full path would leave most of its shard unread on CPU
    (a device copy would read it all)."""
    for t in list(model.parameters()) + list(model.buffers()):
        flat = t.detach().reshape(-1)
        flat[::max(1, 4096 // t.element_size())].float().sum()


def child(job: dict) -> dict:
    """One load in this fresh process (forked from a server that only imported torch + ditkv;
    torch._dynamo too, which building the model would otherwise import inside the timed load)."""
    import os

    import torch

    from ..models.hunyuan import load_checkpoint
    from ..models.hunyuan.parallel_layers import shard_model
    from ..models.hunyuan.sharded_load import ShardReadStats, load_checkpoint_shard

    folder, path = job["folder"], job["path"]
    s = spec(job["rank"], job["tp"], job["ep"])
    _reset_peak()
    with _Sampler() as rss:
        t0 = time.perf_counter()
        if path == "full":
            model = shard_model(load_checkpoint(folder), s)
            read = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                       if n.endswith(".safetensors"))
        else:
            stats = ShardReadStats()
            model = load_checkpoint_shard(folder, s, stats=stats)
            read = stats.bytes_read
        _touch(model)
        elapsed = time.perf_counter() - t0
    out = {"time_s": elapsed, "bytes_read": read, "kept_bytes": _nbytes(model),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
           "peak_anon_growth_bytes": rss.peak[0] - rss.base[0],
           "peak_file_pages_bytes": rss.peak[1] - rss.base[1]}
    if path == "full" and job.get("verify"):  # after the measurement: does not change the peak above
        ref = dict(model.named_parameters())
        got = dict(load_checkpoint_shard(folder, s).named_parameters())
        out["equal"] = list(got) == list(ref) and all(
            got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in ref)
    return out


def _child_entry(job: dict, conn) -> None:
    conn.send(child(job))
    conn.close()


def run_children(jobs: list[dict], parallel: int) -> list[dict]:
    """Each job in its own fresh process, forked by a forkserver that imported torch once;
    `parallel` at a time. A child that dies (e.g. out of memory) fails the run naming its job."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "ditkv.models.hunyuan",
                                "ditkv.models.hunyuan.sharded_load", "safetensors.torch"])
    results: list[dict] = []
    for start in range(0, len(jobs), max(1, parallel)):
        running = []
        for job in jobs[start:start + max(1, parallel)]:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_entry, args=(job, send), daemon=True)
            proc.start()
            send.close()
            running.append((job, proc, recv))
        for job, proc, recv in running:
            try:
                results.append(recv.recv())
            except EOFError:
                proc.join()
                raise RuntimeError(f"load child {job} died (exit code {proc.exitcode})") from None
            proc.join()
    return results


# ------------------------------------------------------------------ parent
def write_checkpoint(cfg, folder, shard_mib: float | None) -> dict:
    import torch

    from ..models.hunyuan import HunyuanImage3Model, save_checkpoint

    model = HunyuanImage3Model.from_config(cfg, seed=0, zero_init_resblocks=False, dtype=torch.bfloat16)
    sd = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    experts = sum(t.numel() * t.element_size() for k, t in sd.items() if ".mlp.experts." in k)
    limit = int(shard_mib * (1 << 20)) if shard_mib else max(1 << 16, total // 6)
    files = save_checkpoint(model, folder, max_shard_bytes=limit)
    return {"tensor_bytes": total, "expert_share": experts / total, "files": len(files),
            "file_bytes": sum(p.stat().st_size for p in files)}


def _pair(full: dict, sliced: dict, key: str) -> str:
    return f"{full[key] / (1 << 20):.0f} / {sliced[key] / (1 << 20):.0f}"


def _ratio(a, b):
    return a / b if b else float("nan")


def run(args) -> dict:
    cfg = make_config(args.preset, args.layers, args.experts)
    tps = list(args.tp)
    plan = layouts(cfg, tps, not args.no_ep)
    folder = tempfile.mkdtemp(prefix="ditkv-loadbench-", dir=args.workdir)
    try:
        ckpt = write_checkpoint(cfg, folder, args.shard_mib)
        ckpt.update(preset=args.preset, layers=cfg.num_hidden_layers, experts=cfg.num_experts,
                    hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size, dtype="bfloat16")
        jobs = []
        for tp, ep in plan:
            for rank in range(max(tp, ep)):
                for path in ("full", "sliced"):
                    jobs.append({"folder": folder, "path": path, "tp": tp, "ep": ep, "rank": rank,
                                 "verify": path == "full" and rank == 0})
        results = run_children(jobs, args.jobs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    runs, table, mb = [], [], 1 << 20
    for i in range(0, len(jobs), 2):
        j, full, sliced = jobs[i], results[i], results[i + 1]
        equal = full.pop("equal", None)
        ratio = {k: _ratio(sliced[k], full[k]) for k in ("time_s", "peak_rss_bytes", "bytes_read")}
        for k in ("peak_anon_growth_bytes", "peak_file_pages_bytes"):
            ratio[k] = _ratio(sliced[k], full[k])
        runs.append({"tp": j["tp"], "ep": j["ep"], "rank": j["rank"], "full": full, "sliced": sliced,
                     "ratio_sliced_over_full": ratio, "equal": equal})
        table.append({"tp": j["tp"], "ep": j["ep"], "rank": j["rank"],
                      "time_s full/sliced": f"{full['time_s']:.2f} / {sliced['time_s']:.2f}",
                      "peak_rss_MiB": _pair(full, sliced, "peak_rss_bytes"), "anon_MiB": _pair(full, sliced, "peak_anon_growth_bytes"),
                      "file_pages_MiB": _pair(full, sliced, "peak_file_pages_bytes"), "read_MiB": _pair(full, sliced, "bytes_read"),
                      "kept_MiB": f"{sliced['kept_bytes'] / mb:.0f}", "equal": "-" if equal is None else equal})
    result = {"checkpoint": ckpt, "jobs": args.jobs, "runs": runs,
              "machine": machine()}
    emit(result, args.json, table, list(table[0]) if table else None)
    return result
