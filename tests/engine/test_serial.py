"""The engine core's messages: msgpack with a fixed list of types, no pickle."""
from __future__ import annotations

import dataclasses
import fractions
import pickle

import msgpack
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.messages import AddRequest, Call, EngineStats, StepOutputs
from pagedllm.engine.serial import decode, decode_error, encode, encode_error
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams


def test_messages_come_back_equal() -> None:
    params = SamplingParams(n=2, temperature=0.7, stop=["\n"], logit_bias={5: -1.5}, logprobs=2,
                            output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    logprobs = TokenLogprobs(sampled_logprob=-0.5, sampled_rank=1, top_token_ids=[5, 9], top_logprobs=[-0.5, -1.0])
    core = EngineCoreOutput(request_id="0:r", new_token_ids=[5, 6], new_logprobs=[logprobs, None], finish_reason="stop",
                            stop_reason="\n", first_scheduled_time=12.5, num_cached_tokens=16)
    out = RequestOutput("r", "hi", [1, 2], [CompletionOutput(0, "a", [5], -0.5, [{5: Logprob(-0.5, 1, "a")}])],
                        True, 0, RequestMetrics(1.0, 2.0), [None, {2: Logprob(-3.0, 4, "b")}])
    add = AddRequest(request_id="r", seq_ids=["0:r", "1:r"], prompt_ids=[1, 2], params=params, arrival_time=3.5,
                     lora_request=LoRARequest("a", 1, "/x"))
    step = StepOutputs(outputs=[core], beam_outputs=[out], stats=EngineStats(num_steps=3, kv_cache_usage=0.25))
    message = [add, BeamSearchParams(2, 8), step, EngineArgs(model="m")]
    back = decode(encode(message))
    assert back == message
    assert back[0].params.output_kind is RequestOutputKind.DELTA and back[0].params.logit_bias == {5: -1.5}
    assert decode(encode((1, 2))) == [1, 2]


def test_anything_else_is_refused_both_ways() -> None:
    @dataclasses.dataclass
    class Unlisted:
        x: int = 1

    for value in (Unlisted(), object(), {1, 2}):
        with pytest.raises(TypeError, match="cannot cross to the engine core process"):
            encode(Call(call_id=0, method="x", args=[value]))
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Popen", {"args": ["true"]}])))  # not a listed type
    with pytest.raises(KeyError):
        decode(forged)
    with pytest.raises(ValueError):  # (msgpack's ExtraData; the pickle of a local class could not even be made)
        decode(pickle.dumps(fractions.Fraction(1, 3)))  # a pickle is not a message


def test_errors_keep_their_parameter() -> None:
    error = decode_error(decode(encode(encode_error(ValidationError("bad", param="max_tokens", value=object())))))
    assert isinstance(error, ValidationError) and error.param == "max_tokens" and error.value.startswith("<object")
    other = decode_error(encode_error(KeyError("x")))
    assert isinstance(other, RuntimeError) and "KeyError in the engine core" in str(other)
