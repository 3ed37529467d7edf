"""The analytic cost model's predictions, pinned, so that a faster model must predict exactly what
the plain one did. Memory: the allocation scripts as checked against the strategies' code (every
rank's allocations traced, ``tests/test_memory_scripts.py``); time: the terms since commit eb71d91,
with weight gradients reduced in fp32; a layer's output gradient dying into the residual's summed
gradient since 2026-11-24 (two ``ring/lean`` working sets one activation smaller); the gated
activation's halves taken with one ``unbind`` since 5f48f84 (its backward stacks their gradients: no
sum; the 30 ``lean`` MLP working sets 1.2% to 13% smaller, the others' peaks elsewhere); ``zero3``'s fc2
gathered while fc1 computes since 2026-11-27 (its gather streamed beside the forward: the 40 ``*/zero3``
times 0.4% to 4.4% lower, their memory the same); ``ulysses``' and ``ring``'s output projection gathered
while the attention core runs since 2026-11-27 (the 60 ``ulysses/*`` and ``ring/*`` times 0.2% to 1.9%
lower, their memory the same), and their QKV projection while the core's backward runs (0.3% to 1.8%
lower again; the same working sets but two: ``ring/lean`` and ``ring/lean+rc`` on the CPU profile's
packed documents, 5.0% and 2.6% larger); a causal document and its padding attended in one call over the
whole sequence since 2026-11-28 (the 12 ``tp_sp/*`` and ``ulysses/*`` times at 37,000 tokens 0.017% to
0.020% higher: the call covers the padding's rows too); q, k, v handed to the kernel dense since
2026-11-28 (where the order is natural, the bidirectional cases: v and the untransformed q, k copied,
the projection's output no longer kept; the 24 ``tp_sp/*`` and ``ulysses/*`` saved bytes 5.4% to 15.7%
smaller, their recomputed working sets 1.5% to 7.1%).

Two models: an H100 node's published figures with the benchmark's LLaMA-3-8B-sized layer (p=8, bf16,
RoPE, no biases, on CUDA), and the unit tests' synthetic CPU profile with a correction (p=4, fp32,
GQA, RoPE); single and packed documents, causal and bidirectional, one and two samples per
micro-batch, every option. One model serves every case in turn, so stale memoised terms of another
layout would show.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_cost_model import GQA, synthetic_profile  # the cost tests' synthetic CPU profile

from megatron_paradyse.bench.planner import bench_shape
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.cost.terms import Dims, layer_terms

MLPS = ("tp_sp", "zero3", "lean")


def _models() -> dict[str, AnalyticCostModel]:
    h100 = AnalyticCostModel(
        hardware_profile(HARDWARE["h100"]), bench_shape(), 8, dtype=torch.bfloat16, rotary_dim=128, bias=False
    )
    profile = synthetic_profile()
    profile["correction"] = {"compute": 1.1, "comm": 0.9, "per_layer_s": 1e-4, "per_sync_s": 2e-5}
    return {"h100": h100, "cpu": AnalyticCostModel(profile, GQA, 4, rotary_dim=16)}


# (model, documents, causal, micro-batch size, option, time_s, saved_bytes, transient_bytes)
PINNED = [
    ("h100", (37000,), True, 1, "tp_sp/tp_sp", 0.03479506813500172, 853330464.0, 450486272.0),
    ("h100", (37000,), True, 1, "tp_sp/tp_sp+rc", 0.045777245663302144, 37896192, 1459669536.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3", 0.0340464943503251, 853330464.0, 602398720.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3+rc", 0.04406281071484443, 37896192, 1417832992.0),
    ("h100", (37000,), True, 1, "tp_sp/lean", 0.034760318380283484, 322783776.0, 522854400.0),
    ("h100", (37000,), True, 1, "tp_sp/lean+rc", 0.044626218914542354, 37896192, 807741984.0),
    ("h100", (37000,), True, 1, "ulysses/tp_sp", 0.03208909526929105, 853330464.0, 450486272.0),
    ("h100", (37000,), True, 1, "ulysses/tp_sp+rc", 0.04192071906309533, 37896192, 1459669536.0),
    ("h100", (37000,), True, 1, "ulysses/zero3", 0.031340521484614435, 853330464.0, 602398720.0),
    ("h100", (37000,), True, 1, "ulysses/zero3+rc", 0.04020628411463762, 37896192, 1417832992.0),
    ("h100", (37000,), True, 1, "ulysses/lean", 0.03205434551457282, 322783776.0, 522854400.0),
    ("h100", (37000,), True, 1, "ulysses/lean+rc", 0.04076969231433555, 37896192, 807741984.0),
    ("h100", (37000,), True, 1, "ring/tp_sp", 0.03770368403406198, 867541536.0, 450486272.0),
    ("h100", (37000,), True, 1, "ring/tp_sp+rc", 0.049224864968785406, 37896192, 1473880608.0),
    ("h100", (37000,), True, 1, "ring/zero3", 0.03695511024938536, 867541536.0, 602398720.0),
    ("h100", (37000,), True, 1, "ring/zero3+rc", 0.0475104300203277, 37896192, 1432044064.0),
    ("h100", (37000,), True, 1, "ring/lean", 0.03766893427934375, 336994848.0, 522854400.0),
    ("h100", (37000,), True, 1, "ring/lean+rc", 0.04807383822002562, 37896192, 821953056.0),
    ("h100", (37000,), True, 1, "lean/tp_sp", 0.03985685188326466, 720693792.0, 450486272.0),
    ("h100", (37000,), True, 1, "lean/tp_sp+rc", 0.05220546347446587, 37896192, 1327032864.0),
    ("h100", (37000,), True, 1, "lean/zero3", 0.039108278098588044, 720693792.0, 602398720.0),
    ("h100", (37000,), True, 1, "lean/zero3+rc", 0.05049102852600816, 37896192, 1285196320.0),
    ("h100", (37000,), True, 1, "lean/lean", 0.03982210212854643, 190147104.0, 522854400.0),
    ("h100", (37000,), True, 1, "lean/lean+rc", 0.05105443672570609, 37896192, 675105312.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/tp_sp", 0.00919984082702562, 305841312.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/tp_sp+rc", 0.012346280265151062, 13582336, 523158688.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3", 0.01117373819279286, 305841312.0, 623149056.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3+rc", 0.014419396658025902, 13582336, 915408032.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/lean", 0.012414474942786718, 115688608.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/lean+rc", 0.015776870370339962, 13582336, 521139360.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/tp_sp", 0.008715930200394073, 305841312.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/tp_sp+rc", 0.011560846309642329, 13582336, 523158688.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3", 0.010689827566161315, 305841312.0, 623149056.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3+rc", 0.013633962702517169, 13582336, 915408032.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/lean", 0.01193056431615517, 115688608.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/lean+rc", 0.01499143641483123, 13582336, 521139360.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/tp_sp", 0.010944224603536713, 310934688.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/tp_sp+rc", 0.014460354597742564, 13582336, 528252064.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3", 0.012918121969303954, 310934688.0, 623149056.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3+rc", 0.016533470990617402, 13582336, 920501408.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/lean", 0.014158858719297812, 120781984.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/lean+rc", 0.017890944702931465, 13582336, 526232736.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/tp_sp", 0.012724222266869655, 258303136.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/tp_sp+rc", 0.017036423655501114, 13582336, 475620512.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3", 0.014698119632636897, 258303136.0, 623149056.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3+rc", 0.019109540048375957, 13582336, 867869856.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/lean", 0.015938856382630755, 68150432.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/lean+rc", 0.020467013760690017, 13582336, 473601184.0),
    ("h100", (5000,), False, 2, "tp_sp/tp_sp", 0.006963173941813281, 225820736.0, 132628480.0),
    ("h100", (5000,), False, 2, "tp_sp/tp_sp+rc", 0.009348701872741956, 10256384, 389922880.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3", 0.009309484814009165, 225820736.0, 643104768.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3+rc", 0.011939926703817948, 10256384, 858669120.0),
    ("h100", (5000,), False, 2, "tp_sp/lean", 0.011193309205402555, 82231360.0, 409886720.0),
    ("h100", (5000,), False, 2, "tp_sp/lean+rc", 0.014160026157378844, 10256384, 481861696.0),
    ("h100", (5000,), False, 2, "ulysses/tp_sp", 0.006750807642174221, 225820736.0, 132628480.0),
    ("h100", (5000,), False, 2, "ulysses/tp_sp+rc", 0.00894014752359358, 10256384, 389922880.0),
    ("h100", (5000,), False, 2, "ulysses/zero3", 0.009097118514370103, 225820736.0, 643104768.0),
    ("h100", (5000,), False, 2, "ulysses/zero3+rc", 0.011531372354669573, 10256384, 858669120.0),
    ("h100", (5000,), False, 2, "ulysses/lean", 0.010980942905763496, 82231360.0, 409886720.0),
    ("h100", (5000,), False, 2, "ulysses/lean+rc", 0.013751471808230466, 10256384, 481861696.0),
    ("h100", (5000,), False, 2, "ring/tp_sp", 0.008469613340610756, 234154048.0, 132628480.0),
    ("h100", (5000,), False, 2, "ring/tp_sp+rc", 0.01118883318189257, 10256384, 398256192.0),
    ("h100", (5000,), False, 2, "ring/zero3", 0.010815924212806638, 234154048.0, 643104768.0),
    ("h100", (5000,), False, 2, "ring/zero3+rc", 0.013780058012968562, 10256384, 867002432.0),
    ("h100", (5000,), False, 2, "ring/lean", 0.012699748604200027, 90564672.0, 409886720.0),
    ("h100", (5000,), False, 2, "ring/lean+rc", 0.01600015746652946, 10256384, 490195008.0),
    ("h100", (5000,), False, 2, "lean/tp_sp", 0.01015765745539805, 195051584.0, 132628480.0),
    ("h100", (5000,), False, 2, "lean/tp_sp+rc", 0.013600889614884914, 10256384, 359153728.0),
    ("h100", (5000,), False, 2, "lean/zero3", 0.012503968327593932, 195051584.0, 643104768.0),
    ("h100", (5000,), False, 2, "lean/zero3+rc", 0.016192114445960908, 10256384, 827899968.0),
    ("h100", (5000,), False, 2, "lean/lean", 0.014387792718987321, 51462208.0, 409886720.0),
    ("h100", (5000,), False, 2, "lean/lean+rc", 0.0184122138995218, 10256384, 451092544.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/tp_sp", 0.1127277763123435, 19180608.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/tp_sp+rc", 0.158986562544687, 1159168, 28453952.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3", 0.0959279686323435, 19180608.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3+rc", 0.13473186430468698, 1159168, 22658112.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/lean", 0.10462040076034351, 9907264.0, 7767040.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/lean+rc", 0.143022724080687, 1159168, 16515136.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/tp_sp", 0.10234673132034351, 19180608.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/tp_sp+rc", 0.144879085488687, 1159168, 28453952.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3", 0.08554692364034351, 19180608.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3+rc", 0.12062438724868699, 1159168, 22658112.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/lean", 0.09423935576834351, 9907264.0, 7767040.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/lean+rc", 0.128915247024687, 1159168, 16515136.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/tp_sp", 0.10949656176341054, 20484672.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/tp_sp+rc", 0.15336989619882102, 1159168, 29758016.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3", 0.09269675408341053, 20484672.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3+rc", 0.129115197958821, 1159168, 23962176.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/lean", 0.10138918621141053, 11211328.0, 10965856.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/lean+rc", 0.137406057734821, 1159168, 21018016.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/tp_sp", 0.12943837841059025, 15123520.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/tp_sp+rc", 0.17832429602118044, 1159168, 24396864.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3", 0.11263857073059023, 15123520.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3+rc", 0.15406959778118043, 1159168, 18601024.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/lean", 0.12133100285859026, 5850176.0, 7767040.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/lean+rc", 0.16236045755718045, 1159168, 12458048.0),
    ("cpu", (900, 100), False, 1, "tp_sp/tp_sp", 0.030530507545380097, 4108000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "tp_sp/tp_sp+rc", 0.04276391096276021, 256000, 6156000.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3", 0.030166551129380104, 4108000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3+rc", 0.04150748267476021, 256000, 5412576.0),
    ("cpu", (900, 100), False, 1, "tp_sp/lean", 0.030970713945380104, 2060000.0, 3251200.0),
    ("cpu", (900, 100), False, 1, "tp_sp/lean+rc", 0.041850464050760205, 256000, 5055200.0),
    ("cpu", (900, 100), False, 1, "ulysses/tp_sp", 0.0310445317373801, 4364000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "ulysses/tp_sp+rc", 0.043454143218760205, 256000, 6412000.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3", 0.0306805753213801, 4364000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3+rc", 0.04219771493076021, 256000, 5668576.0),
    ("cpu", (900, 100), False, 1, "ulysses/lean", 0.031484738137380106, 2316000.0, 3251200.0),
    ("cpu", (900, 100), False, 1, "ulysses/lean+rc", 0.0425406963067602, 256000, 5311200.0),
    ("cpu", (900, 100), False, 1, "ring/tp_sp", 0.033969235189466214, 4556000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "ring/tp_sp+rc", 0.046932974122932423, 256000, 6604000.0),
    ("cpu", (900, 100), False, 1, "ring/zero3", 0.03360527877346622, 4556000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "ring/zero3+rc", 0.045676545834932414, 256000, 5860576.0),
    ("cpu", (900, 100), False, 1, "ring/lean", 0.03440944158946621, 2508000.0, 3251200.0),
    ("cpu", (900, 100), False, 1, "ring/lean+rc", 0.04601952721093242, 256000, 5503200.0),
    ("cpu", (900, 100), False, 1, "lean/tp_sp", 0.05150115419746622, 3340000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "lean/tp_sp+rc", 0.06963113041093243, 256000, 5388000.0),
    ("cpu", (900, 100), False, 1, "lean/zero3", 0.051137197781466213, 3340000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "lean/zero3+rc", 0.06837470212293241, 256000, 4644576.0),
    ("cpu", (900, 100), False, 1, "lean/lean", 0.051941360597466214, 1292000.0, 3251200.0),
    ("cpu", (900, 100), False, 1, "lean/lean+rc", 0.06871768349893242, 256000, 4287200.0),
]


def test_layer_cost_matches_pinned_predictions():
    models = _models()
    for name, docs, causal, b, option, time_s, saved, transient in PINNED:
        model = models[name]
        cost = model.layer_cost(LayerOption.parse(option), SequenceLayout.build(docs, model.p, causal=causal), b)
        expected = (time_s, saved, transient)
        assert (cost.time_s, cost.saved_bytes, cost.transient_bytes) == pytest.approx(expected, rel=1e-12), (
            name,
            docs,
            causal,
            b,
            option,
        )


def test_memoised_memory_equals_every_ranks_layer_terms():
    """The model shares sublayers and layer memories between options and ranks: its bytes are still
    the largest of :func:`layer_terms` on every rank, exactly (recompute's included)."""
    model = _models()["h100"]
    for docs, causal in (((37000,), True), ((1000, 250, 12000), True), ((5000,), False)):
        layout = SequenceLayout.build(docs, model.p, causal=causal)
        d = Dims(
            model.shape,
            model.p,
            layout.padded_len,
            1,
            model.element_size,
            model.rotary_dim,
            bias=model.bias,
            device=model.device,
        )
        for attention, mlp, recompute in itertools.product(("tp_sp", "ulysses", "ring", "lean"), MLPS, (False, True)):
            option = LayerOption(attention, mlp, recompute)
            per_rank = [layer_terms(option, d, layout, rank) for rank in range(model.p)]
            cost = model.layer_cost(option, layout, 1)
            assert cost.saved_bytes == max(t.saved_bytes for t in per_rank), (docs, option)
            assert cost.transient_bytes == max(t.transient_bytes for t in per_rank), (docs, option)


def test_pipeline_stages_price_each_option_once_and_as_alone():
    """The stages' models (:meth:`AnalyticCostModel.for_stage`) share what they price of the layers: a
    later stage prices no layer of a layout an earlier one priced, and every stage's costs and peaks are
    those of a model built alone for it (a tied, unfused output layer's gradient held beside every
    backward included)."""
    h100 = _models()["h100"]
    stages = [
        dict(static_bytes=3e9, vocab_size=128256, tied_unfused_output=True),
        dict(static_bytes=2e9, vocab_size=0),
        dict(static_bytes=2.5e9, vocab_size=128256),
    ]
    shared = [h100.for_stage(**stage) for stage in stages]
    alone = [
        AnalyticCostModel(
            h100.profile, h100.shape, h100.p, dtype=h100.dtype, rotary_dim=h100.rotary_dim, bias=False, **stage
        )
        for stage in stages
    ]
    options = [LayerOption.parse(f"{a}/{m}{rc}") for a in ("tp_sp", "ring") for m in MLPS for rc in ("", "+rc")]
    priced = []
    original = AnalyticCostModel._per_rank

    def counting(self, option, layout, micro_batch_size):
        priced.append(option)
        return original(self, option, layout, micro_batch_size)

    for docs in ((37000,), (1000, 250, 12000)):
        layout = SequenceLayout.build(docs, h100.p, causal=True)
        for i, (model, reference) in enumerate(zip(shared, alone)):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(AnalyticCostModel, "_per_rank", counting)
                costs = [model.layer_cost(option, layout, 1) for option in options]
            assert len(priced) == (len(options) if i < 2 else 0), (docs, i)  # the first stage's output layer is tied
            priced.clear()
            assert costs == [reference.layer_cost(option, layout, 1) for option in options], (docs, i)
            peak = model.peak_bytes(layout, 1, costs[0].saved_bytes, costs[0].transient_bytes)
            assert peak == reference.peak_bytes(layout, 1, costs[0].saved_bytes, costs[0].transient_bytes)
