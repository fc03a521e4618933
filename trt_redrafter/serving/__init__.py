"""Serving through a real Triton Inference Server (see docs/serving.md).

    repo.py          make-repo: fill the triton_repo/ templates (package data) from an engine's config.json
    engine_model.py  the torch engine model's logic (the Triton model.py is a thin adapter over it)
    text.py          tokenization for the pre/postprocessing models, incremental detokenization
    metrics.py       the engine model's Prometheus metrics; a /metrics scraper for tests and load tests
    follower.py      TP ranks 1..tp-1, launched by the engine model with mpirun
    launcher.py      TritonServer: start tritonserver, wait until ready, drain and shut down cleanly
    client.py        a streaming gRPC client (generate command, tests, load tests)
    openai_api/      an OpenAI-compatible HTTP API in front of the server (serve --openai-port), its own process

Triton and tritonclient are imported inside the modules that need them, so `import trt_redrafter.serving`
works without the `serving` extra.
"""

# The engine model's name in the repository: TensorRT-LLM's, so clients written for its ensemble work unchanged.
ENGINE_MODEL = "tensorrt_llm"
ENSEMBLE_MODEL = "ensemble"
# A `stop=true` request with this id ends every open request (the launcher's drain before shutdown).
DRAIN_REQUEST_ID = "__all__"
