"""What a model folder holds and allows, known before a weight is read; shared by the
planner, the engine, the server and the CLI (all above it).

- ``files``: finding a model (folder or hub id), its weight files, sizes and dtypes from
  the safetensors headers (``ModelInfo``, ``ModelError``).
- ``rules``: the request rules of a model: size multiple, frame step, defaults
  (``ModelRules``, ``model_rules``, ``frames_for_seconds``).
- ``fit``: will a config's resting footprint fit the device (``check_fit``, ``FitError``).
"""
