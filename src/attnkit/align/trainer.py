"""Alignment attention with transformers' ``Trainer`` (and so with ``accelerate launch``).

    from attnkit.align import AlignmentRegularizer
    from attnkit.align.trainer import AlignmentTrainer

    reg = AlignmentRegularizer(model, method="ct", weight=0.01)
    trainer = AlignmentTrainer(model=model, args=args, train_dataset=train, regularizer=reg)
    trainer.train()

``AlignmentTrainer`` adds ``reg.loss()`` to the task loss of every training step, puts the regularizer's
parameters (discriminator / critic / navigator) in the optimizer as their own group without weight decay, and
averages their gradients over the processes before each optimizer step (DDP averages only the model's). Any
``Trainer`` subclass can be extended the same way with ``alignment_trainer_class(base)``.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["alignment_trainer_class"]  # AlignmentTrainer (the Trainer subclass) is built on first access


@lru_cache(maxsize=None)
def alignment_trainer_class(base=None):
    """A subclass of ``base`` (default ``transformers.Trainer``) taking ``regularizer=`` in its
    constructor."""
    from transformers import Trainer, TrainerCallback

    base = Trainer if base is None else base

    class _SyncRegularizer(TrainerCallback):
        def __init__(self, regularizer) -> None:
            self.regularizer = regularizer

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.regularizer.sync_gradients()

    class AlignmentTrainer(base):
        """``Trainer`` whose training loss is ``task loss + regularizer.loss()``."""

        def __init__(self, *args, regularizer, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.regularizer = regularizer.to(self.args.device)
            self.add_callback(_SyncRegularizer(regularizer))

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            if model.training and self.regularizer.config.weight > 0:
                reg = self.regularizer.loss()  # the mean over this micro-batch
                if self._loss_scaled_for_accumulation(kwargs.get("num_items_in_batch")):
                    # the Trainer will not divide this loss by the accumulation steps (the task loss was
                    # normalized over the whole accumulated batch): the regularizer's share is divided here,
                    # or its weight would grow with gradient_accumulation_steps
                    reg = reg / getattr(self, "current_gradient_accumulation_steps",
                                        self.args.gradient_accumulation_steps)
                loss = loss + reg
            return (loss, outputs) if return_outputs else loss

        def _loss_scaled_for_accumulation(self, num_items_in_batch) -> bool:
            """``Trainer.training_step``'s own test of whether it leaves the loss undivided."""
            fixed = getattr(self, "loss_is_scaled_for_ga", None)
            if fixed is not None:
                return bool(fixed)
            return bool(
                (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
                or getattr(self, "compute_loss_func", None) is not None
            )

        def create_optimizer(self, *args, **kwargs):
            optimizer = super().create_optimizer(*args, **kwargs)
            own = [p for p in self.regularizer.parameters() if p.requires_grad]
            known = {id(p) for group in optimizer.param_groups for p in group["params"]}
            own = [p for p in own if id(p) not in known]
            if own:
                optimizer.add_param_group({"params": own, "weight_decay": 0.0})
            return optimizer

    AlignmentTrainer.__qualname__ = AlignmentTrainer.__name__ = f"Alignment{base.__name__}"
    return AlignmentTrainer


def __getattr__(name: str):
    if name == "AlignmentTrainer":
        return alignment_trainer_class()
    raise AttributeError(name)
