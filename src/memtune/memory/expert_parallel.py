"""What expert parallelism (trainer.expert_parallel=N, rank.expert_parallel) costs a rank, in
memory and in bytes sent: pure functions of the architecture, the decisions and the counts.

Memory. A rank of an expert-parallel group of N holds E/N of each routed-expert stack (bf16,
or its quantized bytes) and of their adapters. DeepSpeed's ZeRO-1/2 puts the expert
parameters in optimizer groups of their own (``moe``) whose gradients are reduced and whose
optimizer state is partitioned over the expert-data-parallel group (the ranks / N ranks
holding the same experts), so a rank keeps (1/N) / (ranks/N) = 1/ranks of the experts'
adapter gradients and optimizer state: what ZeRO-2 gives every adapter at N=1. Only the bf16
adapter weights and the stacks shrink by N. Under ZeRO-3 the experts' weights (stacks and
adapters) are partitioned over that group as well (:func:`expert_partitions`): a rank keeps
1/ranks of them between uses, as of every other weight, and gathers its group's E/N a layer
(nothing, where the group is one rank) while the rest of the layer is gathered from all.

The exchange (rank.expert_parallel's dispatch): per mixture layer a token goes once to each
rank of its group holding any of its top-k experts (its own rank too, where no byte crosses a
link), with the routing weight of each row routed there; the owner sends one summed vector per
token back. Under **uniform routing** (each token's k experts a uniformly drawn k-subset of the
E, the balance the router's auxiliary loss aims at) a given rank, holding m = E/N experts, is
missed by a token with probability C(E − m, k) / C(E, k), exactly; so a token reaches
N · (1 − C(E − m, k) / C(E, k)) ranks on average, and (N − 1) of those probabilities' complement
are other ranks: the hidden vectors a rank sends per token, in the dispatch and (by symmetry,
what the others send it) in the combine. The weights: k · (N − 1) / N rows a token, one value
each. The backward sends the same again (the reverse exchanges: gradients of what was
received); a recomputed layer runs the forward's exchanges once more. Each forward and
recompute also sends the rows' (pair, local expert) indices, two int64 a row, that the
counter does not see (they need no gradient).

``tests/test_expert_parallel.py`` checks :func:`exchange_bytes` against the bytes the CPU
ranks' exchanges send (``rank.expert_parallel.counting``): on routing drawn uniformly, the
plan's expectation within 5% of what was sent; and on the run's own routing, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from memtune.config import RunConfig, compute_bytes
from memtune.config.architecture import moe_layers
from memtune.config.decisions import Decisions

META_BYTES = 16
"""A dispatched row's (pair, local expert): two int64 (rank.expert_parallel)."""


def expert_parallel(d: Decisions) -> int:
    """The decided expert-parallel size (1: no expert parallelism, or a dense model)."""
    return d.experts.parallel if d.experts is not None else 1


def expert_partitions(d: Decisions) -> int:
    """The ranks a rank's routed experts are partitioned over between uses: under ZeRO-3 the
    expert-data-parallel group (ranks / N, the ranks holding the same experts; all the ranks at
    N=1), else 1 (held whole)."""
    return d.batch.ranks // expert_parallel(d) if d.zero_stage == 3 else 1


def layer_experts(cfg: RunConfig, experts: int) -> float:
    """One mixture layer's share of ``experts`` (a count over every routed-expert stack)."""
    return experts / (sum(moe_layers(dict(cfg.model.architecture))) or 1)


def missed_share(experts: int, top_k: int, size: int) -> float:
    """The probability that a token's top-k experts, drawn uniformly, miss the E/size experts
    of one rank: C(E − E/size, k) / C(E, k)."""
    return comb(experts - experts // size, top_k) / comb(experts, top_k)


def destination_ranks(experts: int, top_k: int, size: int) -> float:
    """Expected distinct ranks of an expert-parallel group of ``size`` a token is sent to under
    uniform routing (its own included)."""
    return size * (1 - missed_share(experts, top_k, size))


@dataclass(frozen=True)
class Exchange:
    """Bytes one rank sends to the other ranks of its group for one mixture layer and one
    micro batch, in one pass (forward, recompute or backward): by what moves."""

    tokens: float  # hidden vectors: the dispatch and the combine
    weights: float  # the rows' routing weights
    meta: float  # the rows' indices (forward and recompute only)


def per_token(experts: int, top_k: int, size: int) -> tuple[float, float]:
    """(other ranks a token is sent to, routing-weight rows a token sends to other ranks), on
    average under uniform routing, at expert-parallel size ``size``."""
    others = (size - 1) * (1 - missed_share(experts, top_k, size))
    return others, top_k * (size - 1) / size


def exchange_bytes(
    hidden: int,
    value_bytes: int,
    experts: int,
    top_k: int,
    tokens: float,
    size: int,
    others: float | None = None,
    rows: float | None = None,
) -> Exchange:
    """One pass of one mixture layer over ``tokens`` tokens of this rank (module docstring),
    hidden ``hidden`` wide in values of ``value_bytes``. ``others`` and ``rows``: the (token,
    other rank) pairs and the rows sent to other ranks, when known (a real routing's); else
    :func:`per_token`'s uniform expectation × ``tokens``. The combine sends back as many
    vectors as the others' dispatches brought: as many as this rank's dispatch sends, on
    average."""
    share, weight_rows = per_token(experts, top_k, size)
    pairs = tokens * share if others is None else others
    routed = tokens * weight_rows if rows is None else rows
    return Exchange(2 * pairs * hidden * value_bytes, routed * value_bytes, routed * META_BYTES)


def micro_step_exchanges(cfg: RunConfig, d: Decisions) -> tuple[int, int]:
    """(mixture layers, of them recomputed): each runs a forward's exchanges and a
    backward's, and a recomputed one a forward's again."""
    routed = moe_layers(dict(cfg.model.architecture))
    recomputed = [
        r and layer != "keep" for r, layer in zip(routed, d.checkpointing.layers, strict=False)
    ]
    return sum(routed), sum(recomputed)


def step_exchange_bytes(cfg: RunConfig, d: Decisions) -> tuple[float, float]:
    """(hidden vectors and routing weights, indices): the bytes a rank's exchanges send per
    optimizer step, no overlap assumed; (0, 0) without expert parallelism."""
    size = expert_parallel(d)
    if size <= 1:
        return 0.0, 0.0
    layers, recomputed = micro_step_exchanges(cfg, d)
    a = cfg.model.architecture
    experts, top = int(a["num_experts"]), int(a["num_experts_per_tok"])
    h, b = int(a["hidden_size"]), compute_bytes(cfg)
    one = exchange_bytes(h, b, experts, top, d.batch.rank_tokens, size)
    gas = d.batch.accumulation
    passes = 2 * layers + recomputed
    return gas * passes * (one.tokens + one.weights), gas * (layers + recomputed) * one.meta


def buffer_bytes(cfg: RunConfig, d: Decisions) -> float:
    """The exchange's buffers for one mixture layer at a time (0 without expert parallelism):
    the tokens dispatched (their copy gathered for sending, and the rows received) and combined
    (the summed vectors, and those received back), each the micro batch's tokens × the ranks
    they go to, hidden wide; and the routing weights sent and received."""
    size = expert_parallel(d)
    if size <= 1:
        return 0.0
    a = cfg.model.architecture
    h, b = int(a["hidden_size"]), compute_bytes(cfg)
    experts, top = int(a["num_experts"]), int(a["num_experts_per_tok"])
    n = d.batch.rank_tokens
    return 4 * n * destination_ranks(experts, top, size) * h * b + 2 * n * top * b


def assumption(cfg: RunConfig, d: Decisions) -> str:
    """The plan line's word on the routing the exchange is priced at."""
    a = cfg.model.architecture
    experts, top = int(a["num_experts"]), int(a["num_experts_per_tok"])
    size = expert_parallel(d)
    reach = destination_ranks(experts, top, size)
    return (
        f"uniform routing assumed: a token's {top} of {experts} experts reach "
        f"{reach:.2f} of {size} ranks on average (exact, C(E−E/N, k)/C(E, k))"
    )
