"""Sequence parallelism under ``transformers.Trainer`` and TRL's trainers, without DeepSpeed.

A script that trains with ``Trainer`` changes by two lines, and is launched with torchrun::

    from ulysses.trainer import SequenceParallelTrainer
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=ds, sp_size=2)

For another Trainer class (TRL's ``SFTTrainer``, a project's own), put the mixin first::

    class SequenceParallelSFTTrainer(ulysses.trainer.SequenceParallel, SFTTrainer): ...

The launched world is a ``("dp", "sp")`` mesh of ``world / sp_size`` data-parallel groups of
``sp_size`` ranks (consecutive ranks form a group). What changes against a plain Trainer:

- **Data:** every rank of an SP group gets the same batch and different groups get different
  batches (the loader is sharded over ``"dp"``, not over the world). Resuming skips batches the
  Trainer's way.
- **The step:** each rank shifts the labels on the whole sequence, keeps its shard
  (:func:`ulysses.hf.shard_batch`), and runs the model on it; attention runs through ulysses over
  ``"sp"``. Padded and packed batches (``DataCollatorWithFlattening``, TRL packing: position ids
  restarting at 0) are exact.
- **The loss** is the exact token mean over the whole optimizer step: every micro-batch of the
  gradient accumulation and every DP group (one all-reduce of the token count per step).
  Gradients are averaged over the world (by the Trainer's DDP, or by FSDP2), so each rank's loss
  is its shard's token sum x world / count, and the logged loss is the global mean.
- **FSDP2:** ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, ...})`` shards the
  parameters, gradients and optimizer state over every rank, SP ranks included. On GPUs the
  Trainer's accelerate applies ``fully_shard``, as it does without ulysses. On CPU, where the
  Trainer ignores ``fsdp``, the mixin applies ``fully_shard`` itself from the same arguments (each
  module of ``transformer_layer_cls_to_wrap``, then the root, over the world) and hands the
  Trainer a model that reduces its own gradients; its checkpoints hold the model and optimizer
  state as torch distributed checkpoint shards (``ulysses_fsdp2/`` in the checkpoint folder),
  which resuming loads, beside the model's full weights.
- **Evaluation** computes the same mean per batch; gathered predictions take one copy per SP
  group, and logits are gathered along the sequence when they are asked for.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from transformers import Trainer

from . import _C, hf, training, vision
from . import groups as G
from . import ops as O
from ._trainer_base import SequenceParallelBase

# Batch keys that carry nothing the shard needs: documents are given by position_ids, and
# TRL's masks are already folded into the labels.
_DROPPED_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
                           "completion_mask", "assistant_masks"})
_SHARDED_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})


def _valid_targets(batch: Mapping[str, torch.Tensor], ignore_index: int) -> torch.Tensor:
    """The number of tokens a batch scores: the shifted labels that are not ignored (one rule,
    the shard's, so the count and the loss cannot disagree)."""
    whole = torch.ops.ulysses.shard_batch(batch["input_ids"], batch.get("labels"), batch.get("attention_mask"),
                                          vision.text_positions(batch.get("position_ids")), 0, 1, 1, ignore_index)
    return (whole[1] != ignore_index).sum()


class SequenceParallel(SequenceParallelBase):
    """Mixin for a ``transformers.Trainer`` class: trains with Ulysses sequence parallelism over
    ``sp_size`` ranks per data-parallel group (module docstring). Put it first in the bases.
    ``verify_tolerance``: before the first step trains, check the model on that step's batch
    against itself unsharded (:func:`ulysses.hf.verify`) and stop with its error above this
    relative error (DDP or one process; not FSDP2). ``tiled_mlp``, ``tiled_loss``, ``checkpoint``,
    ``mlp_tile_tokens``, ``head_chunks`` and ``recompute_chunks`` are
    :func:`ulysses.hf.sequence_parallel`'s. ``timeout``: every wait of the library's (a timedelta
    or seconds); None: ``TrainingArguments.ddp_timeout``, as the Trainer's own collectives."""

    ignore_index = hf.IGNORE_INDEX
    _normalises_the_step = True  # compute_loss is SequenceParallel's (the token mean of the step)

    # --- the step ------------------------------------------------------------------------


    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> Any:
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        # The tokens the whole optimizer step scores, over every micro-batch and DP group.
        tokens = sum((_valid_targets(b, self.ignore_index) for b in batches), torch.zeros((), dtype=torch.long))
        tokens = tokens.to(device)
        dist.all_reduce(tokens, group=self.sequence_mesh["dp"].get_group())
        return batches, tokens

    def _batch_keys(self) -> frozenset:
        """What a batch may hold: the text keys, and a vision-language model's images too."""
        trainer: Any = self
        return _SHARDED_KEYS | (vision.BATCH_KEYS if vision.is_vision_language(trainer.model) else frozenset())

    def _sharded_forward(self, model: torch.nn.Module, inputs: Mapping[str, Any],
                         tiled_loss: bool = False) -> tuple[Any, dict]:
        trainer: Any = self
        keys = self._batch_keys()
        vlm = keys != _SHARDED_KEYS
        unknown = sorted(set(inputs) - keys - _DROPPED_KEYS)
        if unknown:
            problem = (f"the batch has {unknown}, which the sequence shard does not carry; a batch may hold "
                       f"{sorted(keys)}")
        else:
            problem = vision.positions_problem(trainer.model, inputs.get("position_ids")) if vlm else ""
        problem = f"ulysses.trainer: {problem}" if problem else ""
        # One round over every rank before the first collective of the step: a batch wrong on one
        # rank fails all of them alike, not that rank with this error and the others in a timeout.
        _C.check_together(problem, G.group_name(None), self._wait.code(), "ulysses.trainer batch keys")
        sp = self.sequence_mesh["sp"]
        text = {k: v for k, v in inputs.items() if k in _SHARDED_KEYS}
        if "position_ids" in text:  # (a VLM's packed rows: Qwen-VL's [4, B, S])
            text["position_ids"] = vision.text_positions(text["position_ids"])
        shard = hf.shard_batch(text, sp, ignore_index=self.ignore_index)
        if vlm:  # the whole batch on every rank, its shard kept inside (ulysses.vision)
            model_inputs = {k: v for k, v in inputs.items() if k in keys and k != "labels"}
        else:
            model_inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
            if "attention_mask" in shard:
                model_inputs["attention_mask"] = shard["attention_mask"]
        model_inputs["ulysses_seq_lens"] = shard["seq_lens"]
        if tiled_loss:  # the model returns the shard's summed token loss, and no logits
            model_inputs["ulysses_shift_labels"] = shard["shift_labels"]
            model_inputs["ulysses_ignore_index"] = self.ignore_index
        return model(**model_inputs), shard

    def compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if model.training and self._verify_tolerance is not None:
            # The first step's batch, sharded and unsharded, before it trains (ulysses.hf.verify).
            tolerance, self._verify_tolerance = self._verify_tolerance, None
            batch = {k: v for k, v in inputs.items() if k in self._batch_keys()}
            self.verification = hf.verify(self.model, batch, self.sequence_mesh["sp"],  # type: ignore[attr-defined]
                                          tolerance=tolerance)
        settings = hf.long_sequence(self.model)  # type: ignore[attr-defined]
        tiled_loss = settings is not None and settings.tiled_loss and not return_outputs
        outputs, shard = self._sharded_forward(model, inputs, tiled_loss)
        labels = shard["shift_labels"]
        if tiled_loss:
            token_sum = outputs.loss
        else:
            token_sum = torch.nn.functional.cross_entropy(outputs.logits.float().flatten(0, -2), labels.flatten(),
                                                          ignore_index=self.ignore_index, reduction="sum")
        if isinstance(getattr(self, "_total_train_tokens", None), int):  # TRL's SFTTrainer: its metrics
            self._log_token_metrics(None if tiled_loss else outputs.logits, labels, inputs,
                                    "train" if model.training else "eval")
        if model.training:
            # The step's count comes from get_batch_samples (None only outside the training loop).
            tokens = num_items_in_batch if torch.is_tensor(num_items_in_batch) else None
            if tokens is None:
                tokens = (labels != self.ignore_index).sum()
                dist.all_reduce(tokens)
            # DDP and FSDP2 average gradients over the world: scaled so that the average is the mean's.
            loss = training._for_gradients(token_sum / tokens.clamp(min=1), "averaged", None)
        else:
            # Evaluation: this batch's mean over its SP group, the same value on each of its ranks.
            total = torch.stack([token_sum.detach(), (labels != self.ignore_index).sum().to(token_sum.dtype)])
            dist.all_reduce(total, group=self.sequence_mesh["sp"].get_group())
            loss = total[0] / total[1].clamp(min=1)
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, logits: torch.Tensor | None, labels: torch.Tensor, inputs: Mapping[str, Any],
                           mode: str) -> None:
        """TRL SFTTrainer's metrics, which its loss logs and this mixin's loss replaces: the scored
        tokens' mean entropy and top-1 accuracy (from this rank's shard of the logits, summed over
        the SP group; none under the tiled loss, which makes no logits) and the tokens seen, each
        SP group's batch once (_GroupsAsProcesses), as the trainer without SP logs them."""
        trainer: Any = self
        view = self._groups_as_processes_view()
        metrics = trainer._metrics[mode]
        if logits is not None:
            valid = labels != self.ignore_index
            with torch.no_grad():
                logp = torch.log_softmax(logits.float(), -1)
                entropy = -(logp.exp() * logp).sum(-1)
                shard = torch.stack([valid.sum(), (entropy * valid).sum(),
                                     ((logits.argmax(-1) == labels) & valid).sum()]).double()
            dist.all_reduce(shard, group=self.sequence_mesh["sp"].get_group())  # the group's tokens
            count, entropy_sum, correct = (view.gather_for_metrics(x).sum() for x in shard)
            metrics["entropy"].append((entropy_sum / count).item() if count > 0 else 0.0)
            metrics["mean_token_accuracy"].append((correct / count).item() if count > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = inputs["attention_mask"].sum()
            else:  # TRL's count of a padding-free batch: its row length
                tokens = torch.tensor(inputs["position_ids"].size(1), device=labels.device)
            trainer._total_train_tokens += int(view.gather_for_metrics(tokens).sum().item()) // trainer._tp_size
        metrics["num_tokens"] = [trainer._total_train_tokens]

    # --- evaluation ----------------------------------------------------------------------

    def prediction_step(self, model: torch.nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        trainer: Any = self
        inputs = trainer._prepare_inputs(inputs)
        with torch.no_grad(), trainer.compute_loss_context_manager():
            if prediction_loss_only:  # under tiled_loss: no logits
                return self.compute_loss(model, inputs).detach(), None, None
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        sp = self.sequence_mesh["sp"]
        shard_lens = O.sequence_lengths(outputs.logits, 1, sp, self._wait)
        logits = O.all_gather_sequence(outputs.logits.detach(), 1, shard_lens, sp, self._wait)  # whole sequence
        return loss.detach(), logits, inputs.get("labels")

    def _gather_once_per_sequence_group(self, data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's gather_for_metrics, once per SP group (its peers hold the same batch)."""
        return self._groups_as_processes_view().gather_for_metrics(data, use_gather_object)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        trainer: Any = self
        trainer.gather_function = self._gather_once_per_sequence_group  # the Trainer resets it after
        return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]


class WholeSequenceLogProbs(SequenceParallelBase):
    """Mixin for TRL trainers whose loss reads per-token log-probabilities of whole sequences
    through TRL's fused LM head (``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``): put it first in
    the bases, as ``class SequenceParallelDPOTrainer(WholeSequenceLogProbs, DPOTrainer)``.

    It takes :class:`SequenceParallel`'s arguments, and the data follows it (every rank of an SP
    group gets the same batch); the trainer's own loss, metrics and evaluation run unchanged, on
    whole sequences: each of
    its calls ``model(..., labels=labels, fused_lm_head=True)`` (the policy's, the reference
    model's, the old policy's) runs sequence-parallel (:func:`ulysses.hf.whole_sequence_fused_forward`):
    each rank scores its shard and the per-token fields are gathered along the sequence. Every
    rank of an SP group computes the same loss; the gather's backward sums their copies, so the
    Trainer's average of gradients over the world is the exact mean over the data-parallel groups.

    GRPO and RLOO generate as TRL does, on whole prompts (:func:`ulysses.hf.unsharded`: the
    policy's own attention and KV cache), and each SP group keeps its first rank's completions, so
    the group scores one set. Refused, with the reason: an MoE router loss (a shard's), and reward
    statistics over the whole gathered batch (GRPO's ``scale_rewards="batch"`` and
    ``multi_objective_aggregation="normalize_then_sum"``, RLOO's ``normalize_advantages=True``:
    TRL gathers rewards from every rank, and an SP group's ranks hold copies)."""

    _normalises_the_step = False  # the trainer's own loss and its normalisation

    def _make_sequence_parallel(self, model: Any, **long: Any) -> None:
        trainer: Any = self
        args = trainer.args
        if getattr(trainer, "aux_loss_enabled", False):
            raise ValueError("ulysses.trainer: an MoE router loss is a shard's under sequence parallelism; set "
                             "router_aux_loss_coef=0 (or output_router_logits=False) to train with it")
        batch_wide = {"scale_rewards": "batch", "multi_objective_aggregation": "normalize_then_sum",
                      "normalize_advantages": True}  # GRPO's, GRPO's, RLOO's
        chosen = sorted(f"{k}={v!r}" for k, v in batch_wide.items() if getattr(args, k, None) == v)
        if chosen:
            raise ValueError(f"ulysses.trainer: {', '.join(chosen)} takes reward statistics over the whole gathered "
                             "batch, which would count each SP group's copies; not supported with sequence "
                             "parallelism (GRPO: scale_rewards='group' or 'none' with 'sum_then_normalize'; RLOO: "
                             "normalize_advantages=False)")
        if getattr(args, "generation_batch_size", None):  # GRPO/RLOO: TRL counted every rank as a DP rank
            args.generation_batch_size //= self.sp_size
            # ... and seeded each apart (seed + process index) to sample apart; an SP group samples as one.
            set_seed(args.seed + self.sequence_mesh["dp"].get_local_rank())
        for wrapped in (model, getattr(trainer, "ref_model", None)):
            if wrapped is None:
                continue
            m: Any = getattr(wrapped, "module", wrapped)  # the reference model as the accelerator prepared it
            fused = m.__dict__.get("forward")  # trl's add_fused_lm_head put it there
            if fused is None:
                raise ValueError("ulysses.trainer: WholeSequenceLogProbs needs the trainer's fused LM head (TRL's "
                                 f"add_fused_lm_head, as DPOTrainer adds it); {type(m).__name__} has none")
            hf.sequence_parallel(m, self.sequence_mesh["sp"], timeout=self._wait, **long)
            sharded = m.__dict__["forward"]

            def forward(self_: Any, *args: Any, fused_lm_head: bool = False, sharded_: Any = sharded,
                        fused_: Any = fused, **kwargs: Any) -> Any:
                if not fused_lm_head:  # a shard's forward, as sequence_parallel's (whole inside unsharded())
                    return sharded_(*args, **kwargs)
                if self_.__dict__.get("_ulysses_whole"):  # inside unsharded(): TRL's head, whole sequences
                    return fused_(*args, fused_lm_head=True, **kwargs)
                return hf.whole_sequence_fused_forward(self_, fused_, **kwargs)

            m.forward = types.MethodType(forward, m)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        """GRPO's and RLOO's generation: TRL's own, on whole prompts, with the policy unsharded; the
        SP group then keeps its first rank's completions (sampling need not agree across ranks)."""
        trainer: Any = self
        with hf.unsharded(trainer.accelerator.unwrap_model(trainer.model)):
            out = [super()._generate_single_turn(*args, **kwargs)]  # type: ignore[misc]
        dist.broadcast_object_list(out, group=self.sequence_mesh["sp"].get_group(), group_src=0)
        return out[0]

    # The trainer's own steps: its loss runs on whole sequences. Where it scores, logs and
    # normalises, each SP group counts as one process (_GroupsAsProcesses), so its metrics are
    # a run's without SP.
    def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
        with self._groups_as_processes():  # GRPO's and RLOO's rewards, advantages and metrics
            return super()._generate_and_score_completions(*args, **kwargs)  # type: ignore[misc]

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        with self._groups_as_processes():
            return super().compute_loss(*args, **kwargs)  # type: ignore[misc]

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._groups_as_processes():
            return super().prediction_step(*args, **kwargs)  # type: ignore[misc]


class SequenceParallelTrainer(SequenceParallel, Trainer):
    """``transformers.Trainer`` with Ulysses sequence parallelism (:class:`SequenceParallel`)."""


__all__ = ["SequenceParallel", "SequenceParallelTrainer", "WholeSequenceLogProbs"]
