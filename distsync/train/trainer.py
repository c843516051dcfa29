"""The training loop of one rank: build, resume, train, evaluate, checkpoint, summarize.

:class:`Trainer` is what :func:`distsync.train.rank_process.run` runs once the process has joined its group
and locked the run directory. Every collective here is reached by every rank in the same order.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import distsync
from distsync.distributed import get_rank, get_world_size, is_distributed, no_buffer_broadcast
from distsync.launching.worker import NonRetryableError
from distsync.train.build import (
    all_norms_synced,
    build_model,
    build_optimizer,
    build_scheduler,
    building,
)
from distsync.train.checkpoint import remove_stale_temporaries
from distsync.train.collectives import all_gather_object, all_reduce
from distsync.train.config import TrainConfig
from distsync.train.data import LoaderBatches, build_datasets
from distsync.train.evaluation import bn_buffers_in_sync, evaluate
from distsync.train.grad_comm import CommSetup
from distsync.train.interrupt import StopRequests
from distsync.train.logs import console_quiet, init_logger
from distsync.train.metrics import MetricsLog, plot_curves, write_json_atomic
from distsync.train.resume import resume_training, save_training_state
from distsync.train.streaming import StreamBatches, check_streaming, first_input, is_stream
from distsync.train.targets import instantiate
from distsync.tuning import report_result

__all__ = ["Trainer", "FINAL_LOSS_STEPS", "KILL_AT_STEP_ENV"]

KILL_AT_STEP_ENV = "DISTSYNC_TEST_KILL_AT_STEP"
"""Test hook: the rank in ``DISTSYNC_TEST_KILL_RANK`` (default 1) SIGKILLs itself after this step, on the
first attempt only (``TORCHELASTIC_RESTART_COUNT=0``). Used by the fault-tolerance test."""

MAX_LOADER_WORKERS = 8  # data.num_workers's default: one fewer than the cores per rank, at most this

FINAL_LOSS_STEPS = 10  # summary.json's final_loss: the mean training loss of this many last steps


class Trainer:
    """One rank's share of a run: builds its pieces, resumes from the run directory's newest checkpoint,
    then :meth:`fit` trains to ``trainer.max_steps`` and returns the summary (the same on every rank).

    Args:
        cfg: the resolved configuration
        run_dir: the run directory, locked for this job
        device: this rank's device
        started: when this attempt's process started (``time.time()``)
        cores_per_rank: the host's cores over the ranks on it, for ``data.num_workers``'s default
    """

    def __init__(
        self, cfg: TrainConfig, run_dir: Path, device: torch.device, started: float, cores_per_rank: int = 1
    ) -> None:
        self.cfg, self.run_dir, self.device, self.started = cfg, run_dir, device, started
        workers = cfg.data.num_workers
        self.loader_workers = min(MAX_LOADER_WORKERS, cores_per_rank - 1) if workers is None else workers
        if not cfg.data.train:
            self.loader_workers = 0  # the built-in tensors need no loader processes
        self.rank, self.world_size = get_rank(), get_world_size()
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.log = init_logger(run_dir, self.rank)
        t = cfg.trainer
        if self.rank == 0:  # under the run directory's lock: no other job is writing
            for tmp in remove_stale_temporaries(run_dir):
                self.log.warning("removed %s, left by a checkpoint save that was interrupted", tmp.name)

        torch.manual_seed(t.seed)  # the same initial model on every rank
        self._build(cfg)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=low)) if low else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
        _seed_everything(t.seed + self.rank)  # per-rank randomness (dropout) from here on

        self.metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=self.rank == 0)
        self.step, self.resumed_from = 0, None
        self.pruned_at: int | None = None  # the step at which a distsync_optuna sweep pruned this trial
        # This rank's training losses of the last FINAL_LOSS_STEPS steps (for final_loss).
        self.recent_losses = torch.full((FINAL_LOSS_STEPS,), math.nan, dtype=torch.float64, device=device)
        self.seconds_before = 0.0  # of the attempts up to the checkpoint resumed from
        self.training_since: float | None = None  # when this attempt's first step began
        self.stop = StopRequests()  # Ctrl-C/SIGTERM while training: a checkpoint at the next logging step
        local_states = resume_training(self)
        self.ddp = self._wrap_ddp()
        self.forward = torch.compile(self.ddp) if t.compile else self.ddp
        if local_states is not None:  # after DDP's constructor, which copies rank 0's parameters everywhere
            self.model.load_state_dict(local_states["model"])

    # ------------------------------------------------------------------------------------------- setup

    def _build(self, cfg: TrainConfig) -> None:
        """Data, model, loss, optimizer and schedule, with the outcome decided on every rank.

        A config error makes every rank fail alike, and would on every restart: then every rank raises
        :class:`~distsync.NonRetryableError` and :func:`distsync.launch` does not restart the
        world. A failure on some ranks only (a file missing on one node) stays an ordinary one.
        """
        failure = None
        try:
            with building("data.train" if cfg.data.train else "data", cfg.data.train):
                self._load_data(cfg)
            with building("model.factory" if cfg.model.factory else "model", cfg.model.factory):
                self.model = build_model(cfg.model, self.in_channels, self.num_classes).to(self.device)
            if cfg.trainer.channels_last:
                self.model = self.model.to(memory_format=torch.channels_last)
            loss = cfg.model.loss
            with building("model.loss", loss):
                self.criterion = instantiate(loss) if loss else torch.nn.CrossEntropyLoss()
            self.comm = CommSetup(cfg.trainer, self.world_size)
            with building("optim.factory" if cfg.optim.factory else "optim", cfg.optim.factory):
                self.optimizer = self.comm.wrap_optimizer(build_optimizer(cfg, self.model))
            with building("optim.scheduler" if cfg.optim.scheduler else "optim", cfg.optim.scheduler):
                self.scheduler = build_scheduler(cfg, self.optimizer)
        except Exception as error:
            if not is_distributed():
                raise
            failure = error
        messages = all_gather_object(None if failure is None else str(failure))
        failed = [rank for rank, message in enumerate(messages) if message is not None]
        if len(failed) == len(messages) and len(set(messages)) == 1:
            raise NonRetryableError(messages[0]) from failure
        if failed:
            raise RuntimeError(
                f"rank(s) {', '.join(map(str, failed))} could not build the job: {messages[failed[0]]}"
            ) from failure

    def _load_data(self, cfg: TrainConfig) -> None:
        """Training batches and held-out data: the built-in data, or the ``data.train/test`` datasets."""
        self.train, self.test, self.num_classes = build_datasets(cfg.data)
        builtin_or_cnn = not cfg.data.train or not cfg.model.factory
        self.in_channels = first_input(self.train).shape[0] if builtin_or_cnn else None
        self.batches = self._training_batches(cfg.trainer.seed)

    def _training_batches(self, seed: int) -> LoaderBatches | StreamBatches:
        """This rank's endless training batches, shuffled with ``seed`` (a stream's: one pass)."""
        d = self.cfg.data
        if is_stream(self.train):  # see distsync.train.streaming
            check_streaming(self.cfg)
            # A stream splits itself among loader workers only if it is written to: none unless asked.
            return StreamBatches(self.train, d.batch_size, d.num_workers or 0, device=self.device)
        pin_memory = self.device.type == "cuda"
        return LoaderBatches(
            self.train, d.batch_size, self.rank, self.world_size, seed, self.loader_workers, pin_memory
        )

    def _wrap_ddp(self) -> torch.nn.Module:
        if not is_distributed():
            return self.model
        # Synchronized BN keeps the running statistics equal on every rank: no buffer broadcast per forward.
        buffers = no_buffer_broadcast() if all_norms_synced(self.model) else {}
        ddp = DistributedDataParallel(
            self.model, device_ids=[self.device] if self.device.type == "cuda" else None, **buffers
        )
        self.comm.register_hook(ddp, self.step)
        return ddp

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
        finished = self.run_dir / "summary.json"
        if self.resumed_from == t.max_steps and finished.exists():  # the same on every rank: one file
            self.log.info("%s finished at step %d already: nothing to do", self.run_dir, self.step)
            return json.loads(finished.read_text())
        self.training_since = time.time()
        bar = _progress_bar(t.max_steps, self.step, enabled=self.rank == 0 and t.progress)
        with console_quiet(bar is not None), self.stop:  # with a bar, INFO lines go to the rank's file only
            self._train(bar)
        if bar is not None:
            bar.close()
        return self._finish()

    def _train(self, bar) -> None:
        """The training loop: stretches of steps from the batch source (one step each for a map-style
        dataset; a pass under DDP's ``Join`` for a stream, see :mod:`~distsync.train.data`), and at each
        stretch's end the logs, evaluation and checkpoint that fell due within it."""
        t = self.cfg.trainer
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # sum of losses, count
        stretches = self.batches.stretches(self.ddp)
        self.ddp.train()
        while self.step < t.max_steps and self.pruned_at is None:
            start, losses = self.step, []
            stretch = next(stretches)
            with stretch.context:
                for micro_batches in stretch.steps:
                    if self.step >= t.max_steps:  # the ranks still training get here together
                        break
                    loss = self._train_step(micro_batches).detach().double()
                    self.scheduler.step()
                    self.step += 1
                    losses.append((self.step, loss))
                    loss_sum += torch.stack([loss, loss.new_ones(())])
                    if bar is not None:
                        bar.update(1)
            step, recent = self.batches.agree(start, self.step, losses, FINAL_LOSS_STEPS)
            for _ in range(step - self.step):  # a rank that joined catches up its schedule: the LRs agree
                self.scheduler.step()
            self.step = step
            for at, loss in recent.items():
                self.recent_losses[at % FINAL_LOSS_STEPS] = loss  # on the device: no sync
            self._at_stretch_end(start, loss_sum, bar)
            _test_kill_hook(self.step, self.rank, self.restarts)

    def _at_stretch_end(self, start: int, loss_sum: torch.Tensor, bar) -> None:
        """The logs, evaluation and checkpoint that fell due in ``(start, step]``, once each, at this step."""
        t, step = self.cfg.trainer, self.step

        def due(every: int) -> bool:
            return step // every > start // every

        log, evaluate = due(t.log_every) or step == t.max_steps, due(t.eval_every) and step < t.max_steps
        checkpoint = due(t.checkpoint_every) or step == t.max_steps
        if log or evaluate or checkpoint:
            distsync.check_sync()  # deferred GPU-side errors surface before anything is logged or saved
        if log:
            stopping = self._log_train(loss_sum, bar)  # the mean loss of the steps since the last log
            loss_sum.zero_()
            if stopping:  # some rank got Ctrl-C or SIGTERM: every rank saves this step, then ends
                save_training_state(self)
                self.stop.end(step, self.log)
        if evaluate and self.pruned(self._evaluate()):
            return
        if checkpoint:
            save_training_state(self)

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

    def _log_train(self, loss_sum: torch.Tensor, bar) -> bool:
        """Log the mean loss over the ranks' steps since the last row; return whether any rank was asked to
        stop (learned in the same all-reduce: no collective of its own)."""
        reduced = torch.cat([loss_sum, loss_sum.new_tensor([1.0 if self.stop.signum else 0.0])])
        all_reduce(reduced)
        total, count, stopping = reduced.tolist()
        loss = total / count  # the mean over the steps since the last row
        lr = self.scheduler.get_last_lr()[0]
        row = {
            "kind": "train",
            "step": self.step,
            "epoch": self.batches.epoch,
            "loss": loss,
            "lr": lr,
            "elapsed_s": round(self.seconds_spent(), 3),
        }
        self.metrics.write(**row)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.log.info(_fmt(row))
        return stopping > 0

    def _evaluate(self) -> dict[str, float]:
        """Held-out metrics (after precise BN if asked), logged and written to ``metrics.jsonl``."""
        if self.cfg.trainer.precise_bn_batches:
            self._precise_bn()
        row = evaluate(
            self.model,
            self.test,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            num_workers=self.loader_workers,
            prepare=self._laid_out,
            autocast=self.autocast,
        )
        self.metrics.write(kind="eval", step=self.step, **row)
        self.log.info("step %d: held-out %s", self.step, ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
        return row

    def pruned(self, held_out: dict[str, float]) -> bool:
        """Report this evaluation's ``trainer.metric`` to the study of a ``distsync_optuna`` sweep (a no-op
        otherwise) and whether its pruner stops the trial here: the same answer on every rank."""
        metric = self.cfg.trainer.metric
        distsync.report(self.step, held_out[metric] if metric in held_out else self._final_loss())
        if not distsync.should_prune():
            return False
        self.pruned_at = self.step
        self.log.info("step %d: the trial is pruned (the study's pruner stops it here)", self.step)
        return True

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
        inputs = (self._laid_out(x.to(self.device)) for x, _ in batches)
        with self.autocast():
            distsync.update_bn(inputs, self.model)

    def _final_loss(self) -> float:
        """The mean training loss of the last ``FINAL_LOSS_STEPS`` steps over every rank: unlike the logged
        loss, independent of ``trainer.log_every``."""
        recent = self.recent_losses.clone()
        all_reduce(recent)
        steps = [s % FINAL_LOSS_STEPS for s in range(max(1, self.step - FINAL_LOSS_STEPS + 1), self.step + 1)]
        return recent[steps].mean().item() / self.world_size if steps else math.nan

    def _finish(self) -> dict:
        held_out = self._evaluate()
        in_sync = bn_buffers_in_sync(self.model, self.device)
        summary = {
            "world_size": self.world_size,
            "steps": self.step,
            "final_loss": self._final_loss(),
            "accuracy": held_out["accuracy"],
            "accuracy_top5": held_out.get("accuracy_top5"),
            "eval_loss": held_out["eval_loss"],
            "bn_buffers_in_sync": in_sync,
            "restarts": self.restarts,
            "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "loader_workers": self.loader_workers if self.cfg.data.train else None,
            "resumed_from_step": self.resumed_from,
            "wall_seconds": round(self.seconds_spent(), 3),
            "attempt_wall_seconds": round(time.time() - self.started, 3),
            "model": self.cfg.model.name,
            "norm": self.cfg.model.norm,
            "dataset": self.cfg.data.name,
            "global_batch_size": self.cfg.data.batch_size * self.world_size,
            "device": self.device.type,
            "backend": dist.get_backend() if is_distributed() else None,
            "comm_hook": self.cfg.trainer.comm_hook,
            "local_sgd_period": self.cfg.trainer.local_sgd_period,
            "pruned_at_step": self.pruned_at,
        }
        if self.rank == 0:
            self._save_inference_model()
            write_json_atomic(self.run_dir / "summary.json", summary)
            report_result(summary[self.cfg.trainer.metric])  # an Optuna trial's value, in its study now
            plot_curves(
                self.metrics.rows(),
                self.run_dir / "curves.png",
                title=f"{self.cfg.data.name}, norm={self.cfg.model.norm}, "
                f"{self.world_size} rank{'s' if self.world_size > 1 else ''}",
            )
            self.log.info(
                "done: %d steps, accuracy %.4f, final_loss %.4f (mean of the last %d steps), "
                "bn_buffers_in_sync=%s, wall_seconds %.1f -> %s",
                self.step,
                held_out["accuracy"],
                summary["final_loss"],
                min(self.step, FINAL_LOSS_STEPS),
                in_sync,
                summary["wall_seconds"],
                self.run_dir,
            )
        return summary

    def seconds_spent(self) -> float:
        """Seconds spent training this run: this attempt's since its first step (not its start-up: process
        group, data, model, resume), and those of earlier attempts up to their last checkpoint."""
        since = self.training_since
        return self.seconds_before + (time.time() - since if since is not None else 0.0)

    def _save_inference_model(self) -> None:
        """``model_inference.pt``: the whole trained model with plain ``nn.BatchNorm`` layers, for eval and
        export without a process group (``torch.load(path, weights_only=False)``)."""
        model = distsync.revert_sync_batchnorm(copy.deepcopy(self.model)).eval()
        path = self.run_dir / "model_inference.pt"
        temporary = path.with_name(path.name + ".tmp")
        torch.save(model, temporary)
        os.replace(temporary, path)


# -------------------------------------------------------------------------------------------- helpers


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
