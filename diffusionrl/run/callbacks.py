"""``Callback``: hooks a caller attaches to a training run (``run.loop.RunLoop``).

Kept apart from the loop so that callers (MLflow streaming, Flyte checkpoints, Parquet writers)
can subclass it without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Callback:
    """Hooks a caller attaches to a run (Parquet writers, MLflow streaming, Flyte checkpoints).

    Subclass and override what you need; every method is a no-op here. ``batch`` is what the step
    rolled out (a ``Trajectory`` for images, a ``TraceBatch`` for text)."""

    def on_metrics(self, loop: Any, step: int, metrics: dict[str, float]) -> None:
        """Before the step's metrics are written (``loop.history`` ends with them): may add keys."""

    def on_step(self, loop: Any, step: int, batch: Any, metrics: dict[str, float]) -> None:
        pass

    def on_checkpoint(self, loop: Any, path: Path) -> None:
        pass

    def on_end(self, loop: Any) -> None:
        pass
