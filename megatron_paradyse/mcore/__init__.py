"""The Megatron-Core adapter: Megatron modules that run the plan's strategies, the norms and the layer
specs, the static memory of a stage, the drop-in planner for jobs that do not know the plans, and the
memory trace of a Megatron layer at any shape."""
