"""bench/moe_grouped_prefill.py without a GPU: the arms it times and the table it writes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import moe_grouped_prefill as bench  # noqa: E402


def test_the_dense_arms_differ_from_the_heuristic_only_in_the_cluster_and_the_walk():
    for geometry in bench.GEOMETRIES:
        found = bench.arms(geometry, 16384)
        dense, one = found["dense"][1], found["dense 1x1"][1]
        assert (dense.cluster_m, dense.cluster_n) == (2, 1) and (one.cluster_m, one.cluster_n) == (1, 1)
        grouped = found["grouped"][1]
        assert found["grouped 2x1"][1] == grouped.__class__(**{**grouped.__dict__, "cluster_m": 2})
        assert (grouped.tile_m, grouped.tile_n, grouped.pingpong) == (dense.tile_m, dense.tile_n, dense.pingpong)
        rows = found["dense"][2].m
        assert rows == found["grouped"][2].rows == 16384 * bench.GEOMETRIES[geometry][3]
        walk = found.get("dense 1x1, expert bands")
        expert_tiles = -(-(rows // bench.GEOMETRIES[geometry][2]) // one.tile_m)
        assert (walk is None) == (expert_tiles == one.raster_group)
        if walk:
            assert walk[1].raster_group == expert_tiles and walk[1].cluster_m == 1
    assert "dense 1x1, expert bands" in bench.arms("mixtral-8x7b", 16384)


def test_the_table_gives_each_arm_over_the_dense_heuristic():
    row = {"geometry": "mixtral-8x7b", "tokens": 16384, "us": {"grouped": 2.0, "dense": 1.0, "dense 1x1": 1.5},
           "tflops": {"grouped": 300.0, "dense": 600.0, "dense 1x1": 400.0}}
    text = bench.markdown({"gpu": "Fake H100"}, [row], ["x: failed"])
    line = next(x for x in text.splitlines() if x.startswith("| mixtral"))
    assert line.split(" | ")[2:] == ["300", "600", "400", "0.500", "0.667 |"]
    assert "- x: failed" in text and "Fake H100" in text


def test_the_swapped_arms_are_the_grouped_config_on_decode_tiles():
    """At prefill sizes the heuristic takes plain tiles; each swapped arm differs from it in the tiles alone."""
    for geometry in bench.GEOMETRIES:
        found = bench.arms(geometry, 4096)
        grouped = found["grouped"][1]
        assert not grouped.swap_ab
        for tm, tn in bench.SWAPPED:
            module, config, shape = found[f"grouped swapped {tm}x{tn}"]
            assert module is bench.grouped_kernel and shape == found["grouped"][2]
            assert (config.swap_ab, config.tile_m, config.tile_n, config.cluster_m) == (True, tm, tn, 1)
            assert config.variant().key() != grouped.variant().key()
            assert {k: v for k, v in config.__dict__.items() if k not in ("swap_ab", "tile_m", "tile_n", "pingpong",
                                                                          "cluster_m")} == \
                {k: v for k, v in grouped.__dict__.items() if k not in ("swap_ab", "tile_m", "tile_n", "pingpong",
                                                                         "cluster_m")}
