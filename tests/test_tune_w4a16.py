"""The W4A16 tuner's sweep: which launch configurations it times (the timing needs a GPU)."""

import json

import pytest

from bench.tune_row_matmul import parse_schedules
from bench.tune_w4a16 import BLOCK_NS, SCHEDULES, candidates, choose, main, tuned_entry
from dflash_serve.kernels import w4a16_matmul
from dflash_serve.kernels.w4a16_matmul import TILE_K, W4A16Config, config_key


def test_every_schedule_is_swept_and_each_config_once():
    sweep = candidates(2560, 4096, parse_schedules("4x2,8x3"))
    assert {(c.num_warps, c.num_stages) for c in sweep} == {(4, 2), (8, 3)}
    assert len(set(sweep)) == len(sweep)
    assert {c.block_n for c in sweep} == {32, 64, 128} and {c.block_m for c in sweep} == {
        16,
        32,
        64,
    }


def test_splits_give_a_row_tile_enough_programs_and_cover_k():
    """Every candidate's K split is one a row tile of 32, 64 or 128 outputs needs for 2 or 4
    programs per SM, or ⌈tiles / count⌉ for 1 … 12 splits (at least 2 tiles), and every such
    split is swept with every tile size."""
    num_tiles = 9216 // TILE_K  # 36
    sweep = candidates(2560, 9216)
    needed = set()
    for block_n in (32, 64, 128):
        for min_programs in (264, 528):
            for tiles_per_split in range(num_tiles, 1, -1):
                programs = -(-2560 // block_n) * -(-num_tiles // tiles_per_split)
                if programs >= min_programs or tiles_per_split == 2:
                    needed.add(tiles_per_split)
                    break
    by_count = {36, 18, 12, 9, 8, 6, 5, 4, 3}  # ⌈36 / count⌉ for count 1 … 12
    assert needed - by_count and by_count - needed  # (each rule contributes splits of its own)
    assert {config.tiles_per_split for config in sweep} == needed | by_count
    for config in sweep:
        assert config.split_k == -(-num_tiles // config.tiles_per_split)
    assert len(sweep) == len(needed | by_count) * len(BLOCK_NS) * 3 * len(SCHEDULES)
    # K = 2560: 10 tiles; ⌈10 / count⌉ for count 1 … 12 is {10, 5, 4, 3, 2, 1}, and a split of
    # one tile is never a candidate (nothing to pipeline)
    ten_tiles = {config.tiles_per_split for config in candidates(2560, 2560)}
    assert ten_tiles >= {10, 5, 4, 3, 2} and min(ten_tiles) == 2


def test_choice_is_one_split_with_each_buckets_fastest_launch(tmp_path, monkeypatch):
    """The split whose fastest 16-row and 128-row launches sum best (t16 + t128 / 4) wins,
    even when another split has the single fastest launch at one row count; the entry it
    writes is read back by `w4a16_config` per row count."""

    def result(tiles_per_split, block_m, t16, t128):
        config = W4A16Config.over_splits(10, tiles_per_split, block_n=64, block_m=block_m)
        return {"us_16_rows": t16, "us_128_rows": t128}, config

    results = [
        result(5, 16, 10.0, 80.0), result(5, 64, 14.0, 40.0),  # best sum: 10 + 40 / 4
        result(2, 16, 9.0, 90.0), result(2, 64, 15.0, 60.0),  # fastest 16 rows, 9 + 15
    ]  # fmt: skip
    launches, times, refused = choose(results)
    assert [(c.tiles_per_split, c.block_m) for c in launches] == [(5, 16), (5, 64)]
    assert times == {"us_16_rows": 10.0, "us_128_rows": 40.0} and refused == 0
    path = tmp_path / "w4a16_configs.json"
    path.write_text(json.dumps({"configs": {config_key(64, 2560, 128): tuned_entry(launches)}}))
    monkeypatch.setattr(w4a16_matmul, "TUNED_CONFIGS_PATH", path)
    clear_tuned_caches()
    try:
        assert w4a16_matmul.w4a16_config(64, 2560, 128, rows=1) == launches[0]
        assert w4a16_matmul.w4a16_config(64, 2560, 128, rows=16) == launches[0]
        assert w4a16_matmul.w4a16_config(64, 2560, 128, rows=17) == launches[1]
        assert w4a16_matmul.w4a16_config(64, 2560, 128, rows=128) == launches[1]
    finally:  # the shipped file again for the tests after this one
        monkeypatch.undo()
        clear_tuned_caches()


def test_a_pair_whose_rows_differ_is_passed_over_for_the_next_fastest():
    """Pairs of one split in order of t16 + t128 / 4; the check refuses those that mix
    block_n 32 with another (as if their MMAs rounded differently)."""

    def result(tiles_per_split, block_n, block_m, t16, t128):
        config = W4A16Config.over_splits(10, tiles_per_split, block_n=block_n, block_m=block_m)
        return {"us_16_rows": t16, "us_128_rows": t128}, config

    results = [
        result(5, 32, 16, 8.0, 90.0),  # fastest at 16 rows: 8 + 40 / 4 with the next
        result(5, 64, 64, 14.0, 40.0),  # 14 + 10 alone
        result(5, 64, 16, 10.0, 80.0),  # 10 + 10 with the 64-row launch above
        result(2, 32, 64, 20.0, 60.0),  # another split: never paired with split 5
    ]

    def same_block_n(launches):
        return launches[0].block_n == launches[1].block_n

    launches, times, refused = choose(results, same_block_n)
    assert [(c.block_n, c.block_m) for c in launches] == [(64, 16), (64, 64)]
    assert times == {"us_16_rows": 10.0, "us_128_rows": 40.0} and refused == 1
    with pytest.raises(RuntimeError, match="no pair of launches"):
        choose(results, lambda launches: False)


def test_a_tuned_entry_without_row_buckets_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "w4a16_configs.json"
    old_style = {"block_n": 64, "block_m": 32, "tiles_per_split": 10, "split_k": 1}
    path.write_text(json.dumps({"configs": {"18432x2560:g128": old_style}}))
    monkeypatch.setattr(w4a16_matmul, "TUNED_CONFIGS_PATH", path)
    clear_tuned_caches()
    try:
        with pytest.raises(ValueError, match="18432x2560:g128 needs tiles_per_split"):
            w4a16_matmul.tuned_configs()
    finally:
        monkeypatch.undo()
        clear_tuned_caches()


def clear_tuned_caches() -> None:
    w4a16_matmul.tuned_configs.cache_clear()
    w4a16_matmul.tuned_launches.cache_clear()


def test_default_schedules_include_two_stages():
    assert (4, 2) in SCHEDULES and len(candidates(18432, 2560)) > len(
        candidates(18432, 2560, ((4, 3),))
    )


def test_bad_schedules_are_refused(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["tune_w4a16", "--schedules", "4x0"])
    with pytest.raises(SystemExit):
        main()
    assert "--schedules: WARPSxSTAGES items like 4x3, got '4x0'" in capsys.readouterr().err
