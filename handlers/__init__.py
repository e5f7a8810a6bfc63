"""Handlers: everything a run needs beyond the step itself, each attached to a Trainer.

Importing ``handlers`` stays cheap: optional backends (tensorboard, wandb, matplotlib) are imported
only when the handler that needs them is built.
"""

__all__: list[str] = []
