"""What a strategy's tensors cost in memory on one rank: the bookkeeping its memory script runs.

Each strategy's ``memory`` (its record in the library) writes its forward and backward as the tensors
its code allocates and frees, in its order, in the sizes of :class:`~megatron_paradyse.strategies.dims.Dims`:
activations and weights in their element size ``e``, accumulators (ring attention's running output,
log-sum-exp, weight gradients summed over ranks) in the accumulation element size ``acc`` (fp32 for half
precision). A script gives what stays for backward (``saved``) and the high-water marks, which
:mod:`megatron_paradyse.cost.layer_memory` composes with the layer's own tensors (norms, residuals) and
recompute. The building blocks, one per function of the strategies' code, are in
:mod:`~megatron_paradyse.strategies.linear_allocations` and
:mod:`~megatron_paradyse.strategies.attention_allocations`.

The scripts are checked, not trusted: ``tests/ranks/test_memory_scripts.py`` runs every strategy's real
code on gloo ranks over the matrix of dtypes, group sizes, masks, packings, head layouts and MLPs, and
compares every rank's allocations with its script (saved bytes exactly, peaks exactly).

The planner prices every option on every rank: loops that ranks repeat (ring hops, ``lean``'s head
groups) are scripted per iteration (:class:`Iteration`) and memoised by what an iteration depends on
(the tensors alive at its start, the block it sees), so each distinct iteration is scripted once per
micro-batch shape.
"""

from __future__ import annotations

import dataclasses

from megatron_paradyse.strategies.dims import Dims

__all__ = ["Allocations", "Call", "Iteration", "Loop", "MEMO_SIZE", "State", "SublayerMemory", "sublayer_memory_of"]

MEMO_SIZE = 1024
"""Entries kept by each memoised script: one planner decision makes a few dozen; earlier micro-batch
shapes' fall out."""

State = tuple[tuple[str, float], ...]
"""Tensors alive (name, bytes), sorted by name: hashable, so that loop iterations can be memoised."""


class Allocations:
    """Tensors alive, by name, as code allocates and frees them: the bytes alive and their
    high-water mark. Names are unique while alive; freeing a name that is not alive is a bug in a
    script and raises ``KeyError``."""

    __slots__ = ("sizes", "live", "peak", "grads_held", "handed", "kept_bytes", "peak_until_used")

    def __init__(self, grads: Dims | None = None, /, **alive: float):
        """``grads``: the weight-gradient setting of :meth:`to_autograd` (:attr:`Dims.grads_held` and
        :attr:`Dims.grads_before`, whose gradients are alive from the start); none held without it."""
        before = {f"held:{i}": nbytes for i, nbytes in enumerate(grads.grads_before)} if grads else {}
        self.sizes: dict[str, float] = {**before, **alive}
        self.live = float(sum(self.sizes.values()))
        self.peak = self.live
        self.grads_held = grads is not None and grads.grads_held
        self.handed: list[float] = []
        self.kept_bytes = 0.0
        self.peak_until_used: float | None = None

    def alloc(self, **tensors: float) -> None:
        sizes, live = self.sizes, self.live  # locals: the planner runs thousands of these per decision
        for name, nbytes in tensors.items():
            if name in sizes:
                raise ValueError(f"memory script: {name!r} is allocated twice")
            sizes[name] = float(nbytes)
            live += nbytes
            if live > self.peak:
                self.peak = live
        self.live = live

    def free(self, *names: str) -> None:
        sizes, live = self.sizes, self.live
        for name in names:
            live -= sizes.pop(name)
        self.live = live

    def to_autograd(self, *names: str) -> None:
        """Weight (and bias) gradients handed to autograd (their sizes recorded in :attr:`handed`).
        Autograd adds a weight's gradients from all its uses, out of place (a new tensor, then the two
        die), and the sum into ``.grad`` once the last has come: without :attr:`grads_held` the
        gradient (or sum) dies; with it, it waits in autograd's input buffer, alive to the end (as
        ``held:<i>``, the ``i``-th gradient handed over)."""
        for name in names:
            held = f"held:{len(self.handed)}"
            self.handed.append(self.sizes[name])
            if held in self.sizes:
                self.alloc(**{f"{held}+": self.sizes[name]})
                self.free(held, name)
                name = f"{held}+"
            if self.grads_held:
                self.rename(**{name: held})
            else:
                self.free(name)

    def output_gradient_used(self) -> None:
        """A backward's first node has run: the output's gradient it was given (``dy_local``, 0 bytes here:
        the caller counts it) dies here unless the caller holds it too. The high-water mark so far is kept
        apart (:attr:`peak_until_used`), the one from here on starts again."""
        self.peak_until_used = self.peak
        self.peak = self.live

    def kept(self, **tensors: float) -> None:
        """Tensors made before this code ran and alive all through it, which it takes over here (an
        attention core's results kept for a recompute, :attr:`Dims.core_kept`): they count in the
        high-water mark so far, and from here on as its own (in :attr:`kept_bytes` too)."""
        nbytes = sum(tensors.values())
        self.peak += nbytes  # at or above the bytes alive, now theirs too
        self.alloc(**tensors)
        self.kept_bytes += nbytes

    def temporary(self, **tensors: float) -> None:
        """Tensors that live for one operation."""
        self.alloc(**tensors)
        self.free(*tensors)

    def call(self, callee: Call, prefix: str = "") -> None:
        """A function whose own tensors die inside it, leaving ``callee.leaves`` (named ``prefix+name``)."""
        self.peak = max(self.peak, self.live + callee.peak)
        self.alloc(**{prefix + name: nbytes for name, nbytes in callee.leaves})

    def returns(self, output: str, *keep: str) -> dict[str, float]:
        """A function returns ``output``: its other locals die, but what autograd saved (``keep``)."""
        self.free(*(name for name in list(self.sizes) if name != output and name not in keep))
        return {name: self.sizes[name] for name in keep}

    def rename(self, **names: str) -> None:
        """Tensors that live on under another name (a loop's next-iteration names)."""
        for old, new in names.items():
            self.sizes[new] = self.sizes.pop(old)

    def state(self) -> State:
        """The tensors alive, in a canonical order: what a :class:`Iteration` starts from and leaves."""
        return tuple(sorted(self.sizes.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """A function's memory as its caller sees it: the high-water mark above the caller's bytes, and
    the tensors it leaves behind (its results)."""

    peak: float
    leaves: State


@dataclasses.dataclass(frozen=True, slots=True)
class Iteration:
    """One iteration of a loop (a ring hop, a head group): its high-water mark, absolute (it starts
    from the tensors the loop has alive), and the tensors it leaves for the next iteration."""

    peak: float
    state: State


class Loop:
    """A loop run as memoised iterations (functions of the state they start from, returning a
    :class:`Iteration`): ranks and ring hops repeat the same few, so each is scripted once."""

    def __init__(self, start: Allocations):
        self.peak, self.state = start.peak, start.state()

    def add(self, result: Iteration) -> None:
        """Run one iteration: its high-water mark counts, its tensors are what the next starts from."""
        self.peak, self.state = max(self.peak, result.peak), result.state

    def end(self) -> Allocations:
        """The memory after the loop, to go on with."""
        m = Allocations(**dict(self.state))
        m.peak = self.peak
        return m


@dataclasses.dataclass(frozen=True, slots=True)
class SublayerMemory:
    """One sublayer's memory on one rank, from its input ``x_local`` (alive at the start) to its
    output ``y_local``."""

    saved: State
    """Kept from forward to backward, by tensor (the input too where the strategy keeps it; not the
    output)."""
    fwd_peak: float
    """Bytes alive at the forward's high-water mark, its input included."""
    bwd_peak: float
    """Bytes above the backward's start (what was saved, the output's gradient) at its high-water mark."""
    bwd_prelude: float = 0.0
    """Bytes the backward allocates, and still holds, before it first reads what the forward saved:
    with recompute, the layer is rebuilt on top of them."""
    grads_handed: tuple[float, ...] = ()
    """The weight (and bias) gradients the backward hands to autograd, in order (bytes)."""
    handed_on: float = 0.0
    """Bytes the forward leaves alive for the next sublayer beside its output: the MLP's first weight,
    gathered ahead (:attr:`Dims.mlp_weight_ahead`); the next sublayer's forward peak counts them."""
    kept_core: float = 0.0
    """With :attr:`Dims.core_kept`: the bytes of the attention core's results, which exist before the
    forward (in :attr:`saved`, and in :attr:`fwd_peak` from its start)."""
    bwd_peaks_around_use: tuple[float, float] | None = None
    """:attr:`bwd_peak` split where the backward's first node has used the output's gradient
    (:meth:`Allocations.output_gradient_used`): the high-water marks until then and after, both on the
    same base. A gradient only autograd holds (a dropout's) dies there; None: used to the end."""

    @property
    def saved_bytes(self) -> float:
        return float(sum(nbytes for _, nbytes in self.saved))


def sublayer_memory_of(
    fwd_peak: float,
    bwd: Allocations,
    saved: dict[str, float],
    prelude: float = 0.0,
    handed_on: float = 0.0,
    kept_core: float = 0.0,
) -> SublayerMemory:
    """A sublayer's memory from its forward's high-water mark and its backward, which must release
    everything saved and leave the input's gradient."""
    if {name for name in bwd.sizes if not name.startswith("held:")} != {"dy_local", "dx_local"}:
        raise AssertionError(f"memory script: backward ends with {sorted(bwd.sizes)} alive")
    saved_bytes = sum(saved.values())
    around_use = None
    if bwd.peak_until_used is not None:
        around_use = (bwd.peak_until_used - saved_bytes, bwd.peak - saved_bytes)
    backward_peak = max(bwd.peak, bwd.peak_until_used or 0.0) - saved_bytes
    return SublayerMemory(
        tuple(saved.items()), fwd_peak, backward_peak, prelude, tuple(bwd.handed), handed_on, kept_core, around_use
    )
