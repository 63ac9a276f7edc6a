"""A Python-implemented accelerator for testing placement on CPU-only machines.

``install()`` registers PyTorch's PrivateUse1 backend under the name ``"fakegpu"``
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, PyTorch
>= 2.6) and backs every ``fakegpu`` tensor with an ordinary CPU tensor held inside a
wrapper subclass. Every ATen op on a ``fakegpu`` tensor unwraps, runs on the CPU and
re-wraps, so whole diffusers/transformers models run on it with real data.

What it gives a test that a CPU run cannot:

* **Placement errors.** An op that mixes a ``fakegpu`` tensor with a host (CPU) tensor
  of one or more dimensions raises ``RuntimeError("Expected all tensors to be on the
  same device, but found at least two devices, fakegpu:0 and cpu!")``, the message CUDA
  gives. Zero-dimensional host tensors are accepted as scalars, as on CUDA.
* **Exact accounting.** ``stats()`` counts device bytes of live storages
  (``allocated_bytes``; a view adds 0), their high-water mark (``peak_bytes``), bytes
  copied host->device (``h2d_bytes``) and device->host (``d2h_bytes``), one ``transfers``
  per tensor copy between host and device, and ``synchronizes``. ``device_ops`` counts
  the ops a GPU would launch as one kernel or copy each (every ATen op on ``fakegpu``
  tensors that is no view, in-place view op, allocation without a fill (``empty``,
  ``empty_strided``, ``empty_like``) or metadata query, once per op issued: not the
  fake's own re-dispatches inside one), host<->device copies included; ``host_waits``
  counts the calls that block the host on the device (device->host copies, ``.item()``,
  ``.tolist()``, non-blocking ones into pinned memory included; ops whose result the
  host reads, such as ``equal``, ``nonzero`` or a boolean-mask index;
  ``synchronize()``, ``Stream``/``Event`` ``synchronize()`` and ``query()``;
  ``repr()``). ``counters.stats`` documents both exactly.
* **Capacity.** ``set_capacity(nbytes)`` makes an allocation that would push
  ``allocated_bytes`` above ``nbytes`` raise ``torch.OutOfMemoryError``.
* **``.data`` assignment across host and device** works as on CUDA (``install`` puts a
  ``data`` property on ``torch.Tensor`` that handles the ``fakegpu`` case and defers to
  PyTorch otherwise), so libraries that move weights with ``p.data = t`` run too.
* **Pinning.** ``Tensor.pin_memory()`` / ``Tensor.is_pinned()`` work on host tensors
  (CPU kernels for ``aten::_pin_memory`` and ``aten::is_pinned`` registered with
  ``torch.library``). A pinned tensor is an ordinary CPU tensor whose storage is
  remembered as pinned until that storage is freed. ``torch.fakegpu.host_register`` /
  ``host_unregister`` simulate ``cudaHostRegister`` (pinning an existing storage in place).
  ``torch.fakegpu.pinned_host_bytes()`` is the pinned memory alive, as CUDA would hold it:
  a registration's bytes, a ``pin_memory()`` block (or a non-blocking copy's host result)
  rounded up to a power of two as PyTorch's caching host allocator rounds it.

* **Streams, events and a race detector.** ``Stream``, ``Event``, ``current_stream``,
  ``stream(s)`` (also as ``torch.fakegpu.*``, shaped like ``torch.cuda.*``) model CUDA
  stream ordering. Data is still computed at once on the CPU; what is modelled is when
  work would be complete on a GPU. Every op on a ``fakegpu`` tensor runs on the current
  stream and takes its next sequence number; each stream keeps a vector clock of what it
  is ordered after (``wait_event`` on an event, which snapshots the recording stream's
  clock, or ``wait_stream``), and the host keeps one of what it knows complete
  (``synchronize()``, ``Stream.synchronize``, ``Event.synchronize``, a ``query()`` that
  returns True, a blocking copy). Device storages allocated on a side stream, or touched
  by an op on one, are *tracked*: the last use and last write per stream are noted. An op
  raises ``RaceError`` (naming the tensor's shape and dtype and both streams) when it
  reads or writes a tracked storage whose last write on another stream is not ordered
  before it, or writes one that another stream's unordered op still uses. Host reads
  (``.cpu()``, ``.item()``, ``.tolist()``, device->host copies) are ops on the current
  stream like any other. Freeing a tracked storage while a stream other than its
  allocation stream used it, unordered before the allocation stream's clock and not
  covered by a synchronize, by ``tensor.record_stream(that stream)`` or by
  ``record_stream`` of a stream that has waited on that use (CUDA's caching allocator
  reuses the block only once an event recorded on every recorded stream at the free
  completes), is a race too; frees
  happen in finalizers, so that ``RaceError`` is raised by the next ``fakegpu`` op or
  stream/event call. ``stats()`` counts ``stream_waits``, ``events`` and
  ``races_detected`` (every race found, raised or not). Views and metadata ops
  (``detach``, ``t``, ``view``, ``empty_like``...) access no data and are never races.
  Storages only ever used on the default stream stay untracked; until the first side
  stream is created (or a bandwidth set) ops take the plain path with no stream
  bookkeeping at all.
* **Host-side races on pinned memory.** The host is a participant of its own: its clock
  (what it knows complete) advances only by ``synchronize()``, ``Stream.synchronize``,
  ``Event.synchronize``, a ``query()`` returning True, or a blocking copy/``.item()``/
  ``.cpu()``/``.tolist()`` on a stream, which brings in everything that stream was
  ordered after (its waits, transitively). A ``non_blocking`` copy between the device and
  a pinned host storage (``pin_memory()``, ``host_register``, the pinned result of
  ``t.to("cpu", non_blocking=True)``) is *pending* on the host side until the host's
  clock covers it, on the default stream too (on CUDA such a copy is asynchronous to
  the host on any stream). While one is pending, any torch op on the host that reads a
  storage a pending device-to-host copy writes, or writes one that a pending copy reads
  or writes, raises ``RaceError``; so does ``repr()``/``print``/``.tolist()`` of it, and a
  copy on a stream not ordered after the pending one. Reading the source of a pending
  host-to-device copy is no race. Host ops are seen through a ``TorchDispatchMode`` pushed
  on the issuing thread only while such copies are pending (never on top of another
  active mode: a copy issued under a user's mode puts it beneath that mode); it costs
  nothing when none is pending. Copies to or from pageable memory are
  synchronous for host memory, as on CUDA, and never pending. Not seen: access outside
  torch (``.numpy()`` and the arrays it shares memory with, ``data_ptr()``, buffers,
  ``torch.save``), and ops on another thread than the one that issued the copy.
  ``repr()`` of a ``fakegpu`` tensor is a blocking host read on the current stream: it
  raises ``RaceError`` if the tensor's writer on another stream is not ordered before it.
* **``torch.accelerator`` and ``torch.fakegpu``, as for CUDA.** ``torch.accelerator``'s
  ``memory_allocated``/``max_memory_allocated``/``memory_reserved``/``max_memory_reserved``/
  ``memory_stats``/``reset_peak_memory_stats``/``reset_accumulated_memory_stats``/
  ``empty_cache``/``get_memory_info`` answer from the counters above (``allocated_bytes``,
  ``peak_bytes``, capacity; ``counters.memory_stats_nested`` documents every statistic),
  and its ``synchronize``/``current_stream``/``set_stream`` use the streams below
  (``accelerator.py`` explains why and how). ``torch.fakegpu`` has the same memory calls
  and ``get_rng_state``/``set_rng_state`` (the host generator's: random ops on the device
  draw from it). ``t.to("meta")`` gives a meta tensor and moves nothing;
  ``scaled_dot_product_attention`` needing no gradient runs as one device op computing
  what the CPU computes (``kernels._sdpa_autograd``).
* **Copy time.** ``set_copy_bandwidth(bytes_per_second)`` makes host<->device copies
  take ``nbytes / bytes_per_second`` seconds of virtual time per stream: a
  ``non_blocking`` copy on a side stream returns at once, a blocking copy or any copy on
  the default stream sleeps the host until done, and waits and synchronizes sleep until
  the awaited work completes. Compute takes its real CPU time, so copy/compute overlap
  from prefetching shows in wall-clock time.

What it cannot simulate: real asynchronous execution and its timing beyond that model,
allocator caching and fragmentation. Those exist only on a real GPU (see
``bench/gpu_check.py``).

The device type can be registered once per process; ``install()`` is idempotent and
raises ``RuntimeError`` if PrivateUse1 was already renamed to something else.

The package's modules, each importing only those listed before it: ``state`` (the lock
and the shared mutable state), ``counters`` (accounting: ``stats()``, resets, capacity),
``races`` (``RaceError`` and the device-side race detector), ``host_races`` (pinned host
memory and the host-side race detector), ``streams`` (``Stream``, ``Event``,
``synchronize()``, the copy bandwidth), ``accelerator`` (``torch.accelerator``'s calls
answered for ``fakegpu``), ``device`` (``FakeDeviceTensor`` and its
dispatch), ``data`` (``.data`` assignment), ``kernels`` (the ``torch.library`` kernels)
and ``backend`` (``torch.fakegpu`` and ``install()``). This module re-exports the public
API.
"""

from __future__ import annotations

from .backend import install, is_installed
from .counters import (
    live_storages,
    memory_stats_nested,
    reset_accumulated_memory_stats,
    reset_peak,
    reset_stats,
    set_capacity,
    stats,
)
from .device import FakeDeviceTensor, storage_key
from .races import RaceError
from .state import DEVICE_TYPE
from .streams import (
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    set_copy_bandwidth,
    set_stream,
    stream,
    synchronize,
)

__all__ = [
    "DEVICE_TYPE",
    "Event",
    "FakeDeviceTensor",
    "RaceError",
    "Stream",
    "StreamContext",
    "current_stream",
    "default_stream",
    "install",
    "is_installed",
    "live_storages",
    "memory_stats_nested",
    "reset_accumulated_memory_stats",
    "reset_peak",
    "reset_stats",
    "set_capacity",
    "set_copy_bandwidth",
    "set_stream",
    "stats",
    "storage_key",
    "stream",
    "synchronize",
]
