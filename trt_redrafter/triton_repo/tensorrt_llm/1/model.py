"""Triton Python-backend adapter for trt-redrafter's torch engine; the logic is trt_redrafter.serving.engine_model."""

import json

import triton_python_backend_utils as pb_utils

from trt_redrafter.serving.engine_model import EngineModel

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Sink:
    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs, error, final, code="INVALID_ARG"):
        if error is not None:  # the status tells a client's mistake (400) from a busy server (503) or a bug (500)
            status = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(error, status))
        elif outputs is not None:
            response = pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()])
        else:
            response = None
        if response is None:  # decoupled only: a final flag without a response
            self.sender.send(flags=FINAL)
        else:
            self.sender.send(response, flags=FINAL if final else 0)

    def is_cancelled(self):
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        # the admission limit is Triton's own queue-policy field, as in TensorRT-LLM's config: this model takes
        # requests off Triton's queue at once, so the engine's scheduler enforces it on its waiting queue
        policy = config.get("dynamic_batching", {}).get("default_queue_policy", {})
        self.model = EngineModel(params["engine_dir"], int(params["tp_size"]), pb_utils.MetricFamily,
                                 model_name=args["model_name"], runtime_json=params.get("runtime_config", ""),
                                 decoupled=pb_utils.using_decoupled_model_transaction_policy(config),
                                 max_queue_size=int(policy.get("max_queue_size", 0) or 0),
                                 exclude_input_in_output=params.get("exclude_input_in_output", "true").lower()
                                 in ("true", "1", "yes"))

    def execute(self, requests):
        for request in requests:
            # every input the request carries (the config declares all of TensorRT-LLM's); parse_inputs honours
            # each or answers with one error naming it
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            self.model.submit(request.request_id(), inputs, _Sink(request.get_response_sender()))
        # responses are sent from the scheduler thread, decoupled or not (the Python backend lets a non-decoupled
        # model answer through the response sender, exactly one final response per request)
        return None

    def finalize(self):
        self.model.close()  # releases the metric families while the stub is whole (see ServingMetrics.release)
        self.model = None
