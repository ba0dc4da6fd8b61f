"""A warm start: a new run that begins from another run's weights, on its own data, schedule and sample order.

This is what recurring pretraining over a growing corpus uses: tonight's run starts from last night's model on
the newly staged snapshot. Token ids must keep their meaning, so the snapshot's tokenizer must be the one the
weights were trained with (staging reuses it: init_from_run_id). Nothing else carries over: the optimizer starts
fresh and the learning rate warms up again. Exact resume stays the other path (the same run, the same snapshot).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.checkpoint import newest_checkpoint, read_weights
from trainer.errors import CheckpointError
from trainer.layout import RunPaths
from trainer.model import architecture_differences

log = logging.getLogger(__name__)


def warm_start_state(origin: Path, tokenizer_sha256: str, model_config: dict[str, Any]) -> tuple[dict, dict]:
    """The weights of `origin`'s newest good checkpoint (not its optimizer state), after checking that they fit this
    run's tokenizer and model; and what to record of where they came from."""
    checkpoint = newest_checkpoint(RunPaths(origin).checkpoints)
    if checkpoint is None:
        raise CheckpointError(f"--init-from {origin}: that run has no checkpoint to start from")
    state = checkpoint.trainer_state()
    trained_with = state.get("data_snapshot", {}).get("tokenizer_sha256")
    if trained_with is None:
        raise CheckpointError(
            f"--init-from {origin}: its checkpoint does not record its tokenizer (it predates "
            "snapshots), so the token ids cannot be checked; start from scratch"
        )
    if trained_with != tokenizer_sha256:
        raise CheckpointError(
            f"--init-from {origin}: its weights were trained with tokenizer {trained_with[:12]}, and "
            f"this run's snapshot has tokenizer {tokenizer_sha256[:12]}: the token ids would mean "
            "other text; stage with that run's tokenizer (init_from_run_id does)"
        )
    differences = architecture_differences(state["model_config"], model_config)
    if differences:
        raise CheckpointError(
            f"--init-from {origin}: its model has another architecture ({'; '.join(differences)}): "
            "use that run's preset and sequence length"
        )
    record = {
        "run": origin.name,
        "step": int(state["step"]),
        "tokens_seen": int(state["progress"]["tokens_seen"]),
        "snapshot": state["data_snapshot"]["snapshot"],
    }
    return read_weights(checkpoint), record  # the weights only: the optimizer state is not read
