"""``mooncake.moe_ep``: the MoE expert-parallel layer of the FlashInfer design,
dispatch -> grouped-GEMM experts -> combine over a pluggable transport, in
three layouts (docs/moe-ep.md):

| algorithm, layout | transport | receive buffer | combine |
|---|---|---|---|
| LOW_LATENCY, EXPERT_MAJOR | ``Buffer`` | ``[L, R * T, H]``, rows per local expert | re-weights per token |
| LOW_LATENCY, RANK_MAJOR | ``ElasticBuffer`` | ``[R, T, H]``, a row at its source token | unweighted sum |
| HIGH_THROUGHPUT, FLAT | ``ElasticBuffer`` | ``[num_recv, H]``, as received | unweighted sum |

    layer = MoEEp(EpBootstrap(group), FleetConfig(num_experts=16, max_tokens_per_rank=128, hidden=8192,
                  intermediate=2048, layout=Layout.RANK_MAJOR), ExpertWeights(w13, w2))
    out = layer.forward(hidden_states, topk_ids, topk_weights)   # [N, hidden] bf16
"""

from .config import Algorithm, EpBootstrap, ExpertWeights, FleetConfig, Layout
from .layer import MoEEp, available_backends

__all__ = ["Algorithm", "EpBootstrap", "ExpertWeights", "FleetConfig", "Layout", "MoEEp", "available_backends"]
