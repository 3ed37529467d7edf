"""The Paradyse layer spec inside real Megatron-Core GPT models, on CPU gloo ranks.

Two launches, many cases each (Megatron's process groups are rebuilt inside a launch):

- 2 ranks: TP=1 references (and the ready ``ModuleSpec`` at TP=1); TP=2 with sequence parallelism,
  the Paradyse model built as ``--spec megatron_paradyse.spec get_paradyse_layer_spec`` builds it:
  each attention strategy in a uniform plan (the MLP strategies rotating, so that TP=2 and TP=4 with both
  variants run every pair) and random mixed plans (these also with the loss in chunks), a new one every
  iteration of one model; two
  micro-batches run forward, forward, then backward in the other order under a third scope; state
  dicts and Megatron distributed checkpoints between stock and Paradyse models; three steps of
  Megatron's DDP + Adam; the error messages.
- 4 ranks: TP=1 references; TP=4 with sequence parallelism; three optimizer steps at TP2xDP2 with
  different micro-batches and plans per data-parallel replica; TP2xPP2 under Megatron's 1F1B
  schedule against TP2xPP1; plan positions of layers under virtual pipelining.

References are Megatron's stock local spec (explicit causal-within-document mask, natural token
order) at the same TP size and at TP=1. Loss (masked sum of the per-token loss) and every parameter
gradient agree within 1e-5 relative (max abs difference over max abs reference); the strategies only
reorder fp32 sums, observed errors are ~1e-6.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random

import pytest
import torch

from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.strategies import available_strategies, strategy_names

TOLERANCE = 1e-5
MIXES = 4
VARIANTS = ["gpt", "llama"]
CASES = (
    [f"uniform-{a}" for a in strategy_names("attention")]
    + [f"mix{i}" for i in range(MIXES)]
    + [f"mix{i}-chunked-loss" for i in range(MIXES)]
    + ["interleaved"]
)


def documents(p: int) -> list[tuple[int, ...]]:
    """One sequence that needs padding, and three packed documents."""
    return [(12 * p - 5,), (7, 5 * p + 1, 3 * p)]


def random_plan(rng: random.Random, shape, p: int, layers: int, recompute: bool | None = None) -> Plan:
    attention, _ = available_strategies("attention", shape, p)
    mlp, _ = available_strategies("mlp", shape, p)
    options = []
    for _ in range(layers):
        rc = rng.random() < 0.5 if recompute is None else recompute
        off = rc and rng.random() < 0.5
        tile = rng.choice((0, 4 * p))  # tiles of 4 local rows
        options.append(LayerOption(rng.choice(attention), rng.choice(mlp), rc, off, tile))
    return Plan(tuple(options))


def plans(shape, p: int, layers: int, seed: int, rotation: int) -> list[tuple[str, Plan]]:
    """Each attention strategy in a uniform plan, its MLP strategy the ``rotation``-th after it (rotations 0
    to 3, one per TP size and variant, run every pair of the library), then random mixes (recompute on some
    layers, of which some offloaded to host memory; MLPs in tiles on some)."""
    attention, _ = available_strategies("attention", shape, p)
    mlp, _ = available_strategies("mlp", shape, p)
    assert len(mlp) <= 4, "four rotations no longer run every pair"
    rng = random.Random(seed)
    uniform = [
        (f"uniform-{a}", Plan.uniform(LayerOption(a, mlp[(i + rotation) % len(mlp)]), layers))
        for i, a in enumerate(attention)
    ]
    return uniform + [(f"mix{i}", random_plan(rng, shape, p, layers)) for i in range(MIXES)]


# -- rank code ----------------------------------------------------------------------------------------
def _tp1_references(rank: int, batches, check_module_spec: bool) -> tuple[dict, dict]:
    """Per variant: the stock TP=1 weights and one run per batch. With ``check_module_spec``, also the
    ready ModuleSpec at TP=1 against them (Megatron picks its final norm; fine without SP)."""
    from megatron_paradyse.core.layout import SequenceLayout
    from megatron_paradyse.mcore.model_shape import model_shape

    from helpers import megatron_harness as H

    H.init_parallel(tp=1)
    refs, out = {}, {}
    for variant in VARIANTS:
        config = H.make_config(variant, tp=1)
        stock = H.build_gpt(config, H.stock_block_spec(config))
        runs = [H.backward(stock, H.stock_loss(stock, batch)) for batch in batches]
        refs[variant] = (stock.state_dict(), runs)
        if check_module_spec:
            model = H.build_gpt_from_spec_flag(config, "paradyse_layer_spec", seed=1)
            model.load_state_dict(stock.state_dict())
            layout = batches[1].layout
            batch = dataclasses.replace(
                batches[1], layout=SequenceLayout(layout.doc_lengths, 1, True, layout.padded_len)
            )
            plan = random_plan(random.Random(5), model_shape(config), 1, config.num_layers)
            run = H.backward(model, H.paradyse_loss(model, batch, plan))
            out[f"{variant}-tp1-module-spec"] = H.compare(run, runs[1], model, rank, 1, "stock")
    return refs, out


def _tp_cases(rank: int, p: int, batches, refs) -> tuple[dict, dict]:
    """Stock and Paradyse models at TP=p with SP, against each other and TP=1.

    One Paradyse model runs every plan in turn, a different one each iteration, alternating batches.
    Returns (results, {variant: (config, stock model, Paradyse model)}).
    """
    from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
    from megatron_paradyse.mcore.model_shape import model_shape

    from helpers import megatron_harness as H

    H.init_parallel(tp=p)
    out, models = {}, {}
    for variant in VARIANTS:
        full_state, tp1_runs = refs[variant]
        config = H.make_config(variant, tp=p)
        stock = H.build_gpt(config, H.stock_block_spec(config), seed=1)
        stock.load_state_dict(H.sharded_state_dict_from_full(stock, full_state, rank, p))
        stock_runs = [H.backward(stock, H.stock_loss(stock, batch)) for batch in batches]
        out[f"{variant}-stock-tp{p}"] = H.compare(stock_runs[0], tp1_runs[0], stock, rank, p, "TP=1")

        model = H.build_gpt_from_spec_flag(config, "get_paradyse_layer_spec", seed=2)
        model.load_state_dict(stock.state_dict())  # strict: the same keys and shapes
        shape = model_shape(config)
        rotation = VARIANTS.index(variant) + 2 * (p > 2)
        for i, (case, plan) in enumerate(plans(shape, p, config.num_layers, 100 * p + len(variant), rotation)):
            j = i % len(batches)
            run = H.backward(model, H.paradyse_loss(model, batches[j], plan))
            out[f"{variant}-{case}"] = {
                **H.compare(run, stock_runs[j], model, rank, 1, "stock"),
                **H.compare(run, tp1_runs[j], model, rank, p, "TP=1"),
            }
            if case.startswith("mix"):  # the output layer and loss in chunks of 3 rows on every rank
                chunked = dataclasses.replace(plan, loss_chunk_tokens=3 * p)
                run = H.backward(model, H.paradyse_loss(model, batches[j], chunked))
                out[f"{variant}-{case}-chunked-loss"] = {
                    **H.compare(run, stock_runs[j], model, rank, 1, "stock"),
                    **H.compare(run, tp1_runs[j], model, rank, p, "TP=1"),
                }

        out[f"{variant}-tp_sp-modules"] = _tp_sp_through_megatron_modules(rank, model, stock_runs, batches)

        # Two micro-batches in flight, backward in the other order while a third scope is current:
        # every layer, recomputed ones included, must use the micro-batch it ran forward with.
        rng = random.Random(7)
        first = H.paradyse_loss(model, batches[0], random_plan(rng, shape, p, config.num_layers, recompute=True))
        second = H.paradyse_loss(model, batches[1], random_plan(rng, shape, p, config.num_layers))
        with micro_batch_scope(MicroBatch(layout=H.Batch.make((3,), p, 0).layout, plan=Plan(()))):
            second.backward()
            first.backward()
        run = H.take_grads(model, first.detach() + second.detach())
        out[f"{variant}-interleaved"] = {
            **H.compare(run, stock_runs[0] + stock_runs[1], model, rank, 1, "stock"),
            **H.compare(run, tp1_runs[0] + tp1_runs[1], model, rank, p, "TP=1"),
            "first loss vs stock": H.rel_err(first.detach(), stock_runs[0].loss),
        }
        models[variant] = (config, model)
    return out, models


LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _tp_sp_through_megatron_modules(rank: int, model, stock_runs, batches) -> dict:
    """The Paradyse model under tp_sp/tp_sp against the stock local spec on every batch (the loss's
    relative error, every gradient's norm-wise relative error), and how often each layer's Megatron
    linear modules ran their ``forward`` (a forward hook counts the calls; weights read without calling
    the module run none)."""
    from helpers import megatron_harness as H

    calls = {name: 0 for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in LINEARS}

    def count(module, args, output, name):
        calls[name] += 1

    modules = dict(model.named_modules())
    hooks = [modules[name].register_forward_hook(functools.partial(count, name=name)) for name in calls]
    errors = {}
    try:
        plan = Plan.uniform(LayerOption("tp_sp", "tp_sp"), model.config.num_layers)
        for batch, stock_run in zip(batches, stock_runs):
            run = H.backward(model, H.paradyse_loss(model, batch, plan))
            errors["loss"] = max(errors.get("loss", 0.0), H.rel_err(run.loss, stock_run.loss))
            for name, grad in run.grads.items():  # norm-wise: a [hn] q/k norm gradient is all rounding
                want = stock_run.grads[name]
                errors[name] = max(errors.get(name, 0.0), ((grad - want).norm() / want.norm()).item())
    finally:
        for hook in hooks:
            hook.remove()
    return {"errors": errors, "calls": calls}


def _checkpoints(p: int, batch, models: dict, tmp: str) -> dict:
    """Paradyse weights into a stock model (state dict), and a Paradyse distributed checkpoint into
    fresh Paradyse and stock models: the same weights, keys and loss."""
    import torch.distributed as dist

    from megatron_paradyse.mcore.compat import cuda_to_cpu
    from megatron_paradyse.mcore.model_shape import model_shape
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core import dist_checkpointing

    from helpers import megatron_harness as H

    out = {}
    for variant, (config, model) in models.items():
        plan = random_plan(random.Random(11), model_shape(config), p, config.num_layers)
        path = os.path.join(tmp, variant)
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        with torch.no_grad(), cuda_to_cpu():
            want = H.paradyse_loss(model, batch, plan)
            stock = H.build_gpt(config, H.stock_block_spec(config), seed=3)
            stock.load_state_dict(model.state_dict())
            result = {"paradyse state dict -> stock, loss": H.rel_err(H.stock_loss(stock, batch), want)}

            dist_checkpointing.save(model.sharded_state_dict(), path)
            fresh = H.build_gpt(config, get_paradyse_layer_spec(config), seed=4)
            fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), path))
            result["dist ckpt -> paradyse, weights"] = max(
                H.rel_err(a, model.state_dict()[k]) for k, a in fresh.state_dict().items() if torch.is_tensor(a)
            )
            result["dist ckpt -> paradyse, loss"] = H.rel_err(H.paradyse_loss(fresh, batch, plan), want)
            stock = H.build_gpt(config, H.stock_block_spec(config), seed=5)
            stock.load_state_dict(dist_checkpointing.load(stock.sharded_state_dict(), path))
            result["dist ckpt -> stock, loss"] = H.rel_err(H.stock_loss(stock, batch), want)
            keys = [{v.key for v in m.sharded_state_dict().values()} for m in (model, stock)]
            result["checkpoint keys differ from stock"] = float(keys[0] != keys[1])
        out[f"{variant}-checkpoints"] = result
    return out


def _optimizer_steps(tp: int, variant: str) -> dict:
    """Three steps of Megatron's DDP + fp32 Adam on a stock and a Paradyse model from the same weights;
    every data-parallel replica runs its own micro-batches, the Paradyse model a new plan every step."""
    from megatron_paradyse.mcore.compat import cuda_to_cpu
    from megatron_paradyse.mcore.model_shape import model_shape
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from helpers import megatron_harness as H

    H.init_parallel(tp=tp)
    config = H.make_config(variant, tp=tp)
    stock = H.build_gpt(config, H.stock_block_spec(config), seed=21)
    model = H.build_gpt(config, get_paradyse_layer_spec(config), seed=22)
    model.load_state_dict(stock.state_dict())
    trainers = {}
    for name, module in (("stock", stock), ("paradyse", model)):
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), module)
        with cuda_to_cpu():
            optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [ddp])
        trainers[name] = (ddp, optimizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    rng = random.Random(31 + dp_rank)
    batches = [H.Batch.make(documents(tp)[(step + dp_rank) % 2], tp, seed=1000 * step + dp_rank) for step in range(4)]
    result = {}
    for step, batch in enumerate(batches):
        plan = random_plan(rng, model_shape(config), tp, config.num_layers)
        losses = {}
        for name, (ddp, optimizer) in trainers.items():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = H.stock_loss(ddp, batch) if name == "stock" else H.paradyse_loss(ddp, batch, plan)
            loss = loss / (batch.layout.valid_len * H.BATCH)
            losses[name] = loss.detach()
            if step == len(batches) - 1:
                continue  # the loss after the third step
            loss.backward()
            with cuda_to_cpu():
                finalize_model_grads([ddp])
                optimizer.step()
        result[f"loss before step {step}" if step < 3 else "loss after step 2"] = H.rel_err(
            losses["paradyse"], losses["stock"]
        )
    return {f"{variant}-optimizer-tp{tp}-dp{parallel_state.get_data_parallel_world_size()}": result}


def _pipeline(rank: int, variant: str) -> dict:
    """TP2xPP2 under Megatron's 1F1B schedule against TP2xPP1, the same weights and micro-batches.

    Each stage runs its own plan; the micro-batches differ in length (shapes are exchanged), so the
    first stage runs the forward of one while the backward of another is pending.
    """
    from megatron_paradyse.mcore.compat import cuda_to_cpu
    from megatron_paradyse.mcore.model_shape import model_shape
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from helpers import megatron_harness as H

    def schedule(model, micro_batches) -> list[torch.Tensor]:
        def forward_step(data_iterator, model):
            batch, plan = next(data_iterator)
            mask = batch.layout.loss_mask
            return H.paradyse_forward(model, batch, plan), lambda out: (
                (out * mask).sum(),
                {"loss": (out * mask).sum()},
            )

        with cuda_to_cpu():
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=max(batch.layout.padded_len for batch, _ in micro_batches),
                micro_batch_size=H.BATCH,
            )
        return [d["loss"].detach() for d in losses]

    # Stages exchange shapes; Megatron allows variable_seq_lengths only with the alltoall dispatcher.
    pipelined = dict(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    H.init_parallel(tp=2)
    config = H.make_config(variant, tp=2, **pipelined)
    stage_layers = config.num_layers // 2
    rng = random.Random(51)
    micro = [
        (H.Batch.make(docs, 2, seed=60 + i), [random_plan(rng, model_shape(config), 2, stage_layers) for _ in "ab"])
        for i, docs in enumerate([(23,), (5, 9, 4), (41,)])
    ]
    model = H.build_gpt(config, get_paradyse_layer_spec(config), seed=41)
    losses = schedule(model, [(batch, Plan(first.layers + second.layers)) for batch, (first, second) in micro])
    reference = H.take_grads(model, torch.stack(losses))
    state = model.state_dict()

    H.init_parallel(tp=2, pp=2)
    config = H.make_config(variant, tp=2, pp=2, **pipelined)
    stage = parallel_state.get_pipeline_model_parallel_rank()

    def global_name(name: str) -> str:
        if not name.startswith("decoder.layers."):
            return name
        index, rest = name.removeprefix("decoder.layers.").split(".", 1)
        return f"decoder.layers.{int(index) + stage * stage_layers}.{rest}"

    model = H.build_gpt(config, get_paradyse_layer_spec(config), seed=42)
    model.load_state_dict({k: state[global_name(k)] for k in model.state_dict()})
    stage_losses = schedule(model, [(batch, stage_plans[stage]) for batch, stage_plans in micro])
    last_stage = parallel_state.is_pipeline_last_stage()
    run = H.take_grads(model, torch.stack(stage_losses) if last_stage else reference.loss)
    reference = H.Run(reference.loss, {k: reference.grads[global_name(k)] for k in run.grads})
    result = H.compare(run, reference, model, rank, 1, "PP=1")
    if not last_stage:
        del result["loss vs PP=1"]  # only the last stage computes the loss
    return {f"{variant}-pp2": result}


def _vpp_plan_positions() -> dict:
    """(global layer number, plan index, stage layers) of every layer on this rank, PP=2 x VPP=2."""
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core import parallel_state

    from helpers import megatron_harness as H

    H.init_parallel(tp=2, pp=2, vpp=2)
    config = H.make_config("gpt", tp=2, pp=2, num_layers=8, virtual_pipeline_model_parallel_size=2)
    chunks = [H.build_gpt(config, get_paradyse_layer_spec(config, vp_stage=v), vp_stage=v) for v in range(2)]
    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "layers": [
            (layer.layer_number, layer.plan_index, layer.stage_layers) for c in chunks for layer in c.decoder.layers
        ],
    }


def _errors(p: int, models: dict, batch) -> dict[str, str]:
    """The message each misuse raises (on every rank, before any collective of the failing layer)."""
    from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
    from megatron_paradyse.spec import get_paradyse_layer_spec
    from megatron_paradyse.strategies import get_strategy, register

    from helpers import megatron_harness as H

    config, model = models["llama"]
    layers = config.num_layers
    register(
        dataclasses.replace(
            get_strategy("mlp", "zero3"),
            name="test_unusable",
            summary="registered by the test; never usable",
            unsupported=lambda shape, p: "it is never usable",
        )
    )
    tokens, labels, positions = batch.canonical()

    def message(fn) -> str:
        try:
            with torch.no_grad():
                fn()
        except (ValueError, RuntimeError) as e:
            return str(e)
        return "no error"

    def build(**overrides):
        bad = H.make_config("llama", p, **overrides)
        H.build_gpt(bad, get_paradyse_layer_spec(bad))

    def run(options, layout=batch.layout, mask=None):
        with micro_batch_scope(MicroBatch(layout=layout, plan=Plan.from_options(options))):
            model(tokens, positions, mask, labels=labels)

    return {
        "unknown strategy": message(lambda: run(["nope/tp_sp"] * layers)),
        "unusable strategy": message(lambda: run(["ring/test_unusable"] * layers)),
        "plan length": message(lambda: run(["tp_sp/tp_sp"] * (layers - 1))),
        "no scope": message(lambda: model(tokens, positions, None, labels=labels)),
        "attention mask": message(lambda: run(["tp_sp/tp_sp"] * layers, mask=batch.natural_mask())),
        "layout for other p": message(
            lambda: run(["tp_sp/tp_sp"] * layers, layout=H.Batch.make((30,), 2 * p, 0).layout)
        ),
        "megatron recompute": message(
            lambda: build(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        ),
        "unshardable": message(lambda: build(num_query_groups=1)),
        "L2 q/k norms": message(lambda: build(qk_l2_norm=True)),
    }


def _launch_2(rank: int, p: int, tmp: str) -> dict:
    from helpers import megatron_harness as H

    batches = [H.Batch.make(docs, p, seed=i) for i, docs in enumerate(documents(p))]
    refs, out = _tp1_references(rank, batches, check_module_spec=True)
    results, models = _tp_cases(rank, p, batches, refs)
    out.update(results)
    out.update(_checkpoints(p, batches[1], models, tmp))
    out["errors"] = _errors(p, models, batches[1])
    out.update(_optimizer_steps(p, "llama"))
    return out


def _launch_4(rank: int, p: int) -> dict:
    from helpers import megatron_harness as H

    batches = [H.Batch.make(docs, p, seed=i) for i, docs in enumerate(documents(p))]
    refs, out = _tp1_references(rank, batches, check_module_spec=False)
    out.update(_tp_cases(rank, p, batches, refs)[0])
    out.update(_optimizer_steps(2, "gpt"))
    out.update(_pipeline(rank, "llama"))
    out["vpp"] = _vpp_plan_positions()
    return out


# -- tests --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launch_2(tmp_path_factory):
    return run_on_ranks(_launch_2, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout_s=600)


@pytest.fixture(scope="module")
def launch_4():
    return run_on_ranks(_launch_4, 4, timeout_s=600)


@pytest.fixture(params=[2, 4], ids=lambda p: f"tp{p}")
def tp_launch(request):
    return request.param, request.getfixturevalue(f"launch_{request.param}")


def _check(per_rank: list[dict], key: str) -> None:
    for rank, results in enumerate(per_rank):
        if key not in results:
            pytest.skip(f"{key}: not a plan this model can run")
        for what, err in results[key].items():
            assert err <= TOLERANCE, f"rank {rank}, {key}: {what} off by {err:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_stock_spec_matches_tp1(tp_launch, variant):
    """The reference itself: Megatron's stock model at TP=p with SP equals TP=1."""
    p, per_rank = tp_launch
    _check(per_rank, f"{variant}-stock-tp{p}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_paradyse_matches_stock_and_tp1(tp_launch, variant, case):
    _, per_rank = tp_launch
    _check(per_rank, f"{variant}-{case}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp_sp_runs_megatrons_own_modules(tp_launch, variant):
    """tp_sp is Megatron's TP+SP: every layer's linear modules run their forward once per batch, and the
    model equals the stock local spec: the loss within 1e-6, every gradient norm-wise within 1e-5 (fp32;
    the same GEMMs, the attention core and the token order reorder sums only. A [hn] q/k norm gradient,
    downstream of the attention core and summed over every token, has measured up to 1.1e-6 from
    rounding alone; a module left out or run twice is off by O(1))."""
    _, per_rank = tp_launch
    for rank, results in enumerate(per_rank):
        result = results[f"{variant}-tp_sp-modules"]
        for what, err in result["errors"].items():
            tolerance = 1e-6 if what.startswith("loss") else 1e-5
            assert err <= tolerance, f"rank {rank}: {what} off by {err:.2e} from the stock spec"
        assert result["calls"] and set(result["calls"].values()) == {len(documents(2))}, f"rank {rank}: {result}"
        assert {name.rsplit(".", 1)[-1] for name in result["calls"]} == set(LINEARS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_module_spec_at_tp1(launch_2, variant):
    _check(launch_2, f"{variant}-tp1-module-spec")


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoints_move_between_stock_and_paradyse(launch_2, variant):
    _check(launch_2, f"{variant}-checkpoints")


@pytest.mark.parametrize(
    ("launch", "key"), [("launch_2", "llama-optimizer-tp2-dp1"), ("launch_4", "gpt-optimizer-tp2-dp2")]
)
def test_optimizer_steps_match_stock(request, launch, key):
    # Losses, not weights: Adam moves a weight with a near-zero gradient by about the learning rate
    # times the sign of that gradient, so rounding-level differences (any change of TP size makes
    # them too) flip some of those steps; the loss, which such weights barely affect, stays within 1e-5.
    _check(request.getfixturevalue(launch), key)


def test_pipeline_matches_pp1(launch_4):
    _check(launch_4, "llama-pp2")
    assert sum("loss vs PP=1" in r["llama-pp2"] for r in launch_4) == 2, "the last stage's ranks compare losses"


def test_plan_index_is_position_within_the_stage_under_virtual_pipelining(launch_4):
    # 8 layers, PP=2 x VPP=2: stage 0 holds layers 1-2 (chunk 0) and 5-6 (chunk 1), stage 1 the others.
    expected = {0: [1, 2, 5, 6], 1: [3, 4, 7, 8]}
    for result in launch_4:
        layers = sorted(result["vpp"]["layers"])
        assert [n for n, _, _ in layers] == expected[result["vpp"]["pp_rank"]]
        assert [(index, count) for _, index, count in layers] == [(i, 4) for i in range(4)]


ERRORS = {
    "unknown strategy": "layer 1 (plan entry 0, nope/tp_sp): unknown attention strategy 'nope'; known: tp_sp",
    "unusable strategy": (
        "layer 1 (plan entry 0, ring/test_unusable): mlp strategy 'test_unusable' cannot run this model on "
        "p=2 ranks (it is never usable); usable: tp_sp"
    ),
    "plan length": "the plan has 3 layer options, but this pipeline stage has 4 transformer layers",
    "no scope": "the Paradyse layers ran outside micro_batch_scope and outside Megatron's training entry",
    "attention mask": "ParadyseSelfAttention got attention_mask",
    "layout for other p": "the micro-batch's layout is for p=4, the TP group has 2 ranks",
    "megatron recompute": "recompute_granularity='full': Megatron's recompute would rerun layers without",
    "unshardable": "no strategy can split this model over tensor_model_parallel_size=2: num_query_groups=1",
    "L2 q/k norms": (
        "qk_l2_norm=True is not supported by the Paradyse layer: the planner counts the memory of q/k norms of "
        "config.normalization's kind; set qk_l2_norm=False (with qk_layernorm=True for those norms)"
    ),
}


@pytest.mark.parametrize("misuse", ERRORS)
def test_misuse_raises_a_clear_error(launch_2, misuse):
    for rank, results in enumerate(launch_2):
        assert ERRORS[misuse] in results["errors"][misuse], f"rank {rank}"
