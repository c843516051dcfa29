"""The training worker: one process of a torchrun world, started with a resolved :class:`TrainConfig`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import gc
import inspect
import itertools
import math
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync.distributed import get_rank, get_world_size, is_distributed
from distsync.lifeline import die_with_parent

from .checkpoint import (
    load_checkpoint,
    load_newest_checkpoint,
    remove_stale_temporaries,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .comm import CommSetup
from .config import TrainConfig
from .data import LoaderBatches, ShardedBatches, build_datasets, eval_batches, load_data
from .logs import console_quiet, init_logger
from .metrics import MetricsLog, plot_curves, write_json_atomic
from .model import all_norms_synced, batch_norms, build_model
from .resume import ResumeError, check_resume
from .rundir import RunDirBusy, RunDirLock, held_by_launcher, keep_hydra_record, restore_hydra_record
from .targets import instantiate

__all__ = ["run"]

_DDP_ARGS = inspect.signature(
    DistributedDataParallel.__init__
).parameters  # broadcast_buffers renamed in 2.13

KILL_AT_STEP_ENV = "DISTSYNC_TEST_KILL_AT_STEP"
"""Test hook: the rank in ``DISTSYNC_TEST_KILL_RANK`` (default 1) SIGKILLs itself after this step, on the
first attempt only (``TORCHELASTIC_RESTART_COUNT=0``). Used by the fault-tolerance test."""


@record
def run(cfg: TrainConfig, run_dir: str) -> dict:
    """Train under the torchrun environment (or single-process without one) and return the summary.

    Joins the process group with :func:`distsync.init_distributed`, locks ``run_dir`` for this job
    (:class:`~distsync.train.rundir.RunDirBusy` on every rank if another job holds it), resumes from the
    newest checkpoint in ``<run_dir>/checkpoints`` that loads and that the config may continue
    (:mod:`distsync.train.resume`), trains until ``trainer.max_steps``, and on rank 0 writes
    ``metrics.jsonl``, checkpoints, ``summary.json`` and ``curves.png`` under ``run_dir``. Every rank
    returns the same summary (all its values are reduced across ranks). Started by an elastic agent, the
    process dies with the agent (:func:`~distsync.lifeline.die_with_parent`).

    Args:
        cfg: the resolved configuration (a plain dataclass, picklable)
        run_dir: the run directory, the same on every rank
    """
    started = time.time()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    device = distsync.init_distributed(
        cfg.trainer.backend, timeout=datetime.timedelta(seconds=cfg.trainer.timeout_s)
    )
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpu_threads_per_rank())
    lock = None
    try:
        lock = _lock(Path(run_dir))
        try:
            trainer = _Trainer(cfg, Path(run_dir), device, started)
        except ResumeError:
            if lock is not None:  # Hydra wrote this refused job's record over the one of the job that trained
                restore_hydra_record(run_dir)
            raise
        if lock is not None:
            keep_hydra_record(run_dir)  # this job trains here: its record is the one to keep
        summary = trainer.fit()
    finally:
        if lock is not None:
            lock.release()
    if is_distributed():
        # The group goes after the DDP model that holds it: a gloo group freed by DDP after
        # destroy_process_group can deadlock in its destructor. After a failure it dies with the process.
        gc.collect()
        dist.barrier()  # rank 0 writes the last files after the last collective: nobody tears down before
        dist.destroy_process_group()
    return summary


FINAL_LOSS_STEPS = 10  # summary.json's final_loss: the mean training loss of this many last steps


def cpu_threads_per_rank() -> int:
    """The cores this process may use shared among the ranks running on its host, however many agents
    started them.

    torchrun sets ``OMP_NUM_THREADS=1`` only for several workers per agent, so two agents with one worker
    each on one machine would run twice the threads of one agent with two workers, and sum in another
    order: counting the ranks per host gives every layout the same threads, and the same results. The
    cores are the process's CPU affinity, which a packed sweep (``hydra.launcher.n_jobs``) or a scheduler
    narrows to the job's own.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not is_distributed():
        return cores
    hosts: list[str | None] = [None] * get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return max(1, cores // hosts.count(socket.gethostname()))


def _lock(run_dir: Path) -> RunDirLock | None:
    """Rank 0 locks ``run_dir`` before anything is written there; every rank raises if that failed."""
    lock, error = None, None
    if get_rank() == 0 and not held_by_launcher(run_dir):
        try:
            lock = RunDirLock(run_dir).acquire()
        except RunDirBusy as busy:
            error = str(busy)
            print(f"Error: {error}", file=sys.stderr, flush=True)
            restore_hydra_record(run_dir)  # Hydra wrote this job's record over the holder's
    error = _broadcast_object(error)
    if error:
        raise RunDirBusy(error)
    return lock


class _Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, device: torch.device, started: float) -> None:
        self.cfg, self.run_dir, self.device, self.started = cfg, run_dir, device, started
        self.rank, self.world_size = get_rank(), get_world_size()
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.log = init_logger(run_dir, self.rank)
        t = cfg.trainer
        if self.rank == 0:  # under the run directory's lock: no other job is writing
            for tmp in remove_stale_temporaries(run_dir):
                self.log.warning("removed %s, left by a checkpoint save that was interrupted", tmp.name)

        torch.manual_seed(t.seed)  # the same initial model on every rank
        self._load_data(cfg)
        self.model = build_model(cfg.model, self.in_channels, self.num_classes).to(device)
        if t.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.criterion = instantiate(cfg.model.loss) if cfg.model.loss else torch.nn.CrossEntropyLoss()
        self.comm = CommSetup(t, self.world_size)
        self.optimizer = self.comm.wrap_optimizer(_optimizer(cfg, self.model))
        if cfg.optim.scheduler:
            self.scheduler = instantiate(cfg.optim.scheduler, self.optimizer)
        else:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(cfg))
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=low)) if low else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
        _seed_everything(t.seed + self.rank)  # per-rank randomness (dropout) from here on

        self.metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=self.rank == 0)
        self.step, self.last_loss, self.resumed_from = 0, math.nan, None
        # This rank's training losses of the last FINAL_LOSS_STEPS steps (for final_loss).
        self.recent_losses = torch.full((FINAL_LOSS_STEPS,), math.nan, dtype=torch.float64, device=device)
        self.first_started = started
        local_states = self._resume()
        self.ddp = self._wrap_ddp()
        self.forward = torch.compile(self.ddp) if t.compile else self.ddp
        if local_states is not None:  # after DDP's constructor, which copies rank 0's parameters everywhere
            self.model.load_state_dict(local_states["model"])

    # ------------------------------------------------------------------------------------------- setup

    def _load_data(self, cfg: TrainConfig) -> None:
        """Training batches and held-out data: the built-in tensors, or the ``data.train/test`` datasets."""
        if not cfg.data.train:
            self.train, self.test, self.num_classes = load_data(cfg.data)
            self.in_channels = self.train[0].shape[1]
        else:
            self.train, self.test = build_datasets(cfg.data)
            self.num_classes = cfg.data.num_classes
            self.in_channels = None if cfg.model.factory else self.train[0][0].shape[0]
        self.batches = self._training_batches(cfg.trainer.seed)

    def _training_batches(self, seed: int) -> ShardedBatches | LoaderBatches:
        """This rank's endless training batches, shuffled with ``seed``."""
        d = self.cfg.data
        if not d.train:
            return ShardedBatches(self.train, d.batch_size, self.rank, self.world_size, seed)
        pin_memory = self.device.type == "cuda"
        return LoaderBatches(
            self.train, d.batch_size, self.rank, self.world_size, seed, d.num_workers, pin_memory=pin_memory
        )

    def _wrap_ddp(self) -> torch.nn.Module:
        if not is_distributed():
            return self.model
        # Synchronized BN keeps the running statistics equal on every rank: no buffer broadcast per forward.
        sync_buffers = not all_norms_synced(self.model)
        key = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        ddp = DistributedDataParallel(
            self.model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            **{key: sync_buffers},
        )
        self.comm.register_hook(ddp, self.step)
        return ddp

    def _resume(self) -> dict | None:
        """Load the newest usable checkpoint (rank 0 chooses, every rank loads the same one).

        Returns this rank's own model and optimizer state when the checkpoint holds one per rank
        (post-local-SGD, where the ranks' models differ between averagings), for after the DDP wrap.
        """
        path, error, allowed = None, None, []
        if self.rank == 0:
            found = load_newest_checkpoint(self.run_dir, self.log)
            if found is not None:
                path, state = found
                try:
                    allowed = check_resume(
                        state["config"], dataclasses.asdict(self.cfg), state["step"], str(path)
                    )
                except ResumeError as refused:
                    error = str(refused)
                    self.log.error("%s", error)
                if allowed:
                    self.log.info("resuming with changed settings: %s", ", ".join(allowed))
        path, error = _broadcast_object((str(path) if path else None, error))
        if error:
            raise ResumeError(error)
        if path is None:
            self.metrics.truncate(0)  # rows of an earlier attempt that never checkpointed
            return None
        if self.rank != 0:
            state = load_checkpoint(path)
        local = state.get("local")
        same_world = len(state["rng"]) == self.world_size
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(
            local[self.rank]["optimizer"] if local and same_world else state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["batches"])
        if same_world:
            set_rng_state(state["rng"][self.rank])
        else:
            self.log.warning(
                "checkpoint from %d ranks, now %d: RNG reseeded", len(state["rng"]), self.world_size
            )
        self.step = self.resumed_from = int(state["step"])
        self.last_loss = state["last_loss"]
        if "recent_losses" in state:  # older checkpoints: final_loss from the steps run after resuming
            recent = torch.tensor(state["recent_losses"], dtype=torch.float64)
            self.recent_losses.copy_(recent[self.rank] if same_world else recent.mean(0))
        self.first_started = state["started_at"]
        self.metrics.truncate(self.step)
        self.log.info("resumed from %s (step %d, restart %d)", path, self.step, self.restarts)
        return local[self.rank] if local and same_world else None

    # ---------------------------------------------------------------------------------------- training

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        self.log.info(
            "world_size=%d device=%s norm=%s global_batch=%d steps=%d run_dir=%s",
            self.world_size,
            self.device,
            cfg.model.norm,
            cfg.data.batch_size * self.world_size,
            t.max_steps,
            self.run_dir,
        )
        bar = _progress_bar(t.max_steps, self.step, enabled=self.rank == 0 and t.progress)
        with console_quiet(bar is not None):  # with a bar, INFO lines go to the rank's file only
            self._train(bar)
        if bar is not None:
            bar.close()
        return self._finish()

    def _train(self, bar) -> None:
        t = self.cfg.trainer
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # sum of losses, count
        batches = iter(self.batches)
        self.ddp.train()
        while self.step < t.max_steps:
            loss = self._train_step(batches)
            self.scheduler.step()
            self.step += 1
            loss_sum += torch.stack([loss.double(), loss.new_ones((), dtype=torch.float64)])
            self.recent_losses[self.step % FINAL_LOSS_STEPS] = loss.double()  # on the device: no sync
            if bar is not None:
                bar.update(1)
            if (
                self.step % t.log_every == 0
                or self.step % t.checkpoint_every == 0
                or self.step == t.max_steps
            ):
                distsync.check_sync()  # deferred GPU-side errors surface before anything is logged or saved
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                self._log_train(loss_sum, bar)
                loss_sum.zero_()
            if self.step % t.eval_every == 0 and self.step < t.max_steps:
                self._evaluate()
            if self.step % t.checkpoint_every == 0 or self.step == t.max_steps:
                self._checkpoint()
            _test_kill_hook(self.step, self.rank, self.restarts)

    def _train_step(self, batches) -> torch.Tensor:
        """One optimizer step over ``trainer.grad_accum_steps`` micro-batches; returns the mean loss."""
        t = self.cfg.trainer
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for micro in range(t.grad_accum_steps):
            inputs, labels = (x.to(self.device, non_blocking=True) for x in next(batches))
            inputs = self._laid_out(inputs)
            last = micro == t.grad_accum_steps - 1
            no_sync = getattr(self.ddp, "no_sync", None)
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                with self.autocast():
                    loss = self.criterion(self.forward(inputs), labels) / t.grad_accum_steps
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        if t.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return total

    def _log_train(self, loss_sum: torch.Tensor, bar) -> None:
        _all_reduce(loss_sum)
        self.last_loss = (loss_sum[0] / loss_sum[1]).item()
        lr = self.scheduler.get_last_lr()[0]
        row = {
            "kind": "train",
            "step": self.step,
            "epoch": self.batches.epoch,
            "loss": self.last_loss,
            "lr": lr,
            "elapsed_s": round(time.time() - self.first_started, 3),
        }
        self.metrics.write(**row)
        if bar is not None:
            bar.set_postfix(loss=f"{self.last_loss:.4f}", refresh=False)
        self.log.info(_fmt(row))

    @torch.no_grad()
    def _evaluate(self) -> tuple[float, float, float | None]:
        """Held-out top-1 accuracy, loss and top-5 accuracy (None with 5 classes or fewer), each rank on its
        share, summed across ranks."""
        d = self.cfg.data
        if self.cfg.trainer.precise_bn_batches:
            self._precise_bn()
        # loss sum, top-1 correct, count, top-5 correct
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        classes = 0
        self.model.eval()
        for x, y in eval_batches(self.test, self.rank, self.world_size, 1024, d.num_workers):
            x, y = self._laid_out(x.to(self.device)), y.to(self.device)
            with self.autocast():
                logits = self.model(x).float()
            classes = logits.shape[1]
            totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
            totals[1] += (logits.argmax(1) == y).sum().double()
            totals[2] += len(y)
            if classes > 5:
                totals[3] += (logits.topk(5, dim=1).indices == y[:, None]).any(1).sum().double()
        self.model.train()
        has_top5 = torch.tensor([float(classes > 5)], device=self.device)
        _all_reduce(totals)
        _all_reduce(has_top5)  # a rank with no held-out sample saw no logits
        count = max(totals[2].item(), 1.0)
        accuracy, eval_loss = totals[1].item() / count, totals[0].item() / count
        top5 = totals[3].item() / count if has_top5.item() > 0 else None
        row = {"accuracy": accuracy, "eval_loss": eval_loss}
        if top5 is not None:
            row["accuracy_top5"] = top5
        self.metrics.write(kind="eval", step=self.step, **row)
        self.log.info("step %d: held-out %s", self.step, ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
        return accuracy, eval_loss, top5

    def _laid_out(self, images: torch.Tensor) -> torch.Tensor:
        """Model inputs in the configured memory format."""
        if self.cfg.trainer.channels_last and images.dim() == 4:
            return images.contiguous(memory_format=torch.channels_last)
        return images

    def _precise_bn(self) -> None:
        """Precise BN: the synced layers' statistics over ``trainer.precise_bn_batches`` training batches
        per rank, drawn apart from the training order (which a resumed run must see unchanged)."""
        t = self.cfg.trainer
        batches = itertools.islice(iter(self._training_batches(t.seed + 1 + self.step)), t.precise_bn_batches)
        memory_format = torch.channels_last if t.channels_last else torch.contiguous_format
        inputs = (
            x.to(self.device).contiguous(
                memory_format=memory_format if x.dim() == 4 else torch.contiguous_format
            )
            for x, _ in batches
        )
        with self.autocast():
            distsync.update_bn(inputs, self.model)

    def _final_loss(self) -> float:
        """The mean training loss of the last ``FINAL_LOSS_STEPS`` steps over every rank: unlike the logged
        loss, independent of ``trainer.log_every``."""
        recent = self.recent_losses.clone()
        _all_reduce(recent)
        steps = [s % FINAL_LOSS_STEPS for s in range(max(1, self.step - FINAL_LOSS_STEPS + 1), self.step + 1)]
        return recent[steps].mean().item() / self.world_size if steps else math.nan

    def _checkpoint(self) -> None:
        mine = {"rng": rng_state(), "recent_losses": self.recent_losses.tolist()}
        if self.comm.local_sgd:  # the ranks' models and optimizers differ between averagings
            mine.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        ranks = _gather_object(mine)
        if self.rank != 0:
            return
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "batches": self.batches.state_dict(),
            "rng": [r.pop("rng") for r in ranks],
            "local": ranks if self.comm.local_sgd else None,
            "last_loss": self.last_loss,
            "recent_losses": [r.pop("recent_losses") for r in ranks],
            "started_at": self.first_started,
            "world_size": self.world_size,
            "config": dataclasses.asdict(self.cfg),
        }
        path = save_checkpoint(self.run_dir, self.step, state, keep=self.cfg.trainer.keep_checkpoints)
        self.log.info("checkpoint %s", path)

    def _finish(self) -> dict:
        accuracy, eval_loss, top5 = self._evaluate()
        in_sync = self._bn_buffers_in_sync()
        summary = {
            "world_size": self.world_size,
            "steps": self.step,
            "final_loss": self._final_loss(),
            "accuracy": accuracy,
            "accuracy_top5": top5,
            "eval_loss": eval_loss,
            "bn_buffers_in_sync": in_sync,
            "restarts": self.restarts,
            "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "resumed_from_step": self.resumed_from,
            "wall_seconds": round(time.time() - self.first_started, 3),
            "attempt_wall_seconds": round(time.time() - self.started, 3),
            "model": self.cfg.model.name,
            "norm": self.cfg.model.norm,
            "dataset": self.cfg.data.name,
            "global_batch_size": self.cfg.data.batch_size * self.world_size,
            "device": self.device.type,
            "backend": dist.get_backend() if is_distributed() else None,
            "comm_hook": self.cfg.trainer.comm_hook,
            "local_sgd_period": self.cfg.trainer.local_sgd_period,
        }
        if self.rank == 0:
            self._save_inference_model()
            write_json_atomic(self.run_dir / "summary.json", summary)
            plot_curves(
                self.metrics.rows(),
                self.run_dir / "curves.png",
                title=f"{self.cfg.data.name}, norm={self.cfg.model.norm}, "
                f"{self.world_size} rank{'s' if self.world_size > 1 else ''}",
            )
            self.log.info(
                "done: %d steps, accuracy %.4f, final loss %.4f, bn_buffers_in_sync=%s, %.1f s -> %s",
                self.step,
                accuracy,
                self.last_loss,
                in_sync,
                summary["wall_seconds"],
                self.run_dir,
            )
        return summary

    def _save_inference_model(self) -> None:
        """``model_inference.pt``: the whole trained model with plain ``nn.BatchNorm`` layers, for eval and
        export without a process group (``torch.load(path, weights_only=False)``)."""
        model = distsync.revert_sync_batchnorm(copy.deepcopy(self.model)).eval()
        path = self.run_dir / "model_inference.pt"
        temporary = path.with_name(path.name + ".tmp")
        torch.save(model, temporary)
        os.replace(temporary, path)

    def _bn_buffers_in_sync(self) -> bool:
        """True iff every BN buffer is bitwise identical on all ranks (an element-wise max == min check)."""
        buffers = [b.detach().double().flatten() for m in batch_norms(self.model) for b in m.buffers()]
        if not buffers or not is_distributed():
            return True
        flat = torch.cat(buffers).to(self.device)
        high, low = flat.clone(), flat.clone()
        dist.all_reduce(high, dist.ReduceOp.MAX)
        dist.all_reduce(low, dist.ReduceOp.MIN)
        return bool(torch.equal(high, low))


# -------------------------------------------------------------------------------------------- helpers


def _optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.factory:
        return instantiate(o.factory, model.parameters(), **({} if "lr" in o.factory else {"lr": o.lr}))
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.momentum > 0
    )


def _schedule(cfg: TrainConfig):
    warmup, total, cosine = cfg.optim.warmup_steps, cfg.trainer.max_steps, cfg.optim.schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _all_reduce(tensor: torch.Tensor) -> None:
    if is_distributed():
        dist.all_reduce(tensor)


def _broadcast_object(obj):
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _gather_object(obj) -> list | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _progress_bar(total: int, initial: int, enabled: bool):
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def _fmt(row: dict) -> str:
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "kind"
    )


def _test_kill_hook(step: int, rank: int, restarts: int) -> None:
    at = os.environ.get(KILL_AT_STEP_ENV)
    if (
        at
        and restarts == 0
        and step == int(at)
        and rank == int(os.environ.get("DISTSYNC_TEST_KILL_RANK", "1"))
    ):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
