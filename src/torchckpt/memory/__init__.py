"""Memory measurement: exact live tensor bytes on CPU, allocator statistics on CUDA, process RSS, and the host
memory offloaded activations take (``host_pool``)."""

from torchckpt.memory.host_pool import host_live_bytes, host_peak_bytes
from torchckpt.memory.meter import MemoryBreakdown, MemoryMeter, device_of, synchronize
from torchckpt.memory.rss import read_rss_bytes, reset_peak_rss

__all__ = ["MemoryMeter", "MemoryBreakdown", "device_of", "synchronize", "read_rss_bytes", "reset_peak_rss",
           "host_live_bytes", "host_peak_bytes"]
