"""The array, page and scatter forms of the transfer calls (the reference
wheel's engine.pyi), with two engines in one process over the real
transports. The semantics asserted here were read off the reference's
0.3.14 wheel on this machine: `fields` rows are (local base, local stride,
remote base, remote stride, length) for writes and reads alike, and the
scatter ticket's statuses are COMPLETED 0, FAILED_DRAINED -1,
COMPLETION_UNKNOWN -2."""

import numpy as np
import pytest

import mooncake.engine as mce
from _procs import addr, pattern
from mooncake.engine import ScatterTransferCompletionStatus as Status

pytestmark = pytest.mark.timeout(60)


def u64(values):
    return np.asarray(values, dtype=np.uint64)


def test_status_values_are_the_references():
    assert (int(Status.COMPLETED), int(Status.FAILED_DRAINED), int(Status.COMPLETION_UNKNOWN)) == (0, -1, -2)
    assert hasattr(mce, "ScatterTransferTicket")


def test_arrays_write_read_and_async(pair):
    s, d = pair.buffers(1 << 16, 1 << 16)
    layout = [(0, 7, 1), (100, 5000, 4093), (9000, 20000, 30000)]
    bufs, peers, lens = (u64([addr(s, lo) for lo, _, _ in layout]), u64([addr(d, ro) for _, ro, _ in layout]),
                         u64([n for *_, n in layout]))
    assert pair.src.batch_transfer_sync_write_arrays(pair.dst_session, bufs, peers, lens) == 0
    expected = pattern(2, d.size)
    for lo, ro, n in layout:
        expected[ro:ro + n] = s[lo:lo + n]
    np.testing.assert_array_equal(d, expected)
    back = pair.factory.buffer(pair.src, s.size, fill=0)
    back_bufs = np.asarray([addr(back, lo) for lo, _, _ in layout], dtype=np.int64)  # int64 is fine too
    assert pair.src.batch_transfer_sync_read_arrays(pair.dst_session, back_bufs, peers, lens) == 0
    for lo, _, n in layout:
        np.testing.assert_array_equal(back[lo:lo + n], s[lo:lo + n])
    back[:] = 0
    batch = pair.src.batch_transfer_async_read_arrays(pair.dst_session, back_bufs, peers, lens)
    assert batch != 0 and pair.src.get_batch_transfer_status([batch]) == 0
    for lo, _, n in layout:
        np.testing.assert_array_equal(back[lo:lo + n], s[lo:lo + n])
    d[:] = 0
    batch = pair.src.batch_transfer_async_write_arrays(pair.dst_session, bufs, peers, lens)
    assert batch != 0 and pair.src.get_batch_transfer_status([batch]) == 0
    for lo, ro, n in layout:
        np.testing.assert_array_equal(d[ro:ro + n], s[lo:lo + n])


def test_arrays_bad_input_names_the_argument(pair):
    s, d = pair.buffers(4096, 4096)
    e, t = pair.src, pair.dst_session
    with pytest.raises(TypeError, match="buffers: must be a 1-D contiguous array of 8-byte integers"):
        e.batch_transfer_sync_write_arrays(t, np.asarray([1], dtype=np.int32), u64([addr(d)]), u64([8]))
    with pytest.raises(TypeError, match="lengths: must be a 1-D contiguous"):
        e.batch_transfer_sync_write_arrays(t, u64([addr(s)]), u64([addr(d)]), u64([[8]]))
    with pytest.raises(TypeError, match="peer_buffer_addresses"):
        e.batch_transfer_sync_write_arrays(t, u64([addr(s), addr(s)]), u64([addr(d), 0, addr(d)])[::2], u64([8, 8]))
    with pytest.raises(ValueError, match=r"must have the same length \(2, 1, 2\)"):
        e.batch_transfer_sync_write_arrays(t, u64([addr(s), addr(s)]), u64([addr(d)]), u64([8, 8]))


@pytest.mark.parametrize("max_batch_size", [0, 1, 3])
def test_pages_write_and_read(pair, max_batch_size):
    s, d = pair.buffers(1 << 16, 1 << 16)
    src_pages, dst_pages = np.asarray([1, 3, 0], dtype=np.int64), np.asarray([0, 2, 5], dtype=np.int64)
    # Two fields: (local base, local stride, remote base, remote stride, length).
    fields = np.asarray([[addr(s), 1000, addr(d), 500, 37], [addr(s, 8000), 64, addr(d, 9000), 128, 64]],
                        dtype=np.int64)
    assert pair.src.batch_transfer_sync_write_pages(pair.dst_session, src_pages, dst_pages, fields,
                                                    max_batch_size) == 0
    expected = pattern(2, d.size)
    for lb, ls, rb, rs, n in fields.tolist():
        for i, j in zip(src_pages.tolist(), dst_pages.tolist()):
            lo, ro = lb - addr(s) + i * ls, rb - addr(d) + j * rs
            expected[ro:ro + n] = s[lo:lo + n]
    np.testing.assert_array_equal(d, expected)
    # Read: the same columns, local first; the bytes flow the other way.
    back = pair.factory.buffer(pair.src, s.size, fill=0)
    read_fields = fields.copy()
    read_fields[:, 0] += addr(back) - addr(s)
    assert pair.src.batch_transfer_sync_read_pages(pair.dst_session, src_pages, dst_pages, read_fields,
                                                   max_batch_size) == 0
    for lb, ls, rb, rs, n in read_fields.tolist():
        for i, j in zip(src_pages.tolist(), dst_pages.tolist()):
            lo, ro = lb - addr(back) + i * ls, rb - addr(d) + j * rs
            np.testing.assert_array_equal(back[lo:lo + n], d[ro:ro + n])


def test_pages_bad_input_and_failure(pair):
    s, d = pair.buffers(4096, 4096)
    e, t = pair.src, pair.dst_session
    pages = np.asarray([0, 1], dtype=np.int64)
    fields = np.asarray([[addr(s), 8, addr(d), 8, 8]], dtype=np.int64)
    with pytest.raises(ValueError, match="src_pages and dst_pages must have the same length"):
        e.batch_transfer_sync_write_pages(t, pages, pages[:1], fields)
    with pytest.raises(TypeError, match=r"fields: must be a C-contiguous \[rows, 5\] array"):
        e.batch_transfer_sync_write_pages(t, pages, pages, fields[:, :4])
    with pytest.raises(ValueError, match="max_batch_size must be >= 0"):
        e.batch_transfer_sync_write_pages(t, pages, pages, fields, -1)
    outside = np.asarray([[addr(s), 8, addr(d), 8, 8], [addr(s), 8, addr(d) + 8192, 8, 8]], dtype=np.int64)
    assert e.batch_transfer_sync_write_pages(t, pages, pages, outside) == -1  # beyond the peer's registration


def _scatter_args(s, d):
    # Two ranges; the second one's capacities start mid-buffer.
    return ([addr(s), addr(s, 1000)], [1000, 3000], [addr(d, 50), addr(d, 2000)], [500, 2000],
            [[0, 100, 999], [10, 2000]], [[5, 300, 0], [0, 1500]], [[10, 50, 1], [7, 500]])


def test_scatter_write_and_read_with_tickets(pair):
    s, d = pair.buffers(1 << 14, 1 << 14)
    lb, lc, rb, rc, lo, ro, ln = _scatter_args(s, d)
    ticket = pair.src.scatter_transfer_sync_write_with_ticket(pair.dst_session, lb, lc, rb, rc, lo, ro, ln)
    assert ticket.status == Status.COMPLETED and ticket.drained
    expected = pattern(2, d.size)
    for r in range(2):
        for a, b, n in zip(lo[r], ro[r], ln[r]):
            la, ra = lb[r] - addr(s) + a, rb[r] - addr(d) + b
            expected[ra:ra + n] = s[la:la + n]
    np.testing.assert_array_equal(d, expected)

    back = pair.factory.buffer(pair.src, s.size, fill=0)
    lb_back = [b - addr(s) + addr(back) for b in lb]
    ticket = pair.src.submit_scatter_read(pair.dst_session, lb_back, lc, rb, rc, lo, ro, ln)
    assert ticket.drain(10_000) == Status.COMPLETED and ticket.drained and ticket.status == Status.COMPLETED
    for r in range(2):
        for a, b, n in zip(lo[r], ro[r], ln[r]):
            la, ra = lb_back[r] - addr(back) + a, rb[r] - addr(d) + b
            np.testing.assert_array_equal(back[la:la + n], d[ra:ra + n])


def test_scatter_failures(pair):
    s, d = pair.buffers(4096, 4096)
    e, t = pair.src, pair.dst_session
    with pytest.raises(ValueError, match=r"does not fit the range's capacities"):
        e.submit_scatter_write(t, [addr(s)], [4096], [addr(d)], [100], [[0]], [[99]], [[2]])
    with pytest.raises(ValueError, match="same number of fragments in range 0"):
        e.submit_scatter_write(t, [addr(s)], [4096], [addr(d)], [4096], [[0, 1]], [[99]], [[2]])
    with pytest.raises(ValueError, match="remote_capacities must have one entry per range"):
        e.submit_scatter_write(t, [addr(s)], [4096], [addr(d)], [], [[0]], [[0]], [[2]])
    # Nothing to move: completed at once.
    assert e.submit_scatter_write(t, [], [], [], [], [], [], []).status == Status.COMPLETED
    # The peer has no registration there: the batch fails, and the ticket says so once drained.
    outside = pair.factory.buffer(pair.dst, 4096, seed=5, register=False)
    ticket = e.scatter_transfer_sync_write_with_ticket(t, [addr(s)], [4096], [addr(outside)], [4096], [[0]], [[0]],
                                                       [[64]])
    assert ticket.status == Status.FAILED_DRAINED and ticket.drained
    np.testing.assert_array_equal(outside, pattern(5, outside.size))
    assert e.scatter_transfer_sync_write_with_ticket("127.0.0.1:1", [addr(s)], [4096], [addr(d)], [4096], [[0]],
                                                     [[0]], [[8]]).status == Status.FAILED_DRAINED
