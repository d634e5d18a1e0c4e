"""The placement planner on tensor tables of Llama shapes (no files, no device): totals, budgets
never exceeded, determinism, the policy's preferences, and refusals with the minimum."""

from __future__ import annotations

import random

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.gpu.layout import format_of, plane_layout
from infer.synth import SHAPES, Shape, tensor_type
from infer.tiers.plan import (
    ATTENTION_KINDS,
    PlanError,
    Tensor,
    Tier,
    make_plan,
    minimum_vram,
    pass_order,
)

GB = 10**9


def _nbytes(ggml_type: int, rows: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return rows * cols // block * size


def llama_tensors(shape: Shape, kind: str = "q4_k_m", planar: bool = False) -> list[Tensor]:
    """The tensor table synth.write_model would write, with device sizes planar or raw."""
    head = shape.dim // shape.n_heads
    q, kv = shape.n_heads * head, shape.n_kv_heads * head
    out: list[Tensor] = []
    offset = 0

    def add(name: str, ggml_type: int, rows: int, cols: int | None) -> None:
        nonlocal offset
        if cols is None:
            nbytes, dims, device = rows * 4, (rows,), rows * 4
        else:
            nbytes, dims = _nbytes(ggml_type, rows, cols), (rows, cols)
            device = plane_layout(format_of(ggml_type), rows, cols).nbytes if planar else nbytes
        out.append(Tensor(name, offset, nbytes, ggml_type, dims, device))
        offset += -(-nbytes // 32) * 32

    add("token_embd.weight", GGMLQuantizationType.Q4_K, shape.vocab_size, shape.dim)
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", GGMLQuantizationType.F32, shape.dim, None)
        for name, rows, cols in (("attn_q", q, shape.dim), ("attn_k", kv, shape.dim), ("attn_v", kv, shape.dim),
                                 ("attn_output", shape.dim, q)):
            add(p + name + ".weight", tensor_type(kind, name, i, shape.n_layers), rows, cols)
        add(p + "ffn_norm.weight", GGMLQuantizationType.F32, shape.dim, None)
        for name, rows, cols in (("ffn_gate", shape.ffn_dim, shape.dim), ("ffn_up", shape.ffn_dim, shape.dim),
                                 ("ffn_down", shape.dim, shape.ffn_dim)):
            add(p + name + ".weight", tensor_type(kind, name, i, shape.n_layers), rows, cols)
    add("output_norm.weight", GGMLQuantizationType.F32, shape.dim, None)
    add("output.weight", tensor_type(kind, "output", 0, shape.n_layers), shape.vocab_size, shape.dim)
    return out


def check_invariants(plan, vram: int, ram: int) -> None:
    names = [t.name for t in plan.tensors]
    assert len(names) == len(set(names)) and set(plan.tier) == set(names)
    assert plan.vram_used <= vram
    assert plan.bytes_in(Tier.RAM) <= ram
    assert sum(t.nbytes for t in plan.tensors) == (sum(t.nbytes for t in plan.tensors_in(Tier.VRAM))
                                                   + plan.bytes_in(Tier.RAM) + plan.bytes_in(Tier.STORAGE))
    for t in plan.tensors:
        if t.layer is None or t.is_vector:
            assert plan.tier[t.name] is Tier.VRAM, t.name
    streamed = plan.streamed
    if streamed:
        assert plan.slot_nbytes == max(t.nbytes for t in streamed)


def test_70b_q4_k_m_on_a_24gb_card_streams_about_half_the_model() -> None:
    tensors = llama_tensors(SHAPES["70b"], planar=True)
    total_raw = sum(t.nbytes for t in tensors)
    vram, ram = 21 * GB, 64 * GB
    plan = make_plan(tensors, 80, vram, ram, n_slots=4, layer_scratch=True)
    check_invariants(plan, vram, ram)
    assert 41 * GB < total_raw < 44 * GB
    # room for ~21 GB of device bytes minus the ring: between a third and two thirds of the layers stream
    assert 0.4 * total_raw < plan.streamed_nbytes < 0.65 * total_raw
    assert plan.bytes_in(Tier.STORAGE) == 0  # 64 GB of RAM holds every streamed byte
    assert vram - plan.vram_used < 0.5 * GB  # the greedy fill leaves little room unused
    resident = plan.resident_layers()
    assert 25 <= len(resident) <= 40
    gaps = [b - a for a, b in zip(resident, resident[1:], strict=False)]
    assert max(gaps) <= 3, "resident layers are spread through the depth, not one block"


def test_small_ram_budget_sends_the_rest_to_tier_c_in_pass_order() -> None:
    tensors = llama_tensors(SHAPES["8b"])
    plan = make_plan(tensors, 32, 3 * GB, 1 * GB, n_slots=3)
    check_invariants(plan, 3 * GB, 1 * GB)
    assert plan.bytes_in(Tier.STORAGE) > 0 and plan.bytes_in(Tier.RAM) > 0.9 * GB
    first_c = next(i for i, t in enumerate(plan.streamed) if plan.tier[t.name] is Tier.STORAGE)
    assert all(plan.tier[t.name] is Tier.RAM for t in plan.streamed[:first_c])


@pytest.mark.parametrize("vram_gb", [1.2, 2, 3.3, 4.4, 5])
@pytest.mark.parametrize("ram_gb", [0, 0.7, 2.5, 100])
def test_budgets_never_exceeded_and_totals_add_up(vram_gb: float, ram_gb: float) -> None:
    tensors = llama_tensors(SHAPES["8b"], planar=True)
    vram, ram = int(vram_gb * GB), int(ram_gb * GB)
    plan = make_plan(tensors, 32, vram, ram, n_slots=4, layer_scratch=True)
    check_invariants(plan, vram, ram)


def test_everything_resident_when_it_fits() -> None:
    tensors = llama_tensors(SHAPES["1b"])
    total = sum(t.device_nbytes for t in tensors)
    plan = make_plan(tensors, 16, total, 0)
    assert plan.streamed == [] and plan.slot_nbytes == 0 and plan.vram_used == total
    plan = make_plan(tensors, 16, total - 1, 0)
    assert plan.streamed and plan.bytes_in(Tier.STORAGE) == plan.streamed_nbytes


def test_plan_is_deterministic_and_independent_of_table_order() -> None:
    tensors = llama_tensors(SHAPES["8b"], planar=True)
    shuffled = tensors[:]
    random.Random(3).shuffle(shuffled)
    a = make_plan(tensors, 32, 3 * GB, GB, 4, True)
    b = make_plan(shuffled, 32, 3 * GB, GB, 4, True)
    assert a.tier == b.tier and a.slot_nbytes == b.slot_nbytes and a.scratch_nbytes == b.scratch_nbytes
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors] == [t.name for t in pass_order(tensors)]


def test_leftover_room_keeps_attention_groups_of_streamed_layers_whole() -> None:
    tensors = llama_tensors(SHAPES["8b"])
    plan = make_plan(tensors, 32, int(2.6 * GB), 100 * GB, 4)
    partial = [i for i in range(32) if i not in plan.resident_layers()
               and any(tier is Tier.VRAM for tier in plan.layer_tiers(i).values())]
    assert partial, "some streamed layer keeps tensors resident"
    whole_groups = [i for i in partial if all(plan.layer_tiers(i)[k] is Tier.VRAM for k in ATTENTION_KINDS)]
    assert whole_groups, "attention groups go resident whole before single matrices"
    for i in whole_groups:
        assert any(plan.layer_tiers(i)[k] is not Tier.VRAM for k in ("ffn_gate", "ffn_up", "ffn_down"))


def test_too_small_budget_is_refused_with_the_minimum() -> None:
    tensors = llama_tensors(SHAPES["8b"], planar=True)
    minimum = minimum_vram(tensors, 4, True)
    with pytest.raises(PlanError, match="below the minimum") as info:
        make_plan(tensors, 32, minimum - 1, GB, 4, True)
    assert info.value.minimum == minimum
    plan = make_plan(tensors, 32, minimum, GB, 4, True)
    check_invariants(plan, minimum, GB)


def test_a_ring_needs_two_slots() -> None:
    with pytest.raises(ValueError, match="at least 2 slots"):
        make_plan(llama_tensors(SHAPES["tiny"]), 2, 1, 0, n_slots=1)
