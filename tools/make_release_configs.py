"""Regenerate tests/fixtures/release_config_{instruct,instruct_distil}.json: the config.json that the
Instruct / Instruct-Distil configuration class writes.

The published config.json files of HunyuanImage-3.0-Instruct and -Instruct-Distil are in no reachable
repository. Their code is (github.com/suryatmodulus/HunyuanImage-3.0 @1ea1526, hunyuan_image_3/
configuration_hunyuan_image_3.py `HunyuanImage3Config`), so this script builds each file the way
`save_pretrained` would write it: the class constructed with the official base file's values
(tests/fixtures/release_config_base.json, the release sizes and ids) plus what the Instruct code
reads differently, then `to_json_string(use_diff=True)`:

  instruct          model_version "HunyuanImage-3.0-Instruct" (the tokenizer's 37 ratio buckets and the
                    stripped system prompt follow it)
  instruct_distil   the same, "HunyuanImage-3.0-Instruct-Distil", cfg_distilled true (guidance as a token)

Keys the class adds that the base file lacks (image_base_size, img_proj_type, patch_size, ...) take the
class's defaults. Unknown here, so left at the base values: whether the published Distil file sets
use_meanflow (ditkv refuses true by name) and its exact cond_token_attn_type.

    git --git-dir=<mirror of suryatmodulus/HunyuanImage-3.0> archive 1ea1526 hunyuan_image_3 | tar -x -C /tmp/ref_fork
    pip install --no-deps --target /tmp/hi3_deps transformers==4.56.2 huggingface_hub==0.35.3 tokenizers==0.22.1 regex
    PYTHONPATH=/tmp/hi3_deps python tools/make_release_configs.py --reference /tmp/ref_fork
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
VARIANTS = {
    "instruct": {"model_version": "HunyuanImage-3.0-Instruct"},
    "instruct_distil": {"model_version": "HunyuanImage-3.0-Instruct-Distil", "cfg_distilled": True},
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(a.reference).resolve()))
    from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config

    base = json.loads((FIXTURES / "release_config_base.json").read_text())
    for name, changes in VARIANTS.items():
        cfg = HunyuanImage3Config(**{**base, **changes})
        out = json.loads(cfg.to_json_string(use_diff=True))
        path = FIXTURES / f"release_config_{name}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        added = sorted(set(out) - set(base))
        print(f"{path.name}: {len(out)} keys; added by the class: {added}")


if __name__ == "__main__":
    main()
