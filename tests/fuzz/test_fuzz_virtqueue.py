"""Fuzz: split-virtqueue chain walking (virtio 1.2 §2.7) over random rings and descriptor tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smold.devices.virtio.queue import ChainError, Queue, QueueError
from smold.memory import GuestMemory

RAM = 64 * 1024
DESC, AVAIL, USED = 0x1000, 0x3000, 0x4000

pytestmark = pytest.mark.timeout(300)


@given(size_log=st.integers(0, 8), table=st.binary(min_size=0, max_size=256 * 16),
       avail=st.binary(min_size=0, max_size=4 + 2 * 256), next_avail=st.integers(0, 0xFFFF),
       pops=st.integers(1, 300))
def test_pop_gives_a_bounded_chain_or_a_typed_error(size_log: int, table: bytes, avail: bytes, next_avail: int,
                                                    pops: int) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        mem.write(DESC, table)
        mem.write(AVAIL, avail)
        q = Queue(256)
        q.size = 1 << size_log
        q.desc_addr, q.avail_addr, q.used_addr = DESC, AVAIL, USED
        q.validate(mem)
        q.ready = True
        q.next_avail = next_avail
        for _ in range(pops):
            try:
                chain = q.pop(mem)
            except ChainError as e:
                assert 0 <= e.head < q.size
                q.add_used(mem, e.head, 0)
                continue
            except QueueError:
                assert q.broken
                break
            if chain is None:
                break
            descs = chain.readable + chain.writable
            assert 1 <= len(descs) <= q.size
            for d in descs:
                assert d.length == 0 or mem.contains(d.addr, d.length)
            assert all(not d.write for d in chain.readable) and all(d.write for d in chain.writable)
            q.add_used(mem, chain.head, 0)


@given(size=st.integers(-5, 70000), desc=st.integers(0, 2**64 - 1), avail=st.integers(0, 2**64 - 1),
       used=st.integers(0, 2**64 - 1))
def test_ring_layout_is_checked(size: int, desc: int, avail: int, used: int) -> None:
    with GuestMemory([(0, RAM)]) as mem:
        q = Queue(256)
        q.size, q.desc_addr, q.avail_addr, q.used_addr = size, desc, avail, used
        try:
            q.validate(mem)
        except QueueError:
            return
        assert 1 <= size <= 256 and mem.contains(desc, 16 * size) and mem.contains(used, 6 + 8 * size)
