"""`proxima serve` and `proxima selfcheck`: vLLM's OpenAI server with Proxima, supervised.

Process layout (``proxima serve``)::

    proxima serve  = gunicorn arbiter   validates input, runs the GPU pre-flight, restarts the worker
      └ worker (ProximaWorker)          vLLM's FastAPI app behind a gate (app.py, supervisor.py)
          └ vLLM engine core            the scheduler and Proxima's block pool; writes the status file

The arbiter never touches CUDA (pre-flight probes run in a subprocess: a CUDA context in a
parent breaks CUDA in the forked children). Modules:

- ``validate``: cheap input checks, before anything heavy (one line, exit 2 on failure)
- ``gpuprobe`` + ``preflight``: the gpu / cuda / versions self-check lines
- ``report``: one check = one line; the report served at ``/proxima/selfcheck``
- ``supervisor``: starts the engine in the worker, runs the engine self-checks and the
  canary, watches the engine and asks gunicorn for a fresh worker when it dies
- ``launch``: one launcher per engine generation (V1, V0): the engine client, vLLM's app,
  where the engine runs; the supervisor asks it, never which vLLM it is
- ``app``: the ASGI gate in front of vLLM's app (``/health``, ``/proxima/selfcheck``)
- ``worker``, ``gunicorn_conf``: gunicorn's worker class and configuration
- ``metrics``: Prometheus collector over the engine's status file
- ``startup_errors``: turns an engine that failed to start into one actionable line
"""
