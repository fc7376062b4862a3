"""The memory fields of the capacity a head places by: the machine's and the device's, not
zeros (issue 12)."""

from __future__ import annotations

import os

from conformance.head import FleetHead
from nodeagent.daemon import DeviceMemory, host_memory_bytes
from nodeagent.engine.mock import MockDaemon

GIB = 2**30


class GpuMock(MockDaemon):
    """The mock, on a make-believe 80 GiB device with 31 GiB free."""

    def device_memory(self) -> DeviceMemory:
        return DeviceMemory(total=80 * GIB, free=31 * GIB)


def test_host_memory_is_the_machines():
    assert host_memory_bytes() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 0


def test_hello_ack_carries_the_device_and_host_memory(start_node):
    node = start_node(GpuMock())
    with FleetHead.connect(node.addr) as head:
        capacity = head.node.capacity
    assert (capacity.gpu_memory_bytes, capacity.gpu_memory_free_bytes) == (80 * GIB, 31 * GIB)
    assert capacity.host_memory_bytes == host_memory_bytes()


def test_an_engine_off_any_accelerator_reports_no_gpu_memory(start_node):
    node = start_node()
    with FleetHead.connect(node.addr) as head:
        capacity = head.node.capacity
    assert (capacity.gpu_memory_bytes, capacity.gpu_memory_free_bytes) == (0, 0)
    assert capacity.host_memory_bytes > 0
