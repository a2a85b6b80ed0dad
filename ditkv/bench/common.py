"""Shared benchmark helpers: machine description, table printing, JSON output."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

# peak matmul rates of the H200 the benchmarks' MFU figures divide by
H200_BF16_MEASURED = 788e12  # this H200's measured bf16 matmul rate (8192^3 products, random data)
H200_BF16_NOMINAL = 989.4e12  # NVIDIA's dense bf16 peak of the H200 SXM
# this H200's measured e4m3 rate: 8192^3 `torch._scaled_mm` with rowwise scales, bf16 out (2026-12-01)
H200_FP8_MEASURED = 1391e12


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def print_table(rows: list[dict], columns: list[str], file=None) -> None:
    file = file or sys.stdout  # at call time: a replaced sys.stdout (tests, redirects) gets the table

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)


def emit(result: dict, as_json: bool, table_rows: list[dict] | None = None, columns=None) -> None:
    """With --json print exactly one JSON object on stdout; otherwise a table plus the JSON."""
    if as_json:
        print(json.dumps(result))
        return
    if table_rows:
        print_table(table_rows, columns or list(table_rows[0]))
    print(json.dumps(result, indent=1))
