"""The public path of the Paradyse layer spec (``--spec megatron_paradyse.spec get_paradyse_layer_spec``);
the spec itself is :mod:`megatron_paradyse.mcore.spec`. Importing this module installs the drop-in
planner (:func:`megatron_paradyse.run.drop_in.stage_planner_of`), which plans a job that runs the layers
outside any micro-batch scope, as a stock training script does."""

from megatron_paradyse.mcore import drop_in
from megatron_paradyse.mcore.spec import get_paradyse_layer_spec, paradyse_layer_spec
from megatron_paradyse.run.drop_in import stage_planner_of

drop_in.plan_with(stage_planner_of)

__all__ = ["get_paradyse_layer_spec", "paradyse_layer_spec"]
