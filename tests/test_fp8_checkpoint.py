"""FP8 checkpoints (fp8_checkpoint.py, `ditkv quantize`): streaming online quantization equals
quantizing the loaded model, pre-quantized folders load as FP8 (per-channel and per-tensor scales,
whole and sliced per TP/EP rank), every scheme ditkv cannot run is refused naming the tensor or
the config key, and `--model OUT` of `ditkv quantize` gives the image `--quantization fp8` gives."""

from __future__ import annotations

import copy
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from ditkv.entrypoints.cli import main
from ditkv.entrypoints.quantize import PeakMemory, quantize_folder
from ditkv.errors import ConfigError
from ditkv.models import fp8
from ditkv.models.hunyuan import (
    HunyuanImage3Config,
    HunyuanImage3Model,
    load_checkpoint,
    save_checkpoint,
)
from ditkv.models.hunyuan import checkpoint as ckpt
from ditkv.models.hunyuan import fp8_checkpoint as f8
from ditkv.models.hunyuan.parallel_layers import shard_model
from ditkv.models.hunyuan.quantize import (
    QUANTIZED,
    apply_quantization,
    quantization_of,
    quantize_model,
)
from ditkv.models.hunyuan.sharded_load import load_checkpoint_shard
from ditkv.models.loader import TINY_ASSET, load_model

FP8 = fp8.FP8
CFG = HunyuanImage3Config.tiny().replace(num_hidden_layers=2)
O = "model.layers.0.self_attn.o_proj"
QKV = "model.layers.1.self_attn.qkv_proj"
G = "model.layers.1.mlp.experts.3.gate_and_up_proj"
D = "model.layers.1.mlp.experts.3.down_proj"
SINGLE = "model-00001-of-00001.safetensors"


def quiet(line: str) -> None:  # log= sink
    pass


def spec(rank: int, tp: int, ep: int):
    return SimpleNamespace(tp_rank=rank % tp, tp_size=tp, tp_group=None,
                           ep_rank=rank if ep > 1 else 0, ep_size=ep, ep_group=None)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The tiny architecture (2 layers) stored in fp32 over several files, with extra files."""
    model = HunyuanImage3Model.from_config(CFG, seed=3, zero_init_resblocks=False)
    folder = tmp_path_factory.mktemp("plain")
    assert len(save_checkpoint(model, folder, max_shard_bytes=64 << 10)) > 2
    (folder / "generation_config.json").write_text(json.dumps({"diff_infer_steps": 8}))
    (folder / "NOTES.txt").write_text("copied as it is\n")
    return folder


@pytest.fixture(scope="module")
def prequant(plain, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "fp8"
    quantize_folder(str(plain), out, log=quiet)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(bits(got[k]), bits(w)), k


def post_hoc(folder, dtype=None, ignored=()):
    """The reference: load in the stored dtype, quantize the whole model, then cast what the loader casts."""
    model = load_checkpoint(folder)
    quantize_model(model, ignored)
    for name, p in list(model.named_parameters()):
        keep = p.dtype == FP8 or name.endswith((".weight_scale", ".mlp.gate.wg.weight"))
        if dtype is not None and not keep:
            mod, leaf = name.rsplit(".", 1)
            model.get_submodule(mod)._parameters[leaf] = torch.nn.Parameter(p.to(dtype), requires_grad=False)
    return model


def edited(src, dst, tensors=None, config=None):
    """A copy of `src` in one safetensors file, `tensors(state)` and `config(dict)` applied."""
    dst.mkdir()
    state = {}
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            state.update(load_file(str(p)))
        elif p.name != ckpt.INDEX_NAME:
            shutil.copy(p, dst / p.name)
    if tensors:
        tensors(state)
    save_file(state, str(dst / SINGLE), metadata={"format": "pt"})
    (dst / ckpt.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(state, SINGLE)}))
    if config:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


# ------------------------------------------------------------------ streaming online quantization
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bf16"])
def test_streaming_equals_quantizing_the_loaded_model(plain, dtype):
    got = load_checkpoint(plain, dtype=dtype, quantization="fp8")
    assert quantization_of(got) == "fp8"
    assert_same(got.state_dict(), post_hoc(plain, dtype).state_dict())
    assert got.model.layers[0].mlp.gate.wg.weight.dtype == torch.float32
    assert got.model.layers[0].self_attn.o_proj.weight_scale.dtype == torch.float32


def test_streaming_keeps_ignored_layers_unquantized(plain):
    got = load_checkpoint(plain, quantization="fp8", ignored=("model.layers.0.*",))
    assert_same(got.state_dict(), post_hoc(plain, ignored=("model.layers.0.*",)).state_dict())
    assert got.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert got.model.layers[1].self_attn.o_proj.weight.dtype == FP8


def test_no_unquantized_target_weight_is_ever_assigned(plain, monkeypatch):
    """The model never exists in the unquantized dtype: each file's target weights reach the model
    already e4m3, and one assignment holds at most one file's worth of tensors."""
    calls = []
    real = HunyuanImage3Model.load_state_dict

    def spy(self, state, *a, **kw):
        calls.append({k: (v.dtype, v.numel() * v.element_size()) for k, v in state.items()})
        return real(self, state, *a, **kw)

    monkeypatch.setattr(HunyuanImage3Model, "load_state_dict", spy)
    load_checkpoint(plain, dtype=torch.bfloat16, quantization="fp8")
    files = ckpt._weight_files(plain)
    assert len(calls) == len(files) > 2
    largest = max((plain / name).stat().st_size for name in files)
    for state in calls:
        targets = [k for k in state if k.endswith(".weight") and QUANTIZED.search(k[:-7])]
        assert all(state[k][0] == FP8 for k in targets)
        assert sum(b for _, b in state.values()) <= largest


def test_meta_structure_is_quantize_models(plain):
    """apply_plan builds what quantize_model builds on meta (without running its ops)."""
    with torch.device("meta"):
        a, b = HunyuanImage3Model(CFG), HunyuanImage3Model(CFG)
    quantize_model(a)
    f8.apply_plan(b, f8.plan_fp8(b, {}, "fp8"))
    assert [(k, v.dtype, v.shape) for k, v in a.state_dict().items()] == \
        [(k, v.dtype, v.shape) for k, v in b.state_dict().items()]


def test_peak_memory_of_a_streaming_load_is_measured(plain):
    with PeakMemory() as peak:
        load_checkpoint(plain, quantization="fp8")
    assert peak.peak > 0 and peak.added >= 0 and peak.kind == "RSS"
    print(f"streaming load of {plain.name}: peak RSS {peak.peak} bytes (+{peak.added})")


# ------------------------------------------------------------------ pre-quantized folders
@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bf16"])
def test_prequantized_folder_loads_as_fp8_and_equals_online(plain, prequant, quantization, dtype):
    got = load_checkpoint(prequant, dtype=dtype, quantization=quantization)
    assert quantization_of(got) == "fp8"
    assert_same(got.state_dict(), load_checkpoint(plain, dtype=dtype, quantization="fp8").state_dict())


def test_prequantized_layout_on_disk(plain, prequant):
    index = json.loads((prequant / ckpt.INDEX_NAME).read_text())
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(prequant / name)))
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert state[QKV + ".weight"].dtype == FP8 and state[QKV + ".weight_scale"].shape == (CFG.qkv_rows,)
    assert state[QKV + ".weight_scale"].dtype == torch.float32
    stored = load_file(str(plain / json.loads((plain / ckpt.INDEX_NAME).read_text())["weight_map"][QKV + ".weight"]))
    q, s = fp8.quantize_weight(stored[QKV + ".weight"])  # the release grouped row order, scale included
    assert torch.equal(bits(state[QKV + ".weight"]), bits(q)) and torch.equal(state[QKV + ".weight_scale"], s)
    assert state["model.ln_f.weight"].dtype == torch.float32  # not a target: as stored
    cfg = json.loads((prequant / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": None, "ignored_layers": []}
    assert (prequant / "generation_config.json").read_text() == (plain / "generation_config.json").read_text()
    assert (prequant / "NOTES.txt").is_file()


def _per_tensor(state, mod, shape):
    w = fp8.dequantize(state[mod + ".weight"], state[mod + ".weight_scale"])
    s = w.abs().amax().clamp_min(fp8.AMAX_MIN) / fp8.FP8_MAX
    state[mod + ".weight"] = (w / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(FP8)
    state[mod + ".weight_scale"] = s.reshape(shape)
    return state[mod + ".weight"], s


@pytest.fixture(scope="module")
def per_tensor(prequant, tmp_path_factory):
    """o_proj with a [] scale, qkv_proj with a [1] scale, an expert's down_proj with [out, 1]."""
    made = {}

    def edit(st):
        made[O] = _per_tensor(st, O, ())
        made[QKV] = _per_tensor(st, QKV, (1,))
        st[D + ".weight_scale"] = st[D + ".weight_scale"].unsqueeze(1)

    return edited(prequant, tmp_path_factory.mktemp("pt") / "f", edit), made


def test_per_tensor_scales_broadcast_exactly(prequant, per_tensor):
    folder, made = per_tensor
    sd = load_checkpoint(folder).state_dict()
    for mod, (q, s) in made.items():
        assert sd[mod + ".weight_scale"].shape == (q.shape[0],) and sd[mod + ".weight_scale"].dtype == torch.float32
        assert torch.equal(sd[mod + ".weight_scale"], s.expand(q.shape[0]))
        assert torch.equal(bits(sd[mod + ".weight"]), bits(q))
    whole = load_checkpoint(prequant).state_dict()
    assert torch.equal(sd[D + ".weight_scale"], whole[D + ".weight_scale"])  # [out, 1] -> [out]


# ------------------------------------------------------------------ refusals, each naming the tensor
def _dequantized(mod):
    def edit(st):
        st[mod + ".weight"] = fp8.dequantize(st[mod + ".weight"], st[mod + ".weight_scale"])
    return edit


def _lm_head_e4m3(st):
    st["lm_head.weight"], st["lm_head.weight_scale"] = fp8.quantize_weight(st["lm_head.weight"])


TENSOR_FAULTS = {
    "input_scale": (lambda st: st.__setitem__(O + ".input_scale", torch.tensor(0.01)), O + ".input_scale",
                    "dynamically, one scale per token"),
    "block_scale": (lambda st: st.__setitem__(G + ".weight_scale", torch.ones(2, 1)), G + ".weight_scale",
                    "128x128 block scale.*rowwise"),
    "weight_scale_inv": (lambda st: st.__setitem__(O + ".weight_scale_inv", torch.ones(1, 1)),
                         O + ".weight_scale_inv", "block-wise"),
    "scale_without_e4m3": (_dequantized(O), O + ".weight_scale", "without an e4m3 weight"),
    "e4m3_without_scale": (lambda st: st.pop(O + ".weight_scale"), O + ".weight", "without .*weight_scale"),
    "scale_shape": (lambda st: st.__setitem__(O + ".weight_scale", torch.ones(129)), O + ".weight_scale",
                    r"shape \[129\] does not fit"),
    "scale_dtype": (lambda st: st.__setitem__(O + ".weight_scale", torch.ones(128, dtype=torch.int32)),
                    O + ".weight_scale", "scale dtype I32"),
    "scale_zero": (lambda st: st[O + ".weight_scale"].__setitem__(0, 0.0), O + ".weight_scale", "finite and > 0"),
    "e5m2": (lambda st: st.__setitem__(O + ".weight", st[O + ".weight"].float().to(torch.float8_e5m2)),
             O + ".weight", "F8_E5M2"),
    "int8": (lambda st: st.__setitem__(O + ".weight", st[O + ".weight"].float().to(torch.int8)), O + ".weight",
             "dtype I8"),
    "non_target": (_lm_head_e4m3, "lm_head.weight", "does not quantize"),
    "zero_point": (lambda st: st.__setitem__(O + ".weight_zero_point", torch.zeros(128)), O + ".weight_zero_point",
                   "symmetric"),
    "kv_scale": (lambda st: st.__setitem__("model.layers.0.self_attn.k_scale", torch.tensor(1.0)),
                 "model.layers.0.self_attn.k_scale", "KV-cache"),
}


@pytest.mark.parametrize("fault", list(TENSOR_FAULTS))
def test_tensor_refusals_name_the_tensor(prequant, tmp_path, fault):
    edit, key, why = TENSOR_FAULTS[fault]
    folder = edited(prequant, tmp_path / "bad", edit)
    for load in (lambda: load_checkpoint(folder), lambda: load_checkpoint_shard(folder, spec(0, 2, 1))):
        with pytest.raises(ConfigError, match=why) as e:
            load()
        assert key in str(e.value)


def test_e4m3_in_an_ignored_layer_is_refused(prequant):
    with pytest.raises(ConfigError, match="quantization_ignored_layers") as e:
        load_checkpoint(prequant, quantization="fp8", ignored=("model.layers.0.*",))
    assert "model.layers.0." in str(e.value)


def _qc(**changes):
    def edit(raw):
        raw["quantization_config"] = {**raw.get("quantization_config", {}), **changes}
    return edit


CONFIG_FAULTS = {
    "static": (_qc(activation_scheme="static"), "activation_scheme", "static activation scales"),
    "block": (_qc(weight_block_size=[128, 128]), "weight_block_size", "rowwise scales only"),
    "method": (_qc(quant_method="awq"), "quant_method", "FP8 checkpoints spelled"),
    "unknown_key": (_qc(group_size=128), "group_size", "cannot honour it"),
    "ignored_but_e4m3": (_qc(ignored_layers=["model.layers.0.*"]), "model.layers.0.", "among its ignored layers"),
    "modelopt_static": (lambda raw: raw.__setitem__("quantization_config", {"quant_method": "modelopt",
                                                                            "quant_algo": "FP8"}),
                        "quant_algo", "FP8_PER_CHANNEL_PER_TOKEN"),
    "ct_static": (lambda raw: raw.__setitem__("quantization_config", _compressed_tensors(dynamic=False)),
                  "input_activations.dynamic", "static activation scales"),
    "ct_block": (lambda raw: raw.__setitem__("quantization_config", _compressed_tensors(strategy="block")),
                 "weights.strategy", "rowwise scales only"),
}


def _compressed_tensors(dynamic=True, strategy="channel", ignore=("lm_head",)):
    """llm-compressor's FP8_DYNAMIC scheme as it writes it into config.json."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None, "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": dynamic}}}}


@pytest.mark.parametrize("fault", list(CONFIG_FAULTS))
def test_quantization_config_refusals_name_the_key(prequant, tmp_path, fault):
    edit, name, why = CONFIG_FAULTS[fault]
    folder = edited(prequant, tmp_path / "bad", config=edit)
    with pytest.raises(ConfigError, match=why) as e:
        load_checkpoint(folder)
    assert name in str(e.value)


def test_quantization_config_without_e4m3_weights_is_refused(plain, tmp_path):
    folder = edited(plain, tmp_path / "bad", config=_qc(quant_method="fp8", activation_scheme="dynamic"))
    with pytest.raises(ConfigError, match="no weight is stored in e4m3"):
        load_checkpoint(folder, quantization="fp8")


def test_a_target_left_unquantized_must_be_in_the_configs_ignore_list(plain, prequant, tmp_path):
    def partial(st):
        _dequantized(O)(st)
        st.pop(O + ".weight_scale")

    bad = edited(prequant, tmp_path / "bad", partial)
    with pytest.raises(ConfigError, match="does not list it among its ignored layers") as e:
        load_checkpoint(bad)
    assert O + ".weight" in str(e.value)
    ok = edited(prequant, tmp_path / "ok", partial, config=_qc(ignored_layers=[O]))
    model = load_checkpoint(ok)
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.shared_mlp.down_proj.weight.dtype == FP8


@pytest.mark.parametrize("qc", [_compressed_tensors(), {"quant_method": "modelopt", "quantization": {
    "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}],
    ids=["compressed-tensors", "modelopt"])
def test_other_exporters_spellings_load(prequant, tmp_path, qc):
    folder = edited(prequant, tmp_path / "f", config=lambda raw: raw.__setitem__("quantization_config", qc))
    assert_same(load_checkpoint(folder).state_dict(), load_checkpoint(prequant).state_dict())


# ------------------------------------------------------------------ TP / EP ranks
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def test_sharded_prequantized_load_equals_shard_model_of_the_whole(prequant, tp, ep):
    whole = load_checkpoint(prequant)
    for rank in range(max(tp, ep)):
        s = spec(rank, tp, ep)
        want = dict(shard_model(copy.deepcopy(whole), s).named_parameters())
        assert_same(dict(load_checkpoint_shard(prequant, s).named_parameters()), want)


def test_sharded_per_tensor_scales_broadcast_then_slice(per_tensor):
    folder, _ = per_tensor
    whole = load_checkpoint(folder, dtype=torch.bfloat16)
    for rank in range(2):
        s = spec(rank, 2, 1)
        want = dict(shard_model(copy.deepcopy(whole), s).named_parameters())
        assert_same(dict(load_checkpoint_shard(folder, s, dtype=torch.bfloat16).named_parameters()), want)


def test_sharded_online_quantizes_each_ranks_slice(plain):
    """Row-split weights get the whole model's scales; column-split ones (o_proj, down_proj) the
    rank's own, as quantizing the rank's shard after loading gives."""
    whole = post_hoc(plain)
    for rank in range(2):
        s = spec(rank, 2, 1)
        got = dict(load_checkpoint_shard(plain, s, quantization="fp8").named_parameters())
        assert_same(got, dict(apply_quantization(load_checkpoint_shard(plain, s), "fp8").named_parameters()))
        rows = dict(shard_model(copy.deepcopy(whole), s).named_parameters())
        for k, w in rows.items():
            if ".qkv_proj." in k or ".gate_and_up_proj." in k:
                assert torch.equal(bits(got[k]), bits(w)), k


# ------------------------------------------------------------------ ditkv quantize
def test_quantize_cli_round_trip_reports_each_shard(plain, tmp_path, capsys):
    out = tmp_path / "fp8"
    assert main(["quantize", "--model", str(plain), "--out", str(out), "--ignored-layers", "model.layers.0.*"]) == 0
    printed = capsys.readouterr().out
    n = len(ckpt._weight_files(plain))
    assert f"shard 1/{n} " in printed and f"shard {n}/{n} " in printed and "tensors quantized, peak RSS" in printed
    assert "tensor bytes in" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["ignored_layers"] == ["model.layers.0.*"]
    got = load_checkpoint(out)
    assert_same(got.state_dict(), load_checkpoint(plain, quantization="fp8", ignored=("model.layers.0.*",))
                .state_dict())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fp8.partial")]


def test_quantize_summary_has_each_shards_peak(plain, tmp_path):
    summary = quantize_folder(str(plain), tmp_path / "o", log=quiet)
    assert len(summary["shards"]) == len(ckpt._weight_files(plain))
    assert all(s["peak"] > 0 and s["added"] >= 0 for s in summary["shards"])
    assert summary["bytes_out"] < summary["bytes_in"]  # fp32 linears -> 1 byte + a scale per row


@pytest.mark.parametrize("case", ["out_not_empty", "prequantized", "missing", "inside", "bad_pattern"])
def test_quantize_cli_refusals(plain, prequant, tmp_path, capsys, case):
    out = tmp_path / "o"
    model = str(plain)
    if case == "out_not_empty":
        out.mkdir()
        (out / "x").write_text("x")
    argv = ["quantize", "--model", model, "--out", str(out)]
    if case == "prequantized":
        argv[2] = str(prequant)
    elif case == "missing":
        argv[2] = str(tmp_path / "nope")
    elif case == "inside":
        argv[4] = str(plain / "sub")
    elif case == "bad_pattern":
        argv += ["--ignored-layers", " "]
    assert main(argv) == 2
    err = capsys.readouterr().err
    want = {"out_not_empty": "pick another folder, or delete it", "prequantized": "pre-quantized already",
            "missing": "no such folder", "inside": "inside the input folder",
            "bad_pattern": "quantization_ignored_layers"}[case]
    assert want in err
    assert not (plain / "sub").exists()


def test_empty_out_folder_is_used(plain, tmp_path):
    (tmp_path / "o").mkdir()
    quantize_folder(str(plain), tmp_path / "o", log=quiet)
    assert (tmp_path / "o" / "config.json").is_file()


needs_tiny = pytest.mark.skipif(not (TINY_ASSET / "config.json").is_file(), reason="bundled tiny not installed")


def _image(tmp_path, name, *flags):
    png = tmp_path / f"{name}.png"
    assert main(["generate", "--prompt", "a large blue square", "--height", "32", "--width", "32", "--steps", "2",
                 "--guidance", "3", "--seed", "2", "--device", "cpu", "--dtype", "float32", "--no-progress",
                 "--out", str(png), *flags]) == 0
    return np.asarray(Image.open(png))


@needs_tiny
def test_quantized_copy_gives_the_image_of_quantizing_while_loading(tmp_path):
    out = tmp_path / "tiny-fp8"
    assert main(["quantize", "--model", "tiny", "--out", str(out)]) == 0
    a = _image(tmp_path, "online", "--model", "tiny", "--quantization", "fp8")
    b = _image(tmp_path, "stored", "--model", str(out))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, _image(tmp_path, "bf16", "--model", "tiny"))  # FP8 really ran


@needs_tiny
def test_tiny_edit_quantizes_and_loads(tmp_path):
    out = tmp_path / "edit-fp8"
    quantize_folder("tiny-edit", out, log=quiet)
    got, _, _ = load_model(str(out), torch.device("cpu"), torch.float32)
    want, _, _ = load_model("tiny-edit", torch.device("cpu"), torch.float32, quantization="fp8")
    assert quantization_of(got) == "fp8" and got.config.max_input_images == 1
    assert_same(got.state_dict(), want.state_dict())


def test_block_shape_rule_matches_the_ceil_formula():
    h = f8.Header("F32", (math.ceil(300 / 128), math.ceil(200 / 128)))
    with pytest.raises(ConfigError, match="block scale"):
        f8.check_scale("m.weight_scale", h, (300, 200))
    assert f8.check_scale("m.weight_scale", f8.Header("BF16", (300, 1)), (300, 200)) == "channel"
    assert f8.check_scale("m.weight_scale", f8.Header("F32", ()), (300, 200)) == "tensor"


def test_quantization_config_is_a_key_config_reads_and_checks():
    from ditkv.models.hunyuan import config as C

    assert "quantization_config" in C.READ_HERE
    ok = {**CFG.to_dict(), "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    assert HunyuanImage3Config.from_dict(ok).extra["quantization_config"]["quant_method"] == "fp8"
    with pytest.raises(ConfigError, match="quantization_config.activation_scheme"):
        HunyuanImage3Config.from_dict({**ok, "quantization_config": {"quant_method": "fp8",
                                                                      "activation_scheme": "static"}})


def test_ignore_lists_match_fnmatch_and_compressed_tensors_regexes():
    assert f8.matches(O, ("model.layers.0.*",)) and f8.matches(O, ("re:.*self_attn\\.o_proj$",))
    assert not f8.matches(QKV, ("re:.*o_proj$", "lm_head"))


def test_release_folder_keeps_vae_and_vision_tensors_unchanged(tmp_path):
    """A release-format folder (official config shrunk, vision encoder, VAE, tokenizer.json):
    only the decoder linears change; it loads as online quantization loads it."""
    from release_folders import official, shrunk, write_folder

    src = write_folder(tmp_path / "rel", shrunk(official("base")))
    out = tmp_path / "rel-fp8"
    quantize_folder(str(src), out, log=quiet)
    a, b = load_file(str(src / SINGLE)), load_file(str(out / SINGLE))
    kept = [k for k in a if k.startswith(("vae.", "vision_model.", "vision_aligner.")) or "norm" in k]
    assert kept and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in kept)
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    got, _, _ = load_model(str(out), torch.device("cpu"), torch.float32)
    want, _, _ = load_model(str(src), torch.device("cpu"), torch.float32, quantization="fp8")
    assert_same(got.state_dict(), want.state_dict())
