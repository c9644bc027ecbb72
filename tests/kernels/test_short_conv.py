"""The fused ShortConv kernels (`triton_short_conv`) against float64 references: the decode step (conv over the
saved taps and the new input, the state shifted by one) and the prefill chunks (conv over each chunk continuing its
saved inputs, the state the last kernel-1 inputs up to the chunk's real length), with a residual the add and
RMSNorm. Run by Triton's CPU interpreter in a child process, and compiled on the GPU at inkling-small's widths
(marked gpu); the chunk reference is itself checked against the engine's torch path (`ExtendForward._sconv`)."""

import functools
import os
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import ChildRun, assert_close, rms_norm_f64

INTERPRETED = ChildRun.interpreted("tests.kernels.test_short_conv")


def reference(x, state, seq_slots, weight, residual, norm_weight, eps):
    """float64: (conv + x, or (h + it, RMSNorm(h + it)) when a residual is given; the rows' new state)."""
    xd = x.double()
    window = torch.cat([state[seq_slots].double(), xd[:, :, None]], dim=-1)  # [B, C, kernel]
    y = (window * weight[:, 0].double()).sum(-1) + xd
    new_state = window[:, :, 1:].float()
    if residual is None:
        return y, new_state
    h = residual.double() + y
    normed = rms_norm_f64(h, norm_weight, eps)
    return (h, normed), new_state


def check_short_conv(device: str, dtype: torch.dtype, rows: int, channels: int, kernel: int, norm: bool) -> None:
    """Rows on distinct sequence slots of a pool with more slots (the others must stay untouched); x a column
    slice of a wider tensor and the state a channel slice of a wider buffer, as the engine passes them."""
    from inkwell.kernels.triton_short_conv import short_conv_step

    gen = torch.Generator().manual_seed(rows * 1000 + channels + kernel)
    wide = torch.randn(rows, channels + 24, generator=gen).to(dtype)
    x = wide[:, 8 : 8 + channels]
    pool = torch.randn(rows + 3, channels + 16, kernel - 1, generator=gen)
    state = pool[:, 16:]
    seq_slots = torch.randperm(rows + 3, generator=gen)[:rows]
    weight = (torch.randn(channels, 1, kernel, generator=gen) / kernel).to(dtype)
    residual = torch.randn(rows, channels, generator=gen).to(dtype) if norm else None
    norm_weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(dtype) if norm else None
    eps = 1e-6
    expected, expected_state = reference(x, state, seq_slots, weight, residual, norm_weight, eps)
    before = pool.clone()

    def dev(t):
        return None if t is None else t.to(device)

    d_pool, d_x = pool.to(device), dev(wide)[:, 8 : 8 + channels]
    got = short_conv_step(d_x, d_pool[:, 16:], dev(seq_slots), dev(weight), dev(residual), dev(norm_weight), eps)
    got_pool = d_pool.cpu()
    assert torch.equal(got_pool[seq_slots, 16:], expected_state), "the state is not the window shifted by one"
    others = torch.ones(rows + 3, dtype=torch.bool)
    others[seq_slots] = False
    assert torch.equal(got_pool[others], before[others]), "slots of no row changed"
    assert torch.equal(got_pool[:, :16], before[:, :16]), "channels outside the state slice changed"
    if norm:
        assert_close(got[0], expected[0], dtype, "residual + conv")
        assert_close(got[1], expected[1], dtype, "its RMSNorm")
        assert got[0].dtype == got[1].dtype == dtype
    else:
        assert_close(got, expected, dtype, "conv + x")
        assert got.dtype == dtype


def check_short_conv_combined(device: str, dtype: torch.dtype, tokens: int, k: int, channels: int) -> None:
    """The step whose input is the MoE's combine of each token's k dispatched rows (`combine=`): bitwise the
    combine kernel and then the step, outputs and state, so a decode graph that fuses them rounds as the eager
    forward that does not."""
    from inkwell.kernels.triton_moe import moe_combine
    from inkwell.kernels.triton_short_conv import short_conv_step

    gen = torch.Generator().manual_seed(tokens * 100 + k + channels)
    rows = torch.randn(tokens * k, channels, generator=gen).to(dtype)
    weights = torch.rand(tokens * k, generator=gen)
    places = torch.randperm(tokens * k, generator=gen)  # each token's rows anywhere among the experts' rows
    pool = torch.randn(tokens + 2, channels, 3, generator=gen)
    seq_slots = torch.randperm(tokens + 2, generator=gen)[:tokens]
    weight = (torch.randn(channels, 1, 4, generator=gen) / 4).to(dtype)
    residual = torch.randn(tokens, channels, generator=gen).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(dtype)
    rows, weights, places, seq_slots, weight, residual, norm_weight = (
        t.to(device) for t in (rows, weights, places, seq_slots, weight, residual, norm_weight)
    )
    apart, fused = pool.to(device, copy=True), pool.to(device, copy=True)
    mixed = moe_combine(rows, weights, places, tokens, dtype)
    expected = short_conv_step(mixed, apart, seq_slots, weight, residual, norm_weight, 1e-6)
    got = short_conv_step(rows, fused, seq_slots, weight, residual, norm_weight, 1e-6, combine=(weights, places))
    assert torch.equal(fused, apart), "the state differs from the combine's and then the step's"
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), "outputs differ"
    with pytest.raises(ValueError, match="combined input"):
        short_conv_step(rows[1:], fused, seq_slots, weight, residual, norm_weight, 1e-6, combine=(weights, places))


CASES = [  # (rows, channels, kernel): channels off a power of two, kernels of 2-4 taps
    (3, 40, 4),
    (5, 64, 3),
    (2, 17, 2),
]


def chunks_reference(x, state, seq_slots, lengths, weight, residual, norm_weight, eps):
    """float64, chunk by chunk: (conv + x [B, L, C], or (h + it, RMSNorm(h + it)) with a residual; the pool after
    the step, fp32). Padding places (j >= length) are computed as if the chunk went on."""
    batch, width, channels = x.shape
    kernel = weight.shape[-1]
    w = weight[:, 0].double()
    y = torch.empty(batch, width, channels, dtype=torch.float64)
    pool = state.clone()
    for b in range(batch):
        slot, length = int(seq_slots[b]), int(lengths[b])
        seq = torch.cat([state[slot].double(), x[b].double().T], dim=1)  # [C, kernel-1 + L]: saved, then the chunk
        windows = seq.unfold(1, kernel, 1)  # [C, L, kernel]: token j's window ends at its own input
        y[b] = ((windows * w[:, None, :]).sum(-1) + x[b].double().T).T
        if length > 0:
            pool[slot] = seq[:, length : length + kernel - 1].float()
    if residual is None:
        return y, pool
    h = residual.double() + y
    normed = rms_norm_f64(h, norm_weight, eps)
    return (h, normed), pool


def chunk_inputs(dtype, lengths, width, channels, kernel, norm, layout, seed):
    """The inputs of a chunk step as the engine lays them out: x a view of flat rows [B*L, C] that are a column
    slice of wider rows (layout "flat"), or a slice of a wider padded table (layout "table", rows of chunks not L
    apart); the state a channel slice of a pool with more slots than chunks; real chunks on distinct slots, the
    padding chunks (length 0) all on one scratch slot."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    if layout == "flat":
        wide = torch.randn(batch * width, channels + 24, generator=gen).to(dtype)
        x = wide[:, 8 : 8 + channels].view(batch, width, channels)
    else:
        wide = torch.randn(batch, width + 3, channels + 24, generator=gen).to(dtype)
        x = wide[:, 1 : 1 + width, 8 : 8 + channels]
    slots = batch + 3
    pool = torch.randn(slots, channels + 16, kernel - 1, generator=gen)
    scratch = slots - 1
    order = torch.randperm(slots - 1, generator=gen).tolist()
    seq_slots = torch.tensor([order[b] if n > 0 else scratch for b, n in enumerate(lengths)])
    weight = (torch.randn(channels, 1, kernel, generator=gen) / kernel).to(dtype)
    residual = torch.randn(batch, width, channels, generator=gen).to(dtype) if norm else None
    norm_weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(dtype) if norm else None
    return wide, x, pool, seq_slots, torch.tensor(lengths), weight, residual, norm_weight


def check_short_conv_chunks(
    device: str,
    dtype: torch.dtype,
    lengths: list[int],
    width: int,
    channels: int,
    kernel: int,
    norm: bool,
    layout: str = "flat",
    **launch,
) -> None:
    """short_conv_chunks against `chunks_reference` at the real places; the state of real chunks exactly the
    reference's, every other slot (the scratch one of the padding chunks too) and channel untouched."""
    from inkwell.kernels.triton_short_conv import short_conv_chunks

    seed = sum(lengths) * 1000 + width * 100 + channels + kernel
    wide, x, pool, seq_slots, lens, weight, residual, norm_weight = chunk_inputs(
        dtype, lengths, width, channels, kernel, norm, layout, seed
    )
    eps = 1e-6
    state = pool[:, 16:]
    expected, expected_state = chunks_reference(x, state, seq_slots, lens, weight, residual, norm_weight, eps)

    def dev(t):
        return None if t is None else t.to(device)

    d_pool = pool.to(device)
    d_x = dev(wide).as_strided(x.shape, x.stride(), x.storage_offset())
    assert torch.equal(d_x.cpu(), x)
    got = short_conv_chunks(
        d_x,
        d_pool[:, 16:],
        dev(seq_slots),
        dev(lens),
        dev(weight),
        dev(residual),
        dev(norm_weight),
        eps,
        **launch,
    )
    got_pool = d_pool.cpu()
    assert torch.equal(got_pool[:, 16:], expected_state), "the state is not the last kernel-1 inputs"
    assert torch.equal(got_pool[:, :16], pool[:, :16]), "channels outside the state slice changed"
    real = torch.arange(width)[None, :] < lens[:, None]  # [B, L]
    if norm:
        assert got[0].shape == got[1].shape == x.shape and got[0].dtype == got[1].dtype == dtype
        assert_close(got[0].cpu()[real], expected[0][real], dtype, "residual + conv")
        assert_close(got[1].cpu()[real], expected[1][real], dtype, "its RMSNorm")
    else:
        assert got.shape == x.shape and got.dtype == dtype
        assert_close(got.cpu()[real], expected[real], dtype, "conv + x")


CHUNK_CASES = [  # (lengths, L, C, kernel, (block_tokens, block_channels, token_blocks), layout)
    # lengths L, 1, 0 (twice: padding chunks share the scratch slot), < kernel-1 and between; programs of 2 blocks
    # of 2 tokens (the first kernel-1 tokens span two blocks; the last program is half out of the chunk) and 2
    # channel blocks, the second partly past C
    ([9, 1, 0, 2, 7, 0], 9, 40, 4, (2, 32, 2), "flat"),
    ([6, 1, 0, 3], 6, 24, 3, (4, 8, 1), "table"),
    ([4, 1, 0, 3], 4, 17, 2, (1, None, 3), "flat"),  # one saved input, a block per token
    ([2, 1, 0], 2, 24, 4, (1, None, 1), "table"),  # chunks shorter than the saved inputs
    ([12, 2, 0], 12, 40, 4, (None, None, None), "table"),  # the default launch shape
]


def run_interpreted_cases() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16):  # the interpreter rounds bf16 by truncation, fp16 as the GPU
        for rows, channels, kernel in CASES:
            for norm in (False, True):
                check_short_conv("cpu", dtype, rows, channels, kernel, norm)
        check_short_conv_combined("cpu", dtype, 3, 4, 40)
        for lengths, width, channels, kernel, (tokens, chans, loop), layout in CHUNK_CASES:
            for norm in (False, True):
                launch = dict(block_tokens=tokens, block_channels=None if norm else chans, token_blocks=loop)
                check_short_conv_chunks("cpu", dtype, lengths, width, channels, kernel, norm, layout, **launch)
    print("interpreted cases passed")


@pytest.mark.child(INTERPRETED)
def test_short_conv_kernels_match_reference_in_interpreter():
    INTERPRETED.check()


def test_short_conv_step_rejects_mismatched_state():
    from inkwell.kernels.triton_short_conv import short_conv_step

    x, weight = torch.zeros(2, 8), torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="state"):
        short_conv_step(x, torch.zeros(3, 8, 2), torch.arange(2), weight)
    with pytest.raises(ValueError, match="fp32"):
        short_conv_step(x, torch.zeros(3, 8, 3, dtype=torch.bfloat16), torch.arange(2), weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels,norm", [(2048, True), (2048, False), (1024, False)])
def test_short_conv_step_on_gpu(dtype, channels, norm):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_short_conv("cuda", dtype, 8, channels, 4, norm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_short_conv_step_combining_its_input_on_gpu(dtype, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check_short_conv_combined("cuda", dtype, tokens, 6, 2048)  # inkling-small: 4 routed + 2 shared experts a token


def test_chunk_reference_matches_the_engine_torch_path():
    """The float64 chunk reference is what `ExtendForward._sconv` and `_sconv_add_norm` compute (fp32, on the CPU),
    with x the flat rows [B*L, C] the engine passes."""
    from inkwell.serving.native.extend import ExtendForward

    lengths, width, channels, kernel, eps = [7, 1, 0, 2], 7, 24, 4, 1e-6
    for norm in (False, True):
        wide, x, pool, seq_slots, lens, weight, residual, norm_weight = chunk_inputs(
            torch.float32, lengths, width, channels, kernel, norm, "flat", 7
        )
        state = pool[:, 16:]
        expected, expected_state = chunks_reference(x, state, seq_slots, lens, weight, residual, norm_weight, eps)
        model = SimpleNamespace(sconv_weight=lambda layer, site, w=weight: w, w={"norm": norm_weight}, eps=eps)
        engine = SimpleNamespace(model=model, state=SimpleNamespace(conv=[[state]]), offsets=torch.arange(64))
        engine._sconv = functools.partial(ExtendForward._sconv, engine)
        inputs = SimpleNamespace(input_ids=torch.zeros(len(lengths), width), seq_slots=seq_slots, lengths=lens)
        flat = x.reshape(-1, channels)
        real = (torch.arange(width)[None, :] < lens[:, None]).view(-1)
        if norm:
            h, normed = ExtendForward._sconv_add_norm(engine, flat, residual.view(-1, channels), 0, 0, inputs, "norm")
            assert_close(h[real], expected[0].view(-1, channels)[real], torch.float32, "residual + conv")
            assert_close(normed[real], expected[1].view(-1, channels)[real], torch.float32, "its RMSNorm")
        else:
            y = engine._sconv(flat, 0, 0, inputs)
            assert_close(y[real], expected.view(-1, channels)[real], torch.float32, "conv + x")
        assert torch.equal(state, expected_state)


def test_short_conv_chunks_rejects_bad_shapes():
    from inkwell.kernels.triton_short_conv import short_conv_chunks

    x, weight, slots, lengths = torch.zeros(2, 5, 8), torch.zeros(8, 1, 4), torch.arange(2), torch.tensor([5, 0])
    with pytest.raises(ValueError, match="state"):
        short_conv_chunks(x, torch.zeros(3, 8, 2), slots, lengths, weight)
    with pytest.raises(ValueError, match="fp32"):
        short_conv_chunks(x, torch.zeros(3, 8, 3, dtype=torch.bfloat16), slots, lengths, weight)
    with pytest.raises(ValueError, match="unit column stride"):
        short_conv_chunks(x.transpose(1, 2), torch.zeros(3, 5, 3), slots, lengths, torch.zeros(5, 1, 4))
    with pytest.raises(ValueError, match="one entry per chunk"):
        short_conv_chunks(x, torch.zeros(3, 8, 3), slots, lengths[:1], weight)
    with pytest.raises(ValueError, match="norm_weight"):
        short_conv_chunks(x, torch.zeros(3, 8, 3), slots, lengths, weight, residual=torch.zeros(2, 5, 8))
    with pytest.raises(ValueError, match="powers of two"):
        short_conv_chunks(x, torch.zeros(3, 8, 3), slots, lengths, weight, block_tokens=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels,norm", [(2048, True), (2048, False), (1024, False)])
def test_short_conv_chunks_on_gpu(dtype, channels, norm):
    """inkling-small's sites (hidden 2048, k+v 2*4*128) over 8 chunks of up to 1,024 tokens, the launch shape
    the engine gets, a chunk of each kind (full, one token, shorter than the kernel, padding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lengths = [1024, 1, 0, 2, 777, 1000, 0, 513]
    check_short_conv_chunks("cuda", dtype, lengths, 1024, channels, 4, norm)
