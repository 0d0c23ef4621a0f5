"""An OpenAI-compatible HTTP server on the engine (FastAPI and uvicorn: pip install -e '.[serve]').

    python -m tunix_train.serve PATH [--host 127.0.0.1] [--port 8000] [--slots 16] [--max_len 2048]
        [--api_key KEY] [--max_queue 256] [--max_body_bytes 2097152] ...

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET
/metrics; flags, limits and the security model: docs/serving.md. The parts: schema.py checks a
request's fields, app.py decides who may call and shapes the responses, worker.py runs the
engine's session on its own thread, cli.py starts it all.
"""

from tunix_train.serve.cli import main

__all__ = ["main"]
