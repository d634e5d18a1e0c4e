"""The split of a model's layers across GPUs (infer.gpu.stages.split_layers) and the --gpus /
--vram-budget parsing: pure logic, no device."""

from __future__ import annotations

import pytest

from infer.tiers.stage_plan import parse_budgets, parse_gpus, split_layers


def test_equal_layers_split_evenly_and_the_head_pulls_layers_forward() -> None:
    assert split_layers([1.0] * 8, [1] * 8, [100, 100]) == [range(0, 4), range(4, 8)]
    assert split_layers([1.0] * 9, [1] * 9, [100, 100, 100]) == [range(0, 3), range(3, 6), range(6, 9)]
    # the last stage also reads the head (2 layers' worth): it takes fewer layers
    assert split_layers([1.0] * 8, [1] * 8, [100, 100], head_cost=2.0) == [range(0, 5), range(5, 8)]


def test_the_slowest_stage_is_as_fast_as_it_can_be() -> None:
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    ranges = split_layers(costs, [1] * 6, [100, 100])
    assert ranges == [range(0, 1), range(1, 6)]  # 5 | 5, not 6 | 4
    # a GPU twice as fast takes about twice the work
    assert split_layers([1.0] * 9, [1] * 9, [100, 100], speeds=[2.0, 1.0]) == [range(0, 6), range(6, 9)]


def test_rooms_bound_each_stage_and_no_fit_is_an_error() -> None:
    # the second GPU holds at most 2 layers (sizes 10 each, room 25): the first takes the rest
    assert split_layers([1.0] * 6, [10] * 6, [1000, 25]) == [range(0, 4), range(4, 6)]
    with pytest.raises(ValueError, match="do not fit"):
        split_layers([1.0] * 6, [10] * 6, [25, 25])
    with pytest.raises(ValueError, match="cannot make 3 stages"):
        split_layers([1.0] * 2, [1] * 2, [10, 10, 10])


def test_gpus_and_budgets_parse_or_say_why_not() -> None:
    assert parse_gpus("0,1") == [0, 1] and parse_gpus("1") == [1]
    for bad in ("", "0,0", "a,b", "-1"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)
    assert parse_budgets(None, 2) == [None, None]
    assert parse_budgets("24GB", 2) == ["24GB", "24GB"]
    assert parse_budgets("24GB, 20GB", 2) == ["24GB", "20GB"]
    with pytest.raises(ValueError, match="3 sizes for 2 GPUs"):
        parse_budgets("1GB,2GB,3GB", 2)


def test_a_streamed_split_gives_the_gpu_with_less_room_fewer_layers() -> None:
    # 12 layers of 10 bytes; GPU 0 holds 80 of them, GPU 1 40; the rest streams 40x slower
    ranges = split_layers([10.0] * 12, [10] * 12, [80, 40], link_speeds=[1 / 40, 1 / 40])
    assert ranges == [range(0, 8), range(8, 12)]  # each fills its room; nothing streams
    # the bytes past the rooms stream: each GPU streams 20 (by bytes alone, 6 | 6, GPU 1 would stream 40)
    ranges = split_layers([10.0] * 12, [10] * 12, [60, 20], link_speeds=[1 / 40, 1 / 40])
    assert ranges == [range(0, 8), range(8, 12)]
    # GPU 1's link twice as fast: it streams 30 (600 time units), GPU 0 10 (400); 8 | 4 would take 860
    ranges = split_layers([10.0] * 12, [10] * 12, [60, 20], link_speeds=[1 / 40, 1 / 20])
    assert ranges == [range(0, 7), range(7, 12)]
    # equal rooms: an even split, with or without streaming
    assert split_layers([10.0] * 12, [10] * 12, [30, 30], link_speeds=[1 / 40, 1 / 40]) == [range(0, 6), range(6, 12)]


def test_interleaved_runs_and_their_length() -> None:
    from infer.tiers.stage_plan import interleave, interleave_chunk

    assert interleave(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert interleave(7, 3, 2) == [[0, 1, 6], [2, 3], [4, 5]]
    # 10 layers of 100 bytes, rooms of 300 each: 400 stream, 40 a layer; a ring of 80: runs of 2
    assert interleave_chunk([100] * 10, [300, 300], 80) == 2
    assert interleave_chunk([100] * 10, [600, 600], 80) is None  # everything fits: one run a GPU
    assert interleave_chunk([100] * 10, [300, 300], 400) is None  # runs of 10: no shorter than one a GPU


def test_the_first_stage_holds_a_tied_embedding() -> None:
    # the embedding's device copy (20 bytes) goes with the first stage: it takes fewer layers
    assert split_layers([10.0] * 6, [10] * 6, [40, 40]) == [range(0, 3), range(3, 6)]
    assert split_layers([10.0] * 6, [10] * 6, [40, 40], embed_size=20) == [range(0, 2), range(2, 6)]
    with pytest.raises(ValueError, match="do not fit"):
        split_layers([10.0] * 6, [10] * 6, [30, 30], embed_size=20)
