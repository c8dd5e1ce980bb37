"""Nominal bus bandwidths of the links ``accum-kit plan`` knows by name (``--interconnect``), torch-free.

Each is a nominal peak per GPU and direction; the bus bandwidth a collective reaches is lower
(protocol overhead, PCIe, topology, message size): measure it with nccl-tests' ``all_reduce_perf``
on the target and pass ``--busbw_GBps``, or profile on the target and use ``measured``.
"""

from __future__ import annotations

#: ``--interconnect`` name -> (nominal bus bandwidth per link, GB/s per direction; its public source).
INTERCONNECTS = {
    "nvlink": (450.0, "NVIDIA H100 SXM, fourth-generation NVLink: 900 GB/s total per GPU, i.e. 450 GB/s each "
                      "way (https://www.nvidia.com/en-us/data-center/nvlink/); within one machine only"),
    "infiniband": (50.0, "InfiniBand NDR: 400 Gb/s = 50 GB/s per port each way, one port per GPU "
                         "(https://www.nvidia.com/en-us/networking/infiniband/connectx-7/)"),
    "ethernet": (12.5, "100 Gigabit Ethernet (IEEE 802.3): 100 Gb/s = 12.5 GB/s per port each way"),
    "measured": (None, "the profile's: bytes per sync / seconds_per_sync x 2 (n - 1) / n, nccl-tests' definition"),
}
