"""The offload core: residency, transfers and hooks, below everything else.

Its modules are its layers, bottom to top, in this
list, each importing only modules earlier in it (``tests/test_layout.py`` checks it):

- ``config``: ``DiffusionOffloadConfig``, the validated offload config (torch-free).
- ``platform``: one ``Platform`` per device kind (streams, events, pinning, memory queries).
- ``caches``: clearing the method caches that keep a pipeline's device tensors alive.
- ``hostmem``: host memory: pinning in place, what the host has.
- ``checksum``: weighted byte sums, the write check's hash (one int8 matrix product).
- ``writes``: write detection: fingerprints of a tensor's bytes, its host-visible write state.
- ``quantized``: the plain tensors that carry each weight (quantized formats), refusals.
- ``arena``: host arenas: many host copies in one buffer, one H2D copy per arena.
- ``stats``: ``TransferStats``, the engine's counters.
- ``transfer``: moving weights (``Mover``, ``Transaction``, ``TensorSlot``).
- ``readahead``: the disk tier's reader thread (``ReadAhead``): reads ahead of loads.
- ``staging``: the staging ring (``StagingRing``): pinned buffers that carry disk-backed
  bytes to the device, one H2D copy per chunk.
- ``tiers``: the host-memory budget and its tiers (pinned, pageable, disk): ``"auto"``,
  file-backed weights, the tier plan.
- ``disktier``: ``DiskTier``: disk-backed host copies read from their files through the
  staging ring, their page-cache advice and copy-on-write pages.
- ``weights_from``: file-backing the weights of a pipeline built elsewhere from its folder.
- ``checks``: device write checks (``LoadCheck``): what a load put on the device, what changed.
- ``residency``: which bytes sit where (``WeightTable``, ``ComponentWeights``, slots).
- ``policy``: the device-memory budget (``MemoryPolicy``): what stays resident.
- ``discovery``: a pipeline's components and their roles (DiT, text encoder, VAE...).
- ``foreign``: other libraries' placement hooks (accelerate, group offload), refused.
- ``blocks``: a component's repeated blocks (layer mode).
- ``hooks``: ``SequentialOffloadHook``: load before a stage runs, evict others.
- ``streamer``: ``BlockStreamer``: layer mode's block schedule and prefetch.
- ``backends``: one module per backend over a shared base: ``base``
  (``OffloadBackendBase``), ``module`` (``ModelLevelOffloadBackend``), ``layer``
  (``LayerwiseOffloadBackend``), ``split`` (``PartSwitcher``, delegation to a pipeline
  that switches its own parts).

The engine, planner, server and CLI sit above it; it imports none of them. See
``docs/architecture.md``.
"""
