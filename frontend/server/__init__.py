"""tidal's OpenAI-compatible HTTP server (`tidal serve`).

    protocol.py   pydantic request / response models (OpenAI field names plus vLLM's extras)
    errors.py     the OpenAI error body and the status every failure maps to
    admission.py  `--max-num-queued-reqs` / `--max-num-queued-tokens`: whole-server admission
                  control (HTTP 503)
    metrics.py    Prometheus metrics under the `tidal:` prefix, whole-server with N processes
    serving.py    one request end to end: validation, admission, generation, disconnects
    completions.py  POST /v1/completions (JSON body or server-sent events)
    chat.py       POST /v1/chat/completions (the tokenizer's chat template)
    responses.py  the OpenAI response / chunk / logprobs shapes as plain dicts, SSE framing
    app.py        the FastAPI application (routes, API key, lifespan)
    serve.py      `tidal serve`: command-line flags and the processes (daemon + N servers)

Nothing here imports prometheus_client at package import time: with several server
processes the multiprocess directory must be set before it is imported (see metrics.py).
"""
