"""When a run saves and what it starts from: periodic, final and preemption checkpoints, resume on
any mesh (falling back from a corrupt checkpoint to the newest good one), and initial weights from
a Hugging Face checkpoint. The format and the commit protocol live in `dtrain.checkpoint.storage`,
a rank's share of the state in `train_state`, the checksums in `integrity`, what a resumed run keeps
of its flags in `resume`."""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dtrain.checkpoint import integrity, resume
from dtrain.checkpoint import storage as ckpt
from dtrain.checkpoint import train_state
from dtrain.config import to_toml
from dtrain.distributed import Runtime
from dtrain.layout import RunLayout
from models.errors import UserError
from parallel.parallelize import copy_full_

logger = logging.getLogger("dtrain")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Checkpointer:
    """Owns the checkpoints of one run: the model (this rank's parts), its optimizer and LR
    scheduler, and `run_state()`, the trainer's JSON-able state (data position, skipped steps)
    kept in meta.json. The trainer calls `restore()` once they exist, `start()` before the first
    step, `after_step()` at every step boundary, `finish()` after the last step and `close()` always."""

    def __init__(self, layout: RunLayout, runtime: Runtime, *, model_parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, scheduler, run_state: Callable[[], dict[str, Any]] = dict,
                 fp8_scaling=None):
        config = layout.config
        self.config, self.model_cfg, self.mesh_spec = config, layout.model_cfg, layout.mesh
        self.optimizer, self.scheduler, self.run_state = optimizer, scheduler, run_state
        # FP8 delayed scaling's amax histories and scales (parallel.delayed_scaling), or None.
        self.fp8_scaling = fp8_scaling
        t = config.train
        self.run_dir = Path(t.run_dir)
        self.every, self.keep_last, self.final = t.checkpoint_every, t.keep_last, t.final_checkpoint
        self.rank, self.world_size = runtime.rank, runtime.world_size
        self.is_main = runtime.is_main
        self.root = self.run_dir / ckpt.CHECKPOINTS
        self.pending: ckpt.PendingSave | None = None
        self.last_saved: int | None = None
        self.stop_signal: int | None = None
        self.stop_reason: str | None = None  # what asked this rank to save and stop
        self._old_handlers: dict[int, object] = {}
        # Async saves run DCP's collectives in a background thread: they get their own gloo group so
        # they never interleave with the training collectives of the main thread.
        self.async_group = dist.new_group(backend="gloo") if t.async_checkpoint and dist.is_initialized() else None
        # Hashes the files of a background save once it is written, off the training thread.
        self.hasher = concurrent.futures.ThreadPoolExecutor(1, "dtrain-checksum") if self.async_group else None
        # With pipelining a rank holds several stages; a checkpoint sees them as one model.
        self.model = train_state.as_one_module(model_parts)

    # ---- start of a run -------------------------------------------------------------------

    def restore(self) -> resume.Resumed:
        """Loads `--resume`'s checkpoint (else `--init-from-hf`'s weights); returns where to start."""
        t = self.config.train
        if self.is_main and (t.resume or self.saves):
            recovered = ckpt.recover_commits(self.root)
            if recovered:
                logger.info("recovered checkpoints whose commit was interrupted after they were complete: %s",
                            ", ".join(recovered))
            removed = ckpt.remove_incomplete(self.root)
            if removed:
                logger.info("removed incomplete checkpoints: %s", ", ".join(removed))
        if self.saves:  # after the leftovers are gone: a failed save's may have filled the disk
            self._check_writable()
        if t.resume:
            resumed = self._resume()
            if resumed is not None:
                return resumed
        if t.init_from_hf:
            self._load_hf(t.init_from_hf)
        return resume.Resumed()

    def _candidates(self) -> tuple[list[Path], bool]:
        """Rank 0 lists them, so every rank tries the same checkpoints even while files change."""
        found = None
        if self.is_main:
            try:
                found = ckpt.resume_candidates(self.config.train.resume, self.run_dir)
            except UserError as error:
                found = str(error)
        found = ckpt.broadcast_from_main(found)
        if isinstance(found, str):
            raise UserError(found, every_rank=True)  # on every rank, not on rank 0 alone
        return found

    def _resume(self) -> resume.Resumed | None:
        """--resume's checkpoint, the newest that loads (None: none, start at step 0). A corrupt one
        of this run is set aside and the one before it tried; one that vanished while it was read
        (pruned by a run that writes there with --keep-last) was not corrupt: the newest again."""
        t = self.config.train
        candidates, explicit = self._candidates()
        tried, index, relisted = [], 0, 0
        while index < len(candidates):
            path = candidates[index]
            try:
                return self._load(path)
            except UserError as error:
                if ckpt.broadcast_from_main(self.is_main and not path.exists()):
                    if explicit:
                        raise UserError(f"--resume {t.resume}: checkpoint {path} was deleted while it was read (a "
                                        f"run writing there with --keep-last pruned it); pass its run directory to "
                                        f"take the newest") from None
                    if relisted < ckpt.MAX_REREADS:
                        relisted += 1
                        logger.info("%s was pruned while it was read; taking the newest checkpoint again", path)
                        candidates, index = self._candidates()[0], 0
                        continue
                if explicit or not isinstance(error, ckpt.CorruptCheckpoint):
                    raise
                tried.append(path)
                self._set_aside(path, error, candidates[index + 1] if index + 1 < len(candidates) else None)
                index += 1
        if t.resume in (ckpt.LATEST, ckpt.AUTO):
            self._start_without_checkpoint(tried)
        elif candidates:
            raise ckpt.CorruptCheckpoint(f"--resume {t.resume}: every checkpoint ({len(candidates)}) is corrupt "
                                         f"(see the log); restore them from a copy, or start without --resume")
        return None

    def _start_without_checkpoint(self, tried: list[Path]) -> None:
        """`--resume latest|auto` found no valid checkpoint in the run directory (`tried`: those
        found corrupt just now). Step 0 where it never had one and `auto` or --start-over allows it,
        and where every one was corrupt only with --start-over; otherwise an error on every rank,
        so that a restart never drops the progress of a run without saying so."""
        t, refusal, note = self.config.train, None, None
        if self.is_main:
            corrupt = ckpt.set_aside(self.root) or [path.name for path in tried]
            if corrupt and not t.start_over:
                refusal = (f"--resume {t.resume}: no valid checkpoint in {self.root}: every one is corrupt "
                           f"({', '.join(corrupt)}); restore them from a copy, or add --start-over to train again "
                           f"from step 0")
            elif corrupt:
                note = (f"--start-over: no valid checkpoint in {self.root} (the corrupt ones stay: "
                        f"{', '.join(corrupt)}); starting from step 0")
            elif t.resume == ckpt.AUTO or t.start_over:
                note = f"--resume {t.resume}: no checkpoint in {self.root} yet; starting from step 0"
            else:
                refusal = (f"--resume latest: no checkpoint in {self.root}; leave out --resume to start a new run, or "
                           f"use --resume auto where a job restarts (the latest checkpoint if there is one, else step "
                           f"0), or add --start-over")
        refusal, note = ckpt.broadcast_from_main((refusal, note))
        if refusal is not None:
            raise UserError(refusal, every_rank=True)
        if self.is_main:
            logger.log(logging.WARNING if "corrupt" in note else logging.INFO, note)

    def _check_writable(self) -> None:
        """Every rank writes shards into the checkpoint directory: find a read-only one now, not
        at the first save after the training since the start is done."""
        if self.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError:
                pass  # the probe below reports it, on every rank
        ckpt.barrier()
        problem = integrity.write_problem(self.root)
        resume.agree(None if problem is None else UserError(
            f"checkpoint directory {self.root} is not writable: {problem}; make it writable or free space there, "
            f"choose another --run-dir, or turn checkpoints off with --checkpoint-every 0 --no-final-checkpoint"))

    def _set_aside(self, path: Path, error: ckpt.CorruptCheckpoint, older: Path | None) -> None:
        """A corrupt checkpoint of this run is renamed out of the way (kept for inspection), so that
        the next restart does not try it again; the log says what the run falls back to."""
        aside = path.with_name(path.name + ckpt.CORRUPT)
        if self.is_main and path.parent == self.root:
            shutil.rmtree(aside, ignore_errors=True)
            try:
                path.rename(aside)
            except OSError:
                pass  # then it stays, and is verified (and found corrupt) again next time
        ckpt.barrier()
        if self.is_main:
            logger.warning("%s; %s", str(error).split("; resume from")[0],
                           f"resuming from the one before it, {older}" if older else "no earlier checkpoint is left")
            if aside.exists():
                logger.warning("the corrupt checkpoint was moved to %s; delete it once inspected", aside)

    def _load(self, path: Path) -> resume.Resumed:
        start = time.perf_counter()
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        error, meta, has_optim = None, {}, False
        try:
            # Each rank verifies its share of the files' checksums, in parallel.
            meta, has_optim = ckpt.check_checkpoint(path, self.model_cfg, shapes, self.rank, self.world_size)
        except UserError as problem:
            error = problem
        if error is None and int(meta["step"]) > self.config.train.steps:
            error = UserError(f"--steps {self.config.train.steps} is below step {meta['step']} of checkpoint {path}: "
                              f"nothing would train; pass --steps {int(meta['step']) + 1} or more to continue it, or "
                              f"resume from an earlier checkpoint")
        resume.agree(error)
        if "files" not in meta:
            logger.info("checkpoint %s holds no checksums (written before format 2): its files are not verified",
                        path)
        configured = resume.hyperparameters(self.optimizer)
        try:
            train_state.load_train_state(self.model, self.optimizer, path, rank=self.rank, has_optim=has_optim)
            if self.fp8_scaling is not None:
                self.fp8_scaling.load_state_dict(train_state.load_fp8_state(path, list(self.fp8_scaling.layer_shapes())))
        except UserError as problem:  # damage, or a refusal (a file that is not plain data)
            error = problem
        resume.agree(error)
        if meta.get("scheduler"):
            # Its position only: the rest follows from this run's settings (reapply_hyperparameters
            # below), and no other key of meta.json may set an attribute of the scheduler.
            saved = meta["scheduler"]
            position = {key: saved[key] for key in ("last_epoch", "_step_count") if key in saved}
            self.scheduler.load_state_dict({**self.scheduler.state_dict(), **position})
        resume.reapply_hyperparameters(self.optimizer, self.scheduler, configured)
        step = int(meta["step"])
        self.last_saved = step
        saved_mesh, mesh = meta.get("mesh"), str(self.mesh_spec)
        resharded = f" (resharded from {saved_mesh} to {mesh})" if saved_mesh and saved_mesh != mesh else ""
        logger.info("resumed from %s at step %d%s in %s%s", path, step, resharded, ckpt.elapsed(start),
                    "; no step is left to train (--steps)" if step == self.config.train.steps else "")
        changes = resume.changed_settings(meta, self.config)
        if changes:
            logger.info("settings that differ from the checkpoint's run apply from step %d on: %s", step + 1,
                        ", ".join(changes))
        consumed = resume.consumed_samples(meta, self.config.data.global_batch)
        if consumed != step * self.config.data.global_batch:
            logger.info("the data continues at sample %d of the stream, where the checkpoint's run stopped", consumed)
        return resume.Resumed(step, consumed, meta)

    @torch.no_grad()
    def _load_hf(self, hf_path: str) -> None:
        """Every rank reads each full tensor and keeps its own shard (as initialisation does)."""
        from dtrain.interop import hf

        start = time.perf_counter()
        source = hf.HFCheckpoint(hf_path)
        hf.check_matches(source.config, self.model_cfg, self.config.model.model, hf_path)
        fresh = [name for name, _ in self.model.named_parameters() if name.startswith("mtp.") and name not in source.shapes]
        if fresh:
            logger.info("--init-from-hf: %s has no multi-token prediction weights; the MTP modules start "
                        "from their initialisation", hf_path)
        for name, param in self.model.named_parameters():
            if name.endswith(".moe.router_bias") and name not in source.shapes or name in fresh:
                continue  # none in HF: the bias stays 0, MTP modules keep their initial values
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

    @property
    def saves(self) -> bool:
        """Whether this run writes checkpoints: every --checkpoint-every steps, or at its end."""
        return bool(self.every) or self.final

    def finish(self, step: int) -> None:
        """The final save (unless --no-final-checkpoint); waits for any background save."""
        if self.final and self.last_saved != step:
            self.save(step, wait=True)
        self._wait_pending()

    def latest(self) -> Path | None:
        """The run directory's checkpoint of the last step saved (or resumed at), once committed."""
        if self.last_saved is None:
            return None
        path = self.root / ckpt.checkpoint_name(self.last_saved)
        return path if (path / ckpt.COMPLETE).is_file() else None

    def close(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if self.hasher is not None:
            self.hasher.shutdown(wait=False)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, step: int, wait: bool = False) -> Path:
        self._wait_pending()
        nonfinite, = ckpt.all_ranks_max([integrity.count_nonfinite(self.model, self.optimizer)])
        if nonfinite:
            raise UserError(f"the weights or AdamW moments hold NaN or infinite values at step {step}: not saved, "
                            f"the latest checkpoint stays the last good state; resume from it with a lower --lr")
        name = ckpt.checkpoint_name(step)
        tmp, final = self.root / f"{name}.tmp", self.root / name
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        ckpt.barrier()  # no rank writes into tmp before rank 0 has emptied it
        meta = {
            "format": ckpt.FORMAT_VERSION, "step": step,
            "model": ckpt.model_shape(self.model_cfg), "mesh": str(self.mesh_spec),
            "world_size": self.world_size, "scheduler": self.scheduler.state_dict(),
            "config": to_toml(self.config), **self.run_state(),
        }
        started = time.perf_counter()
        use_async = self.async_group is not None and not wait
        try:
            written = train_state.save_train_state(self.model, self.optimizer, tmp, rank=self.rank,
                                            async_group=self.async_group if use_async else None,
                                            fp8_state=self.fp8_scaling.state_dict() if self.fp8_scaling else None)
        except (Exception, dcp.api.CheckpointException) as error:  # DCP's is a BaseException
            self._check_space(step, tmp, error)
            raise
        if use_async:
            future = self.hasher.submit(lambda: (written.result(), integrity.own_checksums(tmp, self.rank))[1])
        else:
            future = concurrent.futures.Future()
            future.set_result(integrity.own_checksums(tmp, self.rank))
        self.pending = ckpt.PendingSave(future, step, tmp, final, meta, started)
        self.last_saved = step
        if not use_async:
            self._commit_pending()
        return final

    def _wait_pending(self) -> None:
        if self.pending is None:
            return
        self._written(self.pending)
        # Every rank's shards are written once every rank's future is done.
        ckpt.barrier()
        self._commit_pending()

    def _written(self, p: ckpt.PendingSave) -> dict:
        """This rank's checksums of a save; raises what the (background) save raised."""
        try:
            return p.future.result()
        except (Exception, dcp.api.CheckpointException) as error:
            self.pending = None
            self._check_space(p.step, p.tmp, error)
            raise

    def _commit_pending(self) -> None:
        """Every rank: its checksums go to rank 0, which lists them in meta.json and commits; every
        rank learns whether the commit failed (a full disk), so that all of them stop alike."""
        p = self.pending
        own = self._written(p)
        self.pending = None
        gathered = [own]
        if dist.is_initialized() and self.world_size > 1:
            gathered = [None] * self.world_size if self.is_main else None
            dist.gather_object(own, gathered, dst=0)
        problem = None
        if self.is_main:
            try:
                ckpt.commit(p.tmp, p.final, {**p.meta, "files": integrity.manifest(p.tmp, gathered)})
                ckpt.prune(self.root, self.keep_last)
            except OSError as error:
                problem = ckpt.space_problem(self.root, p.step, p.tmp, error, remove=self.is_main) or (
                    f"committing the checkpoint of step {p.step} failed: {type(error).__name__}: {error}")
        problem = ckpt.broadcast_from_main(problem)
        if problem is not None:
            raise UserError(problem, every_rank=True)
        if self.is_main:
            logger.info("saved checkpoint %s in %s", p.final, ckpt.elapsed(p.started))

    def _check_space(self, step: int, tmp: Path, error: BaseException) -> None:
        """A save that failed for want of space becomes one line, with the failed save removed (its
        space lets the failure be recorded, and a restart finds no leftover); others pass through."""
        problem = ckpt.space_problem(self.root, step, tmp, error, remove=self.is_main)
        if problem is not None:
            raise UserError(problem) from None
