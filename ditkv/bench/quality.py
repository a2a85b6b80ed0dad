"""`ditkv bench quality`: held-out accuracy of a bundled tiny model through the engine, paged_scheduler
vs dense_legacy: text-to-image captions (`ditkv.train.quality_check`), or with `--edit` the held-out
edits of a model that takes input images (`ditkv.train.edit_quality`).

    ditkv bench quality [--seeds 4]        # = python -m ditkv.bench.quality
    ditkv bench quality --edit             # --model tiny-edit by default
"""

from __future__ import annotations

import argparse
import sys

from ..argtypes import finite_float, nonneg_int, positive_int
from .common import emit, machine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'tiny' / 'tiny-edit' (bundled) or a checkpoint folder (default: tiny; tiny-edit with --edit)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seeds", type=positive_int, default=None,
                   help="images per held-out caption (default 2), or per held-out edit with --edit (default 1)")
    p.add_argument("--steps", type=positive_int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--guidance", type=finite_float, default=None, help="CFG scale (default: the model's)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="use only the first N held-out captions (edits with --edit; default: all)")
    p.add_argument("--threads", type=nonneg_int, default=1,
                   help="torch CPU threads (0 = leave torch's default); the tiny model's matrices are "
                        "too small to gain from more, and shared cores make extra threads ~10x slower")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="run both modes quantized, plus an unquantized paged baseline on the same seeds "
                        "(reports the accuracy difference per attribute; default: unquantized only)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.add_argument("--edit", action="store_true",
                   help="score the held-out edits (instruction + input image, ditkv.data.edits) instead")


def run(args) -> dict:
    import torch

    from ..train import edit_quality, quality_check

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.edit and args.quantization:
        raise SystemExit("ditkv bench quality: --quantization is not implemented for --edit yet; score "
                         "text-to-image (drop --edit) or drop --quantization")
    if args.edit:
        result = edit_quality.edit_quality_check(args.model or "tiny-edit", args.device, args.seeds or 1,
                                                 args.steps, args.guidance, args.limit)
        rows, cols = edit_quality.table_rows(result), ["mode", "edits", *quality_check.FIELDS, "changed", "n",
                                                        "seconds"]
    else:
        result = quality_check.quality_check(args.model or "tiny", args.device, args.seeds or 2, args.steps,
                                             args.guidance, args.limit, quantization=args.quantization)
        rows, cols = quality_check.table_rows(result), ["mode", *quality_check.FIELDS, "n", "seconds"]
    result["machine"] = machine()
    emit(result, args.json, rows, cols)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ditkv.bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
