"""The elastic mode of ``Buffer`` (``Buffer.create_elastic``): a
fixed-capacity buffer connected pairwise through a TCPStore, with no
process group. One file per job:

- ``wire``: the memory layout, the step flags and the published metadata (pure).
- ``links``: the transfer engine, the connections, and one step of bytes among the active peers.
- ``connection``: the collective path's connection interface over those links.
- ``buffer``: the API (``update_memory_buffers``, ``connect_ranks``, masks, dispatch, combine, ...).
"""
