"""An OpenAI-compatible HTTP API in front of the Triton server (`trt-redrafter serve --openai-port N`).

    protocol.py       request bodies checked field by field, OpenAI's error and response shapes (no web framework)
    generation.py     one request's tokens -> text: incremental detokenization, stop strings, ReDrafter statistics
    engine_client.py  what the repository serves; one streaming gRPC call per request to the engine model
    app.py            the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health
    __main__.py       the frontend process (uvicorn on a socket it binds first)
    process.py        OpenAIFrontend: start it next to tritonserver, wait until it answers, stop it cleanly

The frontend is a process of its own, so the web stack (FastAPI, uvicorn: the `serving` extra) never loads into
tritonserver's Python backend, and it is imported only by the modules that need it.
"""

# Seconds uvicorn lets open requests finish on SIGINT/SIGTERM before it cancels them (and their Triton requests).
GRACEFUL_SHUTDOWN_S = 3
