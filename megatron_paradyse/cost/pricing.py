"""A machine's prices of the time model's atoms (:mod:`megatron_paradyse.strategies.terms`): the seconds
of one sublayer's forward or backward on one rank, from a calibrated profile.

``gemm_*(m, n, k) = c0 + c1 * 2mnk + c2 * e(mk + nk + mn)`` (recomputed GEMMs at the forward rate in
the backward); ``attn_*(call) = c0 + per_pair(length) * pairs * hn`` summed over batch and heads,
the rate interpolated in log length between calibrated blocks; a collective's
``latency(kind, p) + bytes * per_byte(kind, p)``. Most collectives are waited for where they are
issued, so they add up; the ring overlaps each hop's send with its kernels, ``lean`` its shards'
transfers with its compute. What communication of ``m`` seconds adds to ``c`` seconds of compute it
overlaps is ``exposed(c, m) = max(c, m) + (1 - overlap) * min(c, m) - c``, per ring hop (c: its kernels,
m: its sends) and per pass for streamed collectives (c: the pass's GEMMs and kernels, m: the
collectives). ``syncs`` counts collectives and ring hops.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_paradyse.strategies.terms import AttentionCall, Collective, Gemm, RingStage, SublayerTerms

__all__ = ["PassTime", "TermPrices"]

# Rough op counts per sublayer call (forward; backward about twice), for the per-op overhead.
_OPS_PER_SUBLAYER = 12


@dataclasses.dataclass(frozen=True, slots=True)
class PassTime:
    """One sublayer's forward or backward, priced on one rank."""

    compute_s: float
    comm_s: float
    syncs: int

    def __add__(self, other: PassTime) -> PassTime:
        return PassTime(self.compute_s + other.compute_s, self.comm_s + other.comm_s, self.syncs + other.syncs)

    def __mul__(self, times: int) -> PassTime:
        return PassTime(times * self.compute_s, times * self.comm_s, times * self.syncs)


class TermPrices:
    """The seconds of GEMMs, attention kernel calls and collectives on ``p`` ranks of the machine
    ``profile`` describes, for elements of ``element_size`` bytes, before the profile's correction.

    Ranks, ring hops and ``lean``'s head groups repeat the same few GEMMs and kernel calls: each is
    priced once until :meth:`forget_calls` (the cost model calls it for each new layout, so memory stays
    bounded); the attention rates, once per direction, mask and head dim.
    """

    def __init__(self, profile: dict[str, Any], p: int, element_size: int) -> None:
        self.profile = profile
        self.p = p
        self.element_size = element_size
        self._call_times: dict[tuple[str, AttentionCall | Gemm], float] = {}
        self._rates: dict[tuple[str, bool, int], tuple[float, np.ndarray, np.ndarray]] = {}

    def forget_calls(self) -> None:
        """Drop the GEMMs and kernel calls priced so far (a new layout prices others)."""
        self._call_times.clear()

    def sublayer_pass(self, sub: SublayerTerms, *, backward: bool) -> PassTime:
        """``sub``'s forward or backward on this rank: its GEMMs, kernels (the ring's too) and memory-bound
        work; the collectives it waits for and what its streamed ones and ring sends leave exposed; its
        synchronisation points."""
        compute = self._backward_compute(sub) if backward else self._forward_compute(sub)
        ring_kernels, ring_exposed = self._rings(sub, backward=backward)
        sync_comm, streamed = (sub.bwd_comm, sub.bwd_streamed) if backward else (sub.fwd_comm, sub.fwd_streamed)
        compute += ring_kernels
        # asynchronous collectives hide behind computation, not behind other transfers
        comm = self.comms(sync_comm) + ring_exposed + self._streamed(streamed, compute)
        return PassTime(compute, comm, sub.syncs(backward=backward))

    def host_copies(self, forward_s: float, backward_s: float, nbytes: float) -> float:
        """What an offloaded layer's two host copies of ``nbytes`` add: its input to the host beside its
        forward, and the next offloaded layer's input back beside its backward (recompute included), each
        hidden as the profile's ``host_link.overlap`` says (0 on CPU, where the copy runs in line)."""
        link = self.profile.get("host_link")
        if link is None:
            raise ValueError(
                "the cost profile has no host_link (host-device copy rates), so offloaded layers ('+rc+off') "
                "cannot be priced; run `paradyse calibrate` again, or leave offload out (planner.host_memory_gib: 0)"
            )
        transfer = link["latency_s"] + nbytes * link["per_byte_s"]
        return sum(self.exposed(compute, transfer, link["overlap"]) for compute in (forward_s, backward_s))

    def gemm(self, gemm: Gemm, direction: str) -> float:
        key = (direction, gemm)  # lean's p groups, and every rank, repeat the same GEMMs
        known = self._call_times.get(key)
        if known is None:
            fit = self.profile["gemm"][direction]
            measured = fit.get("by_shape", {}).get(f"{gemm.n}x{gemm.k}")  # optional in a profile
            if measured is not None:  # its rate interpolated in log m, flat beyond the measured ones
                rate = np.interp(math.log(gemm.m), np.log(measured["m"]), measured["per_flop_s"])
                known = float(rate) * gemm.flops
            else:
                c0, c1, c2 = fit["coef"]
                e = self.element_size
                known = c0 + c1 * gemm.flops + c2 * e * (gemm.m * gemm.k + gemm.n * gemm.k + gemm.m * gemm.n)
            self._call_times[key] = known
        return known

    def _attention(self, calls: Sequence[AttentionCall], direction: str) -> list[float]:
        """Each kernel call's time, ``per_call + per_unit(length) * flops / 4``: the rate at the nearest
        calibrated head dim, interpolated in log length (flat beyond the ends). Ranks and ring hops
        repeat the same few calls: each new one is priced once per layout, one ``np.interp`` for all
        new calls of one kind (mask, head dim)."""
        known = self._call_times
        kinds: dict[tuple[bool, int], list[AttentionCall]] = {}
        for call in calls:
            if (direction, call) not in known:
                kinds.setdefault((call.causal, call.hn), []).append(call)
        for (causal, hn), new in kinds.items():
            new = list(dict.fromkeys(new))
            per_call, log_lengths, per_unit = self._attention_rates(direction, causal, hn)
            x = np.array([math.log(call.length) for call in new])
            flops = np.array([call.flops for call in new], dtype=np.float64)
            times = per_call + np.interp(x, log_lengths, per_unit) * flops / 4
            known.update(zip(((direction, call) for call in new), times.tolist()))
        return [known[direction, call] for call in calls]

    def _attention_rates(self, direction: str, causal: bool, hn: int) -> tuple[float, np.ndarray, np.ndarray]:
        """(per-call seconds, log lengths, per-unit seconds) of the calibrated head dim nearest ``hn``."""
        key = (direction, causal, hn)
        rates_by_key = self._rates
        if key not in rates_by_key:
            fit = self.profile["attention"][direction]["causal" if causal else "full"]
            by_hn = fit["by_head_dim"]
            rates = by_hn[min(by_hn, key=lambda n: abs(math.log(int(n) / hn)))]
            rates_by_key[key] = (
                fit["per_call_s"],
                np.log(rates["lengths"]),
                np.asarray(rates["per_unit_s"], dtype=np.float64),
            )
        return rates_by_key[key]

    def _elementwise(self, sub: SublayerTerms, factor: float) -> float:
        ew = self.profile["elementwise"]
        return factor * (sub.elementwise_bytes * ew["per_byte_s"] + _OPS_PER_SUBLAYER * ew["per_op_s"])

    def _forward_compute(self, sub: SublayerTerms) -> float:
        return (
            sum(self.gemm(g, "forward") for g in sub.gemms)
            + sum(self._attention(sub.attention, "forward"))
            + self._elementwise(sub, 1.0)
        )

    def _backward_compute(self, sub: SublayerTerms) -> float:
        return (
            sum(self.gemm(g, "backward") for g in sub.gemms)
            + sum(self.gemm(g, "forward") for g in sub.recompute_gemms)
            + sum(self._attention(sub.attention, "backward"))
            + self._elementwise(sub, 2.0)
        )

    def _comm(self, c: Collective) -> float:
        entry = self.profile["collectives"][str(self.p)][c.kind]
        return entry["latency_s"] + c.nbytes * entry["per_byte_s"]

    def comms(self, comms: tuple[Collective, ...]) -> float:
        return 0.0 if self.p == 1 else sum(self._comm(c) for c in comms)

    def exposed(self, compute: float, comm: float, overlap: float | None = None) -> float:
        """What ``comm`` seconds of communication add to ``compute`` seconds it runs beside: the
        longer of the two, plus the part of the shorter the calibrated overlap (the ring's unless
        given) does not hide, less the compute."""
        overlap = self.profile["ring_overlap"] if overlap is None else overlap
        return max(compute, comm) + (1.0 - overlap) * min(compute, comm) - compute

    def _streamed(self, comms: tuple[Collective, ...], compute: float) -> float:
        """Asynchronous collectives issued during a pass of ``compute`` seconds."""
        if self.p == 1 or not comms:
            return 0.0
        return self.exposed(compute, sum(self._comm(c) for c in comms))

    def _rings(self, sub: SublayerTerms, *, backward: bool) -> tuple[float, float]:
        """Ring hops: the kernels of hop ``i`` run while the next block travels; backward also
        sends the dk/dv accumulator every hop. Returns the kernels' time and the sends' exposed time."""
        kernels = exposed = 0.0
        priced: dict[int, tuple[float, float]] = {}  # lean's head groups run one ring stage p times
        for ring in sub.rings:
            if id(ring) not in priced:
                priced[id(ring)] = self._ring(ring, backward=backward)
            ring_kernels, ring_exposed = priced[id(ring)]
            kernels += ring_kernels
            exposed += ring_exposed
        return kernels, exposed

    def _ring(self, ring: RingStage, *, backward: bool) -> tuple[float, float]:
        """One ring stage's kernels' time and its sends' exposed time."""
        times = self._attention([call for hop in ring.hops for call in hop], "backward" if backward else "forward")
        # in flight during a hop: the next block (but after the last forward hop), the accumulator
        in_flight = self.comms((ring.send, ring.bwd_send) if backward else (ring.send,))
        in_flight_last = self.comms((ring.bwd_send,) if backward else ())
        kernels = exposed = 0.0
        start = 0
        for i, hop in enumerate(ring.hops):
            compute = sum(times[start : start + len(hop)])
            start += len(hop)
            kernels += compute
            if self.p > 1:
                exposed += self.exposed(compute, in_flight if i < ring.fwd_sends else in_flight_last)
        return kernels, exposed
