"""The collective path of the expert-parallel ``Buffer``: dispatch and combine
built only from the process group's own operations (all_to_all_single and
point-to-point on the group) plus tensor operations, so one code runs on CPU
tensors (``mooncake-cpu`` group) and CUDA tensors (``mooncake`` group).

One file per job:

- ``sizes``: the buffer size rule shared with the reference (``get_ep_buffer_size_hint``).
- ``fp8``: per-token, per-128-channel e4m3 quantisation (the wire format of FP8 dispatch).
- ``checks``: argument checks that name the argument and the rule.
- ``presence``: the per-call agreement on which ranks take part, bounded by ``timeout_us``.
- ``exchange``: moving rows among the ranks that take part.
- ``routing``: where each (token, expert) pick goes and where it lands.
- ``handle``: the dispatch handle (the reference's 5-tuple plus what combine needs).
- ``path``: dispatch and combine themselves (``CollectivePath``, the same interface as the fast path's).
- ``events``: ``EventOverlap`` / ``EventHandle`` for the stream-ordering API.
- ``group``: what the buffers need to know of their process group (control device, active ranks).

See docs/ep.md for the design.
"""
