"""The model-family interface (models/family.py): the registry finds a family from a config or a
checkpoint folder, refuses a folder no family reads, and the HunyuanImage-3 family implements every
method the interface names (the layers above reach the model only through them)."""

import json
import re

import pytest

from ditkv.errors import ConfigError
from ditkv.models import family as family_mod
from ditkv.models.family import family_for_folder, family_named, family_of
from ditkv.models.hunyuan import HunyuanImage3Config
from ditkv.models.hunyuan.family import HunyuanImage3Family
from ditkv.models.loader import TINY_ASSET


def test_a_config_and_a_folder_name_their_family():
    assert isinstance(family_of(HunyuanImage3Config.tiny()), HunyuanImage3Family)
    assert family_for_folder(TINY_ASSET) is family_named("hunyuan_image_3")


def test_a_release_config_json_is_the_hunyuan_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "hunyuan_image_3_moe"}))
    assert family_for_folder(tmp_path).name == "hunyuan_image_3"


def test_a_checkpoint_no_family_reads_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="no registered model family reads this checkpoint.*'llama'") as e:
        family_for_folder(tmp_path)
    assert e.value.field == "model"
    with pytest.raises(ConfigError, match="no model family 'other'"):
        family_named("other")


def test_the_hunyuan_family_implements_every_method_the_interface_names():
    doc = family_mod.__doc__
    names = set(re.findall(r"`([a-z_]+)(?:\([^`]*\))?`", doc[doc.index("The methods, by concern:"):]))
    assert {"request_layout", "sampler", "layout_to_wire", "load", "shard_model", "graph_blocker"} <= names
    sampler_api = {"set_timesteps", "timestep", "guide", "step"}  # the sampler object's, not the family's
    sampler = HunyuanImage3Family().sampler(HunyuanImage3Config.tiny())
    assert all(callable(getattr(sampler, n)) for n in sampler_api)
    missing = sorted(n for n in names - sampler_api if n not in vars(HunyuanImage3Family))
    assert not missing, f"named by models/family.py but not implemented: {missing}"
