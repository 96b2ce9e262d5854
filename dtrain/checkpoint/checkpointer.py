"""When a run saves and what it starts from: periodic, final and preemption checkpoints, resume on
any mesh, and initial weights from a Hugging Face checkpoint. The format and the commit protocol
live in `dtrain.checkpoint.storage`."""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint import storage as ckpt
from dtrain.config import Config, to_toml
from dtrain.distributed import Runtime
from models.config import LlamaConfig
from models.errors import UserError
from parallel.mesh import MeshSpec
from parallel.parallelize import copy_full_

logger = logging.getLogger("dtrain")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Checkpointer:
    """Owns the checkpoints of one run: the model (this rank's parts), its optimizer and LR
    scheduler. The trainer calls `restore()` once they exist, `start()` before the first step,
    `after_step()` at every step boundary, `finish()` after the last step and `close()` always."""

    def __init__(self, config: Config, runtime: Runtime, *, model_cfg: LlamaConfig, mesh_spec: MeshSpec,
                 model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, scheduler):
        self.config, self.model_cfg, self.mesh_spec = config, model_cfg, mesh_spec
        self.optimizer, self.scheduler = optimizer, scheduler
        t = config.train
        self.run_dir = Path(t.run_dir)
        self.every, self.keep_last = t.checkpoint_every, t.keep_last
        self.rank, self.world_size = runtime.rank, runtime.world_size
        self.is_main = runtime.is_main
        self.root = self.run_dir / ckpt.CHECKPOINTS
        if self.every < 0 or self.keep_last < 0:
            raise UserError(f"--checkpoint-every {self.every} and --keep-last {self.keep_last} must be >= 0 "
                            f"(0 turns checkpoints off / keeps them all)")
        self.pending: ckpt.PendingSave | None = None
        self.last_saved: int | None = None
        self.stop_signal: int | None = None
        self.stop_reason: str | None = None  # what asked this rank to save and stop
        self._old_handlers: dict[int, object] = {}
        # Async saves run DCP's collectives in a background thread: they get their own gloo group so
        # they never interleave with the training collectives of the main thread.
        self.async_group = dist.new_group(backend="gloo") if t.async_checkpoint and dist.is_initialized() else None
        # With pipelining a rank holds several stages; a checkpoint sees them as one model.
        self.model = ckpt.as_one_module(model_parts)

    # ---- start of a run -------------------------------------------------------------------

    def restore(self) -> int:
        """Loads `--resume`'s checkpoint (else `--init-from-hf`'s weights); returns the step to start at."""
        t = self.config.train
        if self.is_main and (t.resume or self.every):
            removed = ckpt.remove_incomplete(self.root)
            if removed:
                logger.info("removed incomplete checkpoints: %s", ", ".join(removed))
        path = None
        if t.resume:
            # Rank 0 decides, so every rank loads the same checkpoint even while files change.
            found = ckpt.resolve_resume(t.resume, self.run_dir) if self.is_main else None
            path = ckpt.broadcast_from_main(str(found) if found else None)
            if path is None:
                logger.info("--resume: no checkpoint in %s yet; starting from step 0", self.root)
        if path is not None:
            return self._load(Path(path))
        if t.init_from_hf:
            self._load_hf(t.init_from_hf)
        return 0

    def _load(self, path: Path) -> int:
        start = time.perf_counter()
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        meta, has_optim = ckpt.check_checkpoint(path, self.model_cfg, shapes)
        ckpt.load_train_state(self.model, self.optimizer, path, rank=self.rank, has_optim=has_optim)
        if meta.get("scheduler"):
            self.scheduler.load_state_dict(meta["scheduler"])
        step = int(meta["step"])
        self.last_saved = step
        saved_mesh, mesh = meta.get("mesh"), str(self.mesh_spec)
        resharded = f" (resharded from {saved_mesh} to {mesh})" if saved_mesh and saved_mesh != mesh else ""
        logger.info("resumed from %s at step %d%s in %s", path, step, resharded, ckpt.elapsed(start))
        return step

    @torch.no_grad()
    def _load_hf(self, hf_path: str) -> None:
        """Every rank reads each full tensor and keeps its own shard (as initialisation does)."""
        from dtrain.interop import hf

        start = time.perf_counter()
        source = hf.HFCheckpoint(hf_path)
        hf.check_matches(source.config, self.model_cfg, self.config.model.model, hf_path)
        for name, param in self.model.named_parameters():
            if name.endswith(".moe.router_bias") and name not in source.shapes:
                continue  # none in HF: stays 0
            full = source.tensor(name).to(param.device, torch.float32)
            if tuple(full.shape) != tuple(param.shape):
                raise UserError(f"--init-from-hf {hf_path}: {name} has shape {list(full.shape)}, the model "
                                f"needs {list(param.shape)}")
            copy_full_(param, full)
        logger.info("initialised from Hugging Face checkpoint %s in %s", hf_path, ckpt.elapsed(start))

    def start(self) -> None:
        """Preemption (SIGTERM from a scheduler, SIGINT from Ctrl-C) only sets a flag; the run saves
        and stops at the next step boundary, where every rank agrees to."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.stop_signal = signum
        self.request_stop(signal.Signals(signum).name)

    def request_stop(self, reason: str) -> None:
        """Saves and stops at the next step boundary (a signal, or a stop request in the run dir)."""
        self.stop_reason = self.stop_reason or reason

    # ---- step boundaries ------------------------------------------------------------------

    def after_step(self, step: int, before_save=lambda: None) -> bool:
        """Commits a finished background save, saves when due (calling `before_save()` first: the
        trainer checks the step's loss there, so a diverged state is never saved); True when the
        run must stop."""
        total = self.config.train.steps
        stop, busy = ckpt.all_ranks_max([int(self.stop_reason is not None),
                                         int(self.pending is not None and not self.pending.future.done())])
        if self.pending is not None and not busy:
            self._commit_pending()
        if stop:
            before_save()
            path = self.save(step, wait=True)
            logger.info("received %s: saved %s at step %d/%d and stopped; continue with --resume",
                        self.stop_reason or "a stop request on another rank", path, step, total)
            return True
        if self.every and step % self.every == 0 and step < total:
            before_save()
            self.save(step)
        return False

    def finish(self, step: int) -> None:
        """The final save of a run with checkpoints on; waits for any background save."""
        if self.every and self.last_saved != step:
            self.save(step, wait=True)
        self._wait_pending()

    def close(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # ---- saving ---------------------------------------------------------------------------

    def save(self, step: int, wait: bool = False) -> Path:
        self._wait_pending()
        name = ckpt.checkpoint_name(step)
        tmp, final = self.root / f"{name}.tmp", self.root / name
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        ckpt.barrier()  # no rank writes into tmp before rank 0 has emptied it
        meta = {
            "format": ckpt.FORMAT_VERSION, "step": step, "data_position": step,
            "model": ckpt.model_shape(self.model_cfg), "mesh": str(self.mesh_spec),
            "world_size": self.world_size, "scheduler": self.scheduler.state_dict(),
            "config": to_toml(self.config),
        }
        started = time.perf_counter()
        use_async = self.async_group is not None and not wait
        future = ckpt.save_train_state(self.model, self.optimizer, tmp, rank=self.rank,
                                       async_group=self.async_group if use_async else None)
        self.pending = ckpt.PendingSave(future, step, tmp, final, meta, started)
        self.last_saved = step
        if not use_async:
            self._commit_pending()
        return final

    def _wait_pending(self) -> None:
        if self.pending is None:
            return
        self.pending.future.result()  # raises what the background save raised
        # Every rank's shards are written once every rank's future is done.
        ckpt.barrier()
        self._commit_pending()

    def _commit_pending(self) -> None:
        p, self.pending = self.pending, None
        if p.future is not None:
            p.future.result()
        if self.is_main:
            ckpt.commit(p.tmp, p.final, p.meta)
            ckpt.prune(self.root, self.keep_last)
            logger.info("saved checkpoint %s in %s", p.final, ckpt.elapsed(p.started))
