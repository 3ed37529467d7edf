"""``bench e2e``'s arms on every rank (:mod:`megatron_paradyse.bench.e2e` says what they are and how they
are measured): the demo's GPT built per arm from the same weights, each corpus's memory pass and timed
passes, the arms taking turns at each step."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_paradyse.bench._e2e_results import (
    ADAPTIVE,
    INFEASIBLE,
    LEARNING,
    MEGATRON,
    MIB,
    OOM,
    TRAINED,
    ArmResult,
    Corpus,
    CorpusResult,
    SequenceResult,
)
from megatron_paradyse.bench._e2e_state import (
    Adam,
    accumulate_into_main_grads,
    gradient,
    gradient_buffer,
    resident_bytes,
)
from megatron_paradyse.bench.frontier import training_flops
from megatron_paradyse.core.host_sync import wait_for_device, watch_host_syncs
from megatron_paradyse.core.memory import peak_bytes_of, storage_bytes
from megatron_paradyse.core.micro_batch import MicroBatch
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost import AnalyticCostModel
from megatron_paradyse.cost.correction import TimeCorrections
from megatron_paradyse.cost.hardware import HARDWARE
from megatron_paradyse.data import make_micro_batch
from megatron_paradyse.mcore.chunked_loss import micro_batch_loss
from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim
from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
from megatron_paradyse.mcore.static_memory import OptimizerSetup, pipeline_footprints, torch_optimizer_implementation
from megatron_paradyse.mcore.step_buffers import release_step_buffers
from megatron_paradyse.mcore.stock_spec import stock_block_spec
from megatron_paradyse.mcore.trace import LayerModel
from megatron_paradyse.planner import Planner, PlannerConfig
from megatron_paradyse.run.log import MicroBatchMeter
from megatron_paradyse.strategies import ModelShape

from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

__all__ = [
    "MEGATRON_CANNOT_PACK",
    "DEMO",
    "DEMO_LAYERS",
    "LEARNING_RATE",
    "Settings",
    "arm_order",
    "bench_on_rank",
    "model_config",
    "transformer_impl",
]


MEGATRON_PLAN = "megatron local spec"
MEGATRON_CANNOT_PACK = (
    "Megatron's local spec has no per-document attention on CPU (its packed-sequence path needs "
    "Transformer Engine or flash-attn)"
)

DEMO = LayerModel(
    shape=ModelShape(hidden_size=128, num_attention_heads=8, num_query_groups=8, kv_channels=16, ffn_hidden_size=512),
    normalization="LayerNorm",
    bias=True,
)
"""The layer of the CPU demo's GPT (``configs/tiny-cpu.yaml``, :data:`DEMO_LAYERS` of them): the default
model (``--model`` takes a config's)."""
DEMO_LAYERS = 4
LEARNING_RATE = 1e-3
SEED = 1234


def model_config(
    model: LayerModel, layers: int, p: int, dtype: torch.dtype = torch.float32, transformer_impl: str = "local"
):
    """A GPT of ``layers`` layers ``model`` as a Megatron ``TransformerConfig`` for TP=``p`` with sequence
    parallelism, in ``dtype``, initialised on the CPU, no dropout."""
    config = model.transformer_config(p, dtype)
    return dataclasses.replace(
        config, num_layers=layers, perform_initialization=True, transformer_impl=transformer_impl
    )


def transformer_impl(device: str) -> str:
    """The layers' modules on ``device``: Transformer Engine's where it is installed (GPU only), the
    Paradyse layers' and Megatron's stock ones alike (the same weights), else Megatron's local ones."""
    return "transformer_engine" if HAVE_TE and device == "cuda" else "local"


def arm_order(names: Sequence[str], repeat: int, step: int) -> list[str]:
    """The order in which the arms run step ``step`` of pass ``repeat``: shuffled with both as seed, the
    same on every rank, so that no arm always follows the same one (at 54be9b7, with the order fixed, the
    adaptive arm, always after Megatron's, ran ``tp_sp/tp_sp``'s own plan slower than that arm in 56 of
    78 sequence-repeat pairs)."""
    order = list(names)
    random.Random(repeat * 1_000_003 + step).shuffle(order)
    return order


# -- what runs on every rank --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    tp: int
    dp: int
    model: LayerModel
    """The GPT's layer (:data:`DEMO`, or a config's, ``--model``), RoPE base included."""
    layers: int
    tied_embeddings: bool
    device: str
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank: the local rank's)."""
    dtype: str
    """The model's parameters and activations: ``float32`` or ``bfloat16`` (:mod:`._e2e_state`)."""
    pack_tokens: int | None
    """``--pack`` (None: one document per micro-batch)."""
    repeats: int
    budget_bytes: float | None
    """None: derived per corpus (see the module docstring)."""
    profile: dict
    arms: tuple[str, ...]
    plan_margin: float
    """The adaptive arm plans to ``budget * (1 - plan_margin)``: room for the memory model's error."""
    learn_passes: int
    """Untimed passes of the adaptive+learn arm before its timed repeats."""


def bench_on_rank(rank: int, world_size: int, corpora: list[Corpus], settings: Settings) -> list[CorpusResult]:
    if settings.device == "cuda":  # the rank's own GPU, as NCCL wants (LOCAL_RANK under torchrun)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=settings.tp)
    try:
        placement = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank())
        if placement != (rank % settings.tp, rank // settings.tp):  # the results' rank order relies on it
            raise RuntimeError(f"rank {rank} is (TP rank, DP rank) {placement}, not r % tp, r // tp")
        model_parallel_cuda_manual_seed(SEED)
        return [_CorpusBench(corpus, settings).run() for corpus in corpora]
    finally:
        parallel_state.destroy_model_parallel()


class _CorpusBench:
    """The arms on one corpus, on this rank: models, batches, memory passes, timed passes."""

    def __init__(self, corpus: Corpus, settings: Settings) -> None:
        p, dp = settings.tp, settings.dp
        self.corpus, self.p, self.settings = corpus, p, settings
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        cuda = settings.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        impl = transformer_impl(settings.device)
        self.config = model_config(settings.model, settings.layers, p, getattr(torch, settings.dtype), impl)
        multiple = 128 * p  # Megatron's --make-vocab-size-divisible-by 128, times TP
        self.vocab_size = -(-corpus.vocab_size // multiple) * multiple
        longest = max(sum(corpus.micro_batch_tokens(m)) for m in corpus.micro_batches)

        def build(spec) -> torch.nn.Module:
            torch.manual_seed(SEED)
            return GPTModel(
                self.config,
                spec,
                vocab_size=self.vocab_size,
                max_sequence_length=longest + 2 * p,
                position_embedding_type="rope",
                rotary_base=settings.model.rotary_base,
                share_embeddings_and_output_weights=settings.tied_embeddings,
            ).to(self.device)

        if impl == "transformer_engine":
            stock = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.config.qk_layernorm)  # norm: config's
        else:
            stock = stock_block_spec(self.config)
        self.stock = build(stock)  # also without the megatron arm: the initial weights
        self.paradyse = build(get_paradyse_layer_spec(self.config))
        for model in (self.stock, self.paradyse):
            accumulate_into_main_grads(model)
        self.initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.stock.state_dict().items()}
        (self.footprint,) = pipeline_footprints(
            self.config,
            vocab_size=self.vocab_size,
            tied_embeddings=settings.tied_embeddings,
            learned_positions=0,
            optimizer=OptimizerSetup(torch_optimizer_implementation(self.device.type), weight_decay=False),  # Adam
            grads_in_fp32=True,
        )
        self.cost_model = AnalyticCostModel(
            settings.profile,
            model_shape(self.config),
            p,
            dtype=self.config.params_dtype,
            static_bytes=self.footprint.static_bytes,
            vocab_size=self.vocab_size,
            rotary_dim=rotary_dim(self.config, "rope"),
            bias=self.config.add_bias_linear,
            normalization=self.config.normalization,
            tied_unfused_output=settings.tied_embeddings and not self.config.gradient_accumulation_fusion,
        )
        # Step k runs micro-batch k * dp + d on DP rank d; a trailing remainder of fewer than dp is dropped.
        steps = [corpus.micro_batches[k * dp : (k + 1) * dp] for k in range(len(corpus.micro_batches) // dp)]
        self.document_tokens = [tuple(map(corpus.micro_batch_tokens, step)) for step in steps]
        self.batches = []  # this DP rank's micro-batch of each step, on the device
        for step in steps:
            documents = [corpus.documents[d] for d in step[self.dp_rank]]
            batch = make_micro_batch(documents, [False] * len(documents), p=p, causal=True, pad_id=corpus.pad_id)
            if MEGATRON in settings.arms:  # what Megatron's stock layers take: natural order, padding kept (last)
                order = batch["layout"].canonical_index
                batch["natural"] = {k: batch[k].index_select(1, order).to(self.device) for k in _INPUTS}
            batch.update({k: batch[k].to(self.device) for k in _INPUTS})
            batch["layout"].indices(self.device)  # copied once, before any step, as the entry point does
            self.batches.append(batch)
        shape = model_shape(self.config)
        self.step_flops = tuple(
            math.fsum(training_flops(shape, self.config.num_layers, n) for tokens in step for n in tokens)
            for step in self.document_tokens
        )
        self.meter = MicroBatchMeter(self.device, 0.0, memory=False)  # forward + backward, as a run measures
        self.meter.attach(self.stock)
        self.meter.attach(self.paradyse)
        self.predictor = self._planner(2.0**62)  # the cost model's time of any plan (a budget none reaches)

    # -- arms -------------------------------------------------------------------------------------
    def run(self) -> CorpusResult:
        names = self.settings.arms
        results = {}
        for name in (n for n in names if n not in (ADAPTIVE, LEARNING)):  # the planners plan within the
            self._progress(f"memory pass, {name}")  # budget the static arms' peaks set
            results[name] = self._memory_pass(name)
        budget, rule = self._budget(results)
        self._progress(f"memory pass, {ADAPTIVE} (budget {budget / MIB:.1f} MiB)")
        results[ADAPTIVE] = self._memory_pass(ADAPTIVE, budget=budget)
        for arm in results.values():
            for s in arm.sequences:
                if s.status == TRAINED and max(s.peak_bytes) > budget:
                    s.status = OOM
        if LEARNING in names:  # it trains what the adaptive arm holds within budget; its peaks come after
            self.learning_planner = self._planner(budget, learn=True)
            adaptive = results[ADAPTIVE].sequences
            results[LEARNING] = ArmResult(LEARNING, [SequenceResult(s.document_tokens, s.status) for s in adaptive])
            self._learned_plans: dict[tuple[int, int], object] = {}  # (sequence, repeat): this rank's plan
            for learn_pass in range(self.settings.learn_passes):
                self._progress(f"untimed pass {learn_pass + 1}/{self.settings.learn_passes}, {LEARNING}")
                self._pass([results[LEARNING]], learn_pass, first=False, timed=False)
        for repeat in range(self.settings.repeats):
            self._progress(f"timed pass {repeat + 1}/{self.settings.repeats}, the arms taking turns at each step")
            self._pass([results[name] for name in names], repeat, first=repeat == 0)
        if LEARNING in names:
            self._progress(f"memory pass, {LEARNING}: every plan it ran")
            self._learned_peaks(results[LEARNING], budget)
        arms = {n: results[n] for n in names}
        s = self.settings
        return CorpusResult(
            self.corpus.name,
            s.tp,
            s.dp,
            s.pack_tokens,
            budget,
            rule,
            self.footprint.static_bytes,
            arms,
            step_flops=self.step_flops,
            peak_flops=_peak_flops(self.device),
        )

    def _progress(self, what: str) -> None:
        if dist.get_rank() == 0:
            print(f"bench e2e: {self.corpus.name}: {what}", file=sys.stderr, flush=True)

    def _budget(self, results: dict[str, ArmResult]) -> tuple[float, str]:
        if self.settings.budget_bytes is not None:
            return self.settings.budget_bytes, "--budget-mib"
        lean = max(max(s.peak_bytes) for s in results["lean/lean"].sequences)
        fast = max(max(results["tp_sp/tp_sp"].sequences, key=lambda s: s.tokens).peak_bytes)
        if lean >= fast:
            raise ValueError(
                f"{self.corpus.name}: lean/lean peaks at {lean / MIB:.1f} MiB, not below tp_sp/tp_sp's "
                f"{fast / MIB:.1f} MiB on the longest sequence: no budget separates them; use longer "
                f"sequences (--max-len) or give --budget-mib"
            )
        return (lean + fast) / 2, "midway between lean/lean's largest peak and tp_sp/tp_sp's on the longest sequence"

    def _planner(self, budget: float, *, learn: bool = False):
        config = PlannerConfig(on_infeasible="skip", learn_time=learn)
        return Planner.for_model(
            config,
            self.cost_model,
            shape=self.cost_model.shape,
            p=self.p,
            num_layers=self.footprint.layers,
            budget_bytes=budget * (1.0 - self.settings.plan_margin),
            time_corrections=TimeCorrections(config.learning.learn_prior) if learn else None,
        )

    def _arm_plan(self, name: str, planner, layout):
        """The plan of a micro-batch (None: Megatron's own layers); raises _Infeasible for the planner."""
        if name == MEGATRON:
            return None
        if name in (ADAPTIVE, LEARNING):
            decision = planner.decide(layout)
            if decision is None:
                raise _Infeasible
            return decision.plan
        return Plan.uniform(LayerOption.parse(name), self.config.num_layers)

    def _reset(self, name: str):
        """The arm's model at the initial weights, its Adam, and its flat gradient buffer."""
        model = self._model(name)
        model.load_state_dict(self.initial)
        grads = gradient_buffer(model)  # before Adam: a bf16 model's fp32 weights take their gradients there
        return model, Adam(model, list(model.parameters()), LEARNING_RATE), grads

    def _model(self, name: str) -> torch.nn.Module:
        return self.stock if name == MEGATRON else self.paradyse

    def _gather(self, value) -> list:
        """``value`` of every rank, in rank order."""
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    def _per_dp_rank(self, values: list) -> tuple:
        """One value per DP rank from every rank's, which the ranks of each TP group must agree on."""
        groups = [values[i : i + self.p] for i in range(0, len(values), self.p)]
        for d, group in enumerate(groups):
            if any(v != group[0] for v in group):
                raise RuntimeError(f"the TP ranks of DP rank {d} disagree: {group}")
        return tuple(group[0] for group in groups)

    # -- passes -----------------------------------------------------------------------------------
    def _memory_pass(self, name: str, budget: float | None = None) -> ArmResult:
        """Every sequence once, untimed, under the storage tracker: the peak of each rank."""
        model, optimizer, grads = self._reset(name)
        planner = self._planner(budget) if name == ADAPTIVE else None
        if planner is not None:
            self.adaptive_planner = planner  # the timed passes reuse its cached plans
        results, deciding, syncs = [], 0.0, []
        for batch, document_tokens in zip(self.batches, self.document_tokens):
            layout = batch["layout"]
            try:
                start = time.perf_counter()
                try:
                    plan = self._arm_plan(name, planner, layout)
                finally:
                    deciding += time.perf_counter() - start
                planned = (MEGATRON_PLAN, None, None) if plan is None else self._predicted(plan, layout)
            except _Infeasible:
                planned = None
            plans = self._per_dp_rank(self._gather(planned))
            if None in plans:  # a step runs on every DP rank or on none
                results.append(SequenceResult(document_tokens, INFEASIBLE))
                continue
            creates_optimizer_state = not optimizer.state
            watched = None if creates_optimizer_state else syncs  # the first step sets up what a process does once
            peaks = self._measured_peaks(model, optimizer, grads, batch, plan, syncs=watched)
            results.append(
                SequenceResult(
                    document_tokens,
                    TRAINED,
                    tuple(peaks),
                    plans=tuple(text for text, _, _ in plans),
                    predicted_peak_bytes=tuple(peak for _, peak, _ in plans if peak is not None),
                    creates_optimizer_state=creates_optimizer_state,
                    predicted_time_s=tuple(time_s for _, _, time_s in plans if time_s is not None),
                )
            )
        found = max(self._gather(tuple(syncs)), key=len)
        return ArmResult(name, results, first_decisions_s=deciding if planner is not None else 0.0, host_syncs=found)

    def _predicted(self, plan, layout) -> tuple[str, float, float]:
        """``plan`` in short, and the cost model's peak of one step of it at ``layout`` and its forward +
        backward time."""
        return plan.compact(), self._predicted_peak(plan, layout), self.predictor.predicted_time_s(plan, layout)

    def _predicted_peak(self, plan, layout) -> float:
        """The cost model's peak of one step of ``plan`` at ``layout``: its micro-batch's, or the optimizer
        step's (the footprint's), whichever is larger."""
        step = self.footprint.static_bytes + self.footprint.optimizer_step_bytes
        return max(self.cost_model.plan_peak_bytes(plan, layout, 1), step)

    def _measured_peaks(self, model, optimizer, grads: torch.Tensor, batch: dict, plan, syncs=None) -> list[int]:
        """Every rank's peak of one step of ``plan`` (None: Megatron's layers) on ``batch``: what it holds
        before the step, plus the high-water mark of forward + backward + all-reduces or of Adam's step;
        the host synchronisations of the forward + backward added to ``syncs`` (a list; None: not watched)."""
        release_step_buffers()  # Megatron's all-gather buffer and rotary tables: the step's own
        resident = resident_bytes(model, optimizer) + _input_bytes(batch, plan, self.device)

        def forward_backward() -> None:
            with watch_host_syncs(self.device) if syncs is not None else contextlib.nullcontext([]) as found:
                self._forward_backward(model, grads, batch, plan)
            if syncs is not None:
                syncs.extend(found)

        forward_backward = peak_bytes_of(forward_backward, self.device)
        step = peak_bytes_of(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=False)), self.device)
        return self._gather(resident + max(forward_backward, step))

    def _pass(self, arms: list[ArmResult], repeat: int, *, first: bool, timed: bool = True) -> None:
        """Train each of ``arms`` from the initial weights on the sequences it holds within budget, the arms
        taking turns at each step in an order shuffled per ``repeat`` and step (the same on every rank), so
        that a change in the machine's load hits them alike; time each step (``timed``: record the times;
        ``first``: the losses too). The arms of one model keep their own weights and Adam between their
        steps, swapped in and out of it outside the timed window."""
        models = {id(model): model for model in (self._model(arm.name) for arm in arms)}
        grads = {key: gradient_buffer(model) for key, model in models.items()}  # one per model, shared
        turns = {arm.name: self._turn(arm, grads) for arm in arms}
        for index in range(len(self.batches)):
            for name in arm_order(list(turns), repeat, index):
                turn = turns[name]
                turn.swap_in()
                self._step(turn, index, first=first, timed=timed)
                turn.swap_out()
        for turn in turns.values():
            turn.swap_in()
            turn.arm.resident_bytes = resident_bytes(turn.model, turn.optimizer)
            checksum = sum(float(param.detach().double().sum()) for param in turn.model.parameters())
            turn.arm.weight_checksums = tuple(self._gather(checksum))

    def _turn(self, arm: ArmResult, grads: dict) -> _Turn:
        model = self._model(arm.name)
        planner = None
        if arm.name == ADAPTIVE:  # plans cached by the memory pass, as in a run where length buckets recur
            planner = self.adaptive_planner
        if arm.name == LEARNING:  # what it learned in the passes before, as in a run's later epochs
            planner = self.learning_planner
        if planner is not None:
            planner.forget_previous()
        initial = [self.initial[name].clone() for name, _ in model.named_parameters()]
        return _Turn(arm, model, Adam(model, initial, LEARNING_RATE), grads[id(model)], initial, planner)

    def _step(self, turn: _Turn, index: int, *, first: bool, timed: bool) -> None:
        """``turn``'s arm trains on sequence ``index`` (if it holds it within budget), timed between barriers."""
        arm, planner = turn.arm, turn.planner
        batch, result = self.batches[index], turn.arm.sequences[index]
        if result.status != TRAINED:
            if planner is not None:  # the planner sees every sequence, as in the memory pass (hysteresis)
                planner.decide(batch["layout"])
            return
        explored = _explorations(planner)
        wait_for_device(self.device)
        dist.barrier()
        start = time.perf_counter()
        plan = self._arm_plan(arm.name, planner, batch["layout"])
        self.meter.begin()
        loss = self._forward_backward(turn.model, turn.grads, batch, plan)
        turn.optimizer.step()
        turn.optimizer.zero_grad(set_to_none=False)
        (measured,) = self.meter.collect()
        if arm.name == LEARNING:
            self._learn(planner, batch["layout"], plan, measured.time_s)
        wait_for_device(self.device)
        dist.barrier()
        if timed:
            result.times_s.append(time.perf_counter() - start)
            result.rank_times_s.append(tuple(self._gather(measured.time_s)))
        if first:
            result.losses = tuple(self._gather(loss.item())[:: self.p])
        if arm.name == LEARNING:
            self._learned_plans[(index, len(result.plans_run))] = plan
            result.plans_run.append(self._per_dp_rank(self._gather(plan.compact())))
            result.explored += _explorations(planner) > explored
        elif plan is not None and plan.compact() != result.plans[self.dp_rank]:
            raise RuntimeError(
                f"{arm.name}: plan {plan.compact()} differs from the memory pass's {result.plans[self.dp_rank]}"
            )

    @staticmethod
    def _learn(planner, layout, plan, measured_s: float) -> None:
        """What the training loop does with a measured micro-batch when ``planner.learn_time`` is on, here
        after every step: correct the time model, agree on it across the ranks, and plan with it."""
        planner.observe_time(layout, plan, measured_s)
        if planner.cost_model.corrections.agree(most_entries=len(planner.options)):  # one micro-batch a step
            planner.clear_cache()

    def _learned_peaks(self, arm: ArmResult, budget: float) -> None:
        """Measure each plan the adaptive+learn arm ran on each sequence, in the steady state (Adam's
        moments made); a sequence one of them takes over ``budget`` on any rank becomes an OOM."""
        model, optimizer, grads = self._reset(arm.name)
        optimizer.step()  # makes Adam's moments; the gradients are zero, so the weights do not move
        for index, result in enumerate(arm.sequences):
            if result.status != TRAINED:
                continue
            measured = {}  # the plans of every DP rank -> (every rank's peak, each DP rank's predicted peak)
            for repeat, plans in enumerate(result.plans_run):
                if plans not in measured:
                    plan, batch = self._learned_plans[(index, repeat)], self.batches[index]
                    peaks = self._measured_peaks(model, optimizer, grads, batch, plan)
                    predicted = self._gather(self._predicted_peak(plan, batch["layout"]))
                    measured[plans] = (tuple(peaks), self._per_dp_rank(predicted))
            result.plans, (result.peak_bytes, result.predicted_peak_bytes) = max(
                measured.items(), key=lambda item: max(item[1][0])
            )
            if max(result.peak_bytes) > budget:  # as any arm's OOM: not trained, its time not counted
                result.status, result.times_s, result.losses = OOM, [], ()
        learned = self._gather(self.learning_planner.cost_model.corrections.summary())
        if any(summary != learned[0] for summary in learned):
            raise RuntimeError(f"{LEARNING}: the ranks learned different time corrections: {learned}")
        arm.time_corrections = learned[0]

    def _forward_backward(self, model, grads: torch.Tensor, batch: dict, plan) -> torch.Tensor:
        """Mean loss per token of one micro-batch (left on the device: reading it would make the host wait),
        backward, Megatron's TP all-reduce of the gradients of parameters every rank holds whole (norms,
        row-parallel biases), and the average over the DP ranks of every gradient (``grads``: the flat
        buffer they live in)."""
        if plan is None:  # Megatron's own layers: natural token order (padding last), its causal mask
            natural = batch["natural"]
            per_token = model(natural["tokens"], natural["position_ids"], None, labels=natural["labels"])
            loss = (per_token * natural["loss_mask"]).sum() / natural["loss_mask"].sum()
        else:
            loss = micro_batch_loss(model, batch, MicroBatch(layout=batch["layout"], plan=plan))
        loss.backward()
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False) and self.p > 1:
                dist.all_reduce(gradient(param), group=self.tp_group)
        if self.settings.dp > 1:
            dist.all_reduce(grads, group=self.dp_group)
            grads.div_(self.settings.dp)
        return loss.detach()


@dataclasses.dataclass
class _Turn:
    """An arm during a pass: its own weights (in its model only while it runs a step), Adam and planner."""

    arm: ArmResult
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grads: torch.Tensor
    """The model's flat gradient buffer, shared by the arms of that model (each step zeroes it)."""
    weights: list[torch.Tensor]
    planner: object | None

    def swap_in(self) -> None:
        with torch.no_grad():
            for param, weight in zip(self.model.parameters(), self.weights):
                param.copy_(weight)

    def swap_out(self) -> None:
        with torch.no_grad():
            for param, weight in zip(self.model.parameters(), self.weights):
                weight.copy_(param)


def _peak_flops(device: torch.device) -> float:
    """The dense bf16 peak of ``device``'s GPU model, FLOP/s, where :data:`HARDWARE` lists it (nan elsewhere)."""
    if device.type != "cuda":
        return math.nan
    name = torch.cuda.get_device_name(device)
    return next((spec.peak_bf16_flops for spec in HARDWARE.values() if spec.device_name == name), math.nan)


def _explorations(planner) -> int:
    """How many of ``planner``'s decisions ran a plan to measure it (0 where it does not explore)."""
    return 0 if planner is None or planner.exploration is None else planner.exploration.explored


_INPUTS = ("tokens", "labels", "loss_mask", "position_ids")
"""The micro-batch's tensors the model reads (:func:`~megatron_paradyse.data.make_micro_batch`)."""


class _Infeasible(Exception):
    """The planner found no plan that fits the budget for this micro-batch."""


def _input_bytes(batch: dict, plan, device: torch.device) -> int:
    """Bytes of the micro-batch's inputs the step reads (Megatron's layers: natural order, no index
    tensors), which exist before it starts: the cost model counts them (``stage_bytes``)."""
    if plan is None:
        tensors = list(batch["natural"].values())
    else:
        tensors = [batch[k] for k in _INPUTS]
        tensors += list(batch["layout"].indices(device))
    return storage_bytes(tensors)
