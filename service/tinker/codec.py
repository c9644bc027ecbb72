"""The protobuf bodies of Tinker 0.38, read and written with the client's own generated module
(`tinker.proto.tinker_public_pb2`): a forward_backward request in, a ForwardBackwardOutput and a SampleResponse out.

Arrays are little-endian bytes: tokens int32, loss inputs float32 or int64 (dense, or sparse CSR for 2-D ones),
outputs float32 with per-datum byte offsets. inkwell's losses take one value per token, so an input must be 1-D
or `[N, 1]`. Provenance spans, which only stable_reinforce reads, are ignored (the cookbook sends them with every
RL datum).
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from inkwell.trainer.datums import Datum

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
MAX_DECOMPRESSED_BYTES = 1 << 30
EMPTY_TOPK_LOGPROB = -99999.0  # Tinker's filler for a top-k cell with no token


class CodecError(ValueError):
    """A body that is not a Tinker request inkwell can run; the message names the part."""


@dataclass(frozen=True)
class ForwardBackwardBody:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise CodecError(f"Content-Encoding {encoding!r} is not supported; send zstd or none")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED_BYTES)
    except zstandard.ZstdError as exc:
        raise CodecError(f"the zstd body could not be decompressed: {exc}") from exc


def _tensor(msg: pb.Tensor, where: str) -> list:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise CodecError(f"{where}: dtype {msg.dtype} is not float32, int64 or int32")
    shape = list(msg.shape)
    try:
        if msg.HasField("sparse_csr"):
            csr = msg.sparse_csr
            if len(shape) != 2:
                raise CodecError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            array = np.zeros(shape, dtype=dtype)
            rows = np.repeat(np.arange(shape[0]), np.diff(crow))
            array[rows, col] = values
        else:
            array = np.frombuffer(msg.dense, dtype=dtype)
            if shape:
                array = array.reshape(shape)
    except (ValueError, IndexError) as exc:
        raise CodecError(f"{where}: the bytes do not match shape {shape}: {exc}") from exc
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim not in (1, 2):
        raise CodecError(
            f"{where}: shape {shape}; inkwell's losses take one value per token ([N] or [N, 1]), or K ([N, K]: "
            "cross_entropy's target_tokens and weights)"
        )
    return array.tolist()


def _tokens(datum: pb.Datum, index: int) -> list[int]:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise CodecError(f"data[{index}].model_input: {kind} chunks are not supported; Inkling takes text tokens")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return tokens


def _config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """Loss config: loss_fn_config_v2 when set (numbers and text), else the legacy float map."""
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


def read_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The request's message: its model and seq_id are known from here on, even when a datum cannot be decoded."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError (and others) for bad bytes
        raise CodecError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    return msg


def decode_forward_backward(msg: pb.ForwardBackwardRequest) -> ForwardBackwardBody:
    data = []
    for i, datum in enumerate(msg.data):  # provenance spans (stable_reinforce's) are left unread
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens=_tokens(datum, i), loss_fn_inputs=inputs))
    return ForwardBackwardBody(msg.model_id, msg.seq_id, msg.loss_fn, _config(msg), msg.forward_only, data)


def encode_forward_backward(result: dict[str, Any]) -> bytes:
    """A session's forward(_backward) result ({logprobs: per datum, metrics}) as one ArrayRecord of logprobs, [N]
    per datum or, where K targets per token were given, [N, K] (one K per request: the trailing shape)."""
    logprobs = [np.asarray(row, dtype=np.float32) for row in result["logprobs"]]
    sizes = np.array([0] + [row.size for row in logprobs], dtype=np.int64)
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result["metrics"])
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    record.fields["logprobs"].CopyFrom(
        pb.BatchedTensor(
            data=np.concatenate([row.ravel() for row in logprobs]).tobytes() if logprobs else b"",
            offsets=(np.cumsum(sizes) * 4).tobytes(),
            dtype=pb.DTYPE_FLOAT32,
            trailing_shape=list(logprobs[0].shape[1:]) if logprobs else [],
        )
    )
    return out.SerializeToString()


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), EMPTY_TOPK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k]):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


def encode_sample(
    result: dict[str, Any], prompt_logprobs_last_n: int | None, topk_prompt_logprobs: int, topk_sample_logprobs: int = 0
) -> bytes:
    """A sampling future's result (`sampling.sample`'s shape) as a SampleResponse. Prompt positions without a
    logprob (the first, and those before the last n when only they were asked for) are NaN."""
    out = pb.SampleResponse()
    for seq in result["sequences"]:
        sequence = out.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH if seq["finish_reason"] == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(seq["tokens"], dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq["logprobs"], dtype=np.float32).tobytes(),
        )
        if topk_sample_logprobs > 0:
            sequence.topk_sampled_logprobs.CopyFrom(_topk(seq["topk_logprobs"], topk_sample_logprobs))
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        values = [math.nan if lp is None else lp for lp in prompt]
        if prompt_logprobs_last_n is not None:
            values = [math.nan] * (len(values) - prompt_logprobs_last_n) + values[-prompt_logprobs_last_n:]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    top = result.get("topk_prompt_logprobs")
    if topk_prompt_logprobs > 0 and top is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(top, topk_prompt_logprobs))
    return out.SerializeToString()
