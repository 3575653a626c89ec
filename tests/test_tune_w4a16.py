"""The W4A16 tuner's sweep: which launch configurations it times (the timing needs a GPU)."""

import pytest

from bench.tune_row_matmul import parse_schedules
from bench.tune_w4a16 import SCHEDULES, candidates, main
from dflash_serve.kernels.w4a16_matmul import MIN_PROGRAMS, TILE_K


def test_every_schedule_is_swept_and_each_config_once():
    sweep = candidates(2560, 4096, parse_schedules("4x2,8x3"))
    assert {(c.num_warps, c.num_stages) for c in sweep} == {(4, 2), (8, 3)}
    assert len(set(sweep)) == len(sweep)
    assert {c.block_n for c in sweep} == {64, 128} and {c.block_m for c in sweep} == {16, 32, 64}


def test_splits_give_a_row_tile_enough_programs_and_cover_k():
    for config in candidates(2560, 9216):
        num_tiles = 9216 // TILE_K
        assert config.split_k == -(-num_tiles // config.tiles_per_split)
        programs = -(-2560 // config.block_n) * config.split_k
        assert programs >= MIN_PROGRAMS or config.tiles_per_split == 2


def test_default_schedules_include_two_stages():
    assert (4, 2) in SCHEDULES and len(candidates(18432, 2560)) > len(
        candidates(18432, 2560, ((4, 3),))
    )


def test_bad_schedules_are_refused(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["tune_w4a16", "--schedules", "4x0"])
    with pytest.raises(SystemExit):
        main()
    assert "--schedules: WARPSxSTAGES items like 4x3, got '4x0'" in capsys.readouterr().err
