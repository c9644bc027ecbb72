"""The reference multi-LoRA ops against a per-row loop written from the definitions."""

import pytest
import torch

from inkwell.kernels import (
    expert_lora_shrink,
    expert_out_lora_expand,
    lora_expand,
    lora_shrink,
)
from inkwell.kernels.torch_ops import expert_in_lora_expand
from tests.kernels.lora_checks import expert_groups


def _slots(t: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """Random slots in -1..s-1 with every slot (and the base) present at least once when t allows."""
    slots = torch.randint(-1, s, (t,), generator=gen)
    slots[: min(t, s + 1)] = torch.arange(-1, min(t, s + 1) - 1)
    return slots[torch.randperm(t, generator=gen)]


@pytest.mark.parametrize("t,s,r,k,n", [(1, 1, 4, 8, 16), (13, 3, 8, 32, 24), (40, 5, 16, 64, 48)])
def test_linear_shrink_expand_match_per_row_loop(t, s, r, k, n):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=gen)
    a = torch.randn(s, r, k, generator=gen)
    b = torch.randn(s, n, r, generator=gen)
    scalings = torch.rand(s, generator=gen) + 0.5
    slots = _slots(t, s, gen)
    base = torch.randn(t, n, generator=gen)

    y = lora_shrink(x, a, slots)
    out = lora_expand(y, b, slots, scalings, base.clone())

    for i in range(t):
        if slots[i] < 0:
            assert torch.equal(y[i], torch.zeros(r))
            assert torch.equal(out[i], base[i])
            continue
        ref_y = a[slots[i]] @ x[i]
        torch.testing.assert_close(y[i], ref_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[i], base[i] + scalings[slots[i]] * (b[slots[i]] @ ref_y), rtol=1e-5, atol=1e-4)


def test_expand_adds_in_place_and_returns_out():
    out = torch.ones(3, 2)
    y = torch.ones(3, 1)
    b = torch.full((1, 2, 1), 2.0)
    res = lora_expand(y, b, torch.tensor([0, -1, 0]), torch.tensor([0.5]), out)
    assert res is out
    assert out.tolist() == [[2.0, 2.0], [1.0, 1.0], [2.0, 2.0]]


def test_all_base_tokens_leave_everything_untouched():
    x = torch.randn(4, 8)
    slots = torch.full((4,), -1)
    assert torch.equal(lora_shrink(x, torch.randn(2, 4, 8), slots), torch.zeros(4, 4))
    out = torch.randn(4, 6)
    before = out.clone()
    lora_expand(torch.randn(4, 4), torch.randn(2, 6, 4), slots, torch.ones(2), out)
    assert torch.equal(out, before)


def test_zero_padded_rank_equals_unpadded():
    gen = torch.Generator().manual_seed(7)
    x, a, b = torch.randn(5, 16, generator=gen), torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen)
    a_pad, b_pad = torch.zeros(1, 12, 16), torch.zeros(1, 8, 12)
    a_pad[0, :4], b_pad[0, :, :4] = a, b
    slots = torch.zeros(5, dtype=torch.long)
    out = lora_expand(lora_shrink(x, a_pad, slots), b_pad, slots, torch.tensor([2.0]), torch.zeros(5, 8))
    torch.testing.assert_close(out, 2.0 * x @ a.t() @ b.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("covered", ["both", "routed", "shared"])
@pytest.mark.parametrize("m,s,e,r,k,n", [(1, 1, 2, 4, 8, 8), (37, 3, 6, 8, 24, 40)])
def test_expert_ops_match_per_row_loop(m, s, e, r, k, n, covered):
    """Routed ids 0..e-1 and 2 shared ids after them; the LoRA covers `covered` (both: two groups)."""
    gen = torch.Generator().manual_seed(m + e)
    groups = expert_groups(e, 2, covered)
    g_count = groups.groups
    tokens = max(m // 2, 1)
    token_of_row = torch.randint(0, tokens, (m,), generator=gen)
    slots = _slots(tokens, s, gen)[token_of_row]
    experts = torch.randint(0, e + 2, (m,), generator=gen)
    x = torch.randn(m, k, generator=gen)
    a = torch.randn(s, groups.count, r, k, generator=gen)
    b_out = torch.randn(s, g_count, n, r, generator=gen)
    y_in = torch.randn(tokens, 2 * g_count * r, generator=gen)
    b_in = torch.randn(s, 2, groups.count, n, r, generator=gen)
    scalings = torch.rand(s, 2 * g_count, generator=gen) + 0.5
    base = torch.randn(m, 2 * n, generator=gen)

    y = expert_lora_shrink(x, a, slots, experts, groups)
    down = expert_out_lora_expand(y, b_out, slots, experts, scalings[:, :g_count], base[:, :n].clone(), groups)
    gate_up = expert_in_lora_expand(y_in, b_in, slots, experts, scalings, base.clone(), token_of_row, groups)

    for i in range(m):
        s_i, e_i = int(slots[i]), int(experts[i]) - groups.first
        if s_i < 0 or not 0 <= e_i < groups.count:
            assert torch.equal(y[i], torch.zeros(r))
            assert torch.equal(down[i], base[i, :n]) and torch.equal(gate_up[i], base[i])
            continue
        g = int(groups.split is not None and e_i + groups.first >= groups.split)
        ref_y = a[s_i, e_i] @ x[i]
        torch.testing.assert_close(y[i], ref_y, rtol=1e-5, atol=1e-5)
        ref_down = base[i, :n] + scalings[s_i, g] * (b_out[s_i, g] @ ref_y)
        torch.testing.assert_close(down[i], ref_down, rtol=1e-5, atol=1e-4)
        for p in range(2):
            block = p * g_count + g
            y_block = y_in[int(token_of_row[i]), block * r : (block + 1) * r]
            ref = base[i, p * n : (p + 1) * n] + scalings[s_i, block] * (b_in[s_i, p, e_i] @ y_block)
            torch.testing.assert_close(gate_up[i, p * n : (p + 1) * n], ref, rtol=1e-5, atol=1e-4)
