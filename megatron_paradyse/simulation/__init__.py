"""Training runs priced, not run: a planner over a sequence of lengths, a GPU node's cost models, and the
static Megatron configuration a careful user tunes for a dataset. ``bench simulate``, ``bench frontier``
and ``paradyse plan --vs-megatron`` read them."""
