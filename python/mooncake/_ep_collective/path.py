"""The collective path of the expert-parallel ``Buffer``: dispatch and
combine from the process group's own operations (``Exchange``) and tensor
operations, with the per-call agreement of ``presence`` deciding who takes
part. The same interface as the fast path (``_ep_ipc_path.IpcPath``), so
that ``Buffer`` is argument checks, path choice and fallback."""

from __future__ import annotations

import torch

from .events import call_event
from .fp8 import CHANNELS_PER_SCALE, quantize
from .handle import DispatchHandle, DispatchState
from .routing import (SendPlan, bitmap_bytes, block_begins, byte_rows, pack_bits, plan_sends, segments, token_rows,
                      unpack_bits)


def recv_hook(return_recv_hook: bool):
    """Everything was received before the call returned; the hook only keeps the API."""
    return (lambda: None) if return_recv_hook else None


class CollectivePath:
    """The collective path of a Buffer over ``num_ranks`` ranks (its calls
    run on the Buffer's current connection, passed to each)."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks

    def dispatch(self, conn, x, topk_idx, mask, tokens_per_rank, num_experts, timeout_us, use_fp8, async_finish,
                 return_recv_hook):
        num_ranks = self.num_ranks
        num_tokens, hidden = x.shape

        num_local = num_experts // num_ranks
        slots = num_ranks * tokens_per_rank
        device = x.device
        participants = conn.begin_call(mask, timeout_us)

        num_topk = topk_idx.size(1)
        if participants:
            plan, rows, sources = self._send_tokens(conn, x, topk_idx, mask, participants, num_local, use_fp8)
        else:  # this rank takes no part: it sends nothing and receives nothing
            nobody = torch.zeros(num_ranks, dtype=torch.bool, device=device)
            plan, rows, sources = plan_sends(topk_idx, num_ranks, num_local, nobody), None, None
        final = conn.end_call(mask, participants) if participants else [bool(b) for b in mask.tolist()]

        src_info = torch.full((num_local, slots), -1, dtype=torch.int32, device=device)
        if use_fp8:
            # Allocated and written as bytes: not every device kernel takes float8 tensors.
            data = torch.empty(num_local, slots, hidden, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
            # Scales are stored token-major per group, [L, hidden / 128, R * T], as the kernels write them.
            scales = torch.empty(num_local, hidden // CHANNELS_PER_SCALE, slots, dtype=torch.float32,
                                 device=device).transpose(1, 2)
            recv_x = (data, scales)
        else:
            # Rows past each count are left unwritten, as in the reference.
            data = torch.empty(num_local, slots, hidden, dtype=torch.bfloat16, device=device)
            recv_x = data
        kept = torch.zeros(num_ranks, num_local, dtype=torch.int64, device=device)
        if rows is not None and rows.size(0):
            # Rows of a source the group dropped during the exchange are not used.
            rows, sources = self._from_live_sources(rows, sources, final)
            payload_bytes = hidden if use_fp8 else 2 * hidden
            scale_bytes = 4 * (hidden // CHANNELS_PER_SCALE) if use_fp8 else 0
            index_at = payload_bytes + scale_bytes
            picked = unpack_bits(rows[:, index_at + 4:index_at + 4 + bitmap_bytes(num_local)], num_local)
            # One entry per (local expert, row), by local expert, then row: rows
            # are already by source, then token, so blocks come out in layout order.
            le, row = torch.nonzero(picked.t(), as_tuple=True)
            kept = torch.bincount(sources[row] * num_local + le, minlength=num_ranks * num_local).view(
                num_ranks, num_local)
            per_expert = kept.sum(0)
            slot = torch.arange(le.numel(), device=device) - (torch.cumsum(per_expert, 0) - per_expert)[le]
            # Payloads move as int64 words (rows are 8-byte aligned; see _send_tokens): a
            # byte-wise copy of the same rows is several times slower on CPU.
            words = rows.view(torch.int64)
            payload_words = payload_bytes // 8
            data.view(torch.int64).view(num_local, slots, payload_words)[le, slot] = words[row, :payload_words]
            if use_fp8:
                scales[le, slot] = rows[row, payload_bytes:index_at].view(torch.float32)
            src_info[le, slot] = rows[row, index_at:index_at + 4].view(torch.int32).squeeze(1)
        begins = block_begins(kept)
        recv_count = kept.sum(0).to(torch.int32)
        layout_range = (begins << 32) | kept.t()

        state = DispatchState(connection=conn, call=conn.calls, topk_idx=topk_idx.clone(), num_topk=num_topk,
                              plan=plan, kept_counts=kept, begins=begins)
        handle = DispatchHandle(src_info, layout_range, tokens_per_rank, hidden, num_experts, state)
        event = call_event(async_finish, device, (x, topk_idx, recv_x, recv_count, src_info, layout_range))
        return recv_x, recv_count, handle, event, recv_hook(return_recv_hook)

    def _send_tokens(self, conn, x, topk_idx, mask, participants, num_local, use_fp8):
        """The two exchanges of dispatch: (1) every pair of participants swaps
        whether it accepts rows from the other and how many it has for it;
        (2) rows move between pairs that accept each other, one per (token,
        destination rank): payload, token index, bitmap of picked local experts.
        Returns the pick plan of what was sent (for combine), the rows received
        (bytes, by source then token) and each row's source rank."""
        num_ranks = self.num_ranks
        device = x.device
        willing = torch.tensor(mask.tolist(), dtype=torch.bool, device=device)
        offer = token_rows(topk_idx, num_ranks, num_local, willing)
        header = torch.stack([willing.to(torch.int64), offer.per_rank], dim=1)
        answer = conn.exchange.same_size_blocks(header, participants)
        mutual = willing & answer[:, 0].bool()
        outgoing = offer if bool(torch.equal(mutual, willing)) else token_rows(topk_idx, num_ranks, num_local, mutual)
        incoming = answer[:, 1] * mutual

        tokens = outgoing.token
        if use_fp8:
            q, s = quantize(x)
            parts = [q.view(torch.uint8)[tokens], s[tokens].view(torch.uint8)]
        else:
            parts = [x[tokens].view(torch.uint8)]
        parts.append(tokens.to(torch.int32).unsqueeze(1).view(torch.uint8))
        parts.append(pack_bits(outgoing.experts))
        send = byte_rows(parts)
        recv_counts = incoming.tolist()
        rows = conn.exchange.rows(send, outgoing.per_rank.tolist(), recv_counts, participants)
        sources = torch.repeat_interleave(torch.arange(num_ranks, device=device), incoming,
                                          output_size=rows.size(0))
        return plan_sends(topk_idx, num_ranks, num_local, mutual), rows, sources

    @staticmethod
    def _from_live_sources(rows, sources, final):
        if all(final):
            return rows, sources
        live = torch.tensor(final, dtype=torch.bool, device=rows.device)[sources]
        return rows[live], sources[live]

    def combine(self, conn, state: DispatchState, handle, source, topk_idx, topk_weights, mask, timeout_us,
                async_finish, return_recv_hook, out):
        """`source`: the expert outputs to send back (combine's x, or the zero-copy buffer)."""
        _, _, tokens_per_rank, hidden, num_experts = handle
        num_ranks = self.num_ranks
        num_local = num_experts // num_ranks
        slots = num_ranks * tokens_per_rank
        participants = conn.begin_call(mask, timeout_us)
        num_tokens, num_topk = topk_idx.shape
        device = source.device
        total = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        if participants:
            picks, rows = self._return_rows(conn, source.reshape(num_local * slots, hidden).contiguous(), state,
                                            participants, num_local, slots)
            final = conn.end_call(mask, participants)
            # A returned row counts when its expert's rank is still active.
            active_now = torch.tensor(final, dtype=torch.bool, device=device)
            owner_active = active_now[topk_idx.reshape(-1)[picks] // num_local]
            picks, rows = picks[owner_active], rows[owner_active]
            token, slot = picks // num_topk, picks % num_topk
            weights = topk_weights[token, slot].unsqueeze(1)
            # One top-k slot after another (a token has at most one row per slot):
            # multiply, then add, in float32, so every token sums its picks in slot
            # order, whatever the device, and the result is reproducible.
            for k in range(num_topk):
                in_slot = torch.nonzero(slot == k).squeeze(1)
                if in_slot.numel():
                    total.index_add_(0, token[in_slot], rows[in_slot].float() * weights[in_slot])
        combined = out if out is not None else torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        combined.copy_(total)
        event = call_event(async_finish, device, (source, topk_idx, topk_weights, combined))
        return combined, event, recv_hook(return_recv_hook)

    def _return_rows(self, conn, source, state: DispatchState, participants, num_local, slots):
        """Expert side: rows of each source rank go back in the order they came.
        Token side: rows come back along the plan; returns the picks (flat
        positions) they answer and the rows."""
        num_ranks = self.num_ranks
        device = source.device
        taking_part = torch.zeros(num_ranks, dtype=torch.bool, device=device)
        taking_part[participants] = True
        seg = segments(state.kept_counts, state.begins)
        to_send = taking_part[seg.source]
        # Rows move as int64 words (hidden is a multiple of 128): faster than bf16 elements on CPU.
        send = source.view(torch.int64)[(seg.local_expert * slots + seg.slot)[to_send]].view(torch.bfloat16)
        send_counts = (state.kept_counts.sum(1) * taking_part).tolist()
        plan: SendPlan = state.plan
        comes_back = taking_part[plan.experts // num_local]
        recv_counts = (plan.counts.sum(1) * taking_part).tolist()
        got = conn.exchange.rows(send, send_counts, recv_counts, participants)
        return plan.picks[comes_back], got
