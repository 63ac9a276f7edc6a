"""The offload backends, one module per mode over a shared base.

- ``base``: ``OffloadBackendBase``: config and device checks, discovery, host copies,
  hook table, ``disable``, ``audit``.
- ``module``: ``ModelLevelOffloadBackend``: model-level offload (one group at a time),
  optionally under a device-memory budget.
- ``layer``: ``LayerwiseOffloadBackend``: layer mode (blocks streamed with prefetch).
- ``split``: ``PartSwitcher`` and ``SupportsModelCpuOffload``: a pipeline that switches
  its own parts, driven through the same transfers.
"""
