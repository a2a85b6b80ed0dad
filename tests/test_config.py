import argparse

import pytest
import torch

from ditkv.config import EngineConfig
from ditkv.entrypoints.engine_args import add_engine_arguments, config_from_args
from ditkv.errors import ConfigError


def test_defaults_are_paged_with_two_rows_and_valid():
    cfg = EngineConfig()
    assert cfg.diffusion_kv_mode == "paged_scheduler" and cfg.paged
    assert cfg.diffusion_kv_max_rows_per_request == 2  # CFG's cond + uncond; a one-row request fits too
    assert cfg.block_size == 64 and cfg.block_size % 16 == 0
    assert EngineConfig.from_dict({}) == cfg  # a YAML file without the keys gets the same


def test_generate_and_serve_parse_to_the_config_defaults():
    from ditkv.entrypoints.cli import build_parser

    p = build_parser()
    for argv in (["generate", "--prompt", "a large blue square"], ["serve"]):
        cfg = config_from_args(p.parse_args(argv))
        assert cfg.paged and cfg.diffusion_kv_max_rows_per_request == 2, argv


def test_dense_legacy_stays_selectable(tmp_path):
    from ditkv.entrypoints.cli import build_parser

    assert not EngineConfig(diffusion_kv_mode="dense_legacy").paged
    # rows unset by a dense caller (the old spelling) is still accepted
    assert not EngineConfig(diffusion_kv_mode="dense_legacy", diffusion_kv_max_rows_per_request=None).paged
    args = build_parser().parse_args(["generate", "--prompt", "a large blue square", "--mode", "dense_legacy"])
    assert config_from_args(args).diffusion_kv_mode == "dense_legacy"
    y = tmp_path / "dense.yaml"
    y.write_text("diffusion_kv_mode: dense_legacy\n")
    assert not config_from_args(_parse(["--config", str(y)])).paged


@pytest.mark.parametrize("changes, field", [
    ({"diffusion_kv_mode": "paged"}, "diffusion_kv_mode"),
    ({"diffusion_kv_max_rows_per_request": None}, "diffusion_kv_max_rows_per_request"),  # paged needs a limit
    ({"diffusion_kv_max_rows_per_request": 0}, "diffusion_kv_max_rows_per_request"),
    ({"diffusion_kv_max_rows_per_request": 1.5}, "diffusion_kv_max_rows_per_request"),
    ({"block_size": 24}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": -2}, "max_model_len"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"attention_backend": "flash"}, "attention_backend"),
    ({"fp8_fast_accum": "yes"}, "fp8_fast_accum"),
    ({"fp8_fast_accum": True}, "fp8_fast_accum"),  # without quantization=fp8 it would mean nothing
    ({"quantization": "fp8", "fp8_grouped_gemm": "cutlass"}, "fp8_grouped_gemm"),
    ({"fp8_grouped_gemm": "quack"}, "fp8_grouped_gemm"),  # without quantization=fp8 it would mean nothing
    ({"diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2,
      "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"diffusion_kv_mode": "paged_scheduler", "diffusion_kv_max_rows_per_request": 2,
      "max_num_batched_tokens": "4k"}, "max_num_batched_tokens"),
    # dense mode refuses the batching knobs: it would otherwise accept them and silently not batch
    ({"diffusion_kv_mode": "dense_legacy", "max_num_seqs": 2}, "max_num_seqs"),
    ({"diffusion_kv_mode": "dense_legacy", "max_num_batched_tokens": 4096}, "max_num_batched_tokens"),
])
def test_bad_values_name_field_value_and_fix(changes, field):
    with pytest.raises(ConfigError) as ei:
        EngineConfig(**changes)
    msg = str(ei.value)
    assert ei.value.field == field and field in msg
    assert repr(changes.get(field, ei.value.value)) in msg or str(ei.value.value) in msg
    assert ":" in msg and len(ei.value.fix) > 10  # a fix is stated


def test_paged_mode_takes_the_batching_knobs_and_dense_names_the_fix():
    cfg = EngineConfig(diffusion_kv_mode="paged_scheduler", diffusion_kv_max_rows_per_request=2)
    assert cfg.paged and cfg.replace(max_num_seqs=4, max_num_batched_tokens=8192).max_num_seqs == 4
    with pytest.raises(ConfigError, match="step_execution.*removed.*step by step") as ei:
        EngineConfig.from_dict({"step_execution": True})
    assert ei.value.field == "step_execution"
    with pytest.raises(ConfigError, match="diffusion_kv_mode=paged_scheduler"):
        EngineConfig(diffusion_kv_mode="dense_legacy", max_num_seqs=4)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(argv)


def test_yaml_then_cli_override(tmp_path):
    y = tmp_path / "stage.yaml"
    y.write_text("engine:\n  diffusion_kv_mode: paged_scheduler\n  diffusion_kv_max_rows_per_request: 2\n"
                 "  block_size: 32\n")
    cfg = config_from_args(_parse(["--config", str(y), "--block-size", "128"]))
    assert cfg.paged and cfg.diffusion_kv_max_rows_per_request == 2 and cfg.block_size == 128
    top = tmp_path / "flat.yaml"
    top.write_text("block_size: 16\nmax_model_len: 4096\n")
    cfg2 = config_from_args(_parse(["--config", str(top), "--mode", "dense_legacy"]))
    assert cfg2.block_size == 16 and cfg2.max_model_len == 4096 and not cfg2.paged


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        config_from_args(_parse(["--config", str(tmp_path / "missing.yaml")]))
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_sise: 16\n")
    with pytest.raises(ConfigError, match="block_sise.*valid keys"):
        config_from_args(_parse(["--config", str(bad)]))
    notmap = tmp_path / "list.yaml"
    notmap.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        config_from_args(_parse(["--config", str(notmap)]))


def test_fp8_fast_accum_is_a_process_setting_on_unless_turned_off():
    from ditkv.models import fp8
    from ditkv.worker.threads import apply_process_settings

    try:
        apply_process_settings(EngineConfig(quantization="fp8", fp8_fast_accum=False))
        assert not fp8.FAST_ACCUM["on"]
        apply_process_settings(EngineConfig(quantization="fp8"))
        assert fp8.FAST_ACCUM["on"]  # unset: on, as vLLM's FP8 kernels run on Hopper
        apply_process_settings(EngineConfig(quantization="fp8", fp8_fast_accum=True))
        assert fp8.FAST_ACCUM["on"]
    finally:
        fp8.set_fast_accum(True)


def test_quack_grouped_gemm_says_why_it_cannot_run(monkeypatch):
    from ditkv.models import fp8_quack

    assert "runs on CUDA, got cpu" in fp8_quack.unusable("cpu")
    if not torch.cuda.is_available():
        assert "no CUDA device" in fp8_quack.unusable("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "sm90" in fp8_quack.unusable("cuda") and "sm80" in fp8_quack.unusable("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def broken(error):
        def load():
            raise error
        return load
    monkeypatch.setattr(fp8_quack, "_epilogue", broken(ImportError("No module named 'quack'")))
    assert "not importable" in fp8_quack.unusable("cuda") and "ditkv[fa4]" in fp8_quack.unusable("cuda")
    monkeypatch.setattr(fp8_quack, "_epilogue", broken(OSError("libcute_dsl_runtime.so: cannot open")))
    assert "failed to load (OSError" in fp8_quack.unusable("cuda")


def test_fp8_grouped_gemm_is_a_process_setting_auto_unless_set():
    from ditkv.errors import BackendError
    from ditkv.models import fp8
    from ditkv.worker.threads import apply_process_settings

    try:
        apply_process_settings(EngineConfig(quantization="fp8", fp8_grouped_gemm="torch"))
        assert fp8.GROUPED["impl"] == "torch"
        apply_process_settings(EngineConfig(quantization="fp8"))
        assert fp8.GROUPED["impl"] == "auto"
        assert fp8.grouped_gemm_impl("cpu") == "torch"  # the CPU reference has no grouped kernel to swap
        with pytest.raises(ValueError, match="auto, torch, quack"):
            fp8.set_grouped_gemm("cutlass")
        if not torch.cuda.is_available():  # an explicit quack where it cannot run is refused by name
            fp8.set_grouped_gemm("quack")
            with pytest.raises(BackendError, match="fp8_grouped_gemm='quack'.*no CUDA device"):
                fp8.grouped_gemm_impl("cuda")
    finally:
        fp8.set_grouped_gemm(None)
