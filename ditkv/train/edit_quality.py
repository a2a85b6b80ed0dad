"""Edit quality check through the real engine: held-out edit accuracy of a model that takes images.

Every held-out (source, instruction) pair of `ditkv.data.edits` (never trained on) is sent to
`Engine` as a request `prompt=instruction, images=[source image]` in each KV mode, and the output
is scored with the text-to-image checker (`ditkv.data.check`) against the target spec: shape,
colour, size and position measured from the pixels. Also reported per edit kind (colour, position,
shape, size instructions): `all` and the changed attribute alone.

    ditkv bench quality --edit     # = python -m ditkv.bench.quality --edit
"""

from __future__ import annotations

import time

from .quality_check import FIELDS, MODES, compare_modes, generate_images, load_bundle


def edit_quality_check(model: str = "tiny-edit", device: str = "cpu", seeds_per_pair: int = 1,
                       steps: int | None = None, guidance: float | None = None, limit: int | None = None,
                       modes=MODES, split_seed: int = 0) -> dict:
    from ..data import EditDataset
    from .edit import edit_scores

    bundle = load_bundle(model, device)
    mc = bundle[0].config
    if not getattr(mc, "max_input_images", 0):
        raise SystemExit(f"ditkv: {model!r} takes no input images (max_input_images=0): nothing to edit")
    ds = EditDataset(0, limit, 64, holdout=True, split_seed=split_seed)
    samples = [ds.sample(i) for i in range(len(ds)) for _ in range(seeds_per_pair)]
    pairs = [p for p, _, _ in samples]
    prompts = [p.instruction for p in pairs]
    images_in = [[src] for _, src, _ in samples]
    seeds = list(range(len(samples)))
    result = {"model": model, "device": device, "pairs": len(ds), "images": len(samples),
              "steps": steps or mc.default_steps,
              "guidance": mc.default_guidance if guidance is None else guidance, "modes": {}}
    out = {}
    for mode in modes:
        t0 = time.monotonic()
        out[mode] = generate_images(bundle, mode, prompts, seeds, steps, guidance, device, input_images=images_in)
        acc = edit_scores(out[mode], pairs)
        acc["seconds"] = time.monotonic() - t0
        result["modes"][mode] = acc
    if len(modes) == 2:
        result["paged_vs_dense"] = compare_modes(out[modes[0]], out[modes[1]], [p.target for p in pairs])
    return result


def table_rows(result: dict) -> list[dict]:
    rows = []
    for m, acc in result["modes"].items():
        rows.append({"mode": m, "edits": "every", **{f: acc[f] for f in FIELDS}, "n": acc["n"],
                     "seconds": acc["seconds"]})
        for kind, v in acc["by_edit"].items():
            rows.append({"mode": m, "edits": kind, "all": v["all"], "changed": v["changed_ok"], "n": v["n"]})
    return rows
