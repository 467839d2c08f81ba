"""One ``sde2-train`` process under ``accelerate launch``, recording what the reward saw.

Run as ``accelerate launch ... -m tests.trl_multiprocess_step OUT_DIR <sde2-train flags>``: it
builds the trainer exactly as ``sde2-train`` does (:func:`trainer_client.train.build_trainer`),
then records on this rank, one JSON line per reward call in ``OUT_DIR/rank<r>.jsonl``, what the
reward function received (prompts, completions, token counts, answers) and returned, and what TRL
made of it after gathering across processes (its ``rewards_per_func``); rank 0 also writes TRL's
``log_history``. Used by ``tests/test_trl_multiprocess_trainer.py``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer_client.train import build_parser, build_trainer


def record(trainer: Any, holder: Any, path: Path) -> None:
    """Wrap the reward holder's ``score`` (what the recipe method TRL calls awaits) and TRL's
    ``_calculate_rewards`` (which gathers every process's rewards) to append to ``path``."""
    score = holder.score
    pending: dict[str, Any] = {}

    async def recording_score(
        prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        rewards = await score(prompts, completions, **kwargs)
        ids = kwargs.get("completion_ids")
        pending.update(
            prompts=list(prompts),
            completions=list(completions),
            num_tokens=None if ids is None else [len(x) for x in ids],
            answers=[str(a) for a in kwargs[holder.answer_column]],
            rewards=rewards,
        )
        return rewards

    holder.score = recording_score  # the recipe method calls self.score: this one
    calculate = trainer._calculate_rewards

    def recording_calculate(*args: Any, **kwargs: Any) -> Any:
        gathered = calculate(*args, **kwargs)
        world = trainer.accelerator.num_processes
        line = {**pending, "world_size": world, "gathered": gathered[:, 0].tolist()}
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        pending.clear()
        return gathered

    trainer._calculate_rewards = recording_calculate


def main(argv: Sequence[str]) -> int:
    """``OUT_DIR`` then the ``sde2-train`` flags; trains, recording every reward call."""
    out = Path(argv[0])
    args = build_parser().parse_args(argv[1:])
    trainer, holder = build_trainer(args)
    rank = trainer.accelerator.process_index
    record(trainer, holder, out / f"rank{rank}.jsonl")
    trainer.train()
    if trainer.accelerator.is_main_process:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
