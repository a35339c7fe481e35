"""Training the GR model: AdamW, warm-up + cosine schedule, an exponential
moving average of the weights, validation Recall/NDCG with constrained beam
search on a seeded sample of validation users, early stopping, resumable
checkpoints, a JSONL log and a progress bar with the run's ETA.

``workers`` > 1 trains data-parallel in that many processes on this machine
(``gloo``): every global batch is split between them, gradients are averaged
before each step, and validation is split too, so the learning per step is
the same. What it buys depends on the CPU: on a 2-core AVX2 machine two
single-threaded workers did about 1.6x the work of one process with two
threads (small matrices use one core well and two poorly); on a 2-core
AVX-512 EPYC 1.05x (Beauty's quick recipe: 6.75 against 6.4 steps/s).

Batches are bucketed by history length and trimmed to the longest history in
the batch (histories are left-padded and positions are right-aligned, so the
trim changes nothing but the cost): on Beauty the mean history is 6.7 of 20
items.

``device`` "cuda" trains on a GPU (:mod:`specrec.train.device`): the model, the
training data and validation's beam search there, bfloat16 autocast with
``bf16``, one process (``workers`` is the CPU's path). Checkpoints hold CPU
tensors (:mod:`specrec.train.checkpoint`), so a run goes on on either device;
``checkpoint_minutes`` writes one whenever that many minutes have passed, in
the middle of an epoch too (a resumed run re-draws the epoch's batches and goes
on after the last one done), and ``checkpoint_part_mib`` writes large ones in
parts that can be committed.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel

from ..data.splits import PAD, Examples, sample_examples
from ..ids.trie import SidTrie
from ..models.tiger import Tiger, TigerConfig
from ..terminal import progress_bar
from . import checkpoint as ckpt
from .batches import bucketed_batches, causal_chunks
from .device import autocast, cpu_copy, resolve_device, rng_state, set_rng_state, to_device
from .parallel import average_gradients, evaluate_beam, fit_parallel
from .soft_targets import SasrecTeacher, soft_level_loss

__all__ = ["STEP_SEQUENCE", "TRAINING_ONLY", "TrainConfig", "Trainer", "evaluate_beam"]

#: model settings that only training reads: a run may start from weights trained with others
TRAINING_ONLY = frozenset({"dropout", "label_smoothing"})
#: training settings that fix the sequence of steps: a run resumes only with the ones its checkpoint has
STEP_SEQUENCE = ("batch_size", "window_stride", "seed", "bucket_chunk")


class TrainConfig(BaseModel):
    """Training hyper-parameters (all saved with the run)."""

    epochs: int = 40
    batch_size: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.02
    weight_decay: float = 0.05
    warmup_steps: int = 500
    grad_clip: float = 1.0
    patience: int = 6
    valid_limit: int | None = 4000
    valid_beam: int = 10
    metric: str = "ndcg@10"
    seed: int = 0
    bucket_chunk: int = 50
    bf16: bool = False  # bfloat16 autocast for training matmuls (AMX/AVX-512 CPUs); weights stay float32
    ema: float = 0.0  # decay of the weights' moving average (0 = off); validation keeps the better of raw and EMA
    valid_every: int = 1  # epochs between validations (the last epoch is always validated)
    workers: int = 1  # data-parallel training processes
    threads: int | None = None  # torch threads in all (default: all cores), split between workers
    window_stride: int | None = None  # causal chunks overlap: a new chunk every this many targets (None = max_history)
    # causal encoder: each input item of a training chunk is dropped with this probability (its position masked,
    # every target kept), so a target is also taught from a history without its most recent item (0: off)
    history_dropout: float = 0.0
    budget_minutes: float | None = None  # after the first epoch, plan the epochs (and the cosine) to fill this budget
    curve_limit: int = 0  # test users (a seeded random sample) scored at each validation for the learning curve only
    init_from: str | None = None  # a bundle whose GR weights (same model config but TRAINING_ONLY) start the run
    teacher: str | None = None  # a bundle whose SASRec gives soft targets (:mod:`specrec.train.soft_targets`)
    distill_weight: float = 0.0  # the soft targets' share of the loss (the true next item keeps the rest)
    distill_temp: float = 1.0  # the teacher's softmax temperature
    device: str = "cpu"  # where the model, its batches and validation run: cpu or cuda (specrec.train.device)
    batch_scale: float = 1.0  # for the record: batch_size, lr and warmup_steps above are a recipe's scaled by this
    checkpoint_minutes: float | None = None  # a checkpoint whenever this many minutes passed (mid-epoch too) and
    #                                          at the end; None: at the end of every epoch
    checkpoint_part_mib: float | None = None  # checkpoints larger than this many MiB are written in parts
    # which weights the run keeps: "valid" the best by validation (early stopping); "last" no validation at all
    # (a refit on every interaction but the test ones, :mod:`specrec.train.refit`): the weights at the end,
    # ``last_weights`` "raw" or "ema" (the moving average), as the run it mirrors chose on validation
    select: Literal["valid", "last"] = "valid"
    last_weights: Literal["raw", "ema"] = "raw"
    stop_after: int | None = None  # end after this many epochs of a schedule planned for ``epochs`` (None: all)


class Trainer:
    """Trains one GR model; ``rank``/``world`` are set inside data-parallel workers."""

    def __init__(
        self,
        model_cfg: TigerConfig,
        cfg: TrainConfig,
        sids: np.ndarray,
        train: Examples,
        valid: Examples,
        out_dir: str | Path,
        log: Callable[[str], None] = print,
        rank: int = 0,
        world: int = 1,
        test: Examples | None = None,
    ):
        self.mcfg, self.cfg = model_cfg, cfg
        self.rank, self.world = rank, world
        self.sids_np = np.ascontiguousarray(sids, dtype=np.int64)
        self.sids = torch.from_numpy(self.sids_np)
        self.trie = SidTrie(sids, model_cfg.level_sizes)
        self.train_ex, self.valid_all = train, valid
        self.valid = sample_examples(valid, cfg.valid_limit, cfg.seed)
        # the learning curve's test users: a fixed seeded sample, scored for the record, never used to choose
        self.test_all = test
        self.curve = (
            sample_examples(test, cfg.curve_limit, cfg.seed + 1) if test is not None and cfg.curve_limit else None
        )
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.device = resolve_device(cfg.device)
        if cfg.workers > 1 and self.device.type != "cpu":
            raise ValueError(f"workers {cfg.workers}: data-parallel processes are the CPU's path; on "
                             f"{self.device} one process trains (a bigger batch: batch_scale)")
        self.sids_dev = self.sids.to(self.device)  # what batches are coded with, beside their rows
        torch.manual_seed(cfg.seed)
        self.model = Tiger(model_cfg)
        if cfg.init_from:
            self._init_from(cfg.init_from)
        self.model.to(self.device)
        self.teacher = self._teacher() if cfg.distill_weight > 0 else None
        self.ema = copy.deepcopy(self.model).eval() if cfg.ema else None
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.98),
        )
        n_units = len(causal_chunks(train, cfg.window_stride)[0]) if model_cfg.causal_encoder else len(train)
        self.steps_per_epoch = math.ceil(n_units / cfg.batch_size)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.epoch = 0
        self.step = 0
        self.best = -1.0
        self.best_epoch = -1
        self.bad_epochs = 0
        self.history: list[dict] = []
        self.planned_epochs: int | None = None  # with a time budget: the epochs that fit, set after the first
        self.elapsed_s = 0.0  # training + validation seconds over all sessions of this run
        # the epoch under way: batches done, their loss sum and targets, its training seconds so far
        self.epoch_batches, self.epoch_loss, self.epoch_targets, self.epoch_train_s = 0, 0.0, 0, 0.0
        self._best_state: dict | None = None  # the best weights, not yet written (written with each checkpoint)
        self._saved_at = time.time()  # the last checkpoint (or the start)
        self._dirty = False  # trained since the last checkpoint

    def _init_from(self, path: str) -> None:
        from ..bundle import Bundle

        src = Bundle.load(path)
        theirs, ours = src.cfg.model_dump(), self.mcfg.model_dump()
        differ = sorted(k for k in ours if theirs.get(k) != ours[k] and k not in TRAINING_ONLY)
        if differ:  # the weights' shape and meaning must match; dropout and label smoothing may change
            raise ValueError(f"{path}: its GR model config differs from this run's in {', '.join(differ)}")
        if not np.array_equal(src.sids, self.sids_np):
            raise ValueError(f"{path}: its semantic IDs differ from this run's (use --sids-from {path})")
        self.model.load_state_dict(src.model.state_dict())
        self.log(f"GR weights from {path}")

    def _teacher(self):
        from ..bundle import Bundle

        if not self.mcfg.causal_encoder:
            raise ValueError("distillation is built for the causal encoder's whole-sequence training")
        if not self.cfg.teacher:
            raise ValueError("distill_weight > 0 needs a teacher bundle")
        src = Bundle.load(self.cfg.teacher)
        if src.sasrec is None:
            raise ValueError(f"{self.cfg.teacher}: the bundle has no SASRec (specrec train-baseline)")
        if not np.array_equal(src.sids, self.sids_np):
            raise ValueError(f"{self.cfg.teacher}: its catalogue or semantic IDs differ from this run's")
        if src.sasrec.cfg.max_history < self.mcfg.max_history:
            raise ValueError(f"{self.cfg.teacher}: its SASRec reads {src.sasrec.cfg.max_history} items of history, "
                             f"the GR model {self.mcfg.max_history}")
        if not 0.0 < self.cfg.distill_weight <= 1.0:
            raise ValueError(f"distill_weight {self.cfg.distill_weight}: must be in (0, 1]")
        self.log(f"soft targets from {self.cfg.teacher}'s SASRec (weight {self.cfg.distill_weight}, "
                 f"temperature {self.cfg.distill_temp})")
        return SasrecTeacher(src.sasrec.to(self.device), self.sids_dev, self.mcfg.level_sizes, self.cfg.distill_temp)

    def _sequence_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The causal chunk's loss: cross-entropy of the true next items, mixed with the teacher's soft targets;
        with ``history_dropout`` some input items dropped (masked as padding) while every target is kept."""
        p = self.cfg.history_dropout
        if p > 0 and self.model.training:
            x = x.masked_fill((torch.rand(x.shape, device=x.device) < p) & (x >= 0), -1)
        if self.teacher is None:
            return self.model.forward_sequences(self._codes(x), self._codes(y))
        hidden, tgt = self.model.sequence_hidden(self._codes(x), self._codes(y))
        logits = self.model.levels_logits(hidden, self.mcfg.sid_len)  # one output pass for both losses
        soft = self.teacher.targets(x, y >= 0, tgt)
        w = self.cfg.distill_weight
        return (1.0 - w) * self.model.mean_level_ce(logits, tgt) + w * soft_level_loss(logits, soft)

    @property
    def max_epochs(self) -> int:
        planned = self.planned_epochs if self.planned_epochs is not None else self.cfg.epochs
        return planned if self.cfg.stop_after is None else min(planned, self.cfg.stop_after)

    def _plan(self) -> None:
        """With a time budget: the number of epochs (at most ``epochs``) that fit in it, from the mean cost
        of the epochs so far (training, plus validation spread over ``valid_every`` epochs); the cosine
        decays over those, so the run ends at its minimum learning rate inside the budget. Planned after
        the first epoch and again after each one, at the pace of the last three: a busier machine
        shortens the plan, and it grows back when the machine is quiet again."""
        c = self.cfg
        assert c.budget_minutes is not None  # planned only with a time budget
        train = [h["train_s"] for h in self.history[-3:]] or [0.0]
        valid = [h.get("valid_s", 0.0) + h.get("test_s", 0.0) for h in self.history if "valid_s" in h] or [0.0]
        epoch_s = sum(train) / len(train) + (sum(valid) / len(valid)) / c.valid_every
        left = c.budget_minutes * 60.0 - self.elapsed_s
        fit = max(self.epoch, min(c.epochs, self.epoch + int(max(left, 0.0) // max(epoch_s, 1e-6))))
        if fit == self.planned_epochs:
            return
        first = self.planned_epochs is None
        self.planned_epochs = fit
        self.total_steps = self.steps_per_epoch * self.planned_epochs
        self.log(f"budget {c.budget_minutes:.0f} min, {self.elapsed_s / 60:.1f} spent: an epoch with its share of "
                 f"validation takes {epoch_s / 60:.1f} min, so {self.planned_epochs} epochs ({self.total_steps} steps)"
                 + ("" if first else " (re-planned)"))

    def _lr_factor(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        t = min(1.0, (step - c.warmup_steps) / max(1, self.total_steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    # -- checkpoints ---------------------------------------------------------
    @property
    def ckpt_path(self) -> Path:
        return self.out / "checkpoint.pt"

    @property
    def best_path(self) -> Path:
        return self.out / "best_model.pt"

    @property
    def _part_bytes(self) -> int | None:
        mib = self.cfg.checkpoint_part_mib
        return None if mib is None else int(mib * ckpt.MIB)

    def save_checkpoint(self) -> None:
        """Write the run's state (every tensor on the CPU), and first the best weights validation kept since the
        last one, so the two files always belong together."""
        self._saved_at, self._dirty = time.time(), False
        if self.rank:
            return
        if self._best_state is not None:
            ckpt.save(self._best_state, self.best_path, self._part_bytes)
            self._best_state = None
        state = {
            "model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "epoch": self.epoch, "step": self.step, "best": self.best, "best_epoch": self.best_epoch,
            "bad_epochs": self.bad_epochs, "history": self.history,
            "planned_epochs": self.planned_epochs, "elapsed_s": self.elapsed_s,
            "model_cfg": self.mcfg.model_dump(), "train_cfg": self.cfg.model_dump(),
            "torch_rng": torch.get_rng_state(),
            "epoch_batches": self.epoch_batches, "epoch_loss": self.epoch_loss, "epoch_targets": self.epoch_targets,
            "epoch_train_s": self.epoch_train_s, "device": str(self.device),
        }
        rng = rng_state(self.device)
        if "cuda" in rng:
            state["cuda_rng"] = rng["cuda"]
        ckpt.save(cpu_copy(state), self.ckpt_path, self._part_bytes)

    def resume(self) -> bool:
        if not ckpt.exists(self.ckpt_path):
            return False
        st = ckpt.load(self.ckpt_path)
        if st["model_cfg"] != self.mcfg.model_dump():
            raise ValueError(f"{self.ckpt_path}: model config differs from the checkpoint's; use a new --out")
        theirs = st.get("train_cfg", {})
        differ = [k for k in STEP_SEQUENCE if k in theirs and theirs[k] != getattr(self.cfg, k)]
        if differ:  # the steps done would not be the ones this run's schedule and batches count
            raise ValueError(f"{self.ckpt_path}: the checkpoint's run had another "
                             + ", ".join(f"{k} ({theirs[k]}, here {getattr(self.cfg, k)})" for k in differ)
                             + "; resume with the same, or start afresh (--no-resume)")
        self.model.load_state_dict(st["model"])  # copied into the weights where they are: either device
        self.opt.load_state_dict(st["opt"])  # its moments move to their weights' device
        self.sched.load_state_dict(st["sched"])
        if self.ema is not None and st.get("ema") is not None:
            self.ema.load_state_dict(st["ema"])
        self.epoch, self.step = st["epoch"], st["step"]
        self.best, self.best_epoch, self.bad_epochs = st["best"], st["best_epoch"], st["bad_epochs"]
        self.history = st["history"]
        self.planned_epochs = st.get("planned_epochs")
        self.elapsed_s = st.get("elapsed_s", 0.0)
        self.epoch_batches, self.epoch_loss = st.get("epoch_batches", 0), st.get("epoch_loss", 0.0)
        self.epoch_targets, self.epoch_train_s = st.get("epoch_targets", 0), st.get("epoch_train_s", 0.0)
        if self.planned_epochs is not None:
            self.total_steps = self.steps_per_epoch * self.planned_epochs
        rng = {"cpu": st["torch_rng"], **({"cuda": st["cuda_rng"]} if "cuda_rng" in st else {})}
        same_stream = set_rng_state(rng, self.device)
        if not self.rank:  # the log holds the epochs the checkpoint holds: a later one is trained again
            (self.out / "train_log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in self.history))
        was = st.get("device", "cpu")
        self.log(f"resumed from {self.ckpt_path} at epoch {self.epoch}, step {self.step}"
                 + (f" ({self.epoch_batches} batches into epoch {self.epoch + 1})" if self.epoch_batches else "")
                 + f" (best {self.cfg.metric}={self.best:.4f} @ {self.best_epoch})"
                 + ("" if same_stream else f"; saved on {was}, on {self.device} now: dropout draws a new stream"))
        return True

    def _checkpoint_due(self) -> bool:
        m = self.cfg.checkpoint_minutes
        return m is not None and time.time() - self._saved_at >= m * 60.0

    # -- loop ----------------------------------------------------------------
    def fit(self, progress: bool = True) -> dict:
        if self.cfg.workers > 1 and self.world == 1:
            return fit_parallel(self, progress)
        c = self.cfg
        if self.world == 1:
            torch.set_num_threads(c.threads or torch.get_num_threads())
        dev = self.device
        if self.mcfg.causal_encoder:
            inp, tgt = causal_chunks(self.train_ex, c.window_stride)
            lengths = (inp != PAD).sum(1)
            n_targets_of = (tgt >= 0).sum(1)
            inp_t, tgt_t = to_device(inp, dev), to_device(tgt, dev)  # once: a step sends only its rows' indices
            self.log(f"causal encoder: {len(self.train_ex)} targets in {len(inp)} sequence chunks; "
                     f"{self.steps_per_epoch} steps per epoch of {c.batch_size}"
                     + (f" over {self.world} workers" if self.world > 1 else "") + f" on {dev}")
        else:
            lengths = (self.train_ex.history != PAD).sum(1)
            hist_t, target_t = to_device(self.train_ex.history, dev), to_device(self.train_ex.target, dev)
        ema_params: list[torch.Tensor] = [] if self.ema is None else list(self.ema.parameters())
        model_params: list[torch.Tensor] = list(self.model.parameters())
        t_start = time.time()
        self._saved_at = t_start
        bar = progress_bar(total=self.total_steps, initial=self.step, disable=not progress, unit="step", smoothing=0.05,
                           desc="training")
        while self.epoch < self.max_epochs and self.bad_epochs < c.patience:
            rng = np.random.default_rng(c.seed * 100003 + self.epoch)
            batches = bucketed_batches(lengths, c.batch_size, rng, c.bucket_chunk)
            self.model.train()
            t0 = time.time()
            # the loss sum stays on the device (float64: the same sum as Python floats'), read every 20 steps
            tot = torch.tensor(self.epoch_loss, dtype=torch.float64, device=dev)
            n = self.epoch_targets
            bar.set_description(f"epoch {self.epoch + 1}/{c.epochs}")
            for b in range(self.epoch_batches, len(batches)):  # a run cut mid-epoch goes on after its last batch
                idx = batches[b][self.rank :: self.world]  # this worker's share of the global batch
                rows = to_device(idx, dev)
                if self.mcfg.causal_encoder:
                    w = int(lengths[idx].max())
                    x, y = inp_t[rows][:, -w:], tgt_t[rows][:, -w:]
                    with autocast(dev, c.bf16):
                        loss = self._sequence_loss(x, y)
                    n_targets = int(n_targets_of[idx].sum())
                else:
                    h = int(lengths[idx].max())
                    hist = self._codes(hist_t[rows][:, hist_t.shape[1] - h :])
                    with autocast(dev, c.bf16):
                        loss = self.model(hist, self.sids_dev[target_t[rows]])
                    n_targets = len(idx)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                if self.world > 1:
                    average_gradients(self.model, self.world)
                if c.grad_clip:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
                self.opt.step()
                self.sched.step()
                if ema_params:
                    with torch.no_grad():
                        torch._foreach_lerp_(ema_params, model_params, 1.0 - c.ema)
                self.step += 1
                tot += loss.detach().double() * n_targets
                n += n_targets
                self.epoch_batches, self._dirty = b + 1, True
                bar.update(1)
                if self.step % 20 == 0:
                    bar.set_postfix(loss=f"{float(tot) / max(n, 1):.4f}", lr=f"{self.sched.get_last_lr()[0]:.2e}")
                if self._checkpoint_due() and b + 1 < len(batches):
                    self.epoch_loss, self.epoch_targets = float(tot), n
                    self.epoch_train_s += time.time() - t0
                    t0 = time.time()
                    self.save_checkpoint()
            train_s = self.epoch_train_s + time.time() - t0
            self.epoch += 1
            self.epoch_batches, self.epoch_loss, self.epoch_targets, self.epoch_train_s = 0, 0.0, 0, 0.0
            rec: dict[str, Any] = {"epoch": self.epoch, "step": self.step, "loss": float(tot) / max(n, 1),
                                   "lr": self.sched.get_last_lr()[0], "train_s": round(train_s, 1),
                                   "device": str(dev)}
            self.elapsed_s += train_s
            first_plan = c.budget_minutes is not None and self.planned_epochs is None
            if c.select == "last":
                self._keep_last(rec)
            elif first_plan or self.epoch % c.valid_every == 0 or self.epoch >= self.max_epochs:
                self._validate(rec)
            self.elapsed_s += rec.get("valid_s", 0.0) + rec.get("test_s", 0.0)
            rec["minutes"] = round(self.elapsed_s / 60.0, 2)
            self.history.append(rec)
            if c.budget_minutes is not None:
                self._plan()
                if self.epoch >= self.max_epochs and "valid_s" not in rec and c.select == "valid":  # the plan ends
                    self._validate(rec)
                    self.elapsed_s += rec.get("valid_s", 0.0) + rec.get("test_s", 0.0)
                    rec["minutes"] = round(self.elapsed_s / 60.0, 2)
            if c.budget_minutes is not None:
                bar.total = self.total_steps
                bar.refresh()
            if not self.rank:
                with open(self.out / "train_log.jsonl", "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            self._dirty = True
            if c.checkpoint_minutes is None or self._checkpoint_due():
                self.save_checkpoint()
        if self._dirty or self._best_state is not None:  # the run stops: what it did since the last one
            self.save_checkpoint()
        bar.close()
        stopped = "early_stop" if self.bad_epochs >= c.patience else ("budget" if c.budget_minutes else "max_epochs")
        if self.world > 1:
            torch.distributed.barrier()  # rank 0 has written best_model.pt
        self.model.load_state_dict(ckpt.load(self.best_path, weights_only=True))
        self.model.eval()
        return {
            "epochs": self.epoch,
            "steps": self.step,
            "best_epoch": self.best_epoch,
            f"best_valid.{c.metric}": self.best,
            "stopped": stopped,
            "session_seconds": round(time.time() - t_start, 1),
            "workers": c.workers,
            "planned_epochs": self.planned_epochs,
            "device": str(dev),
            "devices": sorted({h.get("device", "cpu") for h in self.history}),
            "batch_size": c.batch_size,
        }

    def _codes(self, items: torch.Tensor) -> torch.Tensor:
        """[B, T] item indices (-1 = none) -> [B, T, L] codes (rows of -1)."""
        out = self.sids_dev[items.clamp(min=0)]
        return torch.where((items < 0).unsqueeze(-1), torch.full_like(out, -1), out)

    def _keep_last(self, rec: dict) -> None:
        """No validation (``select`` "last"): the weights of this epoch, raw or their moving average, are the
        run's (written with the next checkpoint)."""
        which = self.cfg.last_weights if self.ema is not None else "raw"
        state = self.ema if which == "ema" and self.ema is not None else self.model
        self.best_epoch, self.bad_epochs = self.epoch, 0
        if not self.rank:
            self._best_state = {k: v.detach().to("cpu", copy=True) for k, v in state.state_dict().items()}
        rec["best"] = which
        self.log(f"epoch {self.epoch}: loss {rec['loss']:.4f}  ({rec['train_s']:.0f}s train; no validation: the "
                 f"{which} weights kept)")

    def _validate(self, rec: dict) -> None:
        """Validate the weights (and their EMA); keep the best as best_model.pt (with the next checkpoint)."""
        c = self.cfg
        t1 = time.time()
        shard = (self.rank, self.world)
        val = evaluate_beam(self.model, self.sids, self.trie, self.valid, c.valid_beam, shard=shard)
        best_state, which = self.model, "raw"
        rec.update({f"valid.{k}": v for k, v in val.items()})
        if self.ema is not None:
            ev = evaluate_beam(self.ema, self.sids, self.trie, self.valid, c.valid_beam, shard=shard)
            rec.update({f"valid_ema.{k}": v for k, v in ev.items()})
            if ev[c.metric] > val[c.metric]:
                val, best_state, which = ev, self.ema, "ema"
        rec["valid_s"] = round(time.time() - t1, 1)
        if self.curve is not None:  # the test curve scores the weights validation just chose between
            best_model = self.ema if which == "ema" and self.ema is not None else self.model
            t2 = time.time()
            tv = evaluate_beam(best_model, self.sids, self.trie, self.curve, c.valid_beam, shard=shard)
            rec.update({f"test.{k}": v for k, v in tv.items()})
            rec["test_s"] = round(time.time() - t2, 1)
        score = val[c.metric]
        if score > self.best:
            self.best, self.best_epoch, self.bad_epochs = score, self.epoch, 0
            if not self.rank:  # written with the next checkpoint (a copy: training goes on in these weights)
                self._best_state = {k: v.detach().to("cpu", copy=True) for k, v in best_state.state_dict().items()}
            rec["best"] = which
        else:
            self.bad_epochs += 1
        self.log(
            f"epoch {self.epoch}: loss {rec['loss']:.4f}  valid recall@10 {val['recall@10']:.4f} "
            f"ndcg@10 {val['ndcg@10']:.4f} ({which})  ({rec['train_s']:.0f}s train, {rec['valid_s']:.0f}s valid)"
            + ("  *best*" if rec.get("best") else "")
        )
