"""The protobuf codec against the client's own encoder and decoder (tinker.proto.request_conv / response_conv):
a forward_backward request as the client writes it (zstd too, CSR and [N, 1] inputs) reads back as datums, and
the outputs inkwell writes read back in the client as the values they came from."""

import pytest
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from inkwell.service.tinker import codec


def _request(datum: types.Datum, config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo", loss_fn_config=config),
        model_id="ts_1:train:0",
        seq_id=3,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_clients_request_reads_back_as_datums():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.tensor([[6], [7], [8]])),  # [N, 1]
            "logprobs": [-1.0, -2.0, -0.5],
            "advantages": types.TensorData.from_torch(torch.tensor([1.0, 0.0, -1.0])),
        },
    )
    raw = zstandard.ZstdCompressor().compress(_request(datum, {"clip_low_threshold": 0.9}))
    body = codec.decode_forward_backward(codec.read_forward_backward(codec.decompress(raw, "zstd")))
    assert (body.model_id, body.seq_id, body.loss_fn, body.forward_only) == ("ts_1:train:0", 3, "ppo", False)
    assert body.loss_fn_config == {"clip_low_threshold": pytest.approx(0.9)}
    (got,) = body.data
    assert got.tokens == [5, 6, 7]
    assert got.loss_fn_inputs == {"target_tokens": [6, 7, 8], "logprobs": [-1.0, -2.0, -0.5], "advantages": [1, 0, -1]}


def test_sparse_inputs_and_refusals():
    sparse = types.TensorData(
        data=[1.0, 2.0], dtype="float32", shape=[3, 1], sparse_crow_indices=[0, 1, 1, 2], sparse_col_indices=[0, 0]
    )
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"weights": sparse})
    (got,) = codec.decode_forward_backward(codec.read_forward_backward(_request(datum))).data
    assert got.loss_fn_inputs["weights"] == [1.0, 0.0, 2.0]
    wide = types.Datum(  # K values per token: read as [N][K] (the trainer decides which inputs may be so)
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"weights": types.TensorData(data=[1.0, 0.5] * 2, dtype="float32", shape=[2, 2])},
    )
    (got,) = codec.decode_forward_backward(codec.read_forward_backward(_request(wide))).data
    assert got.loss_fn_inputs["weights"] == [[1.0, 0.5], [1.0, 0.5]]
    deep = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"weights": types.TensorData(data=[1.0] * 8, dtype="float32", shape=[2, 2, 2])},
    )
    msg = codec.read_forward_backward(_request(deep))
    assert (msg.model_id, msg.seq_id) == ("ts_1:train:0", 3)  # known before a datum fails to decode
    with pytest.raises(codec.CodecError, match=r"shape \[2, 2, 2\]; inkwell's losses take one value per token"):
        codec.decode_forward_backward(msg)
    with pytest.raises(codec.CodecError, match="not a ForwardBackwardRequest"):
        codec.read_forward_backward(b"\xff\xff\xff")
    with pytest.raises(codec.CodecError, match="gzip"):
        codec.decompress(b"", "gzip")


def test_outputs_read_back_in_the_client():
    out = deserialize_forward_backward_output(
        codec.encode_forward_backward({"logprobs": [[-1.0, -2.5], [-0.25]], "metrics": {"loss:sum": 3.75}})
    )
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
    assert out.metrics == {"loss:sum": 3.75}
    wide = [[[-1.0, -3.0], [-2.5, -0.5]], [[-0.25, -4.0]]]  # K = 2 targets per token
    out = deserialize_forward_backward_output(codec.encode_forward_backward({"logprobs": wide, "metrics": {}}))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == wide
    result = {
        "sequences": [
            {"tokens": [4, 5], "logprobs": [-0.5, -1.5], "finish_reason": "length"},
            {"tokens": [6], "logprobs": [-0.75], "finish_reason": "stop"},
        ],
        "prompt_logprobs": [None, -1.0, -2.0, -3.0],
        "topk_prompt_logprobs": [None, [(1, -0.5), (2, -1.0)], [(3, -0.25)], []],
    }
    sample = deserialize_sample_response(codec.encode_sample(result, 2, 2))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([4, 5], [-0.5, -1.5], "length"),
        ([6], [-0.75], "stop"),
    ]
    assert sample.prompt_logprobs[:2] == [None, None] and sample.prompt_logprobs[2:] == [-2.0, -3.0]
    top = sample.topk_prompt_logprobs_np
    assert top.logprobs.shape == (4, 2) and top.token_ids[1].tolist() == [1, 2]
    assert top.logprobs[2].tolist() == [-0.25, codec.EMPTY_TOPK_LOGPROB]
    assert top.logprobs[0].tolist() == [codec.EMPTY_TOPK_LOGPROB] * 2  # the first position has no top-k
    whole = deserialize_sample_response(codec.encode_sample(result, None, 0))
    assert whole.prompt_logprobs == [None, -1.0, -2.0, -3.0] and whole.topk_prompt_logprobs_np is None
