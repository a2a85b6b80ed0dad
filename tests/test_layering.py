"""The import layering: each layer imports only those below it (issue 15's target order, today's
folders). An import that runs back up is a failure unless it is one of the known ones listed here
(none left since the stage machinery moved to stages/); a listed edge that no longer exists fails too.
Every import counts, function-level ones included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ditkv"
# lowest first; a module may import its own layer and any lower one
RANK = {"errors": 0, "argtypes": 0, "alignment": 0, "core": 1, "data": 1, "transfer": 1, "attention": 2, "models": 2,
        "config": 2, "step_cache_config": 2, "worker": 3, "engine": 4, "stages": 5, "train": 6, "bench": 6, "entrypoints": 6,
        "__main__": 6, "__init__": 6}
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()  # none left: keep it that way


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> set[tuple[str, str]]:
    edges = set()
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                else:
                    targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges.update((module, t) for t in targets if t.startswith("ditkv."))
    return edges


def test_every_top_level_module_has_a_layer():
    """A new package or top-level module must be placed in RANK before it can be checked."""
    names = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir()
                                                   if p.is_dir() and (p / "__init__.py").exists()}
    assert names <= set(RANK), sorted(names - set(RANK))


def test_no_new_import_runs_back_up_and_the_known_list_is_current():
    back = {(a, b) for a, b in _imports() if RANK[_layer(a)] < RANK[_layer(b)]}
    new = sorted(back - KNOWN_BACK_EDGES)
    assert not new, f"imports that run back up a layer (import from below, or move the code): {new}"
    stale = sorted(KNOWN_BACK_EDGES - back)
    assert not stale, f"these known back-edges are gone: remove them from KNOWN_BACK_EDGES: {stale}"


FAMILY_FREE = ("engine", "worker", "stages")  # they reach a model family only through models/family.py


def test_engine_worker_and_stages_import_no_model_family():
    """Issue 25 item 3: the layers above the models use `ditkv.models.family` (the interface and its
    registry), never a family's own package (bench/ and train/ may)."""
    bad = sorted((a, b) for a, b in _imports()
                 if _layer(a) in FAMILY_FREE and b.startswith("ditkv.models.") and b.split(".")[2] not in
                 ("family", "family_api", "loader", "fp8", "fp8_format", "text_settings"))
    assert not bad, f"import the family interface (ditkv.models.family) instead: {bad}"
