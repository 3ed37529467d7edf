"""What Megatron's ``pretrain()`` runs of megatron-paradyse on each rank, for a checked
:class:`~megatron_paradyse.run.job.Job` (:mod:`megatron_paradyse.pretrain_gpt` builds the job, then this).

- start-up, before Megatron builds the model: the dataset (a built-in corpus is built into the cache by
  the first rank of each node), its token ids checked against the tokenizer's vocabulary; a rank that
  fails stops every rank (:func:`~megatron_paradyse.run.startup.agree`);
- the dataset provider's train iterator: one planner per pipeline stage, the loader's position restored
  on ``--load`` (from the beginning for a checkpoint of Megatron's own ``pretrain_gpt``); on the first
  call, the cost profile (when the config names none: calibrated by the tensor-parallel groups on
  themselves, rank 0's shared) and the start-up check that every rank plans from the same inputs;
- before the first training step, the pre-flight where ``memory.preflight`` asks for it
  (:mod:`~megatron_paradyse.run.preflight`): the budget kept, or shrunk and every planner planning under it;
- the forward step: the micro-batch's tensors to the device, the model under
  :func:`~megatron_paradyse.core.micro_batch.micro_batch_scope` with its plan, Megatron 0.19's per-token
  loss (with Megatron's NaN, Inf and spiky-loss checks);
- the end of each iteration: measured time and peak per micro-batch where ``log.measure`` asks for
  them (:class:`~megatron_paradyse.run.log.MicroBatchMeter`); on the last rank the table (every
  ``--log-interval`` iterations), the figures and plans to Megatron's TensorBoard and W&B writers
  (every ``--tensorboard-log-interval``), JSONL, plot;
- an out-of-memory error in a step: every rank stops, the budget shrunk and saved
  (:class:`~megatron_paradyse.run.fault.FaultWatch`, watching from the first call of the provider on).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from pathlib import Path
from typing import NoReturn

import torch

from megatron_paradyse.calibration.startup import startup_profile
from megatron_paradyse.core.allocator import expandable_segments_off
from megatron_paradyse.core.memory import device_memory_bytes
from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
from megatron_paradyse.cost.correction import TimeCorrections
from megatron_paradyse.data import DynamicSequenceLoader, LoaderConfig
from megatron_paradyse.mcore import compat
from megatron_paradyse.mcore.chunked_loss import output_processor
from megatron_paradyse.mcore.model_shape import model_shape
from megatron_paradyse.mcore.step_buffers import release_step_buffers
from megatron_paradyse.run import preflight
from megatron_paradyse.run.agreement import check_ranks_agree
from megatron_paradyse.run.documents import BUILT_IN, build_corpus, split_source, training_documents
from megatron_paradyse.run.fault import STATE_FILE, FaultWatch
from megatron_paradyse.run.job import Job
from megatron_paradyse.run.log import (
    WARM_UP,
    IterationLog,
    MicroBatchLog,
    MicroBatchMeter,
    append_jsonl,
    format_header,
    format_rows,
    plan_switches,
    switches_in,
    write_iteration,
    write_plot,
)
from megatron_paradyse.run.planned_loader import PlannedMicroBatches, ResumeError
from megatron_paradyse.run.stage_planning import forwards_in_flight_message, stage_planners
from megatron_paradyse.run.startup import StartupError, agree, attempt

from megatron.core import parallel_state as mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_tokenizer
from megatron.training.checkpointing import get_checkpoint_name
from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

__all__ = ["TrainingRun"]

logger = logging.getLogger(__name__)

_GIB = 2**30
_MIB = 2**20


class TrainingRun:
    """What Megatron's ``pretrain()`` calls back into on one rank: the data iterator (from the dataset
    provider), the forward step and its loss, and the end of each iteration (the log)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.iterators: list = []
        """This rank's training iterators, one per virtual-pipeline chunk."""
        self.eval_iterators: list = []
        """Its validation and test iterators (every chunk's)."""
        self.eval_pending: list = []
        """The current evaluation's micro-batch records, in forward order."""
        self.datasets: dict = {}
        """The documents of ``train``, ``valid`` and ``test`` (None: that split has none)."""
        self._prepared = False
        self.meter = None
        self.time_corrections = None
        """What the training planners learned from measured micro-batches (``planner.learn_time``)."""
        if job.config.planner.learning.learn_time:
            self.time_corrections = TimeCorrections(job.config.planner.learning.learn_prior)
        self._planned: list = []
        """This iteration's training micro-batches, in forward order: what the measurements correct."""
        self.records: list = []
        self.pending: list = []
        """This iteration's micro-batch records, in forward order."""
        self._losses: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Loss sum and tokens of this iteration's micro-batches (last stage), by position in ``pending``."""
        self._forwards: dict[int, int] = {}
        """Forward steps of this iteration, per virtual-pipeline chunk."""
        self._checked_parameters = False
        self._flown = False
        """Whether the first training step has begun (the pre-flight, if any, flown before it)."""
        self._warmed_up = False
        """Whether this process has run a measured training micro-batch (the first is the warm-up)."""
        self._last_plan: str | None = None
        """The plan of the last micro-batch logged (plan switches count across iterations)."""
        self._last_end = time.perf_counter()
        self.is_logging_rank = False
        args = job.args
        self.fault_watch = FaultWatch(job.config.memory, state=job.budget_state, save_dir=args.save, load_dir=args.load)

    # start-up -----------------------------------------------------------------------------------
    def start_up(self) -> None:
        """On every rank, once the default process group exists: the dataset, opened and checked. Every
        rank raises :class:`~megatron_paradyse.run.startup.StartupError` if one fails."""
        config, local_rank = self.job.config, self.job.args.local_rank
        problem = None
        if config.data.dataset in BUILT_IN and local_rank in (0, None):
            _, problem = attempt(lambda: build_corpus(config))
        agree(problem)  # then the other ranks of the node read what its first rank built
        self.datasets, problem = attempt(lambda: training_documents(config, self.job.args, get_tokenizer().vocab_size))
        agree(problem)

    # provider ----------------------------------------------------------------------------------
    def dataset_provider(self):
        """Megatron's dataset provider: the train, validation and test iterators (None for a split with
        no documents) on every rank."""

        def provider(train_val_test_num_samples, vp_stage=None):
            return tuple(
                None if self.datasets[split] is None else self.data_iterator(vp_stage, split)
                for split in ("train", "valid", "test")
            )

        provider.is_distributed = True  # every rank builds its own micro-batches (no TP broadcast)
        return provider

    def data_iterator(self, vp_stage: int | None, split: str = "train"):
        """The iterator of ``split`` (``train``, ``valid`` or ``test``) for one virtual-pipeline chunk.

        Validation and test run forward only (Megatron's ``evaluate``): their micro-batches are planned
        for that (:class:`~megatron_paradyse.planner.planner.ForwardOnlyCost`, no recompute), drawn in
        random order (a spread of lengths, whatever ``data.sampler`` is), and every evaluation restarts
        them (:meth:`begin_evaluation`), so its losses compare with the last one's.
        """
        job, config, args = self.job, self.job.config, self.job.args
        if not self._prepared:  # once per rank, whatever the number of virtual-pipeline chunks
            self._prepare()
        evaluation = split != "train"
        data = config.data
        dp_size = mpu.get_data_parallel_world_size()
        loader = DynamicSequenceLoader(
            self.datasets[split],
            LoaderConfig(
                p=job.tp,
                max_len=data.max_len,
                causal=job.causal,
                overflow=data.overflow,
                token_budget=data.token_budget,
                sampler="random" if evaluation else data.sampler,
                bucket_size=data.bucket_size,
                seed=data.seed,
                micro_batches_per_step=(
                    args.eval_global_batch_size // (args.eval_micro_batch_size * dp_size)
                    if evaluation
                    else get_num_microbatches()
                ),
                pad_id=job.pad_id,
            ),
            dp_rank=mpu.get_data_parallel_rank(),
            dp_size=dp_size,
        )
        planner_config = job.planner_config
        learning = self.time_corrections is not None and not evaluation
        planners = stage_planners(
            planner_config,
            args,
            job.model_config.transformer,
            self.cost_models,
            self.footprints,
            job.budget_bytes,
            forward_only=evaluation,
            time_corrections=self.time_corrections if learning else None,
        )
        stage = mpu.get_pipeline_model_parallel_rank()
        iterator = PlannedMicroBatches(
            loader,
            planners,
            stage=stage,
            evaluation=evaluation,
            time_corrections=self.time_corrections if learning else None,
        )
        if evaluation:
            self.eval_iterators.append(iterator)
            return iterator
        if not self.iterators and self.is_logging_rank:
            print(
                f"paradyse: TP={job.tp} PP={mpu.get_pipeline_model_parallel_world_size()} "
                f"DP={mpu.get_data_parallel_world_size()}; per rank: budget {job.budget_bytes / _GIB:.3f} GiB, "
                f"static {self.footprints[stage].static_bytes / _GIB:.3f} GiB (the optimizer step "
                f"{self.footprints[stage].optimizer_step_bytes / _GIB:.3f} GiB more); layer options: "
                f"{', '.join(str(o) for o in planners[stage].options)}. The table shows the micro-batches of "
                f"data-parallel rank {mpu.get_data_parallel_rank()}, pipeline stage {stage}",
                flush=True,
            )
        if not self.iterators and torch.distributed.get_rank() == 0:  # once
            if message := forwards_in_flight_message(args, job.model_config.transformer, planner_config.on_infeasible):
                print(message, flush=True)
            missing = compat.missing_fused_libraries()
            if missing:
                print(f"paradyse: {missing}", flush=True)
            reserving_more = job.device.type == "cuda" and expandable_segments_off()
            if reserving_more:
                print(f"paradyse: warning: {reserving_more}", flush=True)
        if job.args.iteration > 0:
            self._resume(iterator)
        self.iterators.append(iterator)
        if (config.log.measure or learning) and self.meter is None:  # one for every chunk
            self.meter = MicroBatchMeter(job.device, self.footprints[stage].static_bytes, memory=_meters_memory(job))
        return iterator

    def _prepare(self) -> None:
        """Once per rank, on every rank: the dataset, the profile, the start-up agreement check."""
        job = self.job
        self._prepared = True
        self.fault_watch.start()
        profile = job.profile if job.profile is not None else _calibrate_once(job)
        self.cost_models = job.cost_models(profile)
        self.footprints = job.footprints()
        allocator_bytes, problem = attempt(job.measure_budget)  # the same on every rank: agreed capacity
        agree(problem)
        inputs = {
            "config": job.config,
            "model": model_shape(job.model_config.transformer),
            "stages": self.footprints,
            "budget_bytes": job.budget_bytes,
        }
        check_ranks_agree(inputs, [job.config.cost.profile] if job.config.cost.profile else [])
        self.is_logging_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        self.dp_rank = mpu.get_data_parallel_rank()
        if self.is_logging_rank and self.datasets["valid"] is not None:
            counts = {name: 0 if docs is None else len(docs) for name, docs in self.datasets.items()}
            print(
                f"paradyse: documents: {counts['train']} for training, {counts['valid']} for validation, "
                f"{counts['test']} for test ({split_source(job.args)}); validation micro-batches are planned "
                f"for forward-only passes and kept out of the table",
                flush=True,
            )
        if self.is_logging_rank and allocator_bytes is not None and job.config.memory.budget_gib is None:
            device_bytes = device_memory_bytes(job.device)
            print(
                f"paradyse: the CUDA caching allocator can hold {allocator_bytes / _GIB:.4g} GiB per rank (the least "
                f"over the ranks; {(device_bytes - allocator_bytes) / _GIB:.3g} GiB of the device's "
                f"{device_bytes / _GIB:.4g} in use outside it now); memory.margin keeps {job.config.memory.margin:.0%} "
                f"of it out of the budget",
                flush=True,
            )
        state = job.budget_state
        if self.is_logging_rank and state is not None and job.budget_bytes == state.budget_bytes:
            iterations = sorted({e.iteration for e in state.out_of_memory})
            print(
                f"paradyse: memory budget {job.budget_bytes / _GIB:.4g} GiB (shrunk after out-of-memory at "
                f"iteration{'s' if len(iterations) > 1 else ''} {', '.join(map(str, iterations))}, from "
                f"{Path(job.args.load) / STATE_FILE})",
                flush=True,
            )

    def _resume(self, iterator) -> None:
        """Continue the data where the checkpoint ``--load`` gives left it; every rank decides alike.

        A checkpoint without this entry point's loader positions (one of Megatron's own ``pretrain_gpt``,
        say) still gives the model, the optimizer state and the iteration count; its consumed samples
        count another dataset's order, so the data starts from its beginning, with one line saying so.
        """
        args = self.job.args
        path = get_checkpoint_name(
            args.load,
            args.iteration,
            pipeline_parallel=mpu.get_pipeline_model_parallel_world_size() > 1,
            tensor_rank=0,
            pipeline_rank=0,
            expert_parallel=False,
            expert_rank=0,
            basename=f"train_dataloader_dprank{mpu.get_data_parallel_rank():03d}.pt",
        )
        found: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(found, os.path.isfile(path))
        if not any(found):
            if self.is_logging_rank and not self.iterators:
                print(
                    f"paradyse: the checkpoint of iteration {args.iteration} in {args.load} has no data-loader "
                    f"position of this entry point (Megatron's own pretrain_gpt saves none): the model, optimizer "
                    f"state and iteration count continue, the data starts from its beginning (the checkpoint's "
                    f"{args.consumed_train_samples} consumed samples count another dataset's order)",
                    flush=True,
                )
            return
        problem = None
        if not all(found):
            problem = (
                f"the checkpoint of iteration {args.iteration} in {args.load} has data-loader positions for some "
                f"data-parallel ranks only (not {path}): it was saved with another data-parallel size; resume with "
                f"that one, or pass --finetune to start the data and the iteration count from the beginning"
            )
        else:
            try:
                iterator.load_state(torch.load(path, weights_only=False)["dataloader_state_dict"])
            except ResumeError as e:
                problem = str(e)
        agree(problem)

    # forward step -------------------------------------------------------------------------------
    def forward_step(self, data_iterator, model):
        planned = next(data_iterator)
        chunk = get_attr_wrapped_model(model, "vp_stage") or 0
        index = None  # an evaluation's losses are Megatron's to add up
        if not planned.evaluation:
            index = self._forwards.get(chunk, 0)  # chunks run the step's micro-batches in the same order
            self._forwards[chunk] = index + 1
        measured = self.meter is not None and (planned.evaluation or torch.is_grad_enabled())
        if chunk == 0:
            self._record(planned, model, measured)
        if measured:
            self.meter.attach(get_attr_wrapped_model(model, "decoder", return_model_obj=True))
            self.meter.begin(forward_only=planned.evaluation, chunk=chunk)
        return self._run_model(planned, model, index)

    def _run_model(self, planned, model, index: int | None = None):
        """The forward step of a micro-batch drawn (``index``: its place in the iteration's records; None: not
        recorded): its tensors to the device, the model under its plan, and its loss function."""
        batch = planned.batch
        # from pinned memory on a GPU: a copy from pageable memory first waits for the device to catch up
        pinned = self.job.device.type == "cuda"
        tokens, labels, loss_mask, position_ids = (
            (batch[k].pin_memory() if pinned else batch[k]).to(self.job.device, non_blocking=True)
            for k in ("tokens", "labels", "loss_mask", "position_ids")
        )
        planned.layout.indices(self.job.device)  # the layers' index tensors, on the device before they run
        release_step_buffers()
        micro_batch = MicroBatch(
            layout=planned.layout, plan=planned.decision.plan, attention_kernel=self.job.config.attention_kernel
        )
        with micro_batch_scope(micro_batch):
            output = model(
                tokens, position_ids, None, labels=labels, output_processor=output_processor(micro_batch.plan)
            )
        return output, functools.partial(self._loss, loss_mask, index)

    def _record(self, planned, model, measured: bool) -> None:
        """Log the micro-batch (once, from the first model chunk)."""
        if not self._checked_parameters:
            self._check_parameter_count(model)
        plan = planned.decision.plan
        warmup = measured and not planned.evaluation and not self._warmed_up
        self._warmed_up |= warmup
        if not planned.evaluation:
            self._planned.append(planned)
        (self.eval_pending if planned.evaluation else self.pending).append(
            MicroBatchLog(
                tokens=planned.layout.valid_len,
                documents=len(planned.layout.doc_lengths),
                padded=planned.layout.padded_len,
                plan=plan.compact(),
                predicted_time_s=planned.predicted_time_s,
                predicted_peak_bytes=plan.predicted_peak_bytes,
                cached=planned.decision.cached,
                kept_previous=planned.decision.kept_previous,
                explored=planned.decision.explored,
                one_off=WARM_UP if warmup else None,
            )
        )

    def _loss(self, loss_mask: torch.Tensor, index: int | None, output: torch.Tensor):
        """Megatron 0.19's per-token loss convention: (sum, tokens, report); ``index``: the micro-batch's
        position in this iteration's records (None for an evaluation's)."""
        args = self.job.args
        mask = loss_mask.view(-1).float()
        loss = torch.sum(output.view(-1).float() * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        if index is not None:
            self._losses[index] = (loss.detach(), num_tokens)  # read at the iteration's end: no sync here
        rerun = get_rerun_state_machine()
        if args.check_for_nan_in_loss_and_grad:
            for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                rerun.validate_result(
                    result=loss,
                    rejection_func=reject,
                    message=f"found {what} in local forward loss calculation",
                    tolerance=0.0,
                    fatal=True,
                )
        if args.check_for_spiky_loss:
            rerun.validate_result(
                result=loss,
                rejection_func=functools.partial(rerun.is_unexpectedly_large, threshold=10, context="loss"),
                message="Spiky loss",
                tolerance=0.0,
                fatal=False,
            )
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}

    def _check_parameter_count(self, model) -> None:
        """The static bytes the planner budgets for come from a count; compare it with the model (a
        virtual-pipeline chunk holds only part of the stage: not checked)."""
        self._checked_parameters = True
        held = sum(p.numel() for p in model.parameters())
        counted = self.footprints[mpu.get_pipeline_model_parallel_rank()].parameters
        if len(self.iterators) == 1 and held != counted:
            logger.warning(
                "paradyse: this rank holds %d parameters, the planner's static memory counts %d: its memory "
                "predictions are off by the difference",
                held,
                counted,
            )

    def begin_step(self, step: dict) -> None:
        """Before Megatron's schedule runs a training step (``step``: ``train_step``'s arguments by name): before
        the first, the pre-flight where ``memory.preflight`` asks for it; a micro-batch of the step no plan
        fits stops every rank here (``planner.on_infeasible: stop``), not inside the schedule, where the later
        pipeline stages would be waiting for the first one's activations. Virtual-pipeline chunks read the
        same data: one iterator tells."""
        if not self._flown and preflight.wanted(self.job.config.memory.preflight, self.job.device):
            iterator = self.iterators[0] if self.iterators else None  # one: made by _prepare, with the footprints
            static = self.footprints[mpu.get_pipeline_model_parallel_rank()].static_bytes if iterator else 0.0
            self._plan_under(preflight.fly(self.job, iterator, step, self._run_model, static_bytes=static))
        self._flown = True
        if self.iterators:
            self.iterators[0].check_step()

    def _plan_under(self, budget_bytes: float) -> None:
        """Every planner plans under ``budget_bytes`` from now on (the same on every rank), where it differs."""
        if budget_bytes == self.job.budget_bytes:
            return
        self.job.budget_bytes = budget_bytes
        _, problem = attempt(self.job.check_static_memory)
        if problem is not None:
            raise StartupError(f"after the pre-flight: {problem}")
        for iterator in (*self.iterators, *self.eval_iterators):
            iterator.set_budget(budget_bytes)

    def out_of_memory(self, error: torch.OutOfMemoryError) -> NoReturn:
        """The step Megatron is running on this rank ran out of memory (``args.curr_iteration`` counts the
        steps done): stop every rank, the budget shrunk."""
        job = self.job
        self.fault_watch.out_of_memory(error, iteration=job.args.curr_iteration + 1, budget_bytes=job.budget_bytes)

    # iteration end ------------------------------------------------------------------------------
    def end_iteration(self, iteration: int, loss_dict: dict) -> None:
        now = time.perf_counter()
        records, self.pending = self.pending, []
        measured = self.meter.collect() if self.meter is not None else []
        for record, measurement in zip(records, measured):
            record.take(measurement)
        planned, self._planned = self._planned, []
        if self.time_corrections is not None:
            self._learn_time(planned, [None if record.one_off else record.measured_time_s for record in records])
        for index, (loss, tokens) in self._losses.items():
            records[index].loss = loss.item() / max(int(tokens.item()), 1)
        self._losses, self._forwards = {}, {}
        skipped = self.iterators[0].skipped if self.iterators else []
        log = IterationLog(
            iteration=iteration,
            loss=float(loss_dict["lm loss"]) if "lm loss" in loss_dict else None,
            micro_batches=records,
            skipped=[{"tokens": s.layout.valid_len, "stage": s.stage, "reason": str(s.report)} for s in skipped],
            time_s=now - self._last_end,
            rank=torch.distributed.get_rank(),
            dp_rank=self.dp_rank,
        )
        for iterator in self.iterators:
            iterator.skipped.clear()
        self._last_end = now
        if not self.is_logging_rank:
            return
        self.records.append(log)
        switches, self._last_plan = switches_in(log, self._last_plan)
        args = self.job.args
        if self.job.config.log.jsonl:
            append_jsonl(log, self.job.config.log.jsonl)
        if iteration % args.tensorboard_log_interval == 0:  # as Megatron writes its own scalars
            write_iteration(log, switches, tensorboard=get_tensorboard_writer(), wandb=get_wandb_writer())
        lines = []
        # the table follows --log-interval, as Megatron's own line does (the first iteration of a run too)
        if iteration % args.log_interval == 0 or len(self.records) == 1:
            lines = [format_header()] * (len(self.records) == 1) + format_rows(log)
        lines += [f"paradyse: skipped on stage {s['stage']}: {s['reason']}" for s in log.skipped]
        if lines:
            print("\n".join(lines), flush=True)

    def _learn_time(self, planned: list, measured: list[float | None]) -> None:
        """Correct the training planners' time model from this iteration's measured micro-batches; every
        rank takes part (one gather), and every rank's planners then plan with the same corrections."""
        planner = self.iterators[0].planners[mpu.get_pipeline_model_parallel_rank()]
        for micro_batch, seconds in zip(planned, measured):
            if seconds is not None and seconds > 0:
                planner.observe_time(micro_batch.layout, micro_batch.decision.plan, seconds)
        # every rank runs the same number of micro-batches; each ran at most every option a layer of any
        # stage may take (the same count on every rank, whatever its stage)
        options = max(len(stage_planner.options) for stage_planner in self.iterators[0].planners)
        if self.time_corrections.agree(most_entries=get_num_microbatches() * options):
            for iterator in self.iterators:
                for stage_planner in iterator.planners:
                    stage_planner.clear_cache()

    # evaluation ---------------------------------------------------------------------------------
    def begin_evaluation(self) -> None:
        """Megatron starts an evaluation (validation, or test): from the first micro-batch again."""
        for iterator in self.eval_iterators:
            iterator.restart()
        self.eval_pending = []

    def end_evaluation(self, prefix: str) -> None:
        """Megatron has printed the evaluation's loss (``prefix``: its ``iteration N [on ... set]``); the
        last rank adds one line on its micro-batches."""
        records, self.eval_pending = self.eval_pending, []
        measured = self.meter.collect() if self.meter is not None else []
        for record, measurement in zip(records, measured):
            record.take(measurement)
        # one split's iterators ran (every chunk's, skipping alike); the others were restarted, empty
        skipped = max((len(iterator.skipped) for iterator in self.eval_iterators), default=0)
        if not self.is_logging_rank or not records:
            return
        plans = collections.Counter(record.plan for record in records)
        peaks = [r.measured_peak_bytes for r in records if r.measured_peak_bytes is not None]
        measured_text = f", measured {max(peaks) / _MIB:.1f}" if peaks else ""
        print(
            f"paradyse: evaluation at {prefix}: {len(records)} micro-batches of {sum(r.tokens for r in records)} "
            f"tokens, plans: {'; '.join(f'{n}x [{plan}]' for plan, n in plans.items())}; peak up to "
            f"{max(r.predicted_peak_bytes for r in records) / _MIB:.1f} MiB predicted{measured_text}; "
            f"{skipped} skipped",
            flush=True,
        )

    def finish(self) -> None:
        writer = get_tensorboard_writer()
        if writer is not None:  # Megatron flushes at the end of training only, before its last evaluation
            writer.flush()
        if not self.is_logging_rank or not self.records:
            return
        switches, plans = plan_switches(self.records)
        print(
            f"paradyse: {sum(plans.values())} micro-batches, {len(plans)} plans, {switches} plan switches: "
            + "; ".join(f"{n}x [{plan}]" for plan, n in plans.items()),
            flush=True,
        )
        if self.time_corrections is not None:
            learned = self.time_corrections.summary()
            print(f"paradyse: learned time factors (option x[bucket:factor]): {learned}", flush=True)
        if self.job.config.log.plot:
            write_plot(
                self.records,
                self.job.config.log.plot,
                budget_bytes=self.job.budget_bytes,
                title="megatron-paradyse: lengths and plans",
            )
            print(f"paradyse: wrote {self.job.config.log.plot}", flush=True)


def _meters_memory(job: Job) -> bool:
    """Whether the job measures each micro-batch's peak: ``log.measure``, where a micro-batch's peak is its
    own (nothing else runs between its forward and backward: one pipeline stage)."""
    return job.config.log.measure and mpu.get_pipeline_model_parallel_world_size() == 1


def _calibrate_once(job: Job) -> dict:
    """No ``cost.profile``: the quick profile with its correction fitted on the model's layers, read from
    the data cache or measured by every tensor-parallel group on itself, in the job's own processes
    (:func:`~megatron_paradyse.calibration.startup.startup_profile`), its layers timed as the job's meter will
    time them; every rank plans from rank 0's. A failure on any rank raises on every rank."""
    transformer = job.model_config.transformer
    return startup_profile(
        job.config.data.cache_dir,
        mpu.get_tensor_model_parallel_group(),
        torch.distributed.group.WORLD,
        device=job.device,
        dtype=transformer.params_dtype,
        shape=model_shape(transformer),
        longest=job.args.seq_length,
        metered=_meters_memory(job),
    )
