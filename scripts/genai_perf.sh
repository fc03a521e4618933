#!/usr/bin/env bash
# Benchmark `trt-redrafter serve` with NVIDIA's LLM benchmark clients from PyPI (issue 12; numbers in docs/serving.md).
#
#   scripts/genai_perf.sh [OUT]            # default OUT=out/genai-perf; about 3-4 minutes on 2 CPU cores
#
# What it does:
#   1. builds a Triton repository from the committed small trained pair (models/small: convert -> build-engine ->
#      make-repo --compile off), unless OUT/repo exists;
#   2. starts `trt-redrafter serve --repo OUT/repo --openai-port ...` in the background and waits for /health
#      (a trap always stops it: SIGINT, then SIGTERM after 60 s);
#   3. genai-perf: tries `genai-perf profile` once against the OpenAI chat endpoint and once against the ensemble
#      (KServe gRPC) and keeps its log and exit status. genai-perf only prepares inputs and then execs NVIDIA's
#      `perf_analyzer` C++ binary, which no PyPI package provides (PyPI's perf-analyzer 0.1.0 is an empty
#      placeholder), so without a `perf_analyzer` on PATH it stops with
#      `FileNotFoundError: [Errno 2] No such file or directory: 'perf_analyzer'` before sending a request;
#   4. aiperf (NVIDIA's pure-Python successor of genai-perf) at concurrency 1 and 4, fixed request count, fixed
#      input/output lengths (synthetic prompts, greedy, output length forced with ignore_eos / end_id -1):
#        chat         OpenAI /v1/chat/completions, streamed (server-side token counts: --use-server-token-count)
#        completions  OpenAI /v1/completions, streamed (server-side token counts)
#        ensemble     Triton's ensemble over HTTP /v2/models/ensemble/generate_stream (SSE), through aiperf's
#                     `template` endpoint; aiperf 0.13 speaks HTTP only (no gRPC, no KServe `infer`), so the ensemble's
#                     gRPC endpoint cannot be driven by it. Output tokens are counted client-side here.
#      Each run's JSON/CSV/JSONL exports land in OUT/aiperf/<target>-c<N>/; the mean ReDrafter tokens per engine step
#      of each run comes from the server's /metrics (trt_redrafter_tokens_per_step sum/count, warm-up included);
#   5. prints a table (TTFT, ITL = TPOT, request throughput, output tokens/s, tokens/step) and `uptime`s,
#      and writes it to OUT/summary.md.
#
# Installs (each into its own venv under OUT, reused when present; nothing goes into the project's environment):
#   python3 -m venv OUT/venv-aiperf     && OUT/venv-aiperf/bin/pip install "aiperf>=0.13.0,<0.14"
#   python3 -m venv OUT/venv-genai-perf && OUT/venv-genai-perf/bin/pip install "genai-perf>=0.0.16,<0.0.17"
#
# Env: ISL (128), OSL (64), CONCURRENCY ("1 4"), REQUESTS_PER_STREAM (8: requests = 8 x concurrency),
#      TARGETS ("chat completions ensemble"), PORT_BASE (28000: HTTP, +1 gRPC, +2 metrics, +80 OpenAI),
#      SKIP_GENAI_PERF=1 to skip step 3, PYTHON (python3: the interpreter that runs trt-redrafter).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-out/genai-perf}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
TRT=("$PY" -m trt_redrafter.cli)
ISL=${ISL:-128}
OSL=${OSL:-64}
CONCURRENCY=${CONCURRENCY:-"1 4"}
REQUESTS_PER_STREAM=${REQUESTS_PER_STREAM:-8}
TARGETS=${TARGETS:-"chat completions ensemble"}
PORT_BASE=${PORT_BASE:-28000}
HTTP_PORT=$PORT_BASE GRPC_PORT=$((PORT_BASE + 1)) METRICS_PORT=$((PORT_BASE + 2)) OPENAI_PORT=$((PORT_BASE + 80))
MODEL_NAME=small
TOKENIZER=$ROOT/models/small/base
log() { echo "[genai_perf] $*" >&2; }

# ---- 1. model repository ---------------------------------------------------------------------------------------
if [ ! -f "$OUT/repo/ensemble/config.pbtxt" ]; then
    log "building the model repository from models/small"
    "${TRT[@]}" convert --base-model models/small/base --drafter models/small/drafter --output "$OUT/ckpt" --force \
        --dtype float32 --num-beams 4 --draft-len-per-beam 4
    "${TRT[@]}" build-engine --checkpoint "$OUT/ckpt" --output "$OUT/engine" --tokenizer models/small/base --force \
        --max-batch-size 8 --max-input-len 256 --max-seq-len 512
    "${TRT[@]}" make-repo --engine "$OUT/engine" --output "$OUT/repo" --compile off --force
fi

# ---- tools -----------------------------------------------------------------------------------------------------
ISOLATED=(env -u PYTHONPATH)  # the tools' venvs must not see this checkout (PYTHONPATH=. would put it on their path)
venv() {  # venv DIR REQUIREMENT: create DIR and pip-install REQUIREMENT unless DIR/bin/python already has it
    if [ ! -x "$1/bin/python" ] || ! "${ISOLATED[@]}" "$1/bin/pip" show "${2%%[<>=]*}" >/dev/null 2>&1; then
        log "installing $2 into $1"
        "${ISOLATED[@]}" python3 -m venv "$1"
        "${ISOLATED[@]}" "$1/bin/pip" install -q "$2" 2>&1 | grep -v "^WARNING: Location" >&2 || true
        "${ISOLATED[@]}" "$1/bin/pip" show "${2%%[<>=]*}" >/dev/null
    fi
}
venv "$OUT/venv-aiperf" "aiperf>=0.13.0,<0.14"
AIPERF=$OUT/venv-aiperf/bin/aiperf
if [ "${SKIP_GENAI_PERF:-0}" != 1 ]; then
    venv "$OUT/venv-genai-perf" "genai-perf>=0.0.16,<0.0.17"
fi

# ---- 2. server -------------------------------------------------------------------------------------------------
SERVE_PID=
stop_server() {
    [ -n "$SERVE_PID" ] || return 0
    if kill -0 "$SERVE_PID" 2>/dev/null; then
        log "stopping serve (pid $SERVE_PID)"
        kill -INT "$SERVE_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
        kill -TERM "$SERVE_PID" 2>/dev/null || true
    fi
    wait "$SERVE_PID" 2>/dev/null || true
    SERVE_PID=
}
trap stop_server EXIT
trap 'exit 130' INT TERM
log "starting serve (HTTP $HTTP_PORT, gRPC $GRPC_PORT, metrics $METRICS_PORT, OpenAI $OPENAI_PORT); log: $OUT/serve.log"
"${TRT[@]}" serve --repo "$OUT/repo" --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
    --openai-port "$OPENAI_PORT" --openai-model-name "$MODEL_NAME" >"$OUT/serve.log" 2>&1 &
SERVE_PID=$!
for i in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$OPENAI_PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVE_PID" 2>/dev/null || { tail -20 "$OUT/serve.log" >&2; log "serve exited"; exit 1; }
    [ "$i" = 300 ] && { log "serve not ready after 300 s"; exit 1; }
    sleep 1
done
log "ready after ${i} s"

# ---- 3. genai-perf ---------------------------------------------------------------------------------------------
if [ "${SKIP_GENAI_PERF:-0}" != 1 ]; then
    GP=$OUT/genai-perf
    rm -rf "$GP"; mkdir -p "$GP"
    common=(--tokenizer "$TOKENIZER" --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0
            --output-tokens-mean "$OSL" --output-tokens-stddev 0 --concurrency 1 --request-count 8)
    for t in chat ensemble; do
        if [ $t = chat ]; then
            args=(-m "$MODEL_NAME" --endpoint-type chat --streaming -u "127.0.0.1:$OPENAI_PORT")
        else
            args=(-m ensemble --endpoint-type kserve --backend tensorrtllm --streaming -u "127.0.0.1:$GRPC_PORT")
        fi
        set +e
        "${ISOLATED[@]}" "$OUT/venv-genai-perf/bin/genai-perf" profile "${args[@]}" "${common[@]}" --artifact-dir "$GP/$t" \
            >"$GP/$t.log" 2>&1
        echo $? >"$GP/$t.rc"
        set -e
        log "genai-perf $t: exit $(cat "$GP/$t.rc"); $(grep -m1 -oE "[A-Za-z]*Error: .*" "$GP/$t.log" || echo 'no error')"
    done
fi

# ---- 4. aiperf -------------------------------------------------------------------------------------------------
# (a path relative to OUT, where aiperf runs: aiperf reads a template path with a symlink anywhere in it as
# an inline template instead)
cat >"$OUT/ensemble_template.json" <<'EOF'
{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": {{ stream|tojson }}, "end_id": -1}
EOF
metric() {  # metric NAME: the value of trt_redrafter_NAME on /metrics
    curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | awk -v m="trt_redrafter_$1{" 'index($0, m) == 1 {print $2}'
}
AP=$OUT/aiperf
rm -rf "$AP"; mkdir -p "$AP"
: >"$OUT/uptime.txt"
for c in $CONCURRENCY; do
    for t in $TARGETS; do
        case $t in
            chat) args=(-m "$MODEL_NAME" --endpoint-type chat -u "http://127.0.0.1:$OPENAI_PORT" --use-server-token-count
                        --extra-inputs temperature:0 --extra-inputs ignore_eos:true) ;;
            completions) args=(-m "$MODEL_NAME" --endpoint-type completions -u "http://127.0.0.1:$OPENAI_PORT"
                               --use-server-token-count --extra-inputs temperature:0 --extra-inputs ignore_eos:true) ;;
            ensemble) args=(-m ensemble --endpoint-type template --endpoint /v2/models/ensemble/generate_stream
                            -u "http://127.0.0.1:$HTTP_PORT" --extra-inputs payload_template:ensemble_template.json
                            --extra-inputs response_field:text_output) ;;
            *) log "unknown target $t"; exit 2 ;;
        esac
        run=$t-c$c
        s0=$(metric tokens_per_step_sum) n0=$(metric tokens_per_step_count)
        echo "$run before: $(uptime)" >>"$OUT/uptime.txt"
        log "aiperf $run: concurrency $c, $((c * REQUESTS_PER_STREAM)) requests, ISL $ISL, OSL $OSL"
        (cd "$OUT" && "${ISOLATED[@]}" "$AIPERF" profile "${args[@]}" --streaming --tokenizer "$TOKENIZER" \
            --prompt-input-tokens-mean "$ISL" --prompt-input-tokens-stddev 0 \
            --prompt-output-tokens-mean "$OSL" --prompt-output-tokens-stddev 0 \
            --concurrency "$c" --request-count $((c * REQUESTS_PER_STREAM)) --warmup-request-count "$c" \
            --random-seed 0 --ui-type none --no-server-metrics --no-gpu-telemetry --no-auto-plot \
            --output-artifact-dir "$AP/$run") >"$AP/$run.log" 2>&1 || { tail -30 "$AP/$run.log" >&2; exit 1; }
        echo "$run after:  $(uptime)" >>"$OUT/uptime.txt"
        s1=$(metric tokens_per_step_sum) n1=$(metric tokens_per_step_count)
        awk -v s0="$s0" -v s1="$s1" -v n0="$n0" -v n1="$n1" \
            'BEGIN {printf "{\"tokens_per_step_sum\": %s, \"steps\": %s}\n", s1 - s0, n1 - n0}' >"$AP/$run/server_steps.json"
    done
done
stop_server

# ---- 5. table --------------------------------------------------------------------------------------------------
"$PY" - "$OUT" "$ISL" "$OSL" <<'EOF' | tee "$OUT/summary.md"
import json, pathlib, sys

out, isl, osl = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def stat(d, k, s="avg"):
    v = d.get(k)
    return v.get(s) if isinstance(v, dict) else None
def f(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"
print(f"aiperf, ISL {isl} (client tokens of the synthetic user text), OSL {osl}, greedy, streamed; prompt tokens: "
      "the server's usage count (the ensemble gets the completions prompts; aiperf counts no input tokens for it)\n")
print("| target | conc | requests (errors) | prompt tokens | TTFT p50 / avg ms | ITL (TPOT) p50 / avg ms "
      "| req/s | output tok/s | tokens/step |")
print("|---|---|---|---|---|---|---|---|---|")
for run in sorted((out / "aiperf").iterdir(), key=lambda p: (int(p.name.rsplit("-c", 1)[-1]) if p.is_dir() else 0, p.name)):
    j = run / "profile_export_aiperf.json"
    if not j.is_file():
        continue
    d = json.loads(j.read_text())
    t, c = run.name.rsplit("-c", 1)
    steps = json.loads((run / "server_steps.json").read_text())
    tps = steps["tokens_per_step_sum"] / steps["steps"] if steps["steps"] else None
    n = stat(d, "request_count")
    err = len(d.get("error_summary") or [])
    prompt = stat(d, "usage_prompt_tokens") or stat(d, "input_sequence_length")
    print(f"| {t} | {c} | {f(n, 0)} ({err}) | {f(prompt, 0)} | {f(stat(d, 'time_to_first_token', 'p50'))} / "
          f"{f(stat(d, 'time_to_first_token'))} | {f(stat(d, 'inter_token_latency', 'p50'), 2)} / "
          f"{f(stat(d, 'inter_token_latency'), 2)} | {f(stat(d, 'request_throughput'), 2)} | "
          f"{f(stat(d, 'output_token_throughput'))} | {f(tps, 2)} |")
gp = out / "genai-perf"
if gp.is_dir():
    print()
    for rc in sorted(gp.glob("*.rc")):
        log = (gp / (rc.stem + ".log")).read_text(errors="replace")
        err = next((l.strip() for l in log.splitlines() if "Error:" in l), "")
        print(f"genai-perf {rc.stem}: exit {rc.read_text().strip()} {err}")
print()
print((out / "uptime.txt").read_text().rstrip())
EOF
