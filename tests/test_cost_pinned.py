"""The analytic cost model's predictions, pinned: values computed before its memoisation and vectorised
ring pricing (commit eb71d91), so a faster model must predict exactly what the plain one did.

Two models: an H100 node's published figures with the benchmark's LLaMA-3-8B-sized layer (p=8, bf16,
RoPE), and the unit tests' synthetic CPU profile with a correction (p=4, fp32, GQA, RoPE); single and
packed documents, causal and bidirectional, one and two samples per micro-batch, every option. One
model serves every case in turn, so stale memoised terms of another layout would show.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_cost_model import GQA, synthetic_profile  # the cost tests' synthetic CPU profile

from megatron_paradyse.bench.planner import bench_shape
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.cost.terms import Dims, layer_terms
from megatron_paradyse.layout import SequenceLayout
from megatron_paradyse.plan import LayerOption

MLPS = ("tp_sp", "zero3", "lean")


def _models() -> dict[str, AnalyticCostModel]:
    h100 = AnalyticCostModel(hardware_profile(HARDWARE["h100"]), bench_shape(), 8, dtype=torch.bfloat16, rotary_dim=128)
    profile = synthetic_profile()
    profile["correction"] = {"compute": 1.1, "comm": 0.9, "per_layer_s": 1e-4, "per_sync_s": 2e-5}
    return {"h100": h100, "cpu": AnalyticCostModel(profile, GQA, 4, rotary_dim=16)}


# (model, documents, causal, micro-batch size, option, time_s, saved_bytes, transient_bytes)
PINNED = [
    ("h100", (37000,), True, 1, "tp_sp/tp_sp", 0.034788733848291266, 853330464.0, 450486272.0),
    ("h100", (37000,), True, 1, "tp_sp/tp_sp+rc", 0.04576928587735438, 37896192.0, 1265920544.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3", 0.033454224116947984, 853330464.0, 367517696.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3+rc", 0.04373931610223, 37896192.0, 1182951968.0),
    ("h100", (37000,), True, 1, "tp_sp/lean", 0.0343381874995705, 322783776.0, 423928832.0),
    ("h100", (37000,), True, 1, "tp_sp/lean+rc", 0.04420249544473936, 37896192.0, 708816416.0),
    ("h100", (37000,), True, 1, "ulysses/tp_sp", 0.03208937200480283, 853330464.0, 450486272.0),
    ("h100", (37000,), True, 1, "ulysses/tp_sp+rc", 0.042006270619369804, 37896192.0, 1265920544.0),
    ("h100", (37000,), True, 1, "ulysses/zero3", 0.03075486227345954, 853330464.0, 367517696.0),
    ("h100", (37000,), True, 1, "ulysses/zero3+rc", 0.03997630084424542, 37896192.0, 1182951968.0),
    ("h100", (37000,), True, 1, "ulysses/lean", 0.03163882565608206, 322783776.0, 423928832.0),
    ("h100", (37000,), True, 1, "ulysses/lean+rc", 0.04043948018675478, 37896192.0, 708816416.0),
    ("h100", (37000,), True, 1, "ring/tp_sp", 0.037710295056284204, 905437728.0, 450486272.0),
    ("h100", (37000,), True, 1, "ring/tp_sp+rc", 0.04931837631100763, 37896192.0, 1318027808.0),
    ("h100", (37000,), True, 1, "ring/zero3", 0.036375785324940915, 905437728.0, 367517696.0),
    ("h100", (37000,), True, 1, "ring/zero3+rc", 0.04728840653588325, 37896192.0, 1235059232.0),
    ("h100", (37000,), True, 1, "ring/lean", 0.037259748707563434, 374891040.0, 720286704.0),
    ("h100", (37000,), True, 1, "ring/lean+rc", 0.04775158587839261, 37896192.0, 1057281552.0),
    ("h100", (37000,), True, 1, "lean/tp_sp", 0.03980736079089904, 720693792.0, 450486272.0),
    ("h100", (37000,), True, 1, "lean/tp_sp+rc", 0.05215598071427467, 37896192.0, 1133283872.0),
    ("h100", (37000,), True, 1, "lean/zero3", 0.03847285105955575, 720693792.0, 367517696.0),
    ("h100", (37000,), True, 1, "lean/zero3+rc", 0.0501260109391503, 37896192.0, 1050315296.0),
    ("h100", (37000,), True, 1, "lean/lean", 0.039356814442178284, 190147104.0, 423928832.0),
    ("h100", (37000,), True, 1, "lean/lean+rc", 0.05058919028165966, 37896192.0, 576179744.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/tp_sp", 0.00919984082702562, 305841312.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/tp_sp+rc", 0.012346280265151062, 13582336.0, 463135904.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3", 0.010587802246126196, 305841312.0, 282419200.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3+rc", 0.014103861831359235, 13582336.0, 574678176.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/lean", 0.01045801067538646, 115688608.0, 293241856.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/lean+rc", 0.013820685361954434, 13582336.0, 395348128.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/tp_sp", 0.008722541222616296, 305841312.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/tp_sp+rc", 0.01165435765186455, 13582336.0, 463135904.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3", 0.01011050264171687, 305841312.0, 282419200.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3+rc", 0.013411939218072724, 13582336.0, 574678176.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/lean", 0.009980711070977135, 115688608.0, 293241856.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/lean+rc", 0.013128762748667927, 13582336.0, 395348128.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/tp_sp", 0.010950835625758937, 324517024.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/tp_sp+rc", 0.014553865939964786, 13582336.0, 481811616.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3", 0.01233879704485951, 324517024.0, 282419200.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3+rc", 0.016311447506172957, 13582336.0, 593353888.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/lean", 0.012209005474119777, 134364320.0, 293241856.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/lean+rc", 0.01602827103676816, 13582336.0, 414023840.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/tp_sp", 0.012674731174504034, 258303136.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/tp_sp+rc", 0.016986940895309915, 13582336.0, 415597728.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3", 0.014062692593604608, 258303136.0, 282419200.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3+rc", 0.01874452246151809, 13582336.0, 527140000.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/lean", 0.013932901022864874, 68150432.0, 293241856.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/lean+rc", 0.01846134599211329, 13582336.0, 347809952.0),
    ("h100", (5000,), False, 2, "tp_sp/tp_sp", 0.006963173941813281, 228384832.0, 132628480.0),
    ("h100", (5000,), False, 2, "tp_sp/tp_sp+rc", 0.009348701872741956, 10256384.0, 350756928.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3", 0.008723548867342498, 228384832.0, 270778368.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3+rc", 0.01162439187715128, 10256384.0, 488906816.0),
    ("h100", (5000,), False, 2, "tp_sp/lean", 0.009236844938002297, 84795456.0, 275364864.0),
    ("h100", (5000,), False, 2, "tp_sp/lean+rc", 0.012203841148993318, 10256384.0, 349903936.0),
    ("h100", (5000,), False, 2, "ulysses/tp_sp", 0.006757418664396443, 238641216.0, 132628480.0),
    ("h100", (5000,), False, 2, "ulysses/tp_sp+rc", 0.009033658865815803, 10256384.0, 361013312.0),
    ("h100", (5000,), False, 2, "ulysses/zero3", 0.00851779358992566, 238641216.0, 270778368.0),
    ("h100", (5000,), False, 2, "ulysses/zero3+rc", 0.011309348870225128, 10256384.0, 499163200.0),
    ("h100", (5000,), False, 2, "ulysses/lean", 0.00903108966058546, 95051840.0, 275364864.0),
    ("h100", (5000,), False, 2, "ulysses/lean+rc", 0.011888798142067163, 10256384.0, 360160320.0),
    ("h100", (5000,), False, 2, "ring/tp_sp", 0.008476224362832976, 244410432.0, 132628480.0),
    ("h100", (5000,), False, 2, "ring/tp_sp+rc", 0.011282344524114793, 10256384.0, 366782528.0),
    ("h100", (5000,), False, 2, "ring/zero3", 0.010236599288362194, 244410432.0, 270778368.0),
    ("h100", (5000,), False, 2, "ring/zero3+rc", 0.013558034528524117, 10256384.0, 504932416.0),
    ("h100", (5000,), False, 2, "ring/lean", 0.010749895359021995, 100821056.0, 275364864.0),
    ("h100", (5000,), False, 2, "ring/lean+rc", 0.014137483800366153, 10256384.0, 365929536.0),
    ("h100", (5000,), False, 2, "lean/tp_sp", 0.010108166363032424, 195051584.0, 132628480.0),
    ("h100", (5000,), False, 2, "lean/tp_sp+rc", 0.013551406854693712, 10256384.0, 317423680.0),
    ("h100", (5000,), False, 2, "lean/zero3", 0.01186854128856164, 195051584.0, 270778368.0),
    ("h100", (5000,), False, 2, "lean/zero3+rc", 0.015827096859103038, 10256384.0, 455573568.0),
    ("h100", (5000,), False, 2, "lean/lean", 0.01238183735922144, 51462208.0, 275364864.0),
    ("h100", (5000,), False, 2, "lean/lean+rc", 0.016406546130945072, 10256384.0, 316570688.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/tp_sp", 0.1127277763123435, 19180608.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/tp_sp+rc", 0.158986562544687, 1159168.0, 25107520.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3", 0.0963888982323435, 19180608.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3+rc", 0.135653723504687, 1159168.0, 22658112.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/lean", 0.10462040076034351, 9907264.0, 9264288.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/lean+rc", 0.143022724080687, 1159168.0, 18012384.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/tp_sp", 0.10315062572034352, 19180608.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/tp_sp+rc", 0.146025944688687, 1159168.0, 25107520.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3", 0.08681174764034351, 19180608.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3+rc", 0.12269310564868699, 1159168.0, 22658112.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/lean", 0.09504325016834352, 9907264.0, 9264288.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/lean+rc", 0.13006210622468703, 1159168.0, 18012384.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/tp_sp", 0.11030045616341054, 21643840.0, 10441568.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/tp_sp+rc", 0.154516755398821, 1159168.0, 30926240.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3", 0.09396157808341053, 21643840.0, 10441568.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3+rc", 0.131183916358821, 1159168.0, 30926240.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/lean", 0.10219308061141054, 12370496.0, 19714912.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/lean+rc", 0.13855291693482102, 1159168.0, 30926240.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/tp_sp", 0.12943837841059022, 15123520.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/tp_sp+rc", 0.17832429602118044, 1159168.0, 21050432.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3", 0.11309950033059024, 15123520.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3+rc", 0.15499145698118044, 1159168.0, 18601024.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/lean", 0.12133100285859025, 5850176.0, 8926208.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/lean+rc", 0.16236045755718045, 1159168.0, 13617216.0),
    ("cpu", (900, 100), False, 1, "tp_sp/tp_sp", 0.030530507545380097, 4492000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "tp_sp/tp_sp+rc", 0.04276391096276021, 256000.0, 5903072.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3", 0.030627480729380104, 4492000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3+rc", 0.04242934187476021, 256000.0, 5796576.0),
    ("cpu", (900, 100), False, 1, "tp_sp/lean", 0.030970713945380104, 2444000.0, 3507200.0),
    ("cpu", (900, 100), False, 1, "tp_sp/lean+rc", 0.041850464050760205, 256000.0, 5695200.0),
    ("cpu", (900, 100), False, 1, "ulysses/tp_sp", 0.031848426137380106, 4748000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "ulysses/tp_sp+rc", 0.0446010024187602, 256000.0, 6159072.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3", 0.0319453993213801, 4748000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3+rc", 0.04426643333076021, 256000.0, 6052576.0),
    ("cpu", (900, 100), False, 1, "ulysses/lean", 0.0322886325373801, 2700000.0, 3507200.0),
    ("cpu", (900, 100), False, 1, "ulysses/lean+rc", 0.043687555506760206, 256000.0, 5951200.0),
    ("cpu", (900, 100), False, 1, "ring/tp_sp", 0.03477312958946621, 4812000.0, 2358000.0),
    ("cpu", (900, 100), False, 1, "ring/tp_sp+rc", 0.048079833322932426, 256000.0, 6914000.0),
    ("cpu", (900, 100), False, 1, "ring/zero3", 0.034870102773466215, 4812000.0, 2358000.0),
    ("cpu", (900, 100), False, 1, "ring/zero3+rc", 0.047745264234932416, 256000.0, 6914000.0),
    ("cpu", (900, 100), False, 1, "ring/lean", 0.035213335989466216, 2764000.0, 4406000.0),
    ("cpu", (900, 100), False, 1, "ring/lean+rc", 0.047166386410932425, 256000.0, 6914000.0),
    ("cpu", (900, 100), False, 1, "lean/tp_sp", 0.051501154197466224, 3340000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "lean/tp_sp+rc", 0.06963113041093243, 256000.0, 4751072.0),
    ("cpu", (900, 100), False, 1, "lean/zero3", 0.05159812738146622, 3340000.0, 1560576.0),
    ("cpu", (900, 100), False, 1, "lean/zero3+rc", 0.06929656132293242, 256000.0, 4644576.0),
    ("cpu", (900, 100), False, 1, "lean/lean", 0.051941360597466214, 1292000.0, 3507200.0),
    ("cpu", (900, 100), False, 1, "lean/lean+rc", 0.06871768349893242, 256000.0, 4543200.0),
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
        d = Dims(model.shape, model.p, layout.padded_len, 1, model.element_size, model.rotary_dim)
        for attention, mlp, recompute in itertools.product(("tp_sp", "ulysses", "ring", "lean"), MLPS, (False, True)):
            option = LayerOption(attention, mlp, recompute)
            per_rank = [layer_terms(option, d, layout, rank) for rank in range(model.p)]
            cost = model.layer_cost(option, layout, 1)
            assert cost.saved_bytes == max(t.saved_bytes for t in per_rank), (docs, option)
            assert cost.transient_bytes == max(t.transient_bytes for t in per_rank), (docs, option)
