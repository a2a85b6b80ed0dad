"""Regenerate tests/fixtures/release_buckets.json from the release reference code (numbers only).

The release resolves a requested image size to one of its resolution buckets and to the index k of
`<img_ratio_k>` (`ResolutionGroup` in hunyuan_image_3/tokenizer_wrapper.py of
github.com/Tencent-Hunyuan/HunyuanImage-3.0). This script imports that file from a checkout of the
reference (nothing of it is copied into ditkv), records the bucket table at base size 1024 and the
(bucket, ratio index) of a sweep of requested sizes, and writes them as the fixture that
tests/test_buckets.py compares ditkv against.

    git clone https://github.com/Tencent-Hunyuan/HunyuanImage-3.0 /tmp/hi3
    python tools/make_bucket_fixture.py --reference /tmp/hi3 [--out tests/fixtures/release_buckets.json]

The reference module imports `transformers` and `diffusers` at the top for classes the resolution
code does not use; they are stubbed when absent.
"""

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

# requested (height, width): squares, every bucket exactly, off-bucket sizes on both sides of each
# boundary, extreme ratios beyond the table, and the sizes the issue names
SWEEP = [(h, w) for h in (256, 512, 768, 1024, 1280, 1536, 2048, 4096) for w in (256, 512, 720, 768, 1024, 1280, 2048)]
SWEEP += [(768, 1280), (1280, 768), (512, 1024), (1024, 512), (1280, 720), (720, 1280), (64, 64), (64, 4096),
          (4096, 64), (1000, 1001), (1088, 960), (960, 1088), (1920, 1080), (1080, 1920), (16, 32), (32, 16)]


def _stub(name: str, **attrs) -> None:
    if name in sys.modules:
        return
    try:
        __import__(name)
    except ImportError:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True, help="checkout of Tencent-Hunyuan/HunyuanImage-3.0")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/release_buckets.json"))
    a = p.parse_args(argv)
    _stub("transformers", AutoTokenizer=object)
    _stub("diffusers")
    _stub("diffusers.utils", BaseOutput=object)
    path = Path(a.reference) / "hunyuan_image_3" / "tokenizer_wrapper.py"
    spec = importlib.util.spec_from_file_location("release_tokenizer_wrapper", path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    group = ref.ResolutionGroup(base_size=1024)
    sizes = []
    for h, w in dict.fromkeys(SWEEP + [(x.h, x.w) for x in group.data]):
        tw, th = group.get_target_size(w, h)
        base, idx = group.get_base_size_and_ratio_index(w, h)
        sizes.append({"height": h, "width": w, "bucket_height": int(th), "bucket_width": int(tw),
                      "base_size": int(base), "ratio_index": int(idx)})
    out = {"source": "Tencent-Hunyuan/HunyuanImage-3.0 hunyuan_image_3/tokenizer_wrapper.py ResolutionGroup(1024)",
           "base_size": 1024, "buckets": [[x.h, x.w] for x in group.data], "requests": sizes}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(out['buckets'])} buckets, {len(sizes)} requested sizes -> {a.out}")


if __name__ == "__main__":
    main()
