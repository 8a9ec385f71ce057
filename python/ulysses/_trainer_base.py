"""What both trainer mixins of :mod:`ulysses.trainer` share: the ``("dp", "sp")`` mesh and the
model made sequence-parallel over ``"sp"``, FSDP2 where the Trainer does not apply it (CPU) with
its checkpoints, the data sharded over ``"dp"`` (every rank of an SP group gets the same batch),
and each SP group counted as one process where a trainer gathers, reduces or counts
(:class:`_GroupsAsProcesses`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import time
from typing import Any

import accelerate.utils
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from accelerate.utils import recursively_apply
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from transformers.trainer import SCHEDULER_NAME

from . import groups as G
from . import hf
from .attention import HeadChunks

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


class SequenceParallelBase:
    """The part of :class:`ulysses.trainer.SequenceParallel` and
    :class:`ulysses.trainer.WholeSequenceLogProbs` that is the same: their constructor (its
    arguments are documented on ``SequenceParallel``), FSDP2, the data, and the trainer's counts
    over SP groups. A mixin: first in the bases, before a ``transformers.Trainer`` class."""

    _normalises_the_step = False  # True: compute_loss divides by the whole optimizer step's count

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

    # --- each SP group as one process, where a trainer gathers, reduces or counts ---------

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
