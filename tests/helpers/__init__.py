"""What the tests share: single-rank references, the Megatron harness, launchers, synthetic cost models
and profiles, the stand-ins and scripts that launched jobs run. Tests import from here, never from
another test module."""
