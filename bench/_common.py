"""Shared helpers of the benchmarks (each benchmark prints one JSON object on stdout)."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
warnings.filterwarnings("ignore")
logging.basicConfig(level=logging.WARNING)


def emit(result: dict) -> None:
    print(json.dumps(result, indent=None, sort_keys=False), flush=True)
