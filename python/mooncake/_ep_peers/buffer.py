"""``Buffer.create_elastic``: the reference's fixed-capacity ("elastic
mode") Buffer, which joins no process group. A rank allocates its memory
for a capacity of ranks (``update_memory_buffers``), connects pairwise to
the ranks it names through a TCPStore (``connect_ranks``), and keeps its own
mask of the ranks it exchanges with (``update_mask_buffer`` and friends).
dispatch and combine are the collective path's (same layouts, row order and
bits as every other path) run over the links of ``links.py``: the ranks
taking part are the active ones below the call's rank bound.

Beyond the reference, which needs a CUDA build and CUDA tensors: CPU tensors
work too (the memory is then host memory), which is how CI tests it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from mooncake._ep_collective import checks
from mooncake._ep_collective.events import EventOverlap
from mooncake._ep_collective.handle import DispatchHandle, DispatchState
from mooncake._ep_collective.path import CollectivePath
from mooncake.mooncake_ep_buffer import Buffer

from .connection import PeerConnection
from .links import PeerLinks
from .wire import minimum_bytes

# What the reference's elastic combine refuses, in its words' spirit.
_ZERO_COPY = "zero_copy: the elastic-mode Buffer has no combine buffer to write into; pass the expert outputs as x"


class ElasticHandle(tuple):
    """The elastic dispatch's 4-tuple ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden)``, with what combine needs in ``.state``."""

    state: DispatchState

    def __new__(cls, src_info, layout_range, tokens_per_rank, hidden, state: DispatchState):
        self = super().__new__(cls, (src_info, layout_range, tokens_per_rank, hidden))
        self.state = state
        return self


def _within(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Picks of experts past the call's rank bound (ranks that are all
    masked: the default bound follows the active ranks, as the reference's)
    become -1: they contribute nothing, as picks of any masked rank."""
    return topk_idx.masked_fill(topk_idx >= num_experts, -1)  # no host read: the values were checked already


def _rank_list(name: str, ranks, me: int, capacity: int) -> list[int]:
    try:
        out = [int(r) for r in ranks if int(r) != me]
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: must be a list of ints, got {ranks!r}") from err
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: must not contain duplicates, got {list(ranks)}")
    bad = [r for r in out if not 0 <= r < capacity]
    if bad:
        raise ValueError(f"{name}: ranks {bad} are outside the capacity [0, {capacity})")
    return out


class ElasticMode:
    """Made by ``Buffer.create_elastic`` (a ``Buffer`` subclass mixes this in)."""

    def _init_elastic(self, disable_ll_nvlink: bool, explicitly_destroy: bool, rank: int, tcp_store_group,
                      timeout_ms: int, metadata_timeout_ms: int) -> None:
        checks.int_arg("rank", rank, minimum=0)
        checks.int_arg("timeout_ms", timeout_ms, minimum=0)
        checks.int_arg("metadata_timeout_ms", metadata_timeout_ms, minimum=1)
        self._is_elastic = True
        self.rank = rank
        self.group_size = 0  # the capacity, once update_memory_buffers set it
        self.group = None
        self.backend = None
        self.num_ep_buffer_bytes = None
        self.num_rdma_bytes = None
        self.disable_ll_nvlink = bool(disable_ll_nvlink)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.tcp_store_group = tcp_store_group
        self.timeout_ms = timeout_ms  # 0: no timeout (dead peers are still found by probes)
        self.metadata_timeout_ms = metadata_timeout_ms
        self._num_experts_per_rank: int | None = None
        self._links: PeerLinks | None = None
        self._conn: PeerConnection | None = None
        self._active_ranks: torch.Tensor | None = None
        self._comm_stream = None
        self._destroyed = False

    # ------------------------------------------------------------ memory
    @property
    def runtime(self):
        """The links (memory, engine, connections) once update_memory_buffers ran, else None."""
        return self._links

    @property
    def path(self) -> str:
        return "elastic"

    def update_memory_buffers(self, num_ranks: int, num_experts_per_rank: int, num_rdma_bytes: int) -> None:
        """Allocates this rank's memory for a capacity of ``num_ranks`` ranks
        (once: the capacity is fixed), on the current CUDA device, or in host
        memory where there is no CUDA device."""
        if self._destroyed:
            raise RuntimeError("update_memory_buffers: this Buffer was destroyed; create a new one")
        if self._links is not None:
            raise RuntimeError("update_memory_buffers: the capacity is fixed once set; create a new Buffer")
        checks.int_arg("num_ranks", num_ranks, minimum=1)
        checks.int_arg("num_experts_per_rank", num_experts_per_rank, minimum=1)
        checks.int_arg("num_rdma_bytes", num_rdma_bytes, minimum=1)
        if not self.rank < num_ranks:
            raise ValueError(f"rank: must lie in [0, num_ranks={num_ranks}), got {self.rank}")
        if num_rdma_bytes < minimum_bytes(num_ranks):
            raise ValueError(f"num_rdma_bytes: {num_rdma_bytes} is too small for {num_ranks} ranks (at least "
                             f"{minimum_bytes(num_ranks)}; size it with Buffer.get_low_latency_buffer_size_hint)")
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        hint = "tcp" if self.disable_ll_nvlink and device.type == "cuda" else ""
        self._links = PeerLinks(self.rank, num_ranks, num_rdma_bytes, device, self.tcp_store_group, hint)
        self.group_size = num_ranks
        self.num_ep_buffer_bytes = self.num_rdma_bytes = num_rdma_bytes
        self._num_experts_per_rank = num_experts_per_rank
        self._active_ranks = torch.zeros(num_ranks, dtype=torch.int32, device=device)
        self._active_ranks[self.rank] = 1
        self._conn = PeerConnection(self, self._links, self.rank, num_ranks)
        if device.type == "cuda":
            self._comm_stream = torch.cuda.Stream(device)

    def set_tcp_store_group(self, tcp_store_group) -> None:
        self.tcp_store_group = tcp_store_group

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = True) -> torch.Tensor:
        """A view (no copy) of this rank's ``num_rdma_bytes``, from byte
        ``offset``, as ``dtype`` (``size``: its shape; default all of it)."""
        links = self._require("get_local_buffer_tensor")
        if not use_rdma_buffer:
            raise ValueError("use_rdma_buffer: only the RDMA buffer exists here (True)")
        checks.int_arg("offset", offset, minimum=0)
        element = torch.empty(0, dtype=dtype).element_size()
        if offset > links.region.total or offset % element:
            raise ValueError(f"offset: must be a multiple of {element} (the size of {dtype}) within "
                             f"num_rdma_bytes={links.region.total}, got {offset}")
        view = links.memory[offset:offset + (links.region.total - offset) // element * element].view(dtype)
        if size is None:
            return view
        shape = torch.Size(size)
        if shape.numel() > view.numel():
            raise ValueError(f"size: {list(shape)} ({shape.numel()} elements) exceeds the "
                             f"{view.numel()} elements of {dtype} from offset {offset}")
        return view[:shape.numel()].view(shape)

    def get_comm_stream(self) -> torch.Stream:
        self._require("get_comm_stream")
        if self._comm_stream is None:
            raise RuntimeError("get_comm_stream: a CUDA stream; this Buffer's memory is host memory (no CUDA device)")
        return self._comm_stream

    # ------------------------------------------------------- connections
    def connect_ranks(self, remote_ranks: list[int], activate: bool = True) -> None:
        """Connects to ``remote_ranks`` (each must call connect_ranks naming
        this rank) through the TCPStore; ``activate``: unmask them too."""
        links = self._require("connect_ranks")
        ranks = _rank_list("remote_ranks", remote_ranks, self.rank, self.group_size)
        if not ranks:
            return
        already = [r for r in ranks if links.connected(r)]
        if already:
            raise ValueError(f"remote_ranks: ranks {already} are connected already; disconnect_ranks first")
        if self.tcp_store_group is None:
            raise RuntimeError("connect_ranks: the peers' metadata travels through a TCPStore; pass "
                               "tcp_store_group to create_elastic or call set_tcp_store_group")
        links.connect(self.tcp_store_group, ranks, self.metadata_timeout_ms / 1000)
        if activate:
            for r in ranks:
                self._active_ranks[r] = 1

    def disconnect_ranks(self, remote_ranks: list[int]) -> None:
        """Forgets the connections with ``remote_ranks`` and masks them."""
        links = self._require("disconnect_ranks")
        ranks = _rank_list("remote_ranks", remote_ranks, self.rank, self.group_size)
        links.disconnect(ranks)
        for r in ranks:
            self._active_ranks[r] = 0

    # -------------------------------------------------------------- masks
    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """``mask=True`` masks ``rank_to_mask`` (no exchange with it); False unmasks a connected rank."""
        links = self._require("update_mask_buffer")
        checks.int_arg("rank_to_mask", rank_to_mask)
        if not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask: must lie in the capacity [0, {self.group_size}), got {rank_to_mask}")
        if rank_to_mask == self.rank:
            if mask:
                raise ValueError("rank_to_mask: the local rank cannot be masked")
            return
        if not mask and not links.connected(rank_to_mask):
            raise ValueError(f"rank_to_mask: rank {rank_to_mask} is not connected; connect_ranks first")
        if not mask and links.broken(rank_to_mask):
            raise ValueError(f"rank_to_mask: rank {rank_to_mask} was dropped after a failure; disconnect_ranks and "
                             "connect_ranks it on both sides first")
        self._active_ranks[rank_to_mask] = 0 if mask else 1

    def query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes 1 for each masked rank and 0 for each active one into ``mask_status``."""
        self._require("query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32 \
                or not mask_status.is_contiguous() or mask_status.numel() != self.group_size \
                or mask_status.device != self._active_ranks.device:
            raise ValueError(f"mask_status: must be a contiguous int32 tensor of {self.group_size} entries on "
                             f"{self._active_ranks.device}, got {checks.describe(mask_status)}")
        mask_status.view(-1).copy_(1 - self._active_ranks)

    def clean_mask_buffer(self) -> None:
        """Unmasks every connected rank, except those dropped after a failure
        (they need disconnect_ranks and connect_ranks first)."""
        links = self._require("clean_mask_buffer")
        for r in links.connected_ranks():
            if not links.broken(r):
                self._active_ranks[r] = 1

    def _active_bound(self) -> int:
        active = torch.nonzero(self._active_ranks).flatten().tolist()
        return max(active) + 1

    # ------------------------------------------------------------- calls
    def barrier(self) -> None:
        """Every active rank meets every other; one that does not come within
        the timeout is masked."""
        self._require("barrier")
        mask = self._active_ranks.cpu()
        conn = self._conn
        participants = conn.begin_call(mask, self.timeout_ms * 1000)
        conn.what = "barrier"
        empty = torch.empty(0, dtype=torch.uint8, device=self._active_ranks.device)
        self._links.step({r: empty for r in participants}, mask, conn.timeout_s, "barrier",
                         dict.fromkeys(participants, 0))
        self._active_ranks.copy_(mask)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                 num_experts: int | None = None, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                 round_scale: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """The reference's elastic dispatch. Returns ``(recv_x, recv_count,
        handle, event, hook)`` with the 4-item handle; ``num_experts``
        defaults to (highest active rank + 1) x experts per rank."""
        self._require("dispatch")
        if round_scale:
            raise NotImplementedError("round_scale: not implemented (as in the reference)")
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("dispatch_wait_recv_cost_stats: not collected (as in the reference)")
        per_rank = self._num_experts_per_rank
        active_bound = self._active_bound()
        if num_experts is None:
            num_experts = active_bound * per_rank
        checks.int_arg("num_experts", num_experts, minimum=1)
        if num_experts % per_rank:
            raise ValueError(f"num_experts: must be a multiple of the experts per rank ({per_rank}), "
                             f"got {num_experts}")
        rank_bound = num_experts // per_rank
        if not active_bound <= rank_bound <= self.group_size:
            raise ValueError(f"num_experts: {num_experts} covers {rank_bound} ranks; it must cover the active ranks "
                             f"({active_bound}) and stay within the capacity ({self.group_size})")
        checks.check_tokens(x)
        num_tokens, _ = x.shape
        checks.check_dispatch_shape(num_tokens, num_max_dispatch_tokens_per_rank, num_experts, rank_bound)
        if x.device != self._active_ranks.device:
            raise ValueError(f"x: must be on this Buffer's device ({self._active_ranks.device}), got {x.device}")
        checks.check_topk_idx(topk_idx, num_tokens, self.group_size * per_rank, x.device)
        topk_idx = _within(topk_idx, num_experts)
        checks.check_sync_mode(async_finish, return_recv_hook)
        stats = cumulative_local_expert_recv_stats
        if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                                  or stats.dim() != 1 or not stats.is_contiguous() or stats.numel() != per_rank
                                  or stats.device != x.device):
            raise ValueError(f"cumulative_local_expert_recv_stats: must be a contiguous int32 vector of {per_rank} "
                             f"entries (one per local expert) on {x.device}, got {checks.describe(stats)}")
        mask = self._active_ranks[:rank_bound].cpu()
        self._conn.what = "dispatch"
        recv_x, recv_count, handle, event, hook = CollectivePath(rank_bound).dispatch(
            self._conn, x, topk_idx, mask, num_max_dispatch_tokens_per_rank, num_experts, self.timeout_ms * 1000,
            bool(use_fp8), async_finish, return_recv_hook)
        self._active_ranks[:rank_bound].copy_(mask)
        if stats is not None:
            stats.add_(recv_count)
        src_info, layout_range, tokens_per_rank, hidden, _ = handle
        return recv_x, recv_count, ElasticHandle(src_info, layout_range, tokens_per_rank, hidden, handle.state), \
            event, hook

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                return_recv_hook: bool = False, out: torch.Tensor | None = None,
                combine_wait_recv_cost_stats: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """The reference's elastic combine: ``(combined_x, event, hook)``."""
        self._require("combine")
        if zero_copy:
            raise NotImplementedError(_ZERO_COPY)
        if use_logfmt:
            raise NotImplementedError("use_logfmt: the LogFMT combine format is not implemented (as in the reference)")
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("combine_wait_recv_cost_stats: not collected (as in the reference)")
        if not isinstance(handle, ElasticHandle):
            raise TypeError("handle: must be the 4-item handle of this Buffer's dispatch, "
                            f"got {type(handle).__name__}")
        state = handle.state
        if state.connection is not self._conn:
            raise ValueError("handle: belongs to a dispatch of another Buffer")
        src_info, layout_range, tokens_per_rank, hidden = handle
        rank_bound = layout_range.size(1)
        per_rank = self._num_experts_per_rank
        if isinstance(topk_idx, torch.Tensor):
            topk_idx = _within(topk_idx, rank_bound * per_rank)
        checks.check_combine_inputs(x, topk_idx, topk_weights, out, (per_rank, rank_bound * tokens_per_rank, hidden),
                                    state)
        checks.check_sync_mode(async_finish, return_recv_hook)
        full = DispatchHandle(src_info, layout_range, tokens_per_rank, hidden, rank_bound * per_rank, state)
        mask = self._active_ranks[:rank_bound].cpu()
        self._conn.what = "combine"
        result = CollectivePath(rank_bound).combine(self._conn, state, full, x, topk_idx, topk_weights, mask,
                                                    self.timeout_ms * 1000, async_finish, return_recv_hook, out)
        self._active_ranks[:rank_bound].copy_(mask)
        return result

    # ------------------------------------------------------------ the end
    def destroy(self) -> None:
        """Releases the memory and the engine (needs ``explicitly_destroy=True``, as in the reference)."""
        self._require("destroy")
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: this Buffer was created with explicitly_destroy=False; it is released "
                               "when it is garbage collected")
        self._links.close()
        self._links = None
        self._conn = None
        self._destroyed = True

    def __del__(self):
        links = getattr(self, "_links", None)
        if links is not None:
            links.close()

    def update_ep_member(self) -> None:
        raise RuntimeError("update_ep_member: an elastic-mode Buffer joins no process group; replace a rank with "
                           "disconnect_ranks and connect_ranks")

    def connect(self, is_update: bool = False) -> None:
        raise RuntimeError("connect: an elastic-mode Buffer joins no process group; use connect_ranks")

    def get_next_combine_buffer(self, handle) -> torch.Tensor:
        raise NotImplementedError(_ZERO_COPY)

    def _require(self, call: str) -> PeerLinks:
        if self._destroyed:
            raise RuntimeError(f"{call}: this Buffer was destroyed (destroy()); create a new one")
        if self._links is None:
            raise RuntimeError(f"{call}: call update_memory_buffers() first")
        return self._links


class ElasticModeBuffer(ElasticMode, Buffer):
    """What ``Buffer.create_elastic`` returns: a ``Buffer`` whose calls are the elastic mode's."""


@functools.cache
def _mixed(cls) -> type:
    """The elastic class for ``cls`` (a subclass of Buffer gets its own, as the reference's classmethod would)."""
    if cls is Buffer:
        return ElasticModeBuffer
    return type("ElasticMode" + cls.__name__, (ElasticMode, cls), {"__module__": cls.__module__})


def create(cls, **kwargs) -> ElasticModeBuffer:
    """An elastic-mode instance of ``cls`` (``Buffer``): its own methods
    where the modes differ, the Buffer's (size hints, ``capture``) elsewhere."""
    instance = object.__new__(_mixed(cls))
    instance._init_elastic(**kwargs)
    return instance
