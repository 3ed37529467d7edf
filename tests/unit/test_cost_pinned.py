"""The analytic cost model's predictions, pinned, so that a faster model must predict exactly what the
plain one did, and a change to the model shows every prediction it moves (git history keeps why each
pinned value last changed). Memory: the MLPs' recorded from their code and the attention's scripts, as
checked against the strategies' code (every rank's allocations traced, ``tests/ranks/test_memory_scripts.py``);
time: the terms.

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

from megatron_paradyse.bench.planner import bench_shape
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.strategies.dims import Dims

from helpers.cost_profiles import GQA, synthetic_profile

MLPS = ("tp_sp", "zero3", "zero3_actrc", "lean")


def _models() -> dict[str, AnalyticCostModel]:
    h100 = AnalyticCostModel(
        hardware_profile(HARDWARE["h100"]), bench_shape(), 8, dtype=torch.bfloat16, rotary_dim=128, bias=False
    )
    profile = synthetic_profile()
    profile["correction"] = {"compute": 1.1, "comm": 0.9, "per_layer_s": 1e-4, "per_sync_s": 2e-5}
    return {"h100": h100, "cpu": AnalyticCostModel(profile, GQA, 4, rotary_dim=16)}


# (model, documents, causal, micro-batch size, option, time_s, saved_bytes, transient_bytes)
PINNED = [
    ("h100", (37000,), True, 1, "tp_sp/tp_sp", 0.028626255779218547, 682797600.0, 450486272.0),
    ("h100", (37000,), True, 1, "tp_sp/tp_sp+rc", 0.03802539795756239, 37896192.0, 1289136672.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3", 0.02551157191454193, 682797600.0, 806887424.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3_actrc", 0.025930792300143335, 550160928.0, 939524096.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3+rc", 0.03394485292910468, 37896192.0, 1451788832.0),
    ("h100", (37000,), True, 1, "tp_sp/zero3_actrc+rc", 0.034503813443239884, 37896192.0, 1451788832.0),
    ("h100", (37000,), True, 1, "tp_sp/lean", 0.028591506024500318, 284887584.0, 489695232.0),
    ("h100", (37000,), True, 1, "tp_sp/lean+rc", 0.0368743712088026, 37896192.0, 736686624.0),
    ("h100", (37000,), True, 1, "ulysses/tp_sp", 0.02543938099350788, 682797600.0, 450486272.0),
    ("h100", (37000,), True, 1, "ulysses/tp_sp+rc", 0.03368796943735558, 37896192.0, 1289136672.0),
    ("h100", (37000,), True, 1, "ulysses/zero3", 0.021797394888831263, 682797600.0, 806887424.0),
    ("h100", (37000,), True, 1, "ulysses/zero3_actrc", 0.02221661527443267, 550160928.0, 939524096.0),
    ("h100", (37000,), True, 1, "ulysses/zero3+rc", 0.028552819928897865, 37896192.0, 1451788832.0),
    ("h100", (37000,), True, 1, "ulysses/zero3_actrc+rc", 0.029111780443033076, 37896192.0, 1451788832.0),
    ("h100", (37000,), True, 1, "ulysses/lean", 0.02540463123878965, 284887584.0, 489695232.0),
    ("h100", (37000,), True, 1, "ulysses/lean+rc", 0.03253694268859579, 37896192.0, 736686624.0),
    ("h100", (37000,), True, 1, "ring/tp_sp", 0.03657374732885388, 730167840.0, 450486272.0),
    ("h100", (37000,), True, 1, "ring/tp_sp+rc", 0.04792837351217972, 37896192.0, 1336506912.0),
    ("h100", (37000,), True, 1, "ring/zero3", 0.03293176122417727, 730167840.0, 806887424.0),
    ("h100", (37000,), True, 1, "ring/zero3_actrc", 0.033350981609778674, 597531168.0, 939524096.0),
    ("h100", (37000,), True, 1, "ring/zero3+rc", 0.04279322400372201, 37896192.0, 1499159072.0),
    ("h100", (37000,), True, 1, "ring/zero3_actrc+rc", 0.04335218451785721, 37896192.0, 1499159072.0),
    ("h100", (37000,), True, 1, "ring/lean", 0.03653899757413565, 332257824.0, 489695232.0),
    ("h100", (37000,), True, 1, "ring/lean+rc", 0.04677734676341994, 37896192.0, 784056864.0),
    ("h100", (37000,), True, 1, "lean/tp_sp", 0.0392099288697453, 588057120.0, 450486272.0),
    ("h100", (37000,), True, 1, "lean/tp_sp+rc", 0.05139252763059327, 37896192.0, 1194396192.0),
    ("h100", (37000,), True, 1, "lean/zero3", 0.03609524500506868, 588057120.0, 806887424.0),
    ("h100", (37000,), True, 1, "lean/zero3_actrc", 0.03651446539067009, 455420448.0, 939524096.0),
    ("h100", (37000,), True, 1, "lean/zero3+rc", 0.04731198260213556, 37896192.0, 1357048352.0),
    ("h100", (37000,), True, 1, "lean/zero3_actrc+rc", 0.04787094311627076, 37896192.0, 1357048352.0),
    ("h100", (37000,), True, 1, "lean/lean", 0.03917517911502707, 190147104.0, 489695232.0),
    ("h100", (37000,), True, 1, "lean/lean+rc", 0.05024150088183349, 37896192.0, 641946144.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/tp_sp", 0.008612866907762005, 244720800.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/tp_sp+rc", 0.011608677600821835, 13582336.0, 462038176.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3", 0.008453219553510598, 244720800.0, 891985920.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3_actrc", 0.008513320495951335, 197182624.0, 939524096.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3+rc", 0.011548249273678025, 13582336.0, 1123124384.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/zero3_actrc+rc", 0.011658434334819378, 13582336.0, 1123124384.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/lean", 0.011827501023523104, 102106272.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "tp_sp/lean+rc", 0.015039267706010735, 13582336.0, 507557024.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/tp_sp", 0.007648054361130458, 244720800.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/tp_sp+rc", 0.010342341725313104, 13582336.0, 462038176.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3", 0.00696110476687905, 244720800.0, 891985920.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3_actrc", 0.007021205709319788, 197182624.0, 939524096.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3+rc", 0.009227308918169294, 13582336.0, 1123124384.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/zero3_actrc+rc", 0.009337493979310647, 13582336.0, 1123124384.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/lean", 0.010862688476891556, 102106272.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "ulysses/lean+rc", 0.013772931830502004, 13582336.0, 507557024.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/tp_sp", 0.010404755796257869, 261698720.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/tp_sp+rc", 0.013904698335289897, 13582336.0, 479016096.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3", 0.009717806202006461, 261698720.0, 891985920.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3_actrc", 0.009777907144447196, 214160544.0, 939524096.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3+rc", 0.012789665528146086, 13582336.0, 1140102304.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/zero3_actrc+rc", 0.01289985058928744, 13582336.0, 1140102304.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/lean", 0.013619389912018965, 119084192.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "ring/lean+rc", 0.017335288440478797, 13582336.0, 524534944.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/tp_sp", 0.01265727217750259, 210764960.0, 170876928.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/tp_sp+rc", 0.016952292891469586, 13582336.0, 428082336.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3", 0.012497624823251181, 210764960.0, 891985920.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3_actrc", 0.012557725765691918, 163226784.0, 939524096.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3+rc", 0.01689186456432578, 13582336.0, 1089168544.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/zero3_actrc+rc", 0.017002049625467135, 13582336.0, 1089168544.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/lean", 0.015871906293263686, 68150432.0, 419033088.0),
    ("h100", (1000, 250, 12000), True, 1, "lean/lean+rc", 0.02038288299665849, 13582336.0, 473601184.0),
    ("h100", (5000,), False, 2, "tp_sp/tp_sp", 0.006963173941813281, 184795200.0, 132628480.0),
    ("h100", (5000,), False, 2, "tp_sp/tp_sp+rc", 0.009348701872741956, 10256384.0, 348897344.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3", 0.007618286764484061, 184795200.0, 903626752.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3_actrc", 0.007663670588329539, 148897856.0, 939524096.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3+rc", 0.010248728654292844, 10256384.0, 1078165568.0),
    ("h100", (5000,), False, 2, "tp_sp/zero3_actrc+rc", 0.01033193233134289, 10256384.0, 1078165568.0),
    ("h100", (5000,), False, 2, "tp_sp/lean", 0.011193309205402555, 77103168.0, 409886720.0),
    ("h100", (5000,), False, 2, "tp_sp/lean+rc", 0.014160026157378844, 10256384.0, 476733504.0),
    ("h100", (5000,), False, 2, "ulysses/tp_sp", 0.006269905722174221, 184795200.0, 132628480.0),
    ("h100", (5000,), False, 2, "ulysses/tp_sp+rc", 0.00845924560359358, 10256384.0, 348897344.0),
    ("h100", (5000,), False, 2, "ulysses/zero3", 0.006468828914370515, 184795200.0, 903626752.0),
    ("h100", (5000,), False, 2, "ulysses/zero3_actrc", 0.006514212738215995, 148897856.0, 939524096.0),
    ("h100", (5000,), False, 2, "ulysses/zero3+rc", 0.0084468931241955, 10256384.0, 1078165568.0),
    ("h100", (5000,), False, 2, "ulysses/zero3_actrc+rc", 0.008530096801245543, 10256384.0, 1078165568.0),
    ("h100", (5000,), False, 2, "ulysses/lean", 0.010500040985763494, 77103168.0, 409886720.0),
    ("h100", (5000,), False, 2, "ulysses/lean+rc", 0.013270569888230468, 10256384.0, 476733504.0),
    ("h100", (5000,), False, 2, "ring/tp_sp", 0.007988711420610755, 197615680.0, 132628480.0),
    ("h100", (5000,), False, 2, "ring/tp_sp+rc", 0.01070793126189257, 10256384.0, 361717824.0),
    ("h100", (5000,), False, 2, "ring/zero3", 0.008116522003281536, 197615680.0, 903626752.0),
    ("h100", (5000,), False, 2, "ring/zero3_actrc", 0.008161905827127013, 161718336.0, 939524096.0),
    ("h100", (5000,), False, 2, "ring/zero3+rc", 0.010553353563443458, 10256384.0, 1090986048.0),
    ("h100", (5000,), False, 2, "ring/zero3_actrc+rc", 0.010636557240493503, 10256384.0, 1090986048.0),
    ("h100", (5000,), False, 2, "ring/lean", 0.012218846684200028, 89923648.0, 409886720.0),
    ("h100", (5000,), False, 2, "ring/lean+rc", 0.015519255546529458, 10256384.0, 489553984.0),
    ("h100", (5000,), False, 2, "lean/tp_sp", 0.01015765745539805, 159154240.0, 132628480.0),
    ("h100", (5000,), False, 2, "lean/tp_sp+rc", 0.013600889614884914, 10256384.0, 323256384.0),
    ("h100", (5000,), False, 2, "lean/zero3", 0.010812770278068828, 159154240.0, 903626752.0),
    ("h100", (5000,), False, 2, "lean/zero3_actrc", 0.010858154101914307, 123256896.0, 939524096.0),
    ("h100", (5000,), False, 2, "lean/zero3+rc", 0.014500916396435803, 10256384.0, 1052524608.0),
    ("h100", (5000,), False, 2, "lean/zero3_actrc+rc", 0.014584120073485848, 10256384.0, 1052524608.0),
    ("h100", (5000,), False, 2, "lean/lean", 0.014387792718987321, 51462208.0, 409886720.0),
    ("h100", (5000,), False, 2, "lean/lean+rc", 0.0184122138995218, 10256384.0, 451092544.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/tp_sp", 0.1127277763123435, 16282688.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/tp_sp+rc", 0.158986562544687, 1159168.0, 25556032.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3", 0.0936123910323435, 16282688.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3_actrc", 0.09407142156034351, 13964352.0, 6955008.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3+rc", 0.13241628670468697, 1159168.0, 19760192.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/zero3_actrc+rc", 0.133028327408687, 1159168.0, 19760192.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/lean", 0.10462040076034351, 9327680.0, 6607872.0),
    ("cpu", (700, 64, 1500), True, 2, "tp_sp/lean+rc", 0.143022724080687, 1159168.0, 14776384.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/tp_sp", 0.10119987212034351, 16282688.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/tp_sp+rc", 0.143732226288687, 1159168.0, 25556032.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3", 0.0813876276403435, 16282688.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3_actrc", 0.08184665816834351, 13964352.0, 6955008.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3+rc", 0.11576823204868698, 1159168.0, 19760192.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/zero3_actrc+rc", 0.116380272752687, 1159168.0, 19760192.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/lean", 0.09309249656834351, 9327680.0, 6607872.0),
    ("cpu", (700, 64, 1500), True, 2, "ulysses/lean+rc", 0.12776838782468702, 1159168.0, 14776384.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/tp_sp", 0.10834970256341055, 18021440.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/tp_sp+rc", 0.15222303699882103, 1159168.0, 27294784.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3", 0.08853745808341053, 18021440.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3_actrc", 0.08899648861141053, 15703104.0, 6955008.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3+rc", 0.12425904275882103, 1159168.0, 21498944.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/zero3_actrc+rc", 0.12487108346282104, 1159168.0, 21498944.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/lean", 0.10024232701141053, 11066432.0, 10965856.0),
    ("cpu", (700, 64, 1500), True, 2, "ring/lean+rc", 0.136259198534821, 1159168.0, 20873120.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/tp_sp", 0.12943837841059025, 12805184.0, 7086080.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/tp_sp+rc", 0.17832429602118044, 1159168.0, 22078528.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3", 0.11032299313059024, 12805184.0, 4636672.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3_actrc", 0.11078202365859025, 10486848.0, 6955008.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3+rc", 0.15175402018118042, 1159168.0, 16282688.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/zero3_actrc+rc", 0.15236606088518045, 1159168.0, 16282688.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/lean", 0.12133100285859026, 5850176.0, 6607872.0),
    ("cpu", (700, 64, 1500), True, 2, "lean/lean+rc", 0.16236045755718045, 1159168.0, 11298880.0),
    ("cpu", (900, 100), False, 1, "tp_sp/tp_sp", 0.030530507545380097, 3340000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "tp_sp/tp_sp+rc", 0.04276391096276021, 256000.0, 5388000.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3", 0.028704763353380104, 3340000.0, 2103296.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3_actrc", 0.0287784913533801, 2828000.0, 2615296.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3+rc", 0.040045694898760205, 256000.0, 5187296.0),
    ("cpu", (900, 100), False, 1, "tp_sp/zero3_actrc+rc", 0.040153214898760205, 256000.0, 5187296.0),
    ("cpu", (900, 100), False, 1, "tp_sp/lean", 0.030970713945380104, 1804000.0, 2995200.0),
    ("cpu", (900, 100), False, 1, "tp_sp/lean+rc", 0.041850464050760205, 256000.0, 4543200.0),
    ("cpu", (900, 100), False, 1, "ulysses/tp_sp", 0.029897672537380102, 3596000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "ulysses/tp_sp+rc", 0.04230728401876021, 256000.0, 5644000.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3", 0.027375069145380102, 3596000.0, 2103296.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3_actrc", 0.027448797145380097, 3084000.0, 2615296.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3+rc", 0.038195349554760206, 256000.0, 5443296.0),
    ("cpu", (900, 100), False, 1, "ulysses/zero3_actrc+rc", 0.038302869554760206, 256000.0, 5443296.0),
    ("cpu", (900, 100), False, 1, "ulysses/lean", 0.030337878937380103, 2060000.0, 2995200.0),
    ("cpu", (900, 100), False, 1, "ulysses/lean+rc", 0.0413938371067602, 256000.0, 4799200.0),
    ("cpu", (900, 100), False, 1, "ring/tp_sp", 0.03282237598946621, 3980000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "ring/tp_sp+rc", 0.04578611492293242, 256000.0, 6028000.0),
    ("cpu", (900, 100), False, 1, "ring/zero3", 0.03029977259746621, 3980000.0, 2103296.0),
    ("cpu", (900, 100), False, 1, "ring/zero3_actrc", 0.030373500597466206, 3468000.0, 2615296.0),
    ("cpu", (900, 100), False, 1, "ring/zero3+rc", 0.04167418045893242, 256000.0, 5827296.0),
    ("cpu", (900, 100), False, 1, "ring/zero3_actrc+rc", 0.04178170045893242, 256000.0, 5827296.0),
    ("cpu", (900, 100), False, 1, "ring/lean", 0.033262582389466215, 2444000.0, 3082288.0),
    ("cpu", (900, 100), False, 1, "ring/lean+rc", 0.044872668010932426, 256000.0, 5270288.0),
    ("cpu", (900, 100), False, 1, "lean/tp_sp", 0.05150115419746622, 2828000.0, 1667072.0),
    ("cpu", (900, 100), False, 1, "lean/tp_sp+rc", 0.06963113041093243, 256000.0, 4876000.0),
    ("cpu", (900, 100), False, 1, "lean/zero3", 0.049675410005466214, 2828000.0, 2103296.0),
    ("cpu", (900, 100), False, 1, "lean/zero3_actrc", 0.049749138005466216, 2316000.0, 2615296.0),
    ("cpu", (900, 100), False, 1, "lean/zero3+rc", 0.06691291434693242, 256000.0, 4675296.0),
    ("cpu", (900, 100), False, 1, "lean/zero3_actrc+rc", 0.06702043434693242, 256000.0, 4675296.0),
    ("cpu", (900, 100), False, 1, "lean/lean", 0.051941360597466214, 1292000.0, 2995200.0),
    ("cpu", (900, 100), False, 1, "lean/lean+rc", 0.06871768349893242, 256000.0, 4031200.0),
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
