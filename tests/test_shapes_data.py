"""Synthetic shapes dataset: determinism, caption grammar, splits, and the quality checker."""

import numpy as np
import pytest
import torch

from ditkv.data import (COLORS, DEFAULTS, POSITIONS, SHAPES, SIZES, ShapeSpec, ShapesDataset,
                        accuracy, all_specs, analyze, check, heldout_specs, image_to_tensor,
                        parse_caption, render, tensor_to_image, train_specs)


# --- determinism -------------------------------------------------------------

def test_dataset_is_deterministic_from_seed():
    a, b, c = ShapesDataset(7, 12), ShapesDataset(7, 12), ShapesDataset(8, 12)
    for i in range(len(a)):
        (ca, ta), (cb, tb) = a[i], b[i]
        assert ca == cb and torch.equal(ta, tb)
    assert [a[i][0] for i in range(12)] != [c[i][0] for i in range(12)]


def test_dataset_item_format():
    caption, img = ShapesDataset(0, 3, size=64)[1]
    assert isinstance(caption, str)
    assert img.dtype == torch.float32 and img.shape == (3, 64, 64)
    assert img.min() >= -1 and img.max() <= 1
    with pytest.raises(IndexError):
        ShapesDataset(0, 3)[3]


def test_render_determinism_and_jitter():
    spec = ShapeSpec("circle", "red", "medium", "top left")
    img = render(spec)
    assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
    assert np.array_equal(img, render(spec))  # no rng -> no jitter
    j1 = render(spec, rng=np.random.default_rng(3))
    assert np.array_equal(j1, render(spec, rng=np.random.default_rng(3)))
    assert not np.array_equal(j1, img)
    # Anti-aliasing leaves intermediate values on the edge.
    assert len(np.unique(img[..., 0])) > 3


def test_tensor_round_trip():
    img = render(ShapeSpec("cross", "orange", "large", "center"))
    assert np.array_equal(tensor_to_image(image_to_tensor(img)), img)


# --- captions ----------------------------------------------------------------

def test_caption_examples():
    assert ShapeSpec("circle", "red", "small", "top left").caption() == \
        "a small red circle in the top left"
    assert ShapeSpec("square", "blue", "large", "center").caption() == \
        "a large blue square in the center"
    assert ShapeSpec("triangle", "orange").caption() == "an orange triangle"


def test_caption_round_trip_full_and_partial():
    for spec in all_specs():
        assert parse_caption(spec.caption()) == spec
        for drop in ({"position": None}, {"size": None}, {"color": None, "size": None}):
            partial = ShapeSpec(**{**spec.__dict__, **drop})
            assert parse_caption(partial.caption()) == partial


def test_parse_tolerates_omissions_and_variants():
    assert parse_caption("a large blue square") == ShapeSpec("square", "blue", "large", None)
    assert parse_caption("A Large BLUE Square.") == ShapeSpec("square", "blue", "large", None)
    assert parse_caption("red circle at the top-left") == \
        ShapeSpec("circle", "red", None, "top left")
    assert parse_caption("a cross in the centre").position == "center"
    assert parse_caption("small magenta triangle, lower right") == \
        ShapeSpec("triangle", "purple", "small", "bottom right")
    resolved = parse_caption("a circle").resolved()
    assert (resolved.color, resolved.size, resolved.position) == \
        (DEFAULTS["color"], DEFAULTS["size"], DEFAULTS["position"])


@pytest.mark.parametrize("bad", ["a large blue hexagon", "a huge red circle",
                                 "a red circle in the top", "a red blue circle",
                                 "a large blue"])
def test_parse_errors_list_vocabulary(bad):
    with pytest.raises(ValueError) as err:
        parse_caption(bad)
    msg = str(err.value)
    for word in (*SHAPES, *COLORS, *SIZES, *POSITIONS):
        assert word in msg


def test_unknown_word_is_named():
    with pytest.raises(ValueError, match="hexagon"):
        parse_caption("a hexagon")


# --- held-out split ----------------------------------------------------------

def test_heldout_split_is_disjoint_and_covers_vocabulary():
    held, train = set(heldout_specs()), set(train_specs())
    assert held and train and not held & train
    assert held | train == set(all_specs()) and len(all_specs()) == 480
    for field, values in (("shape", SHAPES), ("color", COLORS), ("size", SIZES),
                          ("position", POSITIONS)):
        assert {getattr(s, field) for s in train} == set(values)


def test_dataset_respects_split():
    held = set(heldout_specs())
    train_ds = ShapesDataset(1, 300)
    captions = []
    for i in range(len(train_ds)):
        caption, spec, _ = train_ds.sample(i)
        assert spec not in held
        assert parse_caption(caption).resolved() == spec
        captions.append(caption)
    # Underspecified variants are present so the model learns the defaults.
    assert any(" in the " not in c for c in captions)
    assert any(not any(s in c for s in SIZES) for c in captions)
    test_ds = ShapesDataset(1, 50, holdout=True)
    for i in range(len(test_ds)):
        caption, spec, _ = test_ds.sample(i)
        assert spec in held and parse_caption(caption) == spec


# --- quality checker ---------------------------------------------------------

def test_checker_accuracy_on_rendered_images():
    rng = np.random.default_rng(0)
    specs = list(all_specs())
    images = [render(s, 64, rng) for s in specs]
    acc = accuracy(images, specs)
    for field in ("shape", "color", "size", "position"):
        assert acc[field] >= 0.98, acc


def test_checker_on_dataset_tensors_with_partial_captions():
    ds = ShapesDataset(5, 120)
    items = [ds[i] for i in range(len(ds))]
    acc = accuracy([t for _, t in items], [parse_caption(c) for c, _ in items])
    assert acc["all"] >= 0.98, acc


def test_checker_rejects_wrong_images():
    red_circle = render(ShapeSpec("circle", "red", "large", "center"))
    res = check(red_circle, parse_caption("a large blue square"))
    assert not res["color_ok"] and not res["shape_ok"] and not res["all_ok"]
    assert res["predicted"] == ShapeSpec("circle", "red", "large", "center")

    res = check(red_circle, ShapeSpec("circle", "red", "small", "top right"))
    assert res["color_ok"] and res["shape_ok"]
    assert not res["size_ok"] and not res["position_ok"]


def test_checker_rejects_blank_image():
    blank = np.zeros((64, 64, 3), np.uint8)
    res = check(blank, ShapeSpec("square", "white", "medium", "center"))
    assert not any(res[k] for k in ("color_ok", "shape_ok", "size_ok", "position_ok", "all_ok"))
    assert analyze(blank) == ShapeSpec()
    # Partial spec without defaults still fails: nothing was detected.
    assert not check(blank, ShapeSpec("square"), use_defaults=False)["all_ok"]


def test_checker_ignores_stray_specks():
    img = render(ShapeSpec("triangle", "green", "medium", "bottom left"))
    img[2:4, 60:62] = COLORS["green"]  # a tiny blob elsewhere
    assert check(img, ShapeSpec("triangle", "green", "medium", "bottom left"))["all_ok"]
