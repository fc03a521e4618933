"""Triton Python model: TensorRT-LLM's `tensorrt_llm_bls`, the ensemble's text interface in one model that calls
preprocessing -> tensorrt_llm -> postprocessing with Triton's business-logic scripting (BLS).

Each request runs in a thread of its own (so requests batch in flight in the engine), answered through its response
sender: decoupled, one response per engine response (streaming) and a final flag; not decoupled, exactly one
response. Inputs go to the model that uses them under that model's name (TensorRT-LLM's mapping); an error of any
step is the request's one error response. Pure Triton code: a stock tritonserver loads it without trt-redrafter.
"""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PREPROCESSING, ENGINE, POSTPROCESSING = "preprocessing", "tensorrt_llm", "postprocessing"

# request input -> preprocessing input
TO_PRE = {"text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
          "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
          "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
          "end_id": "END_ID", "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
          "apply_chat_template": "APPLY_CHAT_TEMPLATE"}
# preprocessing output -> engine input
PRE_TO_ENGINE = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
                 "REQUEST_OUTPUT_LEN": "request_output_len", "BAD_WORDS_IDS": "bad_words_list",
                 "STOP_WORDS_IDS": "stop_words_list", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id"}
# request input -> engine input, passed as given
TO_ENGINE = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "length_penalty": "len_penalty",
             "stream": "streaming", **{n: n for n in (
                 "temperature", "repetition_penalty", "min_length", "min_tokens", "presence_penalty",
                 "frequency_penalty", "random_seed", "seed", "return_log_probs", "return_context_logits",
                 "return_generation_logits", "return_perf_metrics", "return_num_input_tokens",
                 "return_num_output_tokens", "num_return_sequences", "beam_width", "exclude_input_in_output",
                 "prompt_embedding_table", "prompt_vocab_size", "lora_task_id", "lora_weights", "lora_config",
                 "guided_decoding_guide_type", "guided_decoding_guide", "decoding_mode", "proposer")}}
# engine outputs this model returns as they are (text_output comes from postprocessing)
PASSTHROUGH = ("output_ids", "cum_log_probs", "output_log_probs", "context_logits", "generation_logits",
               "batch_index", "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
               "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
               "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
               "num_input_tokens", "num_output_tokens")
# the speculative mode of TensorRT-LLM's BLS drafts with a second model; ReDrafter drafts inside the engine
DRAFT_MODEL_INPUTS = ("num_draft_tokens", "use_draft_logits")


class BLSError(Exception):
    """A request this model refuses, or a composing model's error, with its Triton status code."""

    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = pb_utils.TritonError.INVALID_ARG if code is None else code


def _inputs(request) -> dict:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def _exec(model: str, tensors: dict, request_id: str, decoupled: bool = False):
    req = pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor(k, v) for k, v in tensors.items()],
                                    requested_output_names=[], request_id=request_id)
    return req.exec(decoupled=decoupled)


def _outputs(response, step: str) -> dict:
    if response.has_error():
        raise BLSError(f"{step}: {response.error().message()}")  # a composing model's refusal: the client's
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            t = threading.Thread(target=self._serve, args=(request, sender), daemon=True)
            with self.lock:
                self.threads.add(t)
            t.start()
        return None

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=5.0)

    def _serve(self, request, sender):
        sent_final = False
        try:
            sent_final = self._generate(request, sender)
        except BLSError as e:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), e.code)), flags=FINAL)
            sent_final = True
        except Exception as e:  # still exactly one answer
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"tensorrt_llm_bls failed ({type(e).__name__}: {e})")), flags=FINAL)
            sent_final = True
        finally:
            if not sent_final:
                if self.decoupled:
                    sender.send(flags=FINAL)
                else:
                    sender.send(pb_utils.InferenceResponse([]), flags=FINAL)
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _generate(self, request, sender) -> bool:
        """Run the three steps; returns whether the final response was sent."""
        inputs, rid = _inputs(request), request.request_id()
        for name in DRAFT_MODEL_INPUTS:
            if name in inputs and np.any(inputs[name]):
                raise BLSError(f"{name} asks for drafting with a separate draft model; ReDrafter drafts inside the "
                               f"engine: leave it out.")
        pre_in = {TO_PRE[k]: v for k, v in inputs.items() if k in TO_PRE}
        pre = _outputs(_exec(PREPROCESSING, pre_in, rid), PREPROCESSING)
        engine_in = {PRE_TO_ENGINE[k]: v for k, v in pre.items() if k in PRE_TO_ENGINE}
        engine_in.update({TO_ENGINE[k]: v for k, v in inputs.items() if k in TO_ENGINE})
        streaming = bool(inputs["stream"].reshape(-1)[0]) if "stream" in inputs else False
        if self.decoupled:
            responses = _exec(ENGINE, engine_in, rid, decoupled=True)
        else:
            responses = [_exec(ENGINE, engine_in, rid)]
        pending = None  # the last response, held back so the final flag goes on it
        for response in responses:
            if sender.is_cancelled():
                if hasattr(responses, "cancel"):
                    responses.cancel()
                return True  # nobody to answer
            out = _outputs(response, ENGINE)
            if "output_ids" not in out:  # a bare final flag
                continue
            if pending is not None:
                sender.send(pending)
            pending = self._response(out, rid)
            if not streaming and not self.decoupled:
                break
        if pending is None:
            return False
        sender.send(pending, flags=FINAL)
        return True

    def _response(self, out: dict, rid: str):
        post_in = {"TOKENS_BATCH": out["output_ids"], "SEQUENCE_LENGTH": out["sequence_length"]}
        if "preceding_output_ids" in out:
            post_in["PRECEDING_TOKENS"] = out["preceding_output_ids"]
        post = _outputs(_exec(POSTPROCESSING, post_in, rid), POSTPROCESSING)
        tensors = [pb_utils.Tensor("text_output", post["OUTPUT"])]
        tensors += [pb_utils.Tensor(name, out[name]) for name in PASSTHROUGH if name in out]
        return pb_utils.InferenceResponse(tensors)
