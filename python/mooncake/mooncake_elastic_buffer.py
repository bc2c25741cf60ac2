"""Expert-parallel dispatch/combine in DeepEP V2's ``ElasticBuffer`` form:
tokens deduplicated per destination rank, an ``EPHandle``, cached and
expanded modes, FP8 as a pre-quantised ``(x, scales)`` tuple.

    from mooncake.mooncake_elastic_buffer import ElasticBuffer
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=k)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    ...  # the experts run on recv_x; recv_topk_idx holds this rank's local expert ids (-1: not here)
    combined_x, _, event = buffer.combine(expert_out, handle)

Unlike the reference's compiled kernels (a handful of shapes), every shape
works: any hidden size, top-k, expert count, world size and token count, on
CPU tensors over ``mooncake-cpu``, CUDA tensors over ``mooncake``, or any
group with all_gather and all_to_all (``nccl``, ``gloo``).

Transports (``transport=``, ``buffer.transport``): the group agrees on one
(``_ep_elastic.transport``). ``"ibgda"`` runs on one of two paths
(``buffer.path``, the same on every rank): ``"ipc"`` when every rank runs on
one host with CUDA tensors and the constructor sized the buffer (the rows
go through the CUDA IPC kernels, the layout is computed on the GPU, and a
dispatch with ``do_cpu_sync=False`` never synchronises, so it can be
captured in a CUDA graph); else ``"collective"``: the group's own operations.
``"nccl"`` runs the same kernels over an NCCL symmetric window
(``_ep_elastic.nccl_path``; ``buffer.path == "nccl"``): a build with
``-DMOONCAKE_WITH_NCCL_DEVICE=ON``, a preloaded NCCL >= 2.30.4, every rank
in one NCCL LSA team, and a sized buffer (``ep.has_nccl_device_support()``,
docs/ep-elastic.md).

Membership is fixed, as in the reference. A rank that fails during dispatch
or combine makes the call fail on every survivor (within
``num_gpu_timeout_secs`` at worst) instead of hanging, and the buffer then
refuses calls until the process group has recovered every seat and the
survivors called ``update_ep_member()`` while each replacement constructs a
new ElasticBuffer with the same arguments (one coordinated operation).
Handles from before are refused. Contract and differences: docs/ep.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist

import mooncake.ep as _ep
from mooncake._ep_collective.checks import int_arg
from mooncake._ep_collective.events import EventHandle, EventOverlap, call_event
from mooncake._ep_collective.exchange import wait
from mooncake._ep_collective.group import control_device, group_mask_reader, takes_cuda_tensors, work_failure_reader
from mooncake._ep_elastic import checks, nccl_support, sizes
from mooncake._ep_elastic import transport as transports
from mooncake._ep_elastic.collective import CollectivePath
from mooncake._ep_elastic.handle import EPHandle
from mooncake._ep_elastic.ipc_rows import (CARRY_BYTES_ENV, IpcRouting, IpcRowsPath, KernelRows, RowFormat,
                                           carries_counts, carry_bytes_setting, row_width)
from mooncake._ep_elastic.nccl_bootstrap import share_unique_id
from mooncake._ep_elastic.nccl_path import NcclRowsGroup
from mooncake._ep_elastic.output_slots import OUTPUT_SLOTS_ENV, output_slots_asked_for, output_slots_setting
from mooncake._ep_elastic.topology import local_ranks_setting, ranks_per_host, topology
from mooncake._ep_ipc_path import IpcPath, choose_path, local_statement
from mooncake._ep_ipc_path.choice import host_id
from mooncake._ep_ipc_path.path import FastPathUnavailable, close_at_exit

__all__ = ["ElasticBuffer", "EPHandle", "EventOverlap"]

_log = logging.getLogger("mooncake.ep")
_STORE_PREFIX = "mooncake_ep_elastic"


class _Generation:
    """One connection of the buffer (constructor or update_ep_member()): what a handle belongs to."""

    def __init__(self, uid: int):
        self.uid = uid


def _host_number() -> int:
    return int.from_bytes(hashlib.sha256(host_id().encode()).digest()[:7], "little")


class ElasticBuffer:
    def __init__(self, group: dist.ProcessGroup | None, num_bytes: int | None = None, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 transport: str = "auto"):
        if group is None:  # the default group, as torch.distributed's calls take it
            group = dist.distributed_c10d._get_default_group()
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        if not allow_multiple_reduction:
            raise NotImplementedError("allow_multiple_reduction: only True is supported (the reference's rule too)")
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps)):
            int_arg(name, value, minimum=0)
        for name, value in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                            ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            int_arg(name, value, minimum=1)
        if num_bytes is not None:
            int_arg("num_bytes", num_bytes, minimum=0)
        self._transport_request = transports.requested(transport)
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.deterministic = bool(deterministic)  # the collective path is deterministic either way
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = True
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.sl_idx = int(os.environ.get("EP_OVERRIDE_RDMA_SL", sl_idx))
        self.num_allocated_qps = num_allocated_qps
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = bool(explicitly_destroy)
        # Given by the caller: calls that need more are refused, as the reference's fixed buffer would be.
        self._num_bytes_given = num_bytes is not None
        self.num_bytes = num_bytes if num_bytes is not None else self.get_buffer_size_hint(
            group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode)
        self._read_alive = group_mask_reader(group, self.num_ranks)
        self.runtime: CollectivePath | IpcRowsPath | None = None
        self._collective: CollectivePath | None = None  # any call the IPC path does not take
        self._ipc: IpcPath | None = None
        self._nccl: NcclRowsGroup | None = None
        self._path_reason = "not connected"
        self._broken: str | None = None
        self._connect()

    # ------------------------------------------------------------------ setup
    def _connect(self) -> None:
        """Collective: agrees on the transport, the topology and a fresh generation."""
        request = self._transport_request
        missing = self._inactive_ranks()
        if missing:
            raise RuntimeError(f"ElasticBuffer: ranks {missing} are not active in the process group; every rank of "
                               "the group takes part in an ElasticBuffer")
        sized = bool(self.num_max_tokens_per_rank and self.hidden and self.num_topk)
        cuda_group = takes_cuda_tensors(self.group) and torch.cuda.is_available()
        nccl_problem = transports.ready_for_nccl(nccl_support.problem(), sized, cuda_group)
        mine = torch.tensor([transports.code_of(request), int(not nccl_problem), _host_number(),
                             secrets.randbits(62), local_ranks_setting(), carry_bytes_setting()], dtype=torch.int64,
                            device=control_device(self.group))
        table = torch.zeros(self.num_ranks * mine.numel(), dtype=torch.int64, device=mine.device)
        work = dist.all_gather_into_tensor(table, mine, group=self.group, async_op=True)
        wait(work, timedelta(seconds=self.num_cpu_timeout_secs) if mine.device.type == "cpu" else None)
        failed = work_failure_reader(self.group)(work)
        if failed:
            raise RuntimeError(f"ElasticBuffer: ranks {failed} failed while the buffer was set up; once the process "
                               "group has recovered every seat, construct it again")
        rows = table.view(self.num_ranks, mine.numel()).tolist()
        if any(not 0 <= r[0] < len(transports.TRANSPORTS) for r in rows):
            raise RuntimeError(f"ElasticBuffer: a rank sent no transport request ({[r[0] for r in rows]})")
        settings = [r[4] for r in rows]
        if len(set(settings)) > 1:
            raise ValueError(f"MOONCAKE_EP_NUM_LOCAL_RANKS / LOCAL_WORLD_SIZE: every rank must see the same ranks per "
                             f"host (0: unset); rank by rank: {settings}")
        # Every rank must make the same kernel calls per dispatch (ipc_rows.carries_counts).
        carry_limits = [r[5] for r in rows]
        if len(set(carry_limits)) > 1:
            raise ValueError(f"{CARRY_BYTES_ENV}: every rank must see the same value; rank by rank: {carry_limits}")
        self._carry_bytes = carry_limits[0]
        chosen = transports.agree([transports.TRANSPORTS[r[0]] for r in rows], [bool(r[1]) for r in rows],
                                  nccl_problem)
        local = settings[0] or ranks_per_host([r[2] for r in rows])
        topo = topology(self.num_ranks, local, self.allow_hybrid_mode)
        self._topology = topo
        self.num_rdma_ranks, self.num_nvlink_ranks = topo.num_rdma_ranks, topo.num_nvlink_ranks
        self.num_scaleout_ranks, self.num_scaleup_ranks = topo.num_scaleout_ranks, topo.num_scaleup_ranks
        self.scaleout_rank_idx = topo.scaleout_index(self.rank_idx)
        self.scaleup_rank_idx = topo.scaleup_index(self.rank_idx)
        self._generation = _Generation(max(r[3] for r in rows))
        self._close_rows()  # collective: the peers close theirs in their _connect()
        self._collective = CollectivePath(self.group, self.rank_idx, topo, self._generation,
                                          timedelta(seconds=self.num_gpu_timeout_secs))
        nccl_rows = self._nccl_rows_path(topo, explicit=request == "nccl") if chosen == "nccl" else None
        self.transport = "nccl" if nccl_rows is not None else "ibgda"  # auto falls back when NCCL cannot be set up
        fallback = self._path_reason if chosen == "nccl" and nccl_rows is None else ""
        self.runtime = nccl_rows or self._ipc_rows_path(topo) or self._collective
        if fallback:  # why not NCCL, then why this path
            self._path_reason = f"{fallback}; then {self._path_reason}"
        self._broken = None
        if self.rank_idx == 0:
            _log.info("ElasticBuffer over %d rank(s): transport %s, %s path (%s), domains %dx%d", self.num_ranks,
                      self.transport, self.path, self._path_reason, self.num_scaleout_ranks, self.num_scaleup_ranks)

    def _ipc_rows_path(self, topo) -> IpcRowsPath | None:
        """The IPC path when every rank can take it (decided alike on every
        rank, through the job's store); None, with the reason kept, when not."""
        if not (self.num_max_tokens_per_rank and self.hidden and self.num_topk):
            self._path_reason = ("the constructor gave no num_max_tokens_per_rank, hidden and num_topk, which size "
                                 "the IPC path's buffers")
            return None
        if topo.num_scaleout_ranks > 1:
            self._path_reason = f"{topo.num_scaleout_ranks} scale-out domains (CUDA IPC reaches one host)"
            return None
        uid = self._generation.uid
        store = dist.PrefixStore(f"{_STORE_PREFIX}/{uid:x}", dist.distributed_c10d._get_default_store())
        choice = choose_path(store, self.rank_idx, self.num_ranks, cuda_group=takes_cuda_tensors(self.group),
                             alive=self._read_alive(), mine=local_statement(self.num_ranks, disable_p2p=False))
        if not choice.fast:
            self._path_reason = choice.reason
            return None
        ipc = IpcPath(store, self.rank_idx, self.num_ranks, uid, self._read_alive)
        close_at_exit(ipc)
        try:
            width = row_width(self.hidden, self.num_topk)
            # A buffer that carries its counts sends no heads into output slots: it needs none.
            rows_bytes = self.num_max_tokens_per_rank * 2 * width  # one rank's rows at most
            carry = carries_counts(rows_bytes, self._carry_bytes, self.num_ranks)
            slots = 0 if carry else output_slots_setting(self.num_ranks * rows_bytes)
            if carry and output_slots_asked_for() and self.rank_idx == 0:
                _log.info("ElasticBuffer: %s is not used: this buffer's dispatches carry their counts (%s), "
                          "whose payloads come through the receive region", OUTPUT_SLOTS_ENV, CARRY_BYTES_ENV)
            rows = KernelRows(ipc, torch.device("cuda", torch.cuda.current_device()), self.num_max_tokens_per_rank,
                              width, self.num_ranks, self.num_gpu_timeout_secs * 1_000_000, output_slots=slots)
        except FastPathUnavailable as err:  # raised on every rank alike
            ipc.close()
            self._path_reason = f"the IPC kernels could not be set up ({err})"
            return None
        self._ipc = ipc
        self._path_reason = choice.reason
        return IpcRowsPath(self.rank_idx, topo, self._generation, rows, self.num_max_tokens_per_rank,
                           carry_counts=carry)

    def _nccl_rows_path(self, topo, explicit: bool) -> IpcRowsPath | None:
        """The NCCL transport (collective): the unique id from rank 0, one
        communicator and window, the kernels over them. None (with the
        reason kept) when the window cannot be opened under "auto", which
        then takes "ibgda"; the same on every rank, as the opening agrees
        inside NCCL. Raises under an explicit "nccl"."""
        nccl = nccl_support.native()
        device = control_device(self.group)
        uid = share_unique_id(self.group, self.rank_idx, nccl, device,
                              timedelta(seconds=self.num_cpu_timeout_secs) if device.type == "cpu" else None,
                              work_failure_reader(self.group))
        native = NcclRowsGroup(nccl, uid, self.rank_idx, self.num_ranks, timedelta(seconds=self.num_cpu_timeout_secs))
        close_at_exit(native)
        try:
            rows = KernelRows(native, torch.device("cuda", torch.cuda.current_device()), self.num_max_tokens_per_rank,
                              row_width(self.hidden, self.num_topk), self.num_ranks,
                              self.num_gpu_timeout_secs * 1_000_000)
        except RuntimeError as err:
            native.close(abandon=True)
            if explicit:
                raise RuntimeError(f"ElasticBuffer: transport='nccl' could not be set up: {err}") from err
            self._path_reason = f"transport 'auto' took 'ibgda': the NCCL transport could not be set up ({err})"
            _log.info("ElasticBuffer: %s", self._path_reason)
            return None
        self._nccl = native
        self._path_reason = ("the NCCL transport: the EP kernels over an NCCL symmetric window, every rank in one "
                             f"LSA team ({topo.num_ranks} ranks)")
        path = IpcRowsPath(self.rank_idx, topo, self._generation, rows, self.num_max_tokens_per_rank)
        path.name = "nccl"
        return path

    def _close_rows(self) -> None:
        """Closes the kernels' group (collective): after a failure, the NCCL
        one is abandoned (aborted) rather than closed with the peers."""
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
        if self._nccl is not None:
            self._nccl.close(abandon=self._broken is not None)
            self._nccl = None

    @property
    def path(self) -> str:
        """``"ipc"``: the rows go through the CUDA IPC kernels of one host and
        the layout is computed on the GPU; ``"nccl"``: the same kernels over
        an NCCL symmetric window; ``"collective"``: the process group's own
        operations (any device, any shape)."""
        return self.runtime.name if isinstance(self.runtime, IpcRowsPath) else "collective"

    @property
    def path_reason(self) -> str:
        return self._path_reason

    def update_ep_member(self) -> None:
        """Call on every survivor once the process group has recovered every
        seat, while each replacement constructs a new ElasticBuffer with the
        same arguments; also works with no replacement (a healthy re-connect).
        Handles of earlier dispatches are refused afterwards."""
        self._check_alive("update_ep_member")
        missing = self._inactive_ranks()
        if missing:
            raise RuntimeError(f"update_ep_member: ranks {missing} are not active in the process group; wait until "
                               "the group has recovered every seat (pg.get_peer_state, pg.recover_ranks), then call "
                               "it on every survivor while the replacements construct their ElasticBuffer")
        try:
            self._connect()
        except (ValueError, TypeError):
            raise
        except Exception as err:
            self._broken = f"update_ep_member failed: {err}"
            raise RuntimeError(f"update_ep_member: the buffer's collectives failed ({err}); the process group "
                               "must be restarted") from err

    def destroy(self) -> None:
        """Releases the buffer; collective on the IPC and NCCL paths (the peers map its kernels' buffers).
        Calls still on the device end first, as on every rank (closing would release their waits
        early), unless an earlier call failed."""
        if isinstance(self.runtime, IpcRowsPath) and self._broken is None:
            torch.cuda.synchronize(self.runtime.transport.device)
        self._close_rows()
        self.runtime = self._collective = None

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False) -> None:
        del use_comm_stream  # one stream here
        self._check_alive("barrier")
        cuda = with_cpu_sync and torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.group)
        if cuda:
            torch.cuda.synchronize()

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current CUDA stream (a no-op object without CUDA)."""
        if torch.cuda.is_available():
            return EventHandle(torch.device("cuda", torch.cuda.current_device()))
        return EventHandle(None)

    # ------------------------------------------------------------- sizes
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        return sizes.elastic_buffer_size(group.size(), num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                         allow_hybrid_mode, allow_multiple_reduction)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> int:
        return sizes.engram_storage_size(num_entries, hidden, num_max_tokens_per_rank, dtype.itemsize)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        return sizes.pp_buffer_size(num_max_tensor_bytes, num_max_inflight_tensors)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        del group
        return num_max_session_bytes

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int) -> int:
        """The reference's rule from the device's SM count (132 assumed without CUDA)."""
        sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
            if torch.cuda.is_available() else 132
        if self.prefer_overlap_with_compute:
            return max(1, min(24, sm_count // 4))
        return max(1, min(40, sm_count // 2, num_experts * max(1, num_topk)))

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    # ------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None,
                 expert_alignment: int | None = None, handle: EPHandle | None = None, do_expand: bool = False,
                 do_cpu_sync: bool | None = None, num_sms: int | None = None, async_with_compute_stream: bool = False
                 ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor | None, EPHandle,
                            EventOverlap]:
        """Sends every token once to each rank owning one of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``;
        ``recv_x`` is a ``(data, scales)`` tuple for FP8 input. See docs/ep.md.
        """
        if handle is not None:
            data, sf = checks.split_x(x)
            num_tokens, hidden = data.shape
            checks.check_hidden(hidden)
            checks.check_num_sms(num_sms)
            routing = self._routing_of(handle)
            checks.check_cached_call(topk_idx, topk_weights, do_expand, handle.do_expand)
            if (num_tokens, hidden) != (routing.num_tokens, routing.hidden):
                raise ValueError(f"x: a cached dispatch needs x shaped like the handle's dispatch "
                                 f"[{routing.num_tokens}, {routing.hidden}], got {list(data.shape)}")
            if data.device != handle.topk_idx.device:
                raise ValueError(f"x: must be on the device of the handle's dispatch ({handle.topk_idx.device}), "
                                 f"got {data.device}")
            self._check_usable("dispatch")
            runtime = self._runtime_of(routing)
            out = self._guarded("dispatch", lambda: runtime.dispatch_cached(data, sf, handle))
        else:
            self._check_usable("dispatch")
            runtime = self.runtime
            try:
                data, sf = checks.split_x(x)
                num_tokens, hidden = data.shape
                checks.check_hidden(hidden)
                checks.check_num_sms(num_sms)
                if topk_idx is None:
                    raise ValueError("topk_idx: required without a handle")
                checks.check_topk_idx(topk_idx, num_tokens, data.device)
                checks.check_topk_weights(topk_weights, topk_idx)
                if num_experts is None:  # the reference's rule (a CPU synchronisation)
                    num_experts = int(topk_idx.max()) + 1 if topk_idx.numel() else self.num_ranks
                checks.check_num_experts(num_experts, self.num_ranks)
                if num_max_tokens_per_rank is None:
                    num_max_tokens_per_rank = self.num_max_tokens_per_rank or num_tokens
                checks.check_tokens_per_rank(num_max_tokens_per_rank, num_tokens)
                alignment = checks.check_alignment(1 if expert_alignment is None else expert_alignment)
                self._check_fits(num_max_tokens_per_rank, hidden, topk_idx.size(1), sf is not None)
                # Decided from the call's shape, which every rank shares (the collective path checks that).
                if isinstance(runtime, IpcRowsPath) and not runtime.takes(
                        num_max_tokens_per_rank, RowFormat.of(data, sf, topk_idx.size(1))):
                    runtime = self._collective
                if runtime is self._collective:  # the IPC path reads no values (no synchronisation)
                    checks.check_topk_values(topk_idx, num_experts)
            except (ValueError, TypeError):
                # The others are in the count exchange already: meet them, saying so, then raise here.
                device = x[0].device if isinstance(x, tuple) and isinstance(x[0], torch.Tensor) else \
                    x.device if isinstance(x, torch.Tensor) else control_device(self.group)
                try:
                    self._guarded("dispatch", lambda: runtime.join_refused(device))
                except ValueError:
                    pass  # the others' refusal message; this rank raises its own
                raise
            if num_sms is None:
                num_sms = self.get_theoretical_num_sms(num_experts, topk_idx.size(1))
            cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
            out = self._guarded("dispatch", lambda: runtime.dispatch(
                data, sf, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, alignment, bool(do_expand),
                cpu_sync, num_sms))
        keep = (data, out.recv_x, out.recv_topk_idx) + ((sf,) if sf is not None else ())
        event = call_event(async_with_compute_stream, data.device, keep)
        return out.recv_x, out.recv_topk_idx, out.recv_topk_weights, out.handle, event

    # ------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                num_sms: int | None = None, async_with_compute_stream: bool = False
                ) -> tuple[torch.Tensor, None, EventOverlap]:
        """Returns ``(combined_x, None, event)``: per token of the handle's
        dispatch, the float32 sum of the rows its destination ranks return
        (unweighted; ``topk_weights`` is carried as metadata only, as in the
        reference), rounded to bf16."""
        routing = self._routing_of(handle)
        checks.check_combine_x(x, routing.hidden, routing.rows_for_combine, handle.topk_idx.device)
        if topk_weights is not None:
            checks.check_combine_weights(topk_weights, routing, handle.topk_idx.size(1))
        checks.check_num_sms(num_sms)
        self._check_usable("combine")
        runtime = self._runtime_of(routing)
        combined = self._guarded("combine", lambda: runtime.combine(x, handle))
        event = call_event(async_with_compute_stream, x.device, (x, combined))
        return combined, None, event

    # ------------------------------------------------------------- helpers
    def _routing_of(self, handle):
        if not isinstance(handle, EPHandle) or handle.native_handle is None:
            raise TypeError(f"handle: must be the EPHandle of this ElasticBuffer's dispatch, got {type(handle).__name__}")
        routing = handle.native_handle
        if self.runtime is not None and routing.generation is not self._generation:
            raise ValueError("handle: comes from another ElasticBuffer or from before update_ep_member(); "
                             "dispatch again")
        return routing

    def _runtime_of(self, routing):
        """The path that made a handle runs its cached dispatch and combine."""
        return self.runtime if isinstance(routing, IpcRouting) else self._collective

    def _check_fits(self, tokens_per_rank: int, hidden: int, num_topk: int, fp8: bool) -> None:
        if not self._num_bytes_given:
            return
        need = sizes.elastic_buffer_size(self.num_ranks, tokens_per_rank, hidden, num_topk, fp8,
                                         self.allow_hybrid_mode)
        if need > self.num_bytes:
            raise ValueError(
                f"num_bytes: the buffer has {self.num_bytes} bytes but num_max_tokens_per_rank={tokens_per_rank}, "
                f"hidden={hidden}, num_topk={num_topk} need {need} (ElasticBuffer.get_buffer_size_hint)")

    def _check_alive(self, what: str) -> None:
        if self.runtime is None:
            raise RuntimeError(f"ElasticBuffer.{what}: the buffer has been destroyed")

    def _inactive_ranks(self) -> list[int]:
        alive = self._read_alive()
        return [r for r in range(self.num_ranks) if not alive >> r & 1]

    def _check_usable(self, what: str) -> None:
        self._check_alive(what)
        if self._broken is not None:
            raise RuntimeError(f"ElasticBuffer.{what}: an earlier call failed ({self._broken}); the buffer takes no "
                               "calls until the process group has recovered every seat and every rank called "
                               "update_ep_member() (a replacement constructs a new ElasticBuffer)")
        missing = self._inactive_ranks()
        if missing:
            raise RuntimeError(f"ElasticBuffer.{what}: ranks {missing} are not active in the process group; the "
                               "buffer's membership is fixed: once the group has recovered every seat, call "
                               "update_ep_member() on every survivor while each replacement constructs a new "
                               "ElasticBuffer")

    def _guarded(self, what: str, call):
        """Runs an exchange; a failed or timed-out one makes the buffer refuse calls until update_ep_member()."""
        try:
            return call()
        except (ValueError, TypeError):
            raise  # the same argument error on every rank, raised before any row moved
        except Exception as err:
            self._broken = f"{what}: {err}"
            raise RuntimeError(
                f"ElasticBuffer.{what}: the exchange failed ({err}); a rank of the group failed or stalled. The "
                "buffer's membership is fixed: once the process group has recovered every seat, call "
                "update_ep_member() on every survivor while each replacement constructs a new ElasticBuffer") from err


