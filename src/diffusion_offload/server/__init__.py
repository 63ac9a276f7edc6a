"""``diffusion-offload serve``: an OpenAI-style HTTP API over one offloaded pipeline.

- :mod:`.app`: ``create_app(engine_or_factory, ServerSettings) -> FastAPI`` and
  ``serve(args) -> int`` (the CLI command).
- :mod:`.state`: ``ServerSettings`` and ``ServerState`` (engine, jobs, metrics).
- :mod:`.routes`: the endpoints; :mod:`.middleware`: API key, body limit, shutdown.
- :mod:`.schemas`: request models and validation into 400 errors naming the field.
- :mod:`.jobs`: the bounded queue, the single worker, the video job store.
- :mod:`.metrics`: Prometheus metrics on the server's own registry.
- :mod:`.engine_adapter`: pipeline capabilities and the step-progress hook.
- :mod:`.errors`: OpenAI's error envelope.
- :mod:`.ray_serve`: ``serve --ray``, the same app on Ray Serve with many replicas
  (imported only then: it imports Ray); a package: the job index actor, the generator
  and ingress deployments, building and deploying the application, the command.
"""

from .app import ServerSettings, create_app, serve

__all__ = ["ServerSettings", "create_app", "serve"]
