"""Regenerate tests/fixtures/release_instruct_buckets.json: the output image size and `<img_ratio_k>` the
Instruct / Instruct-Distil code makes of a requested size (numbers only).

The Instruct code (hunyuan_image_3/image_processor.py of the fork github.com/suryatmodulus/HunyuanImage-3.0
@1ea1526) maps `generate_image(..., image_size="HxW")` to the generated size and ratio index in
`HunyuanImage3ImageProcessor.build_gen_image_info`, over its `vae_reso_group`: the 33 buckets around
`image_base_size` plus four extra sizes. This script imports that file from a checkout (nothing of it is
copied into ditkv), builds the processor from an Instruct config at base sizes 1024 (the release) and 256
(tests/fixtures/release_edit_tiny's), and records the table and, for a sweep of requested sizes (the base
fixture's, tools/make_bucket_fixture.py, plus sizes around the extra ones), the bucket and ratio index.
tests/test_instruct_buckets.py compares ditkv against it.

    PYTHONPATH=/tmp/hi3_deps:/tmp/hi3_tv python tools/make_instruct_bucket_fixture.py --reference /tmp/ref_fork \\
        [--out tests/fixtures/release_instruct_buckets.json]
"""

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from make_bucket_fixture import SWEEP
from make_edit_fixture import _load_reference

FORK = "suryatmodulus/HunyuanImage-3.0@1ea1526"
MODEL_VERSION = "HunyuanImage-3.0-Instruct"
BASES = (1024, 256)
# around the extra sizes: each exactly, their ratios at other scales, and requests between an extra size and
# its neighbouring buckets (744x1280: halfway between 720x1280 and 768x1280)
NEAR_EXTRA = [(1024, 768), (768, 1024), (1280, 720), (720, 1280), (1080, 1920), (1920, 1080), (600, 800),
              (800, 600), (900, 1600), (1600, 900), (1000, 750), (740, 1280), (700, 1280), (744, 1280),
              (1280, 744), (960, 720), (1200, 900), (3, 4), (4, 3), (9, 16), (16, 9), (1088, 768), (768, 1088)]


def image_processor(ref_root: Path, base: int):
    from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config

    proc = importlib.import_module("hunyuan_image_3.image_processor")
    cfg = HunyuanImage3Config(image_base_size=base, vae_type="hunyuan-image-3-vae", vae_downsample_factor=[16, 16],
                              patch_size=1, vit_type="siglip2-so400m-patch16-naflex",
                              vit_processor={"patch_size": 16, "max_num_patches": 1024}, model_version=MODEL_VERSION)
    return proc.HunyuanImage3ImageProcessor(cfg)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of suryatmodulus/HunyuanImage-3.0 (commit 1ea1526)")
    p.add_argument("--out", default=str(ROOT / "tests/fixtures/release_instruct_buckets.json"))
    a = p.parse_args(argv)
    root = Path(a.reference).resolve()
    _load_reference(root)
    groups = []
    for base in BASES:
        ip = image_processor(root, base)
        table = [[int(x.h), int(x.w)] for x in ip.vae_reso_group.data]
        requests = []
        for h, w in dict.fromkeys(SWEEP + NEAR_EXTRA + [tuple(b) for b in table]):
            info = ip.build_gen_image_info(f"{h}x{w}")  # generate_image's image_size="HxW"
            requests.append({"height": h, "width": w, "bucket_height": int(info.image_height),
                             "bucket_width": int(info.image_width), "ratio_index": int(info.ratio_index),
                             "base_size": int(info.base_size)})
        groups.append({"base_size": base, "buckets": table, "requests": requests})
        print(f"base {base}: {len(table)} buckets, {len(requests)} requested sizes")
    out = {"source": f"{FORK} hunyuan_image_3/image_processor.py HunyuanImage3ImageProcessor.build_gen_image_info "
                     f"(vae_reso_group), model_version {MODEL_VERSION!r}, run by "
                     "tools/make_instruct_bucket_fixture.py",
           "model_version": MODEL_VERSION, "groups": groups}
    Path(a.out).write_text(json.dumps(out, separators=(",", ":")).replace('{"height"', '\n{"height"') + "\n")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
