"""InferenceService: validate -> the shared request path (gateway.inference) -> protobuf replies.
Failures are exceptions (see interceptors)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.completion import Delta
from gateway.inference import Inference
from gateway.validation import validate
from nightjar.v1 import inference_pb2 as pb
from nightjar.v1 import inference_pb2_grpc as pb_grpc

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, inference: Inference) -> None:
        self._inference = inference

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        inf = self._inference
        return pb.GetModelInfoResponse(
            model=inf.cfg.model_name, draft_model=inf.cfg.draft_name,
            max_context_tokens=inf.limits.max_context_tokens, max_tokens_limit=inf.limits.max_tokens_limit,
            vocab_size=len(inf.tokenizer), gamma_max=inf.cfg.gamma_max,
        )

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        valid = validate(request, self._inference.limits)
        request_id = self._inference.new_request_id()
        reply_id = valid.client_request_id or request_id
        # The generator's finally does not run when gRPC drops a cancelled stream that is
        # suspended at a yield, so the RPC's done-callback releases the request too.
        on_admit = lambda release: context.add_done_callback(lambda _ctx: release())  # noqa: E731
        async for event in self._inference.generate(request_id, valid, context.time_remaining(), on_admit=on_admit):
            if isinstance(event, Delta):
                yield pb.GenerateResponse(request_id=reply_id, text=event.text, token_ids=event.token_ids)
            else:
                yield pb.GenerateResponse(
                    request_id=reply_id, finish_reason=FINISH[event.finish_reason],
                    usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
                    ttft_ms=(event.ttft_s or 0.0) * 1000, e2e_ms=event.e2e_s * 1000,
                )
