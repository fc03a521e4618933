#!/usr/bin/env python3
"""bench-structured's tasks through the stock clients of a running `trt-redrafter serve --openai-port`: the `openai`
client (whole and streamed, `response_format` json_schema) and Triton's gRPC client on the ensemble (`text_input`
with the guided_decoding inputs, streamed API), AR and ReDrafter, greedy. Every answer is parsed and validated against
its schema; prints the valid counts per client and mode, and whether each task's texts agree across all of them.

    trt-redrafter make-repo --engine ENGINE --output REPO
    trt-redrafter serve --repo REPO --openai-port 8099 --grpc-port 8091 &
    python scripts/structured_clients.py --openai http://localhost:8099/v1 --grpc localhost:8091
"""

from __future__ import annotations

import argparse
import json
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from openai import OpenAI

from trt_redrafter.bench.structured import TASKS, valid


def _openai(url: str, max_tokens: int) -> dict:
    client = OpenAI(base_url=url, api_key="none")
    model = client.models.list().data[0].id
    out = {}
    for t in TASKS:
        fmt = {"type": "json_schema", "json_schema": {"name": t["name"], "schema": t["schema"]}}
        kw = dict(model=model, messages=[{"role": "user", "content": t["prompt"]}], temperature=0,
                  max_tokens=max_tokens, response_format=fmt)
        for mode in ("ar", "redrafter"):
            whole = client.chat.completions.create(**kw, extra_body={"decoding_mode": mode})
            stream = client.chat.completions.create(**kw, extra_body={"decoding_mode": mode}, stream=True)
            out[("openai", mode, t["name"])] = whole.choices[0].message.content
            out[("openai-stream", mode, t["name"])] = "".join(c.choices[0].delta.content or "" for c in stream
                                                              if c.choices)
    return out


def _tensor(name: str, value: np.ndarray, dtype: str):
    x = grpcclient.InferInput(name, list(value.shape), dtype)
    x.set_data_from_numpy(value)
    return x


def _triton(url: str, max_tokens: int) -> dict:
    client = grpcclient.InferenceServerClient(url)
    out = {}
    for t in TASKS:
        for mode in ("ar", "redrafter"):
            inputs = [_tensor("text_input", np.array([[t["prompt"].encode()]], dtype=object), "BYTES"),
                      _tensor("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
                      _tensor("stream", np.array([[False]]), "BOOL"),
                      _tensor("apply_chat_template", np.array([[True]]), "BOOL"),
                      _tensor("decoding_mode", np.array([[mode.encode()]], dtype=object), "BYTES"),
                      _tensor("guided_decoding_guide_type", np.array([[b"json_schema"]], dtype=object), "BYTES"),
                      _tensor("guided_decoding_guide", np.array([[json.dumps(t["schema"]).encode()]], dtype=object),
                              "BYTES")]
            got: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: got.put(error or result))
            client.async_stream_infer("ensemble", inputs)
            client.stop_stream()
            results = [got.get() for _ in range(got.qsize())]
            errors = [r for r in results if isinstance(r, Exception)]
            if errors:
                raise SystemExit(f"{t['name']} ({mode}): {errors[0]}")
            out[("triton-grpc", mode, t["name"])] = "".join(
                r.as_numpy("text_output").reshape(-1)[0].decode() for r in results
                if r.as_numpy("text_output") is not None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--openai", default="http://localhost:8099/v1")
    p.add_argument("--grpc", default="localhost:8091")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    texts = {**_openai(args.openai, args.max_tokens), **_triton(args.grpc, args.max_tokens)}
    schemas = {t["name"]: t["schema"] for t in TASKS}
    counts: dict = {}
    for (client, mode, task), text in texts.items():
        ok, why = valid(text, schemas[task])
        counts.setdefault((client, mode), []).append(ok)
        if not ok:
            print(f"invalid: {client} {mode} {task}: {why}: {text[:120]!r}")
    for (client, mode), oks in counts.items():
        print(f"{client:14s} {mode:9s} {sum(oks)}/{len(oks)} valid")
    agree = sum(len({v for (c, m, t), v in texts.items() if t == task}) == 1 for task in schemas)
    print(f"tasks whose texts agree across clients and modes: {agree}/{len(schemas)}")


if __name__ == "__main__":
    main()
