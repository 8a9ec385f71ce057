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

import atexit
import contextlib
import functools
import os
import sys
import time
import types
from collections.abc import Mapping
from typing import Any

import accelerate.utils
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from accelerate.utils import recursively_apply, set_seed
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from . import _C, hf, training, vision
from . import groups as G
from . import ops as O
from .attention import HeadChunks

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


# The folder in a checkpoint of the shards of a model the mixin sharded (torch distributed checkpoint).
_SHARDED_CHECKPOINT = "ulysses_fsdp2"

# FSDP plugin arguments the mixin's own fully_shard honours (TrainingArguments._process_fsdp_args).
_FSDP_ARGS = frozenset({"fsdp_version", "auto_wrap_policy", "transformer_cls_names_to_wrap", "reshard_after_forward",
                        "state_dict_type", "cpu_ram_efficient_loading"})


def _fsdp2_arguments(args: Any) -> dict | None:
    """The FSDP plugin arguments a script asked for (``TrainingArguments(fsdp=..., fsdp_config=...)``),
    None without ``fsdp``; FSDP1 is refused."""
    if not getattr(args, "fsdp", None):
        return None
    plugin = getattr(args, "fsdp_plugin_args", None) or {}
    if plugin.get("fsdp_version") != 2:
        raise ValueError("ulysses.trainer: FSDP runs as FSDP2 only; pass fsdp_config={'fsdp_version': 2, ...}")
    return plugin


@functools.cache
def _let_collectives_settle_at_exit() -> None:
    """Before Python finalizes, release the GIL for a moment (pytorch/pytorch#38228).

    The Trainer's last collectives (e.g. ``store_flos``'s all_gather) hand Gloo tensors that
    Python then drops, so a Gloo worker thread often frees them after the caller's wait returned,
    and freeing a tensor that Python owned takes the GIL. Once Python is finalizing, a thread
    that asks for the GIL is ended inside a noexcept destructor: the process aborts with
    "terminate called without an active exception" (~1 run in 12 of the dp 2 x sp 2 example).
    atexit callbacks run before finalization, so the workers can finish there. Local only: no
    collective, nothing to hang on when a peer has died."""
    atexit.register(time.sleep, 0.2)


class _GroupsAsProcesses:
    """The accelerator as a trainer sees it under sequence parallelism: each SP group one process.

    The ranks of an SP group hold copies of the same whole sequences, so whatever a trainer
    gathers, reduces or slices by process would count each group ``sp`` times: its logged token
    counts and metrics, the standard deviations of its rewards. Through this view it counts each
    group once, as a run without SP counts each process: ``process_index`` and
    ``num_processes`` are the data-parallel rank and size, and ``gather``, ``gather_for_metrics``,
    ``reduce`` and ``gather_object`` keep each group's first rank's part. (A loss normaliser such as
    GRPO's, a gathered count over the process count, comes out the same either way.) Everything
    else is the real accelerator's; the gradients' reduction (DDP, FSDP2) still spans the world."""

    def __init__(self, accelerator: Any, dp_rank: int, dp_size: int, sp_size: int) -> None:
        self._accelerator, self._sp = accelerator, sp_size
        self.process_index, self.num_processes = dp_rank, dp_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def _first_of_each_group(self, whole: torch.Tensor) -> torch.Tensor:
        """The world's gather ``[world x n, ...]`` -> each group's first rank's ``[dp x n, ...]``
        (consecutive ranks form a group: the mixin's mesh)."""
        return whole.reshape(self.num_processes, self._sp, -1, *whole.shape[1:])[:, 0].flatten(0, 1)

    def gather(self, data: Any) -> Any:
        return recursively_apply(lambda t: self._first_of_each_group(accelerate.utils.gather(t)), data)

    def gather_object(self, data: Any) -> list:
        every = accelerate.utils.gather_object([data])  # each rank's, in rank order
        return [x for part in every[::self._sp] for x in part]

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        try:
            recursively_apply(lambda t: t, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        data = self.gather_object(data) if use_gather_object else self.gather(data)
        state = self._accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # drop what evened out the last batch
            return data[: state.remainder] if use_gather_object else recursively_apply(
                lambda t: t[: state.remainder], data)
        return data

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        if reduction == "none":
            return tensor * scale
        every = self.gather(tensor[None])  # [dp, *tensor.shape]
        return (every.sum(0) if reduction == "sum" else every.mean(0)) * scale


class SequenceParallel:
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

    def __init__(self, *args: Any, sp_size: int, tiled_mlp: bool = False, tiled_loss: bool = False,
                 checkpoint: str | None = None, mlp_tile_tokens: int | None = None,
                 head_chunks: HeadChunks = 1, recompute_chunks: bool = False,
                 verify_tolerance: float | None = None, timeout: G.Timeout = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        trainer: Any = self
        # Every wait of the job's, the attention's included: the Trainer's own (ddp_timeout, 30
        # minutes by default) unless the script gives one (Note [One wait] in ulysses/groups.py).
        self._wait = G.wait(timeout if timeout is not None else trainer.args.ddp_timeout)
        world = trainer.args.world_size
        if not dist.is_initialized():
            raise RuntimeError("ulysses.trainer: torch.distributed is not initialized; launch the script with "
                               f"torchrun (e.g. torchrun --nproc_per_node {sp_size} train.py)")
        if sp_size < 1 or world % sp_size:
            raise ValueError(f"ulysses.trainer: sp_size must divide the world size {world}; got {sp_size}")
        fsdp = _fsdp2_arguments(trainer.args)
        if trainer.is_deepspeed_enabled or trainer.args.n_gpu > 1:
            raise ValueError("ulysses.trainer: runs under the Trainer's DDP or FSDP2 (one device per process); "
                             "DeepSpeed and DataParallel are not supported with it")
        _let_collectives_settle_at_exit()
        self._shards_itself = False  # set by _fully_shard
        self.sp_size = sp_size
        self.sequence_mesh = init_device_mesh(trainer.args.device.type, (world // sp_size, sp_size),
                                              mesh_dim_names=("dp", "sp"))
        self._make_sequence_parallel(trainer.model, tiled_mlp=tiled_mlp, tiled_loss=tiled_loss,
                                     checkpoint=checkpoint, mlp_tile_tokens=mlp_tile_tokens,
                                     head_chunks=head_chunks, recompute_chunks=recompute_chunks)
        if fsdp is not None and not trainer.is_fsdp_enabled:  # the Trainer ignored fsdp (CPU): shard here
            self._fully_shard(fsdp)
        if self._normalises_the_step:  # compute_loss divides by the whole optimizer step's count
            trainer.loss_is_scaled_for_ga = True
        if verify_tolerance is not None and self._shards_itself:
            raise ValueError("ulysses.trainer: verify_tolerance checks a model whose every rank holds it whole; "
                             "it does not run under FSDP2")
        self._verify_tolerance = verify_tolerance  # None once the first step is verified (or never).
        self.verification: hf.Verification | None = None  # The first step's, with verify_tolerance.
        self._step_tokens: torch.Tensor | None = None

    def _make_sequence_parallel(self, model: Any, **long: Any) -> None:
        hf.sequence_parallel(model, self.sequence_mesh["sp"], timeout=self._wait, **long)

    # --- FSDP2 where the Trainer does not apply it (CPU) ---------------------------------

    def _fully_shard(self, fsdp: dict) -> None:
        """``fully_shard`` as accelerate's FSDP2 plugin applies it from the same arguments: each module
        of the wrapped classes, then the root, over every rank. The Trainer then neither moves nor
        DDP-wraps the model: it reduces its own gradients (transformers' path for models sharded
        at load time)."""
        from torch.distributed.fsdp import fully_shard

        trainer: Any = self
        args, model = trainer.args, trainer.model
        unknown = sorted(k for k, v in fsdp.items() if k not in _FSDP_ARGS and v)
        if unknown or fsdp.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
            raise ValueError(f"ulysses.trainer: on CPU the mixin applies FSDP2 itself and honours "
                             f"transformer_layer_cls_to_wrap and reshard_after_forward only; got {fsdp}")
        names = fsdp.get("transformer_cls_names_to_wrap") or ",".join(getattr(model, "_no_split_modules", None) or [])
        wrapped = {n for n in names.split(",") if n}
        layers = [m for m in model.modules() if type(m).__name__ in wrapped]
        if not layers:
            raise ValueError(f"ulysses.trainer: FSDP2 wraps modules of {sorted(wrapped)}, and the model has none; "
                             "set fsdp_config['transformer_layer_cls_to_wrap']")
        mesh = init_device_mesh(args.device.type, (dist.get_world_size(),))
        reshard = bool(fsdp.get("reshard_after_forward", True))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        # The root (embeddings, head) stays gathered after forward: backward needs it at once.
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        trainer.is_distributed_loading_by_transformers = True
        self._shards_itself = True

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Any:
        """The Trainer's ``no_sync`` for a model it did not wrap: gradients of all but the last
        micro-batch stay unreduced (the Trainer's own version reads a load-time config)."""
        model: Any = self.model  # type: ignore[attr-defined]
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    # Checkpoints of the model sharded here: model and optimizer as torch distributed checkpoint
    # shards (each rank writes and reads its own), beside what the Trainer saves.

    def _sharded_checkpoint(self, folder: str) -> str:
        return os.path.join(folder, _SHARDED_CHECKPOINT)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        trainer: Any = self
        if not self._shards_itself:
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        model, optimizer = get_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=self._sharded_checkpoint(output_dir))
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's full weights, gathered from every rank's shards (a collective: the Trainer
        calls this on every rank of a model it did not wrap), as ``save_pretrained`` writes them."""
        trainer: Any = self
        if self._shards_itself and state_dict is None:
            state_dict = get_model_state_dict(trainer.model,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return super()._save(output_dir, state_dict)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        trainer: Any = self
        if not self._shards_itself:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        state = {"model": get_model_state_dict(trainer.model)}
        dcp.load(state, checkpoint_id=self._sharded_checkpoint(resume_from_checkpoint))
        set_model_state_dict(trainer.model, state["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        trainer: Any = self
        if not self._shards_itself or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        state = {"optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)}
        dcp.load(state, checkpoint_id=self._sharded_checkpoint(checkpoint))
        set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizer"])
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        trainer.lr_scheduler.load_state_dict(scheduler)

    # --- data: sharded over "dp", the same batch on every rank of an SP group ---------------

    def _shard_over_data_parallel(self, loader: Any) -> Any:
        dp = self.sequence_mesh["dp"]
        shard: Any = getattr(loader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            shard = getattr(loader, "dataset", None)
            if not isinstance(shard, IterableDatasetShard):
                raise ValueError(f"ulysses.trainer: the Trainer's data loader is a {type(loader).__name__}, which "
                                 "cannot be sharded over the data-parallel ranks only; for an iterable dataset "
                                 "pass TrainingArguments(accelerator_config={'dispatch_batches': False})")
        shard.num_processes, shard.process_index = dp.size(), dp.get_local_rank()
        if dp.size() == 1 and isinstance(shard, BatchSamplerShard):
            shard.even_batches = False  # one group: no batch to even out, as in a single process
        return loader

    def get_train_dataloader(self) -> Any:
        return self._shard_over_data_parallel(super().get_train_dataloader())  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._shard_over_data_parallel(super().get_eval_dataloader(eval_dataset))  # type: ignore[misc]

    def get_total_train_batch_size(self, args: Any) -> int:
        return super().get_total_train_batch_size(args) // self.sp_size  # type: ignore[misc]

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

    def _groups_as_processes_view(self) -> _GroupsAsProcesses:
        trainer: Any = self
        accelerator = trainer.accelerator
        if isinstance(accelerator, _GroupsAsProcesses):
            return accelerator
        dp = self.sequence_mesh["dp"]
        return _GroupsAsProcesses(accelerator, dp.get_local_rank(), dp.size(), self.sp_size)

    @contextlib.contextmanager
    def _groups_as_processes(self) -> Any:
        """Within, the trainer's accelerator (and the ``gather`` and ``gather_object`` its
        classes' modules imported from accelerate, as TRL's do) count each SP group as one
        process (:class:`_GroupsAsProcesses`). Re-entrant."""
        trainer: Any = self
        if isinstance(trainer.accelerator, _GroupsAsProcesses):
            yield
            return
        real, view = trainer.accelerator, self._groups_as_processes_view()
        patched = []
        for cls in type(self).__mro__:
            module = sys.modules.get(cls.__module__)
            for name in ("gather", "gather_object"):
                if module is not None and getattr(module, name, None) is getattr(accelerate.utils, name):
                    patched.append((module, name))
                    setattr(module, name, getattr(view, name))
        trainer.accelerator = view
        try:
            yield
        finally:
            trainer.accelerator = real
            for module, name in patched:
                setattr(module, name, getattr(accelerate.utils, name))

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """The Trainer's count of input tokens seen (``include_num_input_tokens_seen``): each SP
        group's batch once, as one process would count it."""
        with self._groups_as_processes():
            super()._track_num_input_tokens(inputs)  # type: ignore[misc]

    def floating_point_ops(self, inputs: dict[str, torch.Tensor | Any]) -> int:
        """The first rank of an SP group counts the group's batch and its peers, who hold copies,
        nothing: the Trainer's sum over the world (``total_flos``) counts each batch once."""
        if self.sequence_mesh["sp"].get_local_rank():
            return 0
        return super().floating_point_ops(inputs)  # type: ignore[misc]

    def _gather_once_per_sequence_group(self, data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's gather_for_metrics, once per SP group (its peers hold the same batch)."""
        return self._groups_as_processes_view().gather_for_metrics(data, use_gather_object)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        trainer: Any = self
        trainer.gather_function = self._gather_once_per_sequence_group  # the Trainer resets it after
        return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]


class WholeSequenceLogProbs(SequenceParallel):
    """Mixin for TRL trainers whose loss reads per-token log-probabilities of whole sequences
    through TRL's fused LM head (``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``): put it first in
    the bases, as ``class SequenceParallelDPOTrainer(WholeSequenceLogProbs, DPOTrainer)``.

    The data follows :class:`SequenceParallel` (every rank of an SP group gets the same batch),
    and the trainer's own loss, metrics and evaluation run unchanged, on whole sequences: each of
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
    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        return super(SequenceParallel, self).get_batch_samples(*args, **kwargs)  # type: ignore[misc]

    def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
        with self._groups_as_processes():  # GRPO's and RLOO's rewards, advantages and metrics
            return super()._generate_and_score_completions(*args, **kwargs)  # type: ignore[misc]

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        with self._groups_as_processes():
            return super(SequenceParallel, self).compute_loss(*args, **kwargs)  # type: ignore[misc]

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._groups_as_processes():
            return super(SequenceParallel, self).prediction_step(*args, **kwargs)  # type: ignore[misc]

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        return super(SequenceParallel, self).evaluation_loop(*args, **kwargs)  # type: ignore[misc]


class SequenceParallelTrainer(SequenceParallel, Trainer):
    """``transformers.Trainer`` with Ulysses sequence parallelism (:class:`SequenceParallel`)."""


__all__ = ["SequenceParallel", "SequenceParallelTrainer", "WholeSequenceLogProbs"]
