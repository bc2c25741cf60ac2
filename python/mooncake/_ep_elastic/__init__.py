"""``ElasticBuffer`` (the DeepEP-V2-style EP buffer): one file per job.

- ``sizes``: the reference's buffer size rule (``get_buffer_size_hint``,
  ``mooncake.ep.calculate_elastic_buffer_size``) and its API-compatible hints.
- ``topology``: the physical (hosts x ranks per host) and logical
  (scale-out x scale-up) domains.
- ``transport``: the transport request (argument, ``MOONCAKE_EP_TRANSPORT``)
  and the group's agreement on one.
- ``checks``: argument checks that name the argument and the rule.
- ``layout``: where each token lands (deduplicated per destination rank), the
  expanded per-expert layout, the metadata of the handle (pure tensor logic).
- ``handle``: ``EPHandle`` and the routing it carries for cached dispatch and combine.
- ``collective``: dispatch and combine from the process group's own operations
  (CPU and CUDA tensors, any shape).

See docs/ep.md ("ElasticBuffer") for the contract.
"""
