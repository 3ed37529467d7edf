"""The public path of the Paradyse layer spec (``--spec megatron_paradyse.spec get_paradyse_layer_spec``);
the spec itself is :mod:`megatron_paradyse.mcore.spec`."""

from megatron_paradyse.mcore.spec import get_paradyse_layer_spec, paradyse_layer_spec

__all__ = ["get_paradyse_layer_spec", "paradyse_layer_spec"]
