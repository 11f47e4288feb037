"""Where a benchmark script's JSON report goes (its folder made if missing)."""
from __future__ import annotations

import json
import os


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
